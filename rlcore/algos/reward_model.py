"""A reward model's scores in the RL reward: running normalisation, clipping, and the weighted sum
with the rule scorer's scores.

    reward = rule_weight * rule_score + weight * clip((rm_score - mean) / (std + eps), -clip, clip)

`mean` and `std` are those of every reward-model score the run has trained on so far, this
batch's included (`RunningMoments`), so the scale the critic and the advantages see stays put as
the policy moves the raw scores; without normalisation they are 0 and 1. The clip acts in the
normalised units (standard deviations), so one outlying score cannot swamp a batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

NORM_EPS = 1e-8


@dataclass
class RunningMoments:
    """Count, mean and sum of squared deviations of every value seen, updated a batch at a time
    (Chan, Golub and LeVeque's parallel formula: exact, whatever the batch sizes). The state is
    three floats, kept in a run's checkpoint so a resumed run normalises as the uninterrupted one."""

    count: float = 0.0
    mean: float = 0.0
    m2: float = 0.0

    def update(self, values: torch.Tensor) -> None:
        x = values.detach().double().reshape(-1)
        n = float(x.numel())
        if n == 0:
            return
        batch_mean = float(x.mean())
        batch_m2 = float(((x - batch_mean) ** 2).sum())
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta * delta * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        """Population standard deviation of the values seen (1.0 before any)."""
        return math.sqrt(self.m2 / self.count) if self.count > 0 else 1.0

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count, self.mean, self.m2 = float(state["count"]), float(state["mean"]), float(state["m2"])


def combine_reward_scores(
    rule_scores: torch.Tensor,
    rm_scores: torch.Tensor,
    *,
    weight: float,
    rule_weight: float,
    mean: float = 0.0,
    std: float = 1.0,
    clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-sample reward ([N] float32) and which reward-model terms were clipped ([N] bool)."""
    normalised = (rm_scores.float() - mean) / (std + NORM_EPS)
    clipped = torch.zeros_like(normalised, dtype=torch.bool)
    if clip is not None:
        clipped = normalised.abs() > clip
        normalised = normalised.clamp(-clip, clip)
    return rule_weight * rule_scores.float() + weight * normalised, clipped


__all__ = ["NORM_EPS", "RunningMoments", "combine_reward_scores"]
