"""The private torch APIs the planner stands on, imported here and nowhere else.

- `torch.testing._internal.distributed.fake_pg`: registers the "fake" process-group backend (one
  process plays rank 0 of any world size; collectives move no data) and its `FakeStore`;
- `torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker` and `.mem_tracker.MemTracker`:
  a dispatch mode that counts every tensor storage alive, by kind (parameters, gradients,
  optimizer state, activations, FSDP's gathered layers), and keeps the peak;
- `torch._subclasses.fake_tensor.FakeTensorMode`: tensors with shapes, dtypes and devices but
  no data, so a 70B model's step runs in one laptop process; `unset_fake_temporarily` (in
  `outside_fake`), for the host-side index arithmetic DTensor does on a device mesh's coordinates;
- DTensor's sharding-propagation caches, emptied between simulations (`forget_meshes`).

None of them is a public API: they may change in any torch release. The lock pins the torch they
were checked with (`TESTED_TORCH`); `check()` (and `tests/test_plan.py`) fails with a message that
names the API and both versions when one of them is gone or behaves differently.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from rlcore.errors import RLCoreError

TESTED_TORCH = "2.13.0"  # requirements/lock.txt's torch: the version these APIs were checked with

# The tracker's names for what it counts (`_FSDPRefType` / `_MemRefType` values) -> the planner's.
KINDS: dict[str, str] = {
    "Sharded Param": "params", "Parameter": "params", "Buffer": "params",
    "Sharded Grad": "grads", "Gradient": "grads",
    # FSDP's gradients of the layer(s) being reduced: gathered over the FSDP ranks (only TP splits
    # them) and the reduce-scatter's buffers; a transient of the backward, not the 1/devices shard
    "Unsharded Grad": "grads in flight", "Reduce Scatter": "grads in flight",
    "OptState": "optimizer", "Optstate": "optimizer",
    "Activation": "activations", "Temp": "activations", "Inputs": "activations",
    "Unsharded Param": "gathered", "All Gather": "gathered",
    "Other": "other",
}


class TorchAPIChanged(RLCoreError, RuntimeError):
    """A private torch API the planner needs is missing or changed; names it and the versions."""


@dataclass(frozen=True)
class TorchTools:
    FakeStore: Any
    FakeTensorMode: Any
    FSDPMemTracker: Any
    MemTracker: Any


def _changed(what: str, err: BaseException) -> TorchAPIChanged:
    return TorchAPIChanged(
        f"rlcore plan: torch {torch.__version__} changed a private API the planner uses ({what}: "
        f"{type(err).__name__}: {err}); it was checked with torch {TESTED_TORCH} (requirements/lock.txt). "
        "Install that torch, or update rlcore/plan/torch_api.py for this one")


def load() -> TorchTools:
    """The private APIs, or TorchAPIChanged naming the one that is missing."""
    try:
        import torch.testing._internal.distributed.fake_pg as fake_pg  # registers the "fake" backend
    except Exception as err:  # noqa: BLE001
        raise _changed("torch.testing._internal.distributed.fake_pg", err) from err
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
    except Exception as err:  # noqa: BLE001
        raise _changed("torch._subclasses.fake_tensor.FakeTensorMode", err) from err
    try:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
        from torch.distributed._tools.mem_tracker import MemTracker
    except Exception as err:  # noqa: BLE001
        raise _changed("torch.distributed._tools (FSDPMemTracker, MemTracker)", err) from err
    try:
        store = fake_pg.FakeStore
    except AttributeError as err:
        raise _changed("torch.testing._internal.distributed.fake_pg.FakeStore", err) from err
    return TorchTools(store, FakeTensorMode, FSDPMemTracker, MemTracker)


@contextmanager
def outside_fake() -> Iterator[None]:
    """Leave fake-tensor mode for host arithmetic on real tensors (a DTensor's shard offsets are
    computed from its mesh's coordinates, which under the mode would be fake and unreadable)."""
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
    except Exception as err:  # noqa: BLE001
        raise _changed("torch._subclasses.fake_tensor.unset_fake_temporarily", err) from err
    with unset_fake_temporarily():
        yield


def forget_meshes() -> None:
    """Empty DTensor's sharding-propagation caches (C++ and Python). Each simulation makes a new fake
    process group whose device meshes compare equal to the last one's (a mesh's equality ignores its
    process groups), so a cached result would hand out the old mesh, whose groups are gone."""
    try:
        from torch.distributed.tensor import DTensor

        torch._C._clear_DTensor_sharding_propagator_cache()
        propagator = DTensor._op_dispatcher.sharding_propagator
        propagator.propagate_op_sharding.cache_clear()
        propagator._propagate_tensor_meta_cached.cache_clear()
    except Exception as err:  # noqa: BLE001
        raise _changed("DTensor's sharding-propagation caches (torch._C._clear_DTensor_sharding_propagator_cache, "
                       "DTensor._op_dispatcher.sharding_propagator)", err) from err


def peak_by_kind(tracker: Any) -> dict[str, int]:
    """The tracker's peak snapshot summed over devices, in the planner's kinds (`KINDS`) and
    "total". A kind the tracker reports that `KINDS` does not know is a changed API."""
    try:
        snapshot = tracker.get_tracker_snapshot("peak")
    except Exception as err:  # noqa: BLE001
        raise _changed("MemTracker.get_tracker_snapshot('peak')", err) from err
    out: dict[str, int] = {"total": 0}
    for device_snapshot in snapshot.values():
        for key, value in device_snapshot.items():
            name = getattr(key, "value", key)
            if name == "Total":
                out["total"] += int(value)
                continue
            if name not in KINDS:
                raise _changed("the memory tracker's kinds", KeyError(f"unknown kind {name!r}"))
            kind = KINDS[name]
            out[kind] = out.get(kind, 0) + int(value)
    return out


def check() -> None:
    """Run the APIs once the way the planner does: a two-layer model sharded over 4 fake ranks,
    one fake-tensor training step tracked. TorchAPIChanged when anything the planner relies on
    moved: an import, the fake backend, the tracker's peak and its kinds, FSDP under fake tensors."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    tools = load()
    if dist.is_initialized():
        raise RuntimeError("torch_api.check() needs a process without a process group")
    forget_meshes()
    with outside_fake():
        pass
    try:
        dist.init_process_group("fake", store=tools.FakeStore(), rank=0, world_size=4)
    except Exception as err:  # noqa: BLE001
        raise _changed("the 'fake' process-group backend", err) from err
    try:
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64))
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        fake = tools.FakeTensorMode(allow_non_fake_inputs=True)
        with fake:
            model.to_empty(device="cpu")
            optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
            tracker = tools.FSDPMemTracker(model, optimizer)
            with tracker:
                for _ in range(2):
                    model(torch.ones(512, 64)).sum().backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    tracker.reset_mod_stats()
        peak = peak_by_kind(tracker)
    except TorchAPIChanged:
        raise
    except Exception as err:  # noqa: BLE001
        raise _changed("FSDPMemTracker on a fully_shard model under FakeTensorMode with the fake process group", err) from err
    finally:
        dist.destroy_process_group()
    params = (64 * 256 + 256 + 256 * 64 + 64) * 4
    want = {"params": params // 4, "optimizer": 2 * params // 4}  # a quarter each on rank 0 of 4
    for kind, size in want.items():
        if not 0.9 * size <= peak.get(kind, 0) <= 1.1 * size + 4096:
            raise _changed("the memory tracker's counts", ValueError(f"{kind} {peak.get(kind, 0)} bytes, expected ~{size}: {peak}"))
    if peak.get("activations", 0) < 512 * 256 * 4:
        raise _changed("the memory tracker's counts", ValueError(f"activations {peak.get('activations', 0)} bytes: {peak}"))


__all__ = ["KINDS", "TESTED_TORCH", "TorchAPIChanged", "TorchTools", "check", "forget_meshes", "load", "outside_fake", "peak_by_kind"]
