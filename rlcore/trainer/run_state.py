"""A run's life outside the steps: its folder, the non-finite-step guard, and checkpoints that
resume exactly (worker models and optimizers, plus the controller's own state: step, data
order, KL controller, guard counters, RNG)."""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from rlcore.checkpoint import (
    TRAINER_STATE,
    CheckpointError,
    CheckpointManager,
    load_trainer_state,
    rng_state,
    save_trainer_state,
    set_rng_state,
    step_of,
    weights_only_reason,
)
from rlcore.config import Config, LoraConfig, SFTConfig, dump_config
from rlcore.controller.errors import WorkerError
from rlcore.tracking import truncate_jsonl
from rlcore.trainer.groups import WorkerGroups
from rlcore.trainer.model_folders import WeightFileError, safetensors_header
from rlcore.workers.checkpointing import adapter_folder

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


@dataclass(frozen=True)
class TrainedModel:
    """A trained role's checkpoint as resuming checks it: the model folder it started from, its
    LoRA rank (0: none), and whether its full model must hold every tensor of that folder (the
    policy, the start model itself; a critic or reward model adds or drops a head)."""

    start: str
    lora_rank: int = 0
    same_model: bool = False

    @classmethod
    def of(cls, start: str, lora: LoraConfig, same_model: bool = False) -> TrainedModel:
        """A role started from `start`, with its `lora` section (its rank when enabled)."""
        return cls(start, lora.rank if lora.enabled else 0, same_model)


@dataclass(frozen=True)
class CheckpointPolicy:
    """What `RunCheckpoints` reads of a run's config: how many checkpoints to keep
    (`trainer.keep_last`), where to resume (`trainer.resume`), the tokenizer folder saved with
    each (`model.path`), whether a saved checkpoint passed the health guard (`health.enabled`),
    and the trained roles' models. `checkpoint_policy` makes one from an RL `Config`; `rlcore sft`
    makes its own (the actor alone)."""

    keep_last: int
    resume: str
    tokenizer_dir: str
    checked: bool
    trained: Mapping[str, TrainedModel]


def checkpoint_policy(config: Config) -> CheckpointPolicy:
    """The RL run `config`'s `CheckpointPolicy`."""
    t, path = config.trainer, config.model.path
    return CheckpointPolicy(t.keep_last, t.resume, path, config.health.enabled, {
        "actor": TrainedModel.of(path, config.actor.lora, same_model=True),
        "critic": TrainedModel.of(config.critic.model_path or path, config.critic.lora),
        "reward_model": TrainedModel.of(path, config.reward_model.lora)})


