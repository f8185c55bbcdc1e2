"""Masked reductions over the valid tokens of a padded batch.

``mask`` is 1 for tokens that count and 0 for padding (float or bool). Statistics are taken over
every valid token of the whole tensor unless ``dim`` is given, which is what PPO-style whitening
wants: one mean/variance for the batch, not one per row.

Deliberate difference from verl's ``masked_mean``: an all-padding slice gives 0 instead of NaN
(0/0), so an empty row or micro-batch can't poison a metric or a loss. Whenever the mask has at
least one valid element the numbers are identical.
"""

from __future__ import annotations

import torch

__all__ = ["masked_sum", "masked_mean", "masked_var", "masked_whiten"]


def _as_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return mask.to(dtype=like.dtype) if mask.dtype != like.dtype else mask


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over valid positions (padding may hold garbage, even inf/NaN)."""
    m = _as_mask(mask, x)
    vals = torch.where(m != 0, x * m, torch.zeros_like(x))
    return vals.sum() if dim is None else vals.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over valid positions; 0 where a slice has no valid position."""
    m = _as_mask(mask, x)
    count = m.sum() if dim is None else m.sum(dim=dim)
    safe = torch.where(count != 0, count, torch.ones_like(count))
    return masked_sum(x, m, dim) / safe


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of all valid elements (a 0-dim tensor).

    ``unbiased`` applies Bessel's correction n/(n-1) as verl does; it needs at least two valid
    elements and raises ValueError otherwise (rather than returning inf/NaN silently).
    """
    m = _as_mask(mask, x)
    mean = masked_mean(x, m)
    var = masked_mean((x - mean) ** 2, m)
    if unbiased:
        n = float(m.sum())
        if n == 0:
            raise ValueError("masked_var: mask has no valid element")
        if n == 1:
            raise ValueError("masked_var: unbiased variance needs at least 2 valid elements, mask has 1")
        var = var * (n / (n - 1))
    return var


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) with mean and unbiased var over all valid tokens.

    ``shift_mean=False`` adds the mean back (scale only), as verl. Padding positions are
    transformed too (they are not zeroed); callers multiply by the mask when they care.
    """
    m = _as_mask(mask, x)
    mean = masked_mean(x, m)
    var = masked_var(x, m, unbiased=True)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out
