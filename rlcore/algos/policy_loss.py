"""Policy-gradient losses, looked up by name (``get_policy_loss("vanilla")``).

Every loss has the signature::

    fn(old_log_prob, log_prob, advantages, response_mask, *, clip_ratio_low=0.2,
       clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_mode=..., global_token_count=None,
       global_seq_count=None, norm_length=None, rollout_is_weights=None) -> (loss, metrics)

``loss`` is this micro-batch's share of the mini-batch loss (see ``aggregation``); ``metrics``
holds detached 0-dim tensors ``pg_clipfrac``, ``pg_clipfrac_lower`` and ``ppo_kl`` (mean of
old_logp - logp over this micro-batch's valid tokens, as verl), left as tensors so that
logging them costs no device sync per micro-batch; ``float()`` them when logging.
``rollout_is_weights`` [B, T] (truncated importance weights between the rollout engine's and
the trainer's old policy) multiply the per-token loss when given; they are treated as constants.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from rlcore.algos.aggregation import Count, agg_loss
from rlcore.algos.masked import masked_mean

__all__ = [
    "PolicyLoss",
    "register_policy_loss",
    "get_policy_loss",
    "policy_loss_names",
    "vanilla_policy_loss",
    "gspo_policy_loss",
    "BehaviourCorrection",
    "behaviour_weights",
]

PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str, *, overwrite: bool = False) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator: register a policy loss under ``name`` (raises on a taken name unless overwrite)."""

    def deco(fn: PolicyLoss) -> PolicyLoss:
        if name in _LOSSES and _LOSSES[name] is not fn and not overwrite:
            raise ValueError(f"policy loss {name!r} is already registered")
        _LOSSES[name] = fn
        return fn

    return deco


def policy_loss_names() -> list[str]:
    return sorted(_LOSSES)


def get_policy_loss(name: str) -> PolicyLoss:
    try:
        return _LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown policy loss {name!r}; known: {policy_loss_names()}") from None


BehaviourCorrection = Literal["truncate", "decoupled"]


def behaviour_weights(proximal_log_prob: torch.Tensor, behaviour_log_prob: torch.Tensor, mode: BehaviourCorrection,
                      cap: float | None) -> torch.Tensor | None:
    """Per-token importance weights w = pi_prox / pi_behav between the policy the clipped ratio is
    taken against (``old_log_prob``: the current weights before the update) and the one that
    generated the tokens (the rollout engine's log-probs, possibly several updates old), detached.

    ``truncate`` (truncated importance sampling): ``min(w, cap)``; no weights (None) without a cap.
    ``decoupled`` (AReaL's decoupled PPO, Fu et al. 2025, arXiv:2505.24298): ``w``, and 0 where
    ``w > cap`` (such tokens are masked out of the loss rather than bounded); no cap: ``w`` as is.
    Either multiplies the clipped surrogate of ratio pi / pi_prox token by token (``_finish``)."""
    if mode == "truncate" and cap is None:
        return None
    w = torch.exp(torch.clamp(proximal_log_prob - behaviour_log_prob, max=20.0)).detach()
    if cap is None:
        return w
    return w.clamp(max=cap) if mode == "truncate" else torch.where(w > cap, torch.zeros_like(w), w)


def _finish(
    pg_losses: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is_weights: torch.Tensor | None,
    loss_agg_mode: str,
    norm: dict[str, Count | None],
) -> torch.Tensor:
    if rollout_is_weights is not None:
        if rollout_is_weights.shape != pg_losses.shape:
            raise ValueError(
                f"rollout_is_weights shape {tuple(rollout_is_weights.shape)} != log_prob shape {tuple(pg_losses.shape)}"
            )
        pg_losses = pg_losses * rollout_is_weights.detach()
    return agg_loss(pg_losses, response_mask, loss_agg_mode, **norm)


@register_policy_loss("vanilla")
def vanilla_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    global_token_count: Count | None = None,
    global_seq_count: Count | None = None,
    norm_length: Count | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with clip-higher and dual clip, per token::

        r     = exp(clamp(logp - old_logp, -20, 20))
        L     = max(-A * r, -A * clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))
        L     = min(L, -A * clip_ratio_c)   where A < 0   (dual clip, Ye et al. 2019)

    Clip-higher (DAPO): ``clip_ratio_high > clip_ratio_low`` lets low-probability tokens with
    positive advantage grow further. Dual clip bounds the loss of a negative-advantage token
    whose ratio exploded. ``pg_clipfrac``: share of tokens where the clipped term won;
    ``pg_clipfrac_lower``: share where the dual clip bound.
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 for dual-clip PPO, got {clip_ratio_c}")
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(loss_ppo, loss_dual_bound), loss_ppo)

    norm: dict[str, Count | None] = dict(
        global_token_count=global_token_count, global_seq_count=global_seq_count, norm_length=norm_length
    )
    loss = _finish(pg_losses, response_mask, rollout_is_weights, loss_agg_mode, norm)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), response_mask),
            "pg_clipfrac_lower": masked_mean(((loss_ppo > loss_dual_bound) & negative).float(), response_mask),
            "ppo_kl": masked_mean(-log_ratio, response_mask),
        }
    return loss, {k: v.detach() for k, v in metrics.items()}


@register_policy_loss("gspo")
def gspo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "seq-mean-token-mean",
    global_token_count: Count | None = None,
    global_seq_count: Count | None = None,
    norm_length: Count | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071), the token-level "GSPO-token" form verl uses.

    The sequence ratio s_i = exp(mean over valid tokens of (logp - old_logp)) replaces the
    token ratio. Per token the ratio is sg[s_i] * pi(y_t) / sg[pi(y_t)]: its value is s_i (so
    clipping is decided per sequence), its gradient is s_i * grad log pi(y_t). The log-ratio is
    clamped at 10 for stability, as verl. Clip ranges are typically tiny (e.g. 3e-4 / 4e-4).
    ``clip_ratio_c`` is accepted for a uniform signature and unused (no dual clip);
    ``pg_clipfrac_lower`` is 0.
    """
    m = response_mask.to(dtype=log_prob.dtype)
    log_ratio = log_prob - old_log_prob
    seq_len = m.sum(dim=-1).clamp(min=1)
    seq_log_ratio = (torch.where(m != 0, log_ratio * m, torch.zeros_like(log_ratio))).sum(-1) / seq_len
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = torch.maximum(loss_unclipped, loss_clipped)

    norm: dict[str, Count | None] = dict(
        global_token_count=global_token_count, global_seq_count=global_seq_count, norm_length=norm_length
    )
    loss = _finish(pg_losses, response_mask, rollout_is_weights, loss_agg_mode, norm)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), response_mask),
            "pg_clipfrac_lower": torch.zeros((), device=log_prob.device),
            "ppo_kl": masked_mean(-log_ratio, response_mask),
        }
    return loss, {k: v.detach() for k, v in metrics.items()}
