"""Where a step's metrics go once the step is done: the run-health hooks, the tracker
(console, metrics.jsonl, MLflow), trace.jsonl (and val_trace.jsonl for validations), and the
history `fit()` returns."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcore.config import Config, TrackingConfig
from rlcore.tracking import Tracker, open_tracker
from rlcore.trainer.groups import WorkerGroups
from rlcore.trainer.tracing import TRACE_FILE, VAL_TRACE_FILE, step_record, validation_record, worker_identities

StepHook = Callable[[int, dict[str, Any]], None]


@dataclass(frozen=True)
class LogSettings:
    """What `StepLog` reads of a run's config: the loggers (`trainer.loggers`), the run's length,
    the tracking server and run, the config as the tracker records it (`params`), and the trace
    settings (`trainer.trace`, off: no trace.jsonl). `log_settings` makes them from an RL
    `Config`; `rlcore sft` makes its own."""

    loggers: Sequence[str]
    total_steps: int
    tracking: TrackingConfig
    params: dict[str, Any]
    trace: bool = False
    off_policy: str = "sync"
    trace_samples: int = 0
    trace_max_chars: int = 0


def log_settings(config: Config) -> LogSettings:
    """The RL run `config`'s `LogSettings` (its whole config the tracker's params)."""
    t = config.trainer
    return LogSettings(t.loggers, t.total_steps, config.tracking, config.model_dump(mode="json"), t.trace, t.off_policy,
                       t.trace_samples, t.trace_max_chars)


class StepLog:
    """Use as a context manager around the step loop (opens and closes the tracker).

    `step_hooks` see every step's metrics before they are logged; a hook that raises (a health
    guard's `TrainingStopped`) ends the run, and the step is still logged and traced."""

    def __init__(self, settings: LogSettings, run_dir: Path, algorithm: str, groups: WorkerGroups,
                 step_hooks: Sequence[StepHook] = ()) -> None:
        self.settings = settings
        self.run_dir = run_dir
        self.algorithm = algorithm
        self.groups = groups
        self.step_hooks = list(step_hooks)
        self.history: list[dict[str, Any]] = []
        self.tracker: Tracker | None = None
        self.workers: dict[str, Any] = {}

    def __enter__(self) -> StepLog:
        s = self.settings
        self.tracker = open_tracker(s.loggers, self.run_dir, s.total_steps,
                                    mlflow_uri=s.tracking.mlflow_uri, experiment=s.tracking.experiment,
                                    config_tree=s.params, tags={"rlcore.algorithm": self.algorithm},
                                    run_id=s.tracking.run_id)
        self.workers = worker_identities(self.groups) if s.trace else {}
        return self

    def __exit__(self, *exc: object) -> None:
        if self.tracker is not None:
            self.tracker.close()

    def validation(self, step: int, metrics: dict[str, Any], samples: list[dict[str, Any]] | None = None) -> None:
        """Validation before training (step 0): logged, no hooks; its samples (`samples`, per-sample
        records) traced as a validation record."""
        assert self.tracker is not None
        self.tracker.log(step, metrics)
        self._trace_validation(step, samples)

    def step(self, step: int, metrics: dict[str, Any], trace: dict[str, Any] | None = None,
             validation: list[dict[str, Any]] | None = None) -> None:
        """Hooks, then the tracker and trace.jsonl (`trace`: phases and per-sample records;
        `validation`: the per-sample records of the validation run after this step, if one ran)."""
        assert self.tracker is not None
        try:
            for hook in self.step_hooks:
                hook(step, metrics)
        finally:
            self.tracker.log(step, metrics)
            t = self.settings
            if t.trace:
                self._write_trace(step_record(step, t.off_policy, trace, metrics, self.workers, t.trace_samples,
                                              t.trace_max_chars))
            self._trace_validation(step, validation)
        self.history.append(metrics)

    def _trace_validation(self, step: int, samples: list[dict[str, Any]] | None) -> None:
        """A validation's samples as a record of val_trace.jsonl (`validation_record`)."""
        t = self.settings
        if t.trace and samples:
            self._write_trace(validation_record(step, samples, t.trace_samples, t.trace_max_chars), VAL_TRACE_FILE)

    def _write_trace(self, record: dict[str, Any], name: str = TRACE_FILE) -> None:
        with open(self.run_dir / name, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")


__all__ = ["LogSettings", "StepHook", "StepLog", "log_settings"]
