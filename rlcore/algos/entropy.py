"""Entropy of the categorical distribution given by logits."""

from __future__ import annotations

import torch

__all__ = ["entropy_from_logits"]


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(z) - sum(softmax(z) * z) over the last dim; shape ``logits.shape[:-1]``.

    Computed on z = logits - max(logits) (the value is shift-invariant), so the two terms stay
    small and don't cancel catastrophically for large logits, and -inf logits (masked vocab
    entries) are replaced by the dtype's lowest finite value so that p * z is 0, not NaN.
    Differentiable. Memory is O(logits); the fused chunked version lives in triton_kernels.
    """
    z = logits - logits.detach().amax(dim=-1, keepdim=True)
    z = torch.clamp(z, min=torch.finfo(z.dtype).min)
    p = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (p * z).sum(dim=-1)
