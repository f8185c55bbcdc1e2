"""A run's life outside the steps: its folder, the non-finite-step guard, and checkpoints that
resume exactly (worker models and optimizers, plus the controller's own state: step, data
order, KL controller, guard counters, RNG)."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from rlcore.checkpoint import CheckpointManager, load_trainer_state, rng_state, save_trainer_state, set_rng_state, step_of
from rlcore.config import Config, SFTConfig, dump_config
from rlcore.tracking import truncate_jsonl
from rlcore.trainer.roles import WorkerGroups

log = logging.getLogger(__name__)


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (e.g. too many non-finite updates in a row); work so far is saved."""


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def prepare_run_dir(config: Config | SFTConfig) -> Path:
    """The run folder with the resolved `config.yaml`; seeds torch and numpy from `trainer.seed`."""
    run_dir = Path(config.trainer.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(config))
    torch.manual_seed(config.trainer.seed)
    np.random.seed(config.trainer.seed)
    return run_dir


class BadStepGuard:
    """Counts steps whose update was skipped for a non-finite loss or gradient; stops the run
    after `limit` in a row (`actor.max_consecutive_bad_steps`, or for the reward model trained by
    `algorithm.name: rm`, `reward_model.max_consecutive_bad_steps`: `role="reward_model"`)."""

    LOSS_KEYS = {"actor": "actor/pg_loss", "reward_model": "reward_model/loss"}

    def __init__(self, limit: int, checkpoint_root: Path, role: str = "actor") -> None:
        self.limit = limit
        self.checkpoint_root = checkpoint_root
        self.role = role
        self.in_a_row = 0
        self.total = 0

    def check(self, metrics: dict[str, Any]) -> None:
        """Adds `train/bad_steps_total`; raises `TrainingStopped` at the limit."""
        loss = metrics.get(self.LOSS_KEYS[self.role], 0.0)
        bad = metrics.get(f"{self.role}/bad_updates", 0.0) > 0 or not math.isfinite(loss)
        self.in_a_row = self.in_a_row + 1 if bad else 0
        self.total += int(bad)
        metrics["train/bad_steps_total"] = float(self.total)
        if self.in_a_row >= self.limit:
            raise TrainingStopped(
                f"{self.in_a_row} steps in a row had a non-finite loss or gradient (limit "
                f"{self.role}.max_consecutive_bad_steps={self.limit}); the last good checkpoint is kept in {self.checkpoint_root}"
            )

    def state_dict(self) -> dict[str, Any]:
        return {"in_a_row": self.in_a_row, "total": self.total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.in_a_row, self.total = int(state["in_a_row"]), int(state["total"])


class RunCheckpoints:
    """Save and resume a run: the worker groups' checkpoints and, beside them, the state of every
    controller-side object named in `state` (data loader, KL controller, guard...) and the RNG.

    Resuming also cuts `metrics.jsonl` and `trace.jsonl` back to the checkpoint's step, so a
    resumed run's logs read like an uninterrupted run's; a fresh start empties them.
    """

    LOGS = ("metrics.jsonl", "trace.jsonl")

    def __init__(self, config: Config, run_dir: Path, groups: WorkerGroups, algorithm: str, state: dict[str, Stateful]) -> None:
        self.config = config
        self.run_dir = run_dir
        self.groups = groups
        self.algorithm = algorithm
        self.state = state
        self.manager = CheckpointManager(run_dir / "checkpoints", keep_last=config.trainer.keep_last)

    def resume(self) -> int:
        """Restore the newest checkpoint (`trainer.resume`); returns its step (0: a fresh start)."""
        path = self._resume_point()
        if path is None:  # a fresh start: nothing of an earlier attempt stays in the logs
            for name in self.LOGS:
                truncate_jsonl(self.run_dir / name, -1)
            return 0
        saved = load_trainer_state(path)
        self.groups.load_checkpoint(str(path))
        for name, obj in self.state.items():
            obj.load_state_dict(saved[name])
        set_rng_state(saved["rng"])
        step = step_of(path)
        for name in self.LOGS:
            truncate_jsonl(self.run_dir / name, step)
        log.info("resumed from %s (step %d)", path, step)
        return step

    def save(self, step: int) -> Path:
        def write(folder: Path) -> None:
            self.groups.save_checkpoint(str(folder), tokenizer_dir=self.config.model.path)
            state = {name: obj.state_dict() for name, obj in self.state.items()}
            save_trainer_state(folder, {"step": step, "rng": rng_state(), **state})

        # Saved only after the step passed the health guard; with `health.enabled: false` the
        # checkpoint is unchecked, and pruning keeps the newest checked one.
        return self.manager.save(step, write, extra={"algorithm": self.algorithm}, healthy=self.config.health.enabled)

    def _resume_point(self) -> Path | None:
        mode = self.config.trainer.resume
        if mode == "disable":
            return None
        if mode == "auto":
            return self.manager.latest()
        path = Path(mode)
        self.manager.verify(path)
        return path


__all__ = ["BadStepGuard", "RunCheckpoints", "Stateful", "TrainingStopped", "prepare_run_dir"]
