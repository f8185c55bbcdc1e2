"""`InProcessWorkerGroup`: workers as plain objects in the controller's process.

For debugging and tests: ranks run one after another, a breakpoint in a worker method stops in
this process, and futures are resolved by the time `call_async` returns. Arguments are passed
by reference (a Ray backend copies them), so a worker must not mutate a Batch it is given.

`own_thread=True`: the group's workers live on a thread of their own (built, set up, called and
shut down there, one call at a time in the order they were made), so `call_async` returns at
once and the work overlaps the caller's (torch ops release the GIL). A call waits behind the
ones before it, as on a Ray actor: a weight update made while a generation is in flight runs
after it. The thread's torch intra-op threads are sized for `cores` (`rlcore.cpus.use_cores`).
A failure is raised as `WorkerError` with the original exception as `__cause__`
(`pdb.post_mortem(err.__cause__.__traceback__)` lands in the worker frame).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlcore.controller.dispatch import MethodSpec
from rlcore.controller.errors import WorkerError
from rlcore.controller.group import WorkerGroup
from rlcore.controller.worker import Worker
from rlcore.cpus import use_cores

__all__ = ["InProcessWorkerGroup"]


class InProcessWorkerGroup(WorkerGroup):
    """Builds `worker_factory(rank, world_size)` for each rank, then calls `setup()` on each."""

    def __init__(self, worker_factory: Callable[[int, int], Worker], world_size: int = 1,
                 role: str = "worker", *, own_thread: bool = False, cores: float | None = None):
        super().__init__(role, world_size)
        self._thread_id: int | None = None  # of the group's own thread, once started
        self._thread = (ThreadPoolExecutor(1, thread_name_prefix=f"rlcore-{role}", initializer=self._enter, initargs=(cores,))
                        if own_thread else None)
        try:
            self._on_thread(lambda: self._build(worker_factory, world_size, role))
        except BaseException:
            if self._thread is not None:
                self._thread.shutdown(wait=True)
            raise

    def _enter(self, cores: float | None) -> None:
        """The group's own thread starting: remember it, and use its share of the cores."""
        self._thread_id = threading.get_ident()
        use_cores(cores)

    def _here(self) -> bool:
        """Whether a call runs on the calling thread: without an own thread, or from inside it (a
        worker method calling back into its group, as a weight sync taken between two decode
        steps does: submitting would wait for itself)."""
        return self._thread is None or threading.get_ident() == self._thread_id

    def _on_thread(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` where this group's workers live (its thread, or here), and wait for it."""
        return fn() if self._here() else self._thread.submit(fn).result()  # type: ignore[union-attr]

    def _build(self, worker_factory: Callable[[int, int], Worker], world_size: int, role: str) -> None:
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
        def run_all() -> list[Any]:  # stops at the first failing rank, like the gather would
            return [self._run(rank, method, args, kwargs) for rank, args, kwargs in calls]

        if not self._here():
            return self._thread.submit(run_all).result  # type: ignore[union-attr]
        results: list[Any] = []
        error: WorkerError | None = None
        try:
            results = run_all()
        except WorkerError as e:
            error = e

        def wait() -> list[Any]:
            if error is not None:
                raise error
            return results

        return wait

    def _shutdown_workers(self) -> None:
        try:
            self._on_thread(self._shutdown_each)
        finally:
            if self._thread is not None:
                self._thread.shutdown(wait=True)

    def _shutdown_each(self) -> None:
        errors = []
        for rank, w in enumerate(self.workers):
            try:
                w.shutdown()
            except Exception as e:
                errors.append(WorkerError.from_exception(self.role, rank, "shutdown", e))
        if errors:
            raise errors[0]
