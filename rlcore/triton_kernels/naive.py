"""Reference implementation: the full [tokens, vocab] float32 log-softmax.

What a plain PyTorch actor does; used by the tests as ground truth and by the memory benchmark
as the baseline the chunked paths are measured against.
"""

from __future__ import annotations

import torch

from rlcore.triton_kernels.output import FusedOutput


def naive_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    temperature: float = 1.0,
    compute_entropy: bool = True,
) -> FusedOutput:
    """Log-prob of ``targets`` and softmax entropy via materialised fp32 logits, with the head
    semantics of ``fused_token_logprobs`` (bias, logit scale, soft-cap, then temperature)."""
    logits = hidden.float() @ weight.float().T
    if bias is not None:
        logits = logits + bias.float()
    logits = logits * logit_scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    logprobs = logp_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1) if compute_entropy else None
    return FusedOutput(logprobs, entropy)
