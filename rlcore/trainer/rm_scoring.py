"""The reward model's part of an RL step (runs with `reward_model.path`): score the samples on
the reward_model group, then make the reward from its scores and the rule scorer's.

`launch` sends the batch to the reward model without waiting; the recipe then runs the rule
scorer, the old and reference log-probs and (PPO) the critic's values, and `collect` waits. On Ray,
with the reward model on its own pool, its scoring runs at the same time as those (measured by
`benchmarks/bench_reward_model.py`); `reward_model.overlap: false` waits at once instead.

The reward is `rlcore.algos.combine_reward_scores`: rule_weight x the rule score + weight x the
reward model's score, standardised by the running mean/std of every training score so far
(`reward_model.normalize`, state kept in the checkpoint) and clipped (`reward_model.clip`). The
rule scorer's `acc` is left as it was: accuracy (and validation) is always judged by the rule.
A NaN/inf score stops the run, or with `reward_model.on_nonfinite: skip` is counted and its
sample left out of the update; it never becomes a silent zero reward.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from rlcore.algos import RunningMoments, combine_reward_scores, group_ids_from_uids
from rlcore.config import Config
from rlcore.controller import GroupFuture
from rlcore.errors import RLCoreError
from rlcore.protocol import Batch
from rlcore.rewards import scores_to_token_rewards
from rlcore.trainer.groups import WorkerGroups, required
from rlcore.trainer.metrics import Timer

log = logging.getLogger(__name__)


class NonFiniteRewardModelScore(RLCoreError, RuntimeError):
    """The reward model gave NaN/inf scores with `reward_model.on_nonfinite: error`."""


def rule_agreement(uids: np.ndarray, rule: torch.Tensor, rm: torch.Tensor) -> tuple[float, float]:
    """(agreeing, total) over pairs of samples of one prompt that the rule scorer tells apart:
    how often the reward model orders them as the rule does (ties in the reward model disagree)."""
    groups = torch.as_tensor(group_ids_from_uids(uids), dtype=torch.long)
    same = groups[:, None] == groups[None, :]
    rule_wins = (rule[:, None] > rule[None, :]) & same
    agree = rule_wins & (rm[:, None] > rm[None, :])
    return float(agree.sum()), float(rule_wins.sum())


class RewardModelScoring:
    """Launch the reward model's scoring and turn its scores into the step's reward."""

    def __init__(self, config: Config, groups: WorkerGroups) -> None:
        self.config = config.reward_model
        self.groups = groups
        self.enabled = config.reward_model.path is not None
        self.moments = RunningMoments()
        if self.enabled and groups.reward_model is None:
            raise ValueError("reward_model.path is set but the run has no reward_model worker group")

    def launch(self, gen: Batch, timer: Timer) -> GroupFuture[Batch] | None:
        """Start scoring `gen` (None when the run has no reward model). In one process the call
        runs here and now; on Ray it runs on the reward model's ranks while the caller goes on."""
        if not self.enabled:
            return None
        with timer.phase("reward_model"):
            pending = required(self.groups.reward_model, "reward_model").compute_rm_score_async(gen)
            if not self.config.overlap:
                pending.result()
        return pending

    def collect(self, pending: GroupFuture[Batch] | None, gen: Batch, timer: Timer) -> tuple[Batch, dict[str, float]]:
        """Wait for the scores and make the reward: `scores` and `token_level_scores` replaced,
        `rule_scores` and `rm_scores` beside them; the running statistics take this batch in."""
        if pending is None:
            return gen, {}
        with timer.phase("reward_model"):
            out = pending.result()
        cfg = self.config
        raw = out.tensors["rm_scores"].float()
        finite = torch.isfinite(raw)
        bad = int((~finite).sum())
        if bad:
            self._refuse_or_count(gen, finite)
        if cfg.normalize:
            self.moments.update(raw[finite])
        mean, std = (self.moments.mean, self.moments.std) if cfg.normalize else (0.0, 1.0)
        rule = gen.tensors["scores"].float()
        reward, clipped = combine_reward_scores(rule, torch.where(finite, raw, torch.zeros_like(raw)), weight=cfg.weight,
                                                rule_weight=cfg.rule_weight, mean=mean, std=std, clip=cfg.clip)
        response_mask = gen.tensors["response_mask"]
        if bad:  # skipped samples: no loss, and a reward that moves no group baseline
            reward = torch.where(finite, reward, reward[finite].mean())
            response_mask = response_mask * finite[:, None].to(response_mask.dtype)
        tensors = dict(gen.tensors)
        tensors.update(scores=reward, rule_scores=rule, rm_scores=raw, response_mask=response_mask,
                       token_level_scores=scores_to_token_rewards(reward, response_mask))
        metrics = self._metrics(gen, raw, finite, clipped, out.tensors["rm_truncated"], mean, std)
        return Batch(tensors=tensors, meta={**gen.meta, "rm_response_text": out.meta["rm_response_text"]}, info=dict(gen.info)), metrics

    def _refuse_or_count(self, gen: Batch, finite: torch.Tensor) -> None:
        bad = int((~finite).sum())
        first = int((~finite).nonzero()[0])
        which = gen.meta["request_id"][first] if "request_id" in gen.meta else first
        what = (f"the reward model ({self.config.path}) scored {bad} of {len(finite)} samples NaN/inf "
                f"(first: sample {which})")
        if self.config.on_nonfinite == "error":
            raise NonFiniteRewardModelScore(f"{what}; reward_model.on_nonfinite=error stops the run "
                                            "(reward_model.on_nonfinite=skip leaves such samples out of the update)")
        if bad == len(finite):
            raise NonFiniteRewardModelScore(f"{what}: every sample; nothing to train on")
        log.warning("%s: skipped (reward_model.on_nonfinite=skip)", what)

    def _metrics(self, gen: Batch, raw: torch.Tensor, finite: torch.Tensor, clipped: torch.Tensor,
                 truncated: torch.Tensor, mean: float, std: float) -> dict[str, float]:
        scores = raw[finite]
        m = {
            "reward_model/score_mean": float(scores.mean()),
            "reward_model/score_std": float(scores.std()) if len(scores) > 1 else 0.0,
            "reward_model/running_mean": mean,
            "reward_model/running_std": std,
            "reward_model/clipped": float((clipped & finite).sum()),
            "reward_model/truncated": float(truncated.sum()),
            "reward_model/nonfinite": float((~finite).sum()),
            "reward/rule_mean": float(gen.tensors["scores"].float().mean()),
        }
        if "uid" in gen.meta:
            agree, pairs = rule_agreement(gen.meta["uid"][finite.numpy()], gen.tensors["scores"].float()[finite], scores)
            if pairs:
                m["reward_model/rule_agreement"] = agree / pairs
            m["reward_model/rule_pairs"] = pairs
        return m

    def state_dict(self) -> dict[str, Any]:
        return {"moments": self.moments.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.moments.load_state_dict(state["moments"])


__all__ = ["NonFiniteRewardModelScore", "RewardModelScoring", "rule_agreement"]
