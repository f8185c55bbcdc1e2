"""Reward-model training (`algorithm.name: rm`): the whole loop.

One step, as data flows: take a batch of preference pairs (prompt, chosen, rejected) as text, let
the reward_model group render both conversations with the reward model's own tokenizer and chat
template (what it will score in RL), score them in one packed forward and take a Bradley-Terry
update (`-log sigmoid(r_chosen - r_rejected - margin)`). Validation: held-out pairwise accuracy,
loss and score gap. The model starts from `model.path` (a causal LM: a fresh score head on its
backbone), and each checkpoint's `reward_model/` folder is an HF folder that
`AutoModelForSequenceClassification.from_pretrained` loads as is and `reward_model.path` takes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from rlcore.config import Config
from rlcore.data.preference import PreferenceLoader, collate_rm_pairs
from rlcore.protocol import Batch
from rlcore.trainer.groups import WorkerGroups, required
from rlcore.trainer.health import HealthGuard
from rlcore.trainer.loaders import preference_loader
from rlcore.trainer.metrics import Timer, mean_over_ranks
from rlcore.trainer.roles import build_worker_groups, placement
from rlcore.trainer.run_state import BadStepGuard, RunCheckpoints, checkpoint_policy, prepare_run_dir
from rlcore.trainer.step_log import StepHook, StepLog, log_settings
from rlcore.workers.reward_model import held_out_pair_metrics
from rlcore.workers.tokenizer import load_tokenizer


class RewardModelTrainer:
    algorithm = "rm"

    def __init__(self, config: Config, groups: WorkerGroups | None = None, step_hooks: Sequence[StepHook] = ()) -> None:
        self.config = config
        self.run_dir = prepare_run_dir(config)
        tokenizer = load_tokenizer(config.model.path)
        data = config.data
        self.train_loader = preference_loader(config, tokenizer, data.train_files, "pairwise", train=True, collate=collate_rm_pairs)
        self.val_loader = (preference_loader(config, tokenizer, data.val_files, "pairwise", train=False, collate=collate_rm_pairs)
                           if data.val_files else None)
        self.groups = groups or build_worker_groups(placement(config))
        self.reward_model = required(self.groups.reward_model, "reward_model")  # the model this run trains
        self.guard = BadStepGuard(config.reward_model.max_consecutive_bad_steps, self.run_dir / "checkpoints", role="reward_model")
        self.health = HealthGuard.from_config(config.health, role="reward_model")
        self.checkpoints = RunCheckpoints(checkpoint_policy(config), self.run_dir, self.groups, self.algorithm,
                                          {"train_loader": self.train_loader, "guard": self.guard, "health": self.health})
        self.log = StepLog(log_settings(config), self.run_dir, self.algorithm, self.groups, [self.health, *step_hooks])
        self.step = 0

    def fit(self) -> list[dict[str, Any]]:
        cfg = self.config.trainer
        try:
            self.step = self.checkpoints.resume()
            with self.log:
                if self.step == 0 and cfg.val_before_train and self.val_loader is not None:
                    self.log.validation(0, self.validate())
                while self.step < cfg.total_steps:
                    self.step += 1
                    last = self.step == cfg.total_steps
                    start = time.perf_counter()
                    metrics = self.train_step(self.train_loader.next_batch())
                    metrics["time/step_s"] = time.perf_counter() - start
                    self.guard.check(metrics)
                    if self.val_loader is not None and (self.step % cfg.val_every == 0 or last):
                        metrics.update(self.validate())
                    self.log.step(self.step, metrics)
                    if self.step % cfg.save_every == 0 or last:
                        self.checkpoints.save(self.step)
        finally:
            self.groups.close()
        return self.log.history

    def train_step(self, batch: Batch) -> dict[str, Any]:
        timer = Timer()
        with timer.phase("update_reward_model"):
            metrics = mean_over_ranks(self.reward_model.update_reward_model(batch))
        return {**metrics, **timer.metrics()}

    def validate(self) -> dict[str, float]:
        """Held-out pairs: pairwise accuracy (`val/pairwise_acc`), loss, score gap, mean scores."""
        assert self.val_loader is not None
        return pair_validation(self.groups, self.val_loader, self.config.reward_model.margin)


def pair_validation(groups: WorkerGroups, loader: PreferenceLoader, margin: float) -> dict[str, float]:
    """`held_out_pair_metrics` of the reward model being trained over every held-out pair, as `val/*`
    (the promotion gate computes the same numbers from the registered folder)."""
    reward_model = required(groups.reward_model, "reward_model")

    def score_pairs(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        out = reward_model.score_pairs(batch)
        return out.tensors["chosen_scores"], out.tensors["rejected_scores"]

    timer = Timer()
    with timer.phase("validate"):
        found = held_out_pair_metrics(loader.epoch_batches(), score_pairs, margin)
    metrics = {f"val/{k}": v for k, v in found.items() if k != "num_pairs"}
    metrics["time/validate_s"] = timer.seconds["validate"]
    return metrics


__all__ = ["RewardModelTrainer", "pair_validation"]
