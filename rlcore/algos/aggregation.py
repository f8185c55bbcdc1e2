"""Reduce a [B, T] per-token loss to a scalar: this micro-batch's share of the mini-batch loss.

Deliberate difference from verl's legacy ``agg_loss``, which averages inside each micro-batch
and then scales by 1/(number of micro-batches): when micro-batches hold different numbers of
tokens (token-budget packing, uneven responses), that weights tokens of small micro-batches
more, so the gradient depends on how the mini-batch was split. Here every mode divides by a
count for the *whole* mini-batch (all micro-batches, all data-parallel ranks), passed in as
``global_token_count`` / ``global_seq_count``. Summing the shares of all micro-batches gives
exactly the full-batch loss, so gradient accumulation is split-invariant.

Counts default to this micro-batch's own (correct when it is the whole mini-batch). A
sequence counts when it has at least one valid token, so padding rows added to even out
shards don't dilute the mean; compute the global counts the same way (:func:`loss_counts`).

Data parallelism: the shares of all ranks add up to the loss. If the gradient reduction
averages over ranks (the DDP/FSDP default), multiply the loss by the world size, or sum-reduce.
"""

from __future__ import annotations

import torch

__all__ = ["AGG_MODES", "agg_loss", "loss_counts"]

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

Count = int | float | torch.Tensor


def loss_counts(loss_mask: torch.Tensor) -> dict[str, int]:
    """Token and sequence counts of a (mini-)batch, in the form ``agg_loss`` takes them.

    Compute these on the whole mini-batch (sum them across data-parallel ranks) and pass them to
    every micro-batch's ``agg_loss`` call.
    """
    tokens = loss_mask.sum(dim=-1)
    return {"global_token_count": int(tokens.sum().item()), "global_seq_count": int((tokens > 0).sum().item())}


def _denominator(given: Count | None, own: torch.Tensor, name: str) -> torch.Tensor | float:
    if given is None:
        return own.clamp(min=1)  # an empty micro-batch contributes 0, not NaN
    if torch.is_tensor(given):
        return given  # not checked: reading a GPU value would sync every micro-batch
    if given <= 0:
        raise ValueError(f"{name} must be positive, got {given}")
    return float(given)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: str,
    *,
    global_token_count: Count | None = None,
    global_seq_count: Count | None = None,
    norm_length: Count | None = None,
) -> torch.Tensor:
    """Aggregate ``loss_mat`` [B, T] over valid tokens (``loss_mask`` 1) with ``mode``:

    - ``"token-mean"``: sum(loss * mask) / global_token_count. Every token of the mini-batch
      weighs the same.
    - ``"seq-mean-token-sum"``: sum over sequences of (sum of their token losses), divided by
      global_seq_count.
    - ``"seq-mean-token-mean"``: sum over sequences of (mean of their token losses) /
      global_seq_count. A sequence without valid tokens contributes 0 (no NaN).
    - ``"seq-mean-token-sum-norm"``: each sequence's token sum divided by the constant
      ``norm_length`` (default ``loss_mask.shape[-1]``, the max response length), then
      summed / global_seq_count: Dr.GRPO's length-unbiased objective,
      (1/G) sum_i (1/L_max) sum_t loss_it. verl's legacy version omits the 1/G (it divides the
      micro-batch's token sum only by L_max), which makes the loss, and so the effective
      learning rate, grow with the batch size and the number of micro-batches; we divide by the
      sequence count as the Dr.GRPO paper does.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; choose one of {list(AGG_MODES)}")
    if loss_mat.shape != loss_mask.shape:
        raise ValueError(f"loss_mat shape {tuple(loss_mat.shape)} != loss_mask shape {tuple(loss_mask.shape)}")
    m = loss_mask.to(dtype=loss_mat.dtype)
    token_loss = torch.where(m != 0, loss_mat * m, torch.zeros_like(loss_mat))

    if mode == "token-mean":
        return token_loss.sum() / _denominator(global_token_count, m.sum(), "global_token_count")

    seq_sum = token_loss.sum(dim=-1)
    seq_tokens = m.sum(dim=-1)
    if mode == "seq-mean-token-sum":
        per_seq = seq_sum
    elif mode == "seq-mean-token-mean":
        per_seq = seq_sum / seq_tokens.clamp(min=1)
    else:  # seq-mean-token-sum-norm
        length = loss_mask.shape[-1] if norm_length is None else norm_length
        if not torch.is_tensor(length) and length <= 0:
            raise ValueError(f"norm_length must be positive, got {length}")
        per_seq = seq_sum / length
    own_seqs = (seq_tokens > 0).to(loss_mat.dtype).sum()
    return per_seq.sum() / _denominator(global_seq_count, own_seqs, "global_seq_count")
