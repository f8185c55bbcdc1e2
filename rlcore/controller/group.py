"""`WorkerGroup`: the interface the control flow talks to, whatever runs the workers.

The trainer only ever does `wg.generate(batch)` / `wg.call("generate", batch)`; dispatch planning
and result collection live here and in `dispatch.py`, so a backend (in-process, Ray) only says how
to start per-rank calls and wait for them (`_launch`), and how to stop (`_shutdown_workers`).
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from rlcore.controller.dispatch import Dispatch, MethodSpec, plan_dispatch

__all__ = ["GroupFuture", "RoleView", "WorkerGroup"]

_UNSET = object()
T_co = TypeVar("T_co", covariant=True)


class GroupFuture(Generic[T_co]):
    """Result of `call_async`: `.result()` waits, merges per-rank results and returns them,
    or raises the `WorkerError` of the first failing rank. `GroupFuture[Batch]`: what the typed
    group interfaces (`rlcore.trainer.groups`) say it will return."""

    def __init__(self, wait: Callable[[], Any]):
        self._wait = wait
        self._value: Any = _UNSET
        self._error: BaseException | None = None

    def result(self) -> T_co:
        if self._value is _UNSET and self._error is None:
            try:
                self._value = self._wait()
            except Exception as e:
                self._error = e
        if self._error is not None:
            raise self._error
        return self._value


class WorkerGroup(abc.ABC):
    """`world_size` ranks of one role. Call registered worker methods as `wg.method(...)`.

    Names of the group's own attributes (call, view, shutdown, role, ...) win over worker
    methods of the same name: reach those with `wg.call("name", ...)`.
    """

    def __init__(self, role: str, world_size: int):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self._role = role
        self._world_size = world_size
        self._closed = False

    @property
    def role(self) -> str:
        return self._role

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    @abc.abstractmethod
    def methods(self) -> dict[str, MethodSpec]:
        """Registered worker methods of this group, by name."""

    @abc.abstractmethod
    def _launch(self, method: str, calls: list[tuple[int, tuple, dict]]) -> Callable[[], list[Any]]:
        """Start the per-rank calls; return a function that waits for them and returns their
        results in `calls` order, raising `WorkerError` for a failed rank."""

    @abc.abstractmethod
    def _shutdown_workers(self) -> None:
        """Stop the workers (called once)."""

    def _spec(self, method: str) -> MethodSpec:
        if self._closed:
            raise RuntimeError(f"worker group {self._role!r} is shut down (calling {method!r})")
        spec = self.methods.get(method)
        if spec is None:
            raise AttributeError(
                f"worker group {self._role!r} has no registered method {method!r}; "
                f"registered: {sorted(self.methods)}"
            )
        return spec

    def call_async(self, method: str, *args: Any, **kwargs: Any) -> GroupFuture[Any]:
        """Dispatch per the method's registration; returns a future."""
        spec = self._spec(method)
        args, kwargs = self._prepare_args(spec.dispatch, args, kwargs)
        plan = plan_dispatch(spec.dispatch, self._world_size, args, kwargs, method=method,
                             ranks_per_shard=spec.ranks_per_shard)
        wait = self._launch(method, plan.calls)
        return self._make_future(spec.dispatch, lambda: plan.collect(wait()))

    def _prepare_args(self, dispatch: Dispatch, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Futures passed as arguments are waited for here (a backend may pass them on instead)."""
        def resolve(v: Any) -> Any:
            return v.result() if isinstance(v, GroupFuture) else v

        return tuple(resolve(a) for a in args), {k: resolve(v) for k, v in kwargs.items()}

    def _make_future(self, dispatch: Dispatch, wait: Callable[[], Any]) -> GroupFuture[Any]:
        return GroupFuture(wait)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Dispatch per the method's registration; the result, or a future if non-blocking."""
        future = self.call_async(method, *args, **kwargs)
        return future.result() if self._spec(method).blocking else future

    def view(self, role: str) -> RoleView:
        """Methods of one role in a colocated group: `wg.view("actor").update_actor(b)`."""
        prefix = f"{role}."
        if not any(m.startswith(prefix) for m in self.methods):
            raise AttributeError(f"worker group {self._role!r} has no colocated role {role!r}")
        return RoleView(self, role)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self.methods:
            return functools.partial(self.call, name)
        if name.endswith("_async") and name[: -len("_async")] in self.methods:  # wg.generate_async(b)
            return functools.partial(self.call_async, name[: -len("_async")])
        raise AttributeError(
            f"worker group {self._role!r} has no registered method {name!r}; "
            f"registered: {sorted(self.methods)}"
        )

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | {m for m in self.methods if "." not in m})

    def shutdown(self) -> None:
        """Stop the workers; later calls raise. Safe to call twice."""
        if not self._closed:
            self._closed = True
            self._shutdown_workers()

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(role={self._role!r}, world_size={self._world_size})"


class RoleView:
    """The methods of one colocated role, called as `view.method(...)`."""

    def __init__(self, group: WorkerGroup, role: str):
        self._group, self._role = group, role

    @property
    def group(self) -> WorkerGroup:
        """The colocated group this view belongs to."""
        return self._group

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._group.call(f"{self._role}.{method}", *args, **kwargs)

    def call_async(self, method: str, *args: Any, **kwargs: Any) -> GroupFuture[Any]:
        return self._group.call_async(f"{self._role}.{method}", *args, **kwargs)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        full = f"{self._role}.{name}"
        if full in self._group.methods:
            return functools.partial(self._group.call, full)
        if name.endswith("_async") and full[: -len("_async")] in self._group.methods:  # view.generate_async(b), as on a group
            return functools.partial(self._group.call_async, full[: -len("_async")])
        raise AttributeError(f"role {self._role!r} has no registered method {name!r}")
