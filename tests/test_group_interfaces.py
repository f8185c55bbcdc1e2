"""The typed interfaces of the worker groups (`rlcore.trainer.groups`) say what the recipes' calls
take and give back through a group. Each one is derived here from the worker's own method and its
`@register` dispatch, both ways, so an interface cannot drift from the worker it stands for (mypy
then checks the recipe layer against the interfaces: `./dev check`)."""

from __future__ import annotations

import inspect
import types
import typing
from typing import Any, Union, get_args, get_origin, get_type_hints

import pytest

from rlcore.controller import Dispatch, GroupFuture, InProcessWorkerGroup, Worker, register
from rlcore.controller.dispatch import MethodSpec, collect_methods
from rlcore.protocol import Batch
from rlcore.trainer.groups import INTERFACES, ActorGroup, ReferenceGroup
from rlcore.workers.actor import ActorWorker, ReferenceWorker
from rlcore.workers.critic import CriticWorker
from rlcore.workers.reward import RewardWorker
from rlcore.workers.reward_model import RewardModelWorker
from rlcore.workers.rollout import RolloutWorker

WORKERS: dict[str, type[Worker]] = {"actor": ActorWorker, "ref": ReferenceWorker, "critic": CriticWorker,
                                    "rollout": RolloutWorker, "reward": RewardWorker, "reward_model": RewardModelWorker}


def through_group(result: Any, spec: MethodSpec) -> Any:
    """What a group call gives back for a worker method returning `result` (rlcore.controller.dispatch)."""
    if spec.dispatch is Dispatch.ONE_TO_ALL:
        out = list[result]  # one result per rank
    elif spec.dispatch in (Dispatch.DP_COMPUTE, Dispatch.DP_BALANCED):
        if get_origin(result) is tuple and get_args(result)[0] is Batch:  # (Batch, metrics): the batch whole, metrics per rank
            out = tuple[Batch, list[get_args(result)[1]]]  # type: ignore[misc]
        else:
            out = result if result in (Batch, type(None)) else list[result]  # batches concatenated, the rest per rank
    else:
        out = result  # rank 0's, or the collective's one result
    return out if spec.blocking else GroupFuture[out]


def same_type(a: Any, b: Any) -> bool:
    """Equal types, a bare generic (`dict`) matching any parametrisation of it."""
    a, b = (type(None) if t is None else t for t in (a, b))
    if a == b:
        return True
    if isinstance(a, type) and get_origin(b) is a or isinstance(b, type) and get_origin(a) is b:
        return True
    origin_a, origin_b = get_origin(a), get_origin(b)
    if origin_a in (Union, types.UnionType) and origin_b in (Union, types.UnionType):
        return len(get_args(a)) == len(get_args(b)) and all(map(same_type, get_args(a), get_args(b)))
    return (origin_a is not None and origin_a == origin_b and len(get_args(a)) == len(get_args(b))
            and all(map(same_type, get_args(a), get_args(b))))


def interface_methods(interface: type) -> list[str]:
    return sorted(name for name, fn in inspect.getmembers(interface, inspect.isfunction) if not name.startswith("_"))


def check_against(interface: type, worker: type[Worker]) -> list[str]:
    """Every problem with `interface` as the group view of `worker`'s registered methods."""
    problems = []
    registered = collect_methods(worker)
    for name in interface_methods(interface):
        base = name.removesuffix("_async")
        if base not in registered:
            problems.append(f"{interface.__name__}.{name}: {worker.__name__} registers no {base!r}")
            continue
        spec = registered[base]
        ours, theirs = get_type_hints(getattr(interface, name)), get_type_hints(getattr(worker, base))
        want = GroupFuture[through_group(theirs["return"], MethodSpec(spec.dispatch))] if name != base else \
            through_group(theirs["return"], spec)
        if not same_type(ours["return"], want):
            problems.append(f"{interface.__name__}.{name} returns {ours['return']}; through its group, "
                            f"{worker.__name__}.{base} ({spec.dispatch.value}) gives {want}")
        ours_params = list(inspect.signature(getattr(interface, name)).parameters.values())[1:]
        theirs_params = list(inspect.signature(getattr(worker, base)).parameters.values())[1:]
        if [(p.name, p.kind, p.default) for p in ours_params] != [(p.name, p.kind, p.default) for p in theirs_params]:
            problems.append(f"{interface.__name__}.{name}{inspect.signature(getattr(interface, name))} does not take "
                            f"what {worker.__name__}.{base}{inspect.signature(getattr(worker, base))} takes")
            continue
        for p in ours_params:
            mine, real = ours[p.name], theirs[p.name]
            if not (same_type(mine, real) or same_type(mine, Union[real, GroupFuture[real]])):  # noqa: UP007
                problems.append(f"{interface.__name__}.{name}({p.name}: {mine}): the worker takes {real} (or a future of it)")
    return problems


