"""The one exception a worker failure becomes in the controller."""

from __future__ import annotations

import traceback


class WorkerError(RuntimeError):
    """A worker method raised. Names role, rank and method, and carries the remote traceback text.

    Every backend raises this (in-process and Ray alike), so the control flow handles one type.
    """

    def __init__(self, role: str, rank: int, method: str, error: str, remote_traceback: str):
        self.role, self.rank, self.method = role, rank, method
        self.error, self.remote_traceback = error, remote_traceback
        super().__init__(
            f"worker role={role!r} rank={rank} method={method!r} failed: {error}\n"
            f"--- remote traceback (role={role!r} rank={rank}) ---\n{remote_traceback.rstrip()}"
        )

    @classmethod
    def from_exception(cls, role: str, rank: int, method: str, exc: BaseException) -> WorkerError:
        """Build from an exception caught where the worker runs (keeps its formatted traceback)."""
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(role, rank, method, f"{type(exc).__name__}: {exc}", tb)

    def __reduce__(self):  # picklable across processes (Ray) with all fields intact
        return (type(self), (self.role, self.rank, self.method, self.error, self.remote_traceback))
