"""Reward baselines that need work of their own: ReMax's greedy baseline (Li et al. 2023,
arXiv:2310.10505), as verl computes it.

For each prompt of the step, one greedy response (do_sample off, n=1, same length limit) is
generated and scored by the reward worker; its score is the baseline subtracted from the reward of
every sampled response to that prompt (`algorithm.adv_estimator=remax`). The greedy responses are
not trained on. Generating them before the step's samples are collected keeps the engine awake
(colocated runs put it to sleep after the training generation); under `trainer.off_policy=one_step`
the baseline then comes from weights one update newer than the samples, which is still a baseline
(it does not depend on the sampled response), so the gradient stays unbiased.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from rlcore.protocol import Batch
from rlcore.rollout import SamplingParams
from rlcore.trainer.groups import required

if TYPE_CHECKING:  # annotations only
    from rlcore.trainer.groups import WorkerGroups
    from rlcore.trainer.metrics import Timer


def greedy_sampling(sampling: SamplingParams) -> SamplingParams:
    """The step's sampling parameters made greedy with one response per prompt (seed unused)."""
    return replace(sampling, n=1, do_sample=False)


@dataclass(frozen=True)
class GreedyBaselines:
    """Each prompt's greedy-response score, by prompt uid."""

    by_uid: dict[str, float]

    def for_samples(self, uids: Sequence[str] | np.ndarray) -> torch.Tensor:
        """The baseline of each sample [B] (float32): the score of its prompt's greedy response."""
        missing = sorted({str(u) for u in uids} - self.by_uid.keys())
        if missing:
            raise KeyError(f"no greedy baseline for prompt uids {missing[:5]} (the baseline was generated for other prompts)")
        return torch.tensor([self.by_uid[str(u)] for u in uids], dtype=torch.float32)

    def metrics(self) -> dict[str, float]:
        """`remax/greedy_reward_mean`: the mean baseline over prompts (what the samples must beat)."""
        return {"remax/greedy_reward_mean": float(np.mean(list(self.by_uid.values())))} if self.by_uid else {}


def greedy_reward_baselines(groups: WorkerGroups, prompts: Batch, sampling: SamplingParams, timer: Timer) -> GreedyBaselines:
    """Generate one greedy response per prompt of `prompts` and score it (timed as phases
    `baseline_generate` and `baseline_reward`)."""
    if "uid" not in prompts.meta:
        raise ValueError("greedy baselines need the prompts' uids (meta 'uid') to match samples to their prompt")
    with timer.phase("baseline_generate"):
        greedy = required(groups.rollout, "rollout").generate_sequences(prompts, greedy_sampling(sampling))
    with timer.phase("baseline_reward"):
        scored, _ = required(groups.reward, "reward").compute_reward(greedy)
    scores = scored.tensors["scores"].float().tolist()
    return GreedyBaselines({str(uid): score for uid, score in zip(greedy.meta["uid"], scores)})


__all__ = ["GreedyBaselines", "greedy_reward_baselines", "greedy_sampling"]
