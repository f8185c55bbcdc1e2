"""`SubprocessWorkerGroup`: one rank in a child process of this one, for the in-process backend's
one-step overlap without sharing a GIL.

The child (started with `spawn`, so it begins clean: no copied OpenMP pools or CUDA state) builds
and sets up the worker, then runs calls one at a time in the order they were sent, as a Ray actor
does: a weight update sent while a generation runs happens after it. Calls and results travel
pickled over a pipe (torch tensors by value: the rollout's batches and weight buckets are small
next to the work). Its torch threads are sized for `cores` (`rlcore.cpus.use_cores`). A worker
error comes back as the `WorkerError` it raised there; a child that dies is one too.

Like `spawn` everywhere, a script that builds one needs an `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from rlcore.controller.dispatch import MethodSpec
from rlcore.controller.errors import WorkerError
from rlcore.controller.group import WorkerGroup
from rlcore.controller.worker import Worker

__all__ = ["SubprocessWorkerGroup"]


def _serve(conn: Any, factory: Callable[[int, int], Worker], role: str, cores: float | None) -> None:
    """The child: build the worker, then answer (method, args, kwargs) in order until "shutdown".
    Requests are read on a thread of their own, so a request arriving while a reply is being
    written (both bigger than the pipe's buffer) never blocks both ends."""
    import queue

    from rlcore.cpus import use_cores

    use_cores(cores)
    method = "__init__"
    try:
        worker = factory(0, 1)
        worker.role = worker.role or role
        method = "setup"
        worker.setup()
        conn.send_bytes(pickle.dumps(("ok", worker.registered_methods())))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send_bytes(pickle.dumps(("err", WorkerError.from_exception(role, 0, method, e))))
        return
    requests: queue.Queue[tuple[str, tuple, dict] | None] = queue.Queue()

    def read() -> None:
        while True:
            try:
                requests.put(pickle.loads(conn.recv_bytes()))
            except (EOFError, OSError):  # the parent is gone
                requests.put(None)
                return

    threading.Thread(target=read, daemon=True, name="rlcore-requests").start()
    while (request := requests.get()) is not None:
        method, args, kwargs = request
        try:
            reply = ("ok", worker.shutdown() if method == "shutdown" else worker.execute(method, *args, **kwargs))
        except BaseException as e:  # noqa: BLE001
            reply = ("err", WorkerError.from_exception(role, 0, method, e))
        conn.send_bytes(pickle.dumps(reply))
        if method == "shutdown":
            return


class _Reply:
    def __init__(self, method: str) -> None:
        self.method = method
        self.done = False
        self.value: Any = None
        self.error: WorkerError | None = None


class SubprocessWorkerGroup(WorkerGroup):
    """World size 1: `worker_factory(0, 1)` (picklable: a class or `functools.partial`) in a child."""

    def __init__(self, worker_factory: Callable[[int, int], Worker], role: str = "worker", *, cores: float | None = None):
        super().__init__(role, 1)
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, worker_factory, role, cores), name=f"rlcore-{role}", daemon=True)
        self._proc.start()
        child.close()
        self._lock = threading.Lock()  # one reader at a time; replies come back in call order
        self._pending: deque[_Reply] = deque()
        first = _Reply("__init__")
        self._pending.append(first)
        try:
            self._methods: dict[str, MethodSpec] = self._wait(first)
        except BaseException:
            self._proc.kill()
            raise

    @property
    def methods(self) -> dict[str, MethodSpec]:
        return self._methods

    def pids(self) -> list[int]:
        return [self._proc.pid or 0]

    def _send(self, method: str, args: tuple, kwargs: dict) -> _Reply:
        reply = _Reply(method)
        with self._lock:
            self._pending.append(reply)
            self._conn.send_bytes(pickle.dumps((method, args, kwargs)))
        return reply

    def _wait(self, reply: _Reply) -> Any:
        """Read replies (in order) until `reply` has arrived; its value, or its error raised."""
        while not reply.done:
            with self._lock:
                if reply.done:
                    break
                try:
                    status, value = pickle.loads(self._conn.recv_bytes())
                except (EOFError, OSError) as e:
                    err = WorkerError(self.role, 0, reply.method, f"the worker process died (exit code {self._proc.exitcode})",
                                      repr(e))
                    for r in self._pending:
                        r.done, r.error = True, err
                    self._pending.clear()
                    break
                head = self._pending.popleft()
                head.done = True
                if status == "ok":
                    head.value = value
                else:
                    head.error = value
        if reply.error is not None:
            raise reply.error
        return reply.value

    def _launch(self, method: str, calls: list[tuple[int, tuple, dict]]) -> Callable[[], list[Any]]:
        replies = [self._send(method, args, kwargs) for _, args, kwargs in calls]
        return lambda: [self._wait(r) for r in replies]

    def _shutdown_workers(self) -> None:
        try:
            if self._proc.is_alive():
                self._wait(self._send("shutdown", (), {}))
        finally:
            self._proc.join(timeout=30)
            if self._proc.is_alive():
                self._proc.kill()
            self._conn.close()
