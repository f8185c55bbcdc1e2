"""`InProcessWorkerGroup`: workers as plain objects in the controller's process.

For debugging and tests: ranks run one after another, a breakpoint in a worker method stops in
this process, and futures are resolved by the time `call_async` returns. Arguments are passed
by reference (a Ray backend copies them), so a worker must not mutate a Batch it is given.
A failure is raised as `WorkerError` with the original exception as `__cause__`
(`pdb.post_mortem(err.__cause__.__traceback__)` lands in the worker frame).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlcore.controller.dispatch import MethodSpec
from rlcore.controller.errors import WorkerError
from rlcore.controller.group import WorkerGroup
from rlcore.controller.worker import Worker

__all__ = ["InProcessWorkerGroup"]


class InProcessWorkerGroup(WorkerGroup):
    """Builds `worker_factory(rank, world_size)` for each rank, then calls `setup()` on each."""

    def __init__(self, worker_factory: Callable[[int, int], Worker], world_size: int = 1,
                 role: str = "worker"):
        super().__init__(role, world_size)
        self.workers: list[Worker] = []
        for rank in range(world_size):
            try:
                w = worker_factory(rank, world_size)
            except Exception as e:
                raise WorkerError.from_exception(role, rank, "__init__", e) from e
            if not isinstance(w, Worker):
                raise TypeError(f"{role}: worker_factory returned {type(w).__name__}, not a Worker")
            if (w.rank, w.world_size) != (rank, world_size):
                raise ValueError(
                    f"{role}: worker_factory built rank {w.rank}/{w.world_size} "
                    f"when asked for rank {rank}/{world_size}"
                )
            w.role = w.role or role
            self.workers.append(w)
        for rank in range(world_size):
            self._run(rank, "setup", (), {})
        self._methods = self.workers[0].registered_methods()

    @property
    def methods(self) -> dict[str, MethodSpec]:
        return self._methods

    def _run(self, rank: int, method: str, args: tuple, kwargs: dict) -> Any:
        try:
            return self.workers[rank].execute(method, *args, **kwargs)
        except Exception as e:
            raise WorkerError.from_exception(self.role, rank, method, e) from e

    def _launch(self, method: str, calls: list[tuple[int, tuple, dict]]) -> Callable[[], list[Any]]:
        results: list[Any] = []
        error: WorkerError | None = None
        try:
            for rank, args, kwargs in calls:
                results.append(self._run(rank, method, args, kwargs))
        except WorkerError as e:  # stop at the first failing rank, like the gather would
            error = e

        def wait() -> list[Any]:
            if error is not None:
                raise error
            return results

        return wait

    def _shutdown_workers(self) -> None:
        errors = []
        for rank, w in enumerate(self.workers):
            try:
                w.shutdown()
            except Exception as e:
                errors.append(WorkerError.from_exception(self.role, rank, "shutdown", e))
        if errors:
            raise errors[0]
