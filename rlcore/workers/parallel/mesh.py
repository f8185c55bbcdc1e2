"""The device mesh of a layout: dims ("dp", "sp", "tp"), tensor-parallel ranks consecutive.

Made once per process group and layout (making one creates a process group per dim, a collective
every rank of the world joins in the same order): roles sharing a process and a model reloaded
from a checkpoint reuse it. Under torch's fake process group (the memory planner) it is made the
same way."""

from __future__ import annotations

from typing import Any, Protocol

import torch.distributed as dist

DIMS = ("dp", "sp", "tp")
FSDP_DIM = "dp_sp"  # FSDP2 shards over data- and sequence-parallel ranks together (the mesh flattened)


class Layout(Protocol):
    """A layout's sizes (`rlcore.config.LayoutConfig` is one)."""

    data_parallel: int
    sequence_parallel: int
    tensor_parallel: int


_MESHES: dict[tuple[Any, ...], tuple[Any, Any]] = {}  # (device type, shape) -> (the world group it was made in, mesh)
_FLAT: dict[int, tuple[Any, Any]] = {}  # id(mesh) -> (mesh, its "dp_sp" mesh): slicing that from the root is deprecated


def device_mesh(layout: Layout, device_type: str) -> Any:
    """The `DeviceMesh` of `layout` over the initialised world (its size must be the layout's product)."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = (layout.data_parallel, layout.sequence_parallel, layout.tensor_parallel)
    world = dist.get_world_size()
    if shape[0] * shape[1] * shape[2] != world:
        raise ValueError(f"a layout of {shape[0]} x {shape[1]} x {shape[2]} ranks (data x sequence x tensor parallel) "
                         f"does not match the {world} ranks of this process group")
    world_group = dist.group.WORLD
    cached = _MESHES.get((device_type, shape))
    if cached is not None and cached[0] is world_group:  # the same process group (not a new one since)
        return cached[1]
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=DIMS)
    _MESHES[(device_type, shape)] = (world_group, mesh)
    return mesh


def fsdp_mesh(mesh: Any) -> Any:
    """The 1-D mesh FSDP2 shards over: data- and sequence-parallel ranks (the world without tp),
    flattened once per mesh (`_flatten`: private, stable since torch 2.5; torchtitan uses it)."""
    known = _FLAT.get(id(mesh))
    if known is None:
        known = _FLAT[id(mesh)] = (mesh, mesh["dp", "sp"]._flatten(FSDP_DIM))
    return known[1]


__all__ = ["DIMS", "FSDP_DIM", "Layout", "device_mesh", "fsdp_mesh"]
