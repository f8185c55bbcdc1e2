"""Offline preference losses: DPO (sigmoid, IPO, robust), KTO, and the reward model's Bradley-Terry loss.

All take *sequence* log-probs (one number per completion: the sum, or for IPO the mean, of its
token log-probs) under the policy and the frozen reference, and return per-example losses plus
the implicit rewards `beta * (log pi - log pi_ref)` (detached) for metrics. Reducing the losses
(mean over the global batch) is the caller's job, so data-parallel ranks can divide by the global
count and get exactly the one-rank loss.

Semantics follow the papers (and TRL's reading of them):
- DPO, Rafailov et al. 2023: `-log sigmoid(beta * h)`, h = chosen log-ratio - rejected log-ratio.
  With `label_smoothing` eps > 0 it is conservative DPO (cDPO, Mitchell 2023): the preference
  label is assumed flipped with probability eps.
- robust DPO (rDPO, Chowdhury et al. 2024): the unbiased loss under label noise eps,
  `((1-eps) * -log s(beta h) - eps * -log s(-beta h)) / (1 - 2 eps)`.
- IPO, Azar et al. 2023: `(h - 1/(2 beta))^2`, a squared loss that does not push h to infinity.
- Bradley-Terry (reward-model training; Ouyang et al. 2022, with Llama 2's margin, Touvron et al.
  2023): `-log sigmoid(r_chosen - r_rejected - m)` on the reward model's scalar scores, m >= 0 a
  margin by which chosen must win (0: the plain pairwise loss).
- KTO, Ethayarajh et al. 2024: desirable `w_d * (1 - s(beta (r - z0)))`, undesirable
  `w_u * (1 - s(beta (z0 - r)))`, with the reference point z0 = max(0, mean log-ratio of
  mismatched (prompt, completion) pairs of the batch), detached.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

DPO_LOSS_TYPES = ("sigmoid", "ipo", "robust")


class PreferenceLossOutput(NamedTuple):
    losses: torch.Tensor  # [B] per-example loss (mean it over the global batch)
    chosen_rewards: torch.Tensor  # [B] detached beta * log-ratio (KTO: of the example's completion)
    rejected_rewards: torch.Tensor | None  # [B] DPO only


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> PreferenceLossOutput:
    """Per-pair DPO loss of the kind `loss_type` ("sigmoid" = DPO/cDPO, "ipo", "robust")."""
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    chosen_ratio = policy_chosen_logps - ref_chosen_logps
    rejected_ratio = policy_rejected_logps - ref_rejected_logps
    h = chosen_ratio - rejected_ratio
    eps = label_smoothing
    if loss_type == "sigmoid":
        losses = -(1.0 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    elif loss_type == "robust":
        losses = (-(1.0 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1.0 - 2.0 * eps)
    elif loss_type == "ipo":
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r} (expected one of {', '.join(DPO_LOSS_TYPES)})")
    return PreferenceLossOutput(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


def kto_reference_point(policy_kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """z0: mean log-ratio over the batch's mismatched pairs, clamped at 0 and detached (a scalar).

    Data-parallel ranks must average over all ranks' pairs: see `kto_reference_point_from_sums`."""
    return (policy_kl_logps - ref_kl_logps).detach().mean().clamp(min=0.0)


def kto_reference_point_from_sums(logratio_sum: float, count: float) -> torch.Tensor:
    """z0 from a (global) sum of mismatched-pair log-ratios and their count."""
    return torch.tensor(max(0.0, logratio_sum / max(1.0, count)))


def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    reference_point: torch.Tensor | float,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> PreferenceLossOutput:
    """Per-example KTO loss; `desirable` is a bool (or 0/1) tensor, `reference_point` is z0."""
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    z0 = torch.as_tensor(reference_point, dtype=policy_logps.dtype, device=policy_logps.device).detach()
    ratio = policy_logps - ref_logps
    good = desirable.to(torch.bool)
    desirable_losses = desirable_weight * (1.0 - torch.sigmoid(beta * (ratio - z0)))
    undesirable_losses = undesirable_weight * (1.0 - torch.sigmoid(beta * (z0 - ratio)))
    losses = torch.where(good, desirable_losses, undesirable_losses)
    return PreferenceLossOutput(losses, beta * ratio.detach(), None)


def bradley_terry_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor,
                       margin: torch.Tensor | float = 0.0) -> torch.Tensor:
    """Per-pair reward-model loss `-log sigmoid(r_c - r_r - m)` ([B]; mean it over the global batch).

    `margin` is a number or a [B] tensor (per-pair margins from the data); logsigmoid keeps it
    finite for any score gap."""
    m = torch.as_tensor(margin, dtype=chosen_scores.dtype, device=chosen_scores.device)
    return -F.logsigmoid(chosen_scores - rejected_scores - m)


__all__ = [
    "DPO_LOSS_TYPES",
    "PreferenceLossOutput",
    "bradley_terry_loss",
    "dpo_loss",
    "kto_loss",
    "kto_reference_point",
    "kto_reference_point_from_sums",
]