class RunCheckpoints:
    """Save and resume a run: the worker groups' checkpoints and, beside them, the state of every
    controller-side object named in `state` (data loader, KL controller, guard...) and the RNG.

    Resuming also cuts `metrics.jsonl`, `trace.jsonl` and `val_trace.jsonl` back to the checkpoint's step, so a
    resumed run's logs read like an uninterrupted run's; a fresh start empties them. A checkpoint
    that verifies but cannot be restored (content forged to match its manifest: trainer state of
    another shape, weights of another model) is refused in one line naming the folder and file;
    with `trainer.resume: auto` the run then falls back to the next older intact checkpoint. A
    resumed run says which step it continued from, and where (console and logs).
    """

    LOGS = ("metrics.jsonl", "trace.jsonl", "val_trace.jsonl")

    def __init__(self, policy: CheckpointPolicy, run_dir: Path, groups: WorkerGroups, algorithm: str,
                 state: dict[str, Stateful]) -> None:
        self.policy = policy
        self.run_dir = run_dir
        self.groups = groups
        self.algorithm = algorithm
        self.state = state
        self.manager = CheckpointManager(run_dir / "checkpoints", keep_last=policy.keep_last, state_keys=tuple(state))

    def resume(self) -> int:
        """Restore the newest checkpoint (`trainer.resume`); returns its step (0: a fresh start)."""
        mode = self.policy.resume
        refused = []
        for path in self._resume_points():
            try:
                step = self._restore(path)
            except CheckpointError as err:
                if mode != "auto":
                    raise
                log.warning("cannot resume from %s: %s", path, err)
                refused.append(str(err))
                continue
            if refused:
                log.warning("fell back to the older checkpoint %s", path)
            announce(f"resumed from checkpoint step {step} ({path}, trainer.resume={mode})")
            return step
        if refused:
            raise CheckpointError(f"no checkpoint in {self.manager.root} could be resumed: " + "; ".join(refused))
        for name in self.LOGS:  # a fresh start: nothing of an earlier attempt stays in the logs
            truncate_jsonl(self.run_dir / name, -1)
        return 0

    def _restore(self, path: Path) -> int:
        saved = load_trainer_state(path)
        problem = self._weights_problem(path)
        if problem is not None:
            raise CheckpointError(problem)
        try:
            self.groups.load_checkpoint(str(path))
        except WorkerError as err:
            raise CheckpointError(load_failure(path, err)) from None
        for name, obj in self.state.items():
            try:
                obj.load_state_dict(saved[name])
            except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
                raise CheckpointError(f"{path}: file {TRAINER_STATE}: entry {name!r} cannot be restored "
                                      f"({type(err).__name__}: {err})") from None
        try:
            set_rng_state(saved["rng"])
        except (KeyError, TypeError, ValueError, RuntimeError) as err:
            raise CheckpointError(f"{path}: file {TRAINER_STATE}: entry 'rng' cannot be restored "
                                  f"({type(err).__name__}: {err})") from None
        step = step_of(path)
        for name in self.LOGS:
            truncate_jsonl(self.run_dir / name, step)
        return step

    def _weights_problem(self, path: Path) -> str | None:
        """The first weight file of the checkpoint that does not fit this run's model, read from the
        safetensors headers (before any worker loads it: transformers would re-initialise a missing
        tensor, and names a mismatched one only in a log): a trained role's full model must have
        the start model's tensors at their shapes, a LoRA adapter the run's rank."""
        for role, model in self.policy.trained.items():
            start, rank, same_model = model.start, model.lora_rank, model.same_model
            for folder in (path / role, path / adapter_folder(role)):
                if not folder.is_dir():
                    continue
                found = _shapes(folder)
                if isinstance(found, str):
                    return f"{path}: {found}"
                if folder.name == role:
                    base = _shapes(Path(start))
                    if isinstance(base, str):
                        continue  # the start model's own problems are preflight's to report
                    for name, (file, shape) in found.items():
                        if name in base and base[name][1] != shape:
                            return (f"{path}: file {role}/{file} does not fit this run's model: tensor {name} is "
                                    f"{shape}, {start} has {base[name][1]}")
                    missing = sorted(set(base) - set(found)) if same_model else []
                    if missing:
                        return (f"{path}: file {role}/ lacks {len(missing)} tensor(s) of this run's model ({start}), "
                                f"first {missing[0]!r}")
                elif rank:
                    for name, (file, shape) in found.items():
                        r = shape[0] if "lora_A" in name else shape[-1] if "lora_B" in name else rank
                        if r != rank:
                            return (f"{path}: file {folder.name}/{file} does not fit this run's adapter: tensor {name} "
                                    f"is {shape}, of rank {r}; this run's {role}.lora.rank is {rank}")
        return None

    def save(self, step: int) -> Path:
        def write(folder: Path) -> None:
            self.groups.save_checkpoint(str(folder), tokenizer_dir=self.policy.tokenizer_dir)
            state = {name: obj.state_dict() for name, obj in self.state.items()}
            save_trainer_state(folder, {"step": step, "rng": rng_state(), **state})

        # Saved only after the step passed the health guard; with `health.enabled: false` the
        # checkpoint is unchecked, and pruning keeps the newest checked one.
        return self.manager.save(step, write, extra={"algorithm": self.algorithm}, healthy=self.policy.checked)

    def _resume_points(self) -> Iterator[Path]:
        mode = self.policy.resume
        if mode == "disable":
            return
        if mode == "auto":
            yield from self.manager.intact()
            return
        path = Path(mode)
        self.manager.verify(path)
        yield path


def _shapes(folder: Path) -> dict[str, tuple[str, list[int]]] | str:
    """tensor name -> (file, shape) over a folder's safetensors files; a problem line if one is unreadable."""
    shapes: dict[str, tuple[str, list[int]]] = {}
    for file in sorted(folder.glob("*.safetensors")):
        try:
            header = safetensors_header(file)
        except (WeightFileError, OSError) as err:
            return f"file {folder.name}/{file.name} is not a readable safetensors file ({err})"
        shapes.update({name: (file.name, list(info["shape"])) for name, info in header.items()})
    return shapes


def load_failure(path: Path, err: WorkerError) -> str:
    """One line for a checkpoint a worker could not load: the folder, the file of the role that
    failed (its weights, or its optimizer state), and the library's first words on it."""
    role = "actor" if err.role == "rollout" else err.role  # the rollout engine loads the actor's folder
    lines = [ln.strip() for ln in err.error.splitlines() if ln.strip()]
    detail = next((ln for ln in lines if "size mismatch" in ln), lines[0] if lines else "")
    if "Weights only load failed" in err.error or "UnpicklingError" in err.error:
        detail = f"holds more than plain data ({weights_only_reason(Exception(err.error))})"
    optimizer = any(w in err.error for w in ("optimizer", "param_groups", "parameter group", "scheduler"))
    candidates = ([f"{role}_optim.pt", f"{role}_scheduler.pt", f"{role}_dcp"] if optimizer else []) + [
        f"{role}_adapter/adapter_model.safetensors", f"{role}/model.safetensors", adapter_folder(role), role]
    where = next((c for c in candidates if (path / c).exists()), role)
    return f"{path}: cannot resume from file {where} ({err.role} worker): {detail[:400]}"


def announce(message: str) -> None:
    """A fact a person must see about the run (not a problem): in rlcore's log, and on the console
    (stderr), or inside a Prefect run in the flow run's log (which Prefect also prints)."""
    log.info(message)
    if "prefect" in sys.modules:
        try:
            from prefect.exceptions import MissingContextError
            from prefect.logging import get_run_logger

            get_run_logger().info(message)
            return
        except (ImportError, MissingContextError):
            pass
    if not log.isEnabledFor(logging.INFO):
        print(f"rlcore: {message}", file=sys.stderr, flush=True)


__all__ = ["BadStepGuard", "CheckpointPolicy", "RunCheckpoints", "Stateful", "TrainedModel", "TrainingStopped",
           "checkpoint_policy", "announce", "load_failure", "prepare_run_dir"]
