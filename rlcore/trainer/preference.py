"""Offline preference optimisation: DPO and its variants (IPO, robust/cDPO via
`preference.loss_type` and `label_smoothing`) on pairs, and KTO (the Kahneman-Tversky value
function) on unpaired, labelled completions: the whole loop (`algorithm.name: dpo | kto`).

One step, as data flows: take a batch of preference rows (pairs: prompt, chosen, rejected; or
unpaired: prompt, completion, desirable?), attach the reference model's sequence log-probs
(cached per dataset, or computed now by the reference group), and let the actor take its update
on the algorithm's loss. Unpaired rows also carry a mismatched pair (the row's prompt with the
previous row's completion), whose policy/reference log-ratio, averaged over the batch and clamped
at 0, is KTO's reference point z0; it depends on the batch, so its reference log-probs are always
computed now. No rollout: the data is offline. The rollout and reward groups serve validation
only: greedy task accuracy on `preference.task_val_files`, exactly as an RL run measures `val/acc`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from rlcore.algorithms import PreferenceObjective
from rlcore.config import Config
from rlcore.protocol import Batch
from rlcore.trainer.groups import WorkerGroups, required
from rlcore.trainer.health import HealthGuard
from rlcore.trainer.loaders import preference_loader, prompt_loader
from rlcore.trainer.metrics import Timer, mean_over_ranks
from rlcore.trainer.preference_parts import (
    BATCH_DEPENDENT,
    ReferenceLogProbs,
    SequenceLogProbs,
    preference_kind,
    preference_step_metrics,
    preference_validation,
)
from rlcore.trainer.roles import build_worker_groups, placement
from rlcore.trainer.rollout_parts import RolloutSleep, sync_weights
from rlcore.trainer.run_state import BadStepGuard, RunCheckpoints, checkpoint_policy, prepare_run_dir
from rlcore.trainer.step_log import StepHook, StepLog, log_settings
from rlcore.trainer.validation import RLValidator
from rlcore.workers.tokenizer import load_tokenizer


class PreferenceTrainer:
    def __init__(self, config: Config, groups: WorkerGroups | None = None, step_hooks: Sequence[StepHook] = ()) -> None:
        self.config = config
        self.algorithm = config.algorithm.name
        objective = config.traits.objective  # the loss `update_preference` trains with
        if objective is None:
            raise ValueError(f"algorithm.name={self.algorithm} has no preference objective in its traits row (rlcore.algorithms)")
        self.objective: PreferenceObjective = objective
        self.run_dir = prepare_run_dir(config)
        self.tokenizer = load_tokenizer(config.model.path)
        data, self.kind = config.data, preference_kind(config.traits.data)
        self.train_loader = preference_loader(config, self.tokenizer, data.train_files, self.kind, train=True)
        self.val_loader = preference_loader(config, self.tokenizer, data.val_files, None, train=False) if data.val_files else None
        task_files = config.preference.task_val_files
        self.task_validator = RLValidator(config, prompt_loader(config, self.tokenizer, task_files, train=False)) if task_files else None
        self.groups = groups or build_worker_groups(placement(config))
        self.actor = required(self.groups.actor, "actor")
        # IPO averages each sequence's log-probs over its tokens (a loss of pairs: DPO's)
        self.logps = SequenceLogProbs(self.groups, average=self.kind == "pairwise" and config.preference.loss_type == "ipo")
        self.reference = ReferenceLogProbs(config, self.run_dir, self.logps)
        self.guard = BadStepGuard(config.actor.max_consecutive_bad_steps, self.run_dir / "checkpoints")
        self.health = HealthGuard.from_config(config.health)
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
        with timer.phase("ref_log_prob"):  # ref_chosen_logps, ref_rejected_logps; unpaired: ref_logps, ref_kl_logps
            batch = self.reference.attach(batch, self.train_loader, extra_prefixes=BATCH_DEPENDENT[self.kind])
        with timer.phase("update_actor"):
            actor_metrics = mean_over_ranks(self.actor.update_preference(batch, self.objective))
        return {**actor_metrics, **preference_step_metrics(batch, timer, self.config.actor.ppo_epochs)}

    def validate(self) -> dict[str, float]:
        """Held-out preference metrics and, with `preference.task_val_files`, greedy task accuracy."""
        assert self.val_loader is not None
        timer = Timer()
        out = preference_validation(self.val_loader, self.reference, self.logps, self.config.preference.beta, timer)
        if self.task_validator is not None:
            sync_weights(self.groups, RolloutSleep(self.groups, "never"), timer)
            out.update(self.task_validator.run(self.groups, self.step, self.step))
        out["time/validate_s"] = sum(timer.seconds.values()) + out.get("time/validate_s", 0.0)
        return out


__all__ = ["PreferenceTrainer"]
