"""Reference implementation: the full [tokens, vocab] float32 log-softmax.

What a plain PyTorch actor does; used by the tests as ground truth and by the memory benchmark
as the baseline the chunked paths are measured against.
"""

from __future__ import annotations

import torch

from rlcore.triton_kernels.kl import token_kl
from rlcore.triton_kernels.output import FusedOutput


def naive_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    ref_logprobs: torch.Tensor | None = None,
    kl_kind: str = "k3",
    compute_entropy: bool = True,
) -> FusedOutput:
    """Log-prob of ``targets``, softmax entropy and KL via materialised fp32 logits."""
    logits = hidden.float() @ weight.float().T / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logprobs = logp_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1) if compute_entropy else None
    kl = token_kl(logprobs, ref_logprobs, kl_kind) if ref_logprobs is not None else None
    return FusedOutput(logprobs, entropy, kl)
