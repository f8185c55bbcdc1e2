"""Clipped value-function loss for the PPO critic."""

from __future__ import annotations

import torch

from rlcore.algos.aggregation import Count, agg_loss
from rlcore.algos.masked import masked_mean

__all__ = ["compute_value_loss"]


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float | None,
    loss_agg_mode: str = "token-mean",
    *,
    global_token_count: Count | None = None,
    global_seq_count: Count | None = None,
    norm_length: Count | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``0.5 * agg(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2))``, as verl.

    Clipping keeps the critic from moving far from the values it had at rollout time
    (``values``); taking the max makes it pessimistic. ``cliprange_value=None`` disables it.
    Returns ``(loss, vf_clipfrac)``, the latter the detached share of valid tokens where the
    clipped error was the larger one.
    """
    loss_unclipped = (vpreds - returns) ** 2
    if cliprange_value is None:
        loss_clipped = loss_unclipped
    else:
        v_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
        loss_clipped = (v_clipped - returns) ** 2
    per_token = torch.maximum(loss_unclipped, loss_clipped)
    loss = 0.5 * agg_loss(
        per_token,
        response_mask,
        loss_agg_mode,
        global_token_count=global_token_count,
        global_seq_count=global_seq_count,
        norm_length=norm_length,
    )
    with torch.no_grad():
        clipfrac = masked_mean((loss_clipped > loss_unclipped).float(), response_mask)
    return loss, clipfrac
