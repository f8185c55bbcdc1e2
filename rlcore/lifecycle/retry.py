"""The pipeline's retry policy: how many times a Prefect task of `rl_pipeline` is tried again
(`STAGE_RETRIES`, `rlcore pipeline run/serve --retries N`; `LOOKUP_RETRIES` for the registry reads)
and which failures are worth it (`retry_if_transient`, every task's `retry_condition_fn`): an I/O
hiccup (a file system, the tracking store) is; a deterministic data/config error is not (the same
inputs fail the same way again), and neither is the death of a process of the run (a worker
killed, `pipeline serve` gone from under its flow-run process): a retry would repeat it or run
orphaned, so the run ends at once and is reported once."""

from __future__ import annotations

import sys
from typing import Any

from rlcore.errors import RLCoreError

STAGE_RETRIES = 1  # each stage (data_prep, sft, reward model, train, evaluate, promote): one more try
LOOKUP_RETRIES = 2  # the registry reads (the champion, the reward model in use): cheap, two more tries


def is_deterministic(err: BaseException) -> bool:
    """A problem in the data or the config (rlcore's own errors, validation's ValueErrors): the same
    inputs fail the same way again, so a retry would only delay the report."""
    return isinstance(err, (RLCoreError, ValueError, TypeError, KeyError))


def _process_death_types() -> tuple[type[BaseException], ...]:
    """Exceptions that mean a process of the run died: BrokenPipeError (the pipe a flow-run process
    writes its log to was closed: the serving process is gone), MemoryError, an interrupt or exit, a
    training worker lost (rlcore's WorkerDiedError: killed, out of memory, its node lost) and, when
    Ray is loaded, Ray's own actor/worker/node deaths."""
    from rlcore.controller.ray_backend import WorkerDiedError

    found: list[type[BaseException]] = [BrokenPipeError, MemoryError, KeyboardInterrupt, SystemExit, WorkerDiedError]
    if "ray.exceptions" in sys.modules:  # never imported just to decide
        ray_exceptions = sys.modules["ray.exceptions"]
        found += [getattr(ray_exceptions, name) for name in ("RayActorError", "WorkerCrashedError", "NodeDiedError",
                                                              "LocalRayletDiedError") if hasattr(ray_exceptions, name)]
    return tuple(found)


def is_process_death(err: BaseException) -> bool:
    """`err`, or an exception it was raised from (`raise ... from`), says a process of the run died."""
    kinds = _process_death_types()
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, kinds):
            return True
        seen.add(id(current))
        current = current.__cause__
    return False


def retry_if_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect's `retry_condition_fn`: retry an I/O hiccup, not a deterministic data/config error nor
    a process death. `state.data` holds the exception (Prefect builds the failed state from it)."""
    err = getattr(state, "data", None)
    return not (isinstance(err, BaseException) and (is_deterministic(err) or is_process_death(err)))


__all__ = ["LOOKUP_RETRIES", "STAGE_RETRIES", "is_deterministic", "is_process_death",
           "retry_if_transient"]
