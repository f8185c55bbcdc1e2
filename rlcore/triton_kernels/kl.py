"""Per-token KL estimators between the policy and a reference, from log-probs alone.

Same definitions as verl's ``kl_penalty`` (k1/k2/k3 of Schulman's "Approximating KL"), written
as plain differentiable torch ops so autograd chains the KL gradient through the log-prob:
the fused kernels never need to know about the KL.
"""

from __future__ import annotations

import torch

# verl's names are accepted as aliases of the k-names.
KL_KINDS: dict[str, str] = {
    "k1": "k1",
    "kl": "k1",
    "k2": "k2",
    "mse": "k2",
    "k3": "k3",
    "low_var_kl": "k3",
    "abs": "abs",
}


def canonical_kl_kind(kl_kind: str) -> str:
    """Map a KL name (or verl alias) to k1/k2/k3/abs, with an error naming the bad value."""
    try:
        return KL_KINDS[kl_kind]
    except KeyError:
        raise ValueError(f"kl_kind={kl_kind!r} is not one of {sorted(KL_KINDS)}") from None


def token_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kl_kind: str = "k3") -> torch.Tensor:
    """KL estimate per token; ``ref_logprobs`` is treated as a constant (no gradient).

    k1: logp - ref.  k2: 0.5 * (logp - ref)^2.  abs: |logp - ref|.
    k3 (low-variance): with d = clamp(ref - logp, -20, 20), clamp(exp(d) - d - 1, -10, 10);
    the clamps bound the value (and zero the gradient) when the policies drift far apart.
    """
    kind = canonical_kl_kind(kl_kind)
    ref = ref_logprobs.detach().to(logprobs.dtype)
    if kind == "k1":
        return logprobs - ref
    if kind == "k2":
        return 0.5 * (logprobs - ref).square()
    if kind == "abs":
        return (logprobs - ref).abs()
    d = torch.clamp(ref - logprobs, min=-20.0, max=20.0)
    return torch.clamp(torch.exp(d) - d - 1.0, min=-10.0, max=10.0)