@pytest.mark.parametrize("role", list(INTERFACES))
def test_each_interface_is_its_workers_methods_through_the_group(role):
    interface, worker = INTERFACES[role], WORKERS[role]
    assert check_against(interface, worker) == []
    missing = set(collect_methods(worker)) - {name.removesuffix("_async") for name in interface_methods(interface)}
    assert not missing, f"{worker.__name__} registers {sorted(missing)}, which {interface.__name__} does not declare"


def test_the_actor_serves_as_reference_with_lora():
    """`groups.ref = groups.actor` under LoRA: the actor's interface is also the reference's."""
    assert ReferenceGroup in ActorGroup.__mro__
    assert check_against(ReferenceGroup, ActorWorker) == []


class _Echo(Worker):
    @register(dispatch=Dispatch.DP_COMPUTE)
    def double(self, batch: Batch) -> Batch:
        return Batch(tensors={"x": batch.tensors["x"] * 2})

    @register(dispatch=Dispatch.DP_COMPUTE)
    def metrics(self, batch: Batch) -> dict[str, float]:
        return {"rows": float(len(batch))}

    @register(dispatch=Dispatch.DP_COMPUTE)
    def double_with_metrics(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        return self.double(batch), {"rows": float(len(batch))}

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def ping(self) -> None:
        pass


class _EchoGroup(typing.Protocol):
    def double(self, batch: Batch) -> Batch: ...
    def double_async(self, batch: Batch) -> GroupFuture[Batch]: ...
    def metrics(self, batch: Batch) -> list[dict[str, float]]: ...
    def double_with_metrics(self, batch: Batch) -> tuple[Batch, list[dict[str, float]]]: ...
    def ping(self) -> list[None]: ...


def test_the_derivation_matches_what_groups_return():
    """The rule `through_group` encodes is what a group really gives back: checked on real groups of
    two ranks (in process), plain and as a colocated role's view, for each kind of method above."""
    import torch

    from rlcore.controller import ColocatedWorker

    assert check_against(_EchoGroup, _Echo) == []
    batch = Batch(tensors={"x": torch.arange(4.0)})
    plain = InProcessWorkerGroup(lambda rank, ws: _Echo(rank, ws), world_size=2, role="echo")
    colocated = InProcessWorkerGroup(lambda rank, ws: ColocatedWorker({"echo": _Echo(rank, ws)}, rank, ws), world_size=2, role="c")
    try:
        for group in (plain, colocated.view("echo")):
            assert torch.equal(group.double(batch).tensors["x"], torch.arange(4.0) * 2)
            future = group.double_async(batch)
            assert isinstance(future, GroupFuture) and torch.equal(future.result().tensors["x"], torch.arange(4.0) * 2)
            assert group.metrics(batch) == [{"rows": 2.0}, {"rows": 2.0}]
            doubled, per_rank = group.double_with_metrics(Batch(tensors={"x": torch.arange(3.0)}))  # padded to 4 rows, cut back
            assert torch.equal(doubled.tensors["x"], torch.arange(3.0) * 2) and per_rank == [{"rows": 2.0}, {"rows": 2.0}]
            assert group.ping() == [None, None]
    finally:
        plain.shutdown()
        colocated.shutdown()


class _DriftedEchoGroup(typing.Protocol):
    def double(self, batch: Batch, scale: float) -> Batch: ...
    def metrics(self, batch: Batch) -> dict[str, float]: ...  # one dict: but a data-parallel group gives one per rank
    def pong(self) -> None: ...


def test_a_drifted_interface_is_caught():
    problems = check_against(_DriftedEchoGroup, _Echo)
    assert len(problems) == 3, problems
    assert "_DriftedEchoGroup.double(self, batch: 'Batch', scale: 'float') -> 'Batch' does not take" in problems[0]
    assert "_DriftedEchoGroup.metrics returns dict[str, float]; through its group, _Echo.metrics (dp_compute) gives " \
           "list[dict[str, float]]" in problems[1]
    assert "_Echo registers no 'pong'" in problems[2]
