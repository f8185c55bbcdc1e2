"""`Worker`: the base class role workers (actor, rollout, critic, ...) subclass."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from rlcore.controller.dispatch import MethodSpec, collect_methods

__all__ = ["ColocatedWorker", "Worker"]


class Worker:
    """One rank of a role. Subclasses add `@register`-ed methods that each do one thing.

    Construction must be cheap; heavy work (process groups, loading a model) goes in `setup()`,
    which the group calls on every rank once all ranks exist, so ranks can rendezvous there.

    `ranks_per_shard`: how many consecutive ranks receive the same part of a data-parallel call
    (a sequence-parallel group); set at construction, it is what `registered_methods` reports.
    """

    ranks_per_shard: int = 1

    def __init__(self, rank: int = 0, world_size: int = 1, role: str = ""):
        self.rank = rank
        self.world_size = world_size
        self.role = role  # the group fills it in when left empty

    def setup(self) -> None:
        """Called once per rank after all ranks are built."""

    def shutdown(self) -> None:
        """Release resources; called by `WorkerGroup.shutdown()`."""

    def registered_methods(self) -> dict[str, MethodSpec]:
        """Methods the group may call, with their dispatch specs (and this worker's ranks per shard)."""
        specs = collect_methods(type(self))
        if self.ranks_per_shard == 1:
            return specs
        return {name: dataclasses.replace(spec, ranks_per_shard=self.ranks_per_shard) for name, spec in specs.items()}

    def execute(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The single entry point a backend uses to run a method on this rank."""
        return getattr(self, method)(*args, **kwargs)


class ColocatedWorker(Worker):
    """Several role workers sharing one rank (e.g. actor + reference on the same GPUs).

    Their methods are exposed as "role.method": `wg.call("actor.update_actor", batch)`, or
    `wg.view("actor").update_actor(batch)`. `setup()`/`shutdown()` fan out to every role.
    """

    def __init__(self, workers: Mapping[str, Worker], rank: int = 0, world_size: int = 1,
                 role: str = ""):
        super().__init__(rank, world_size, role or "+".join(workers))
        self.workers = dict(workers)
        for name, w in self.workers.items():
            if "." in name:
                raise ValueError(f"colocated role name {name!r} must not contain '.'")
            if not w.role:
                w.role = name

    def setup(self) -> None:
        for w in self.workers.values():
            w.setup()

    def shutdown(self) -> None:
        for w in reversed(list(self.workers.values())):
            w.shutdown()

    def registered_methods(self) -> dict[str, MethodSpec]:
        return {f"{name}.{m}": spec for name, w in self.workers.items()
                for m, spec in w.registered_methods().items()}

    def execute(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if "." not in method:  # the colocated worker's own methods (setup, shutdown)
            return super().execute(method, *args, **kwargs)
        name, _, inner = method.partition(".")
        if name not in self.workers:
            raise AttributeError(
                f"colocated method {method!r}: role must be one of {list(self.workers)}"
            )
        return self.workers[name].execute(inner, *args, **kwargs)
