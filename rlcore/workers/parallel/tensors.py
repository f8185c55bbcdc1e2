"""Sharded tensors as a rank sees them: its local rows, how many ranks hold the same ones, the
gradient norm over tensors on different meshes.

Under FSDP2 x TP a decoder matrix is a DTensor on the 2-D (data, tensor) mesh, while a norm's
weight (split by no plan) is one on the 1-D data mesh, held alike by every tensor-parallel rank;
sums over the world must count such copies once, and torch's `clip_grad_norm_` cannot stack norms
from two meshes."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist


def is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    return t.to_local() if is_dtensor(t) else t


def copies(t: torch.Tensor) -> int:
    """Ranks of the world holding the same local shard as this one: the world over the mesh
    dims `t` is sharded on (every rank, for a plain tensor)."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if not is_dtensor(t):
        return world
    from torch.distributed.tensor.placement_types import _StridedShard  # FSDP2's dim-0 shard of a TP shard

    sharded = math.prod(t.device_mesh.size(i) for i, p in enumerate(t.placements) if p.is_shard() or isinstance(p, _StridedShard))
    return world // sharded


def vocab_rows(weight: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """(this rank's rows, a `VocabShard` saying which) of an LM head split over the vocabulary on a
    1-D tensor-parallel mesh; (weight, None) for a whole one. Differentiable: gradients reach the
    DTensor's own rows."""
    if not is_dtensor(weight):
        return weight, None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from rlcore.triton_kernels import VocabShard

    mesh, placements = weight.device_mesh, weight.placements
    if mesh.ndim != 1 or not placements[0].is_shard(0):
        raise ValueError(f"an LM head on a {mesh.ndim}-D mesh with placements {placements}: rlcore's log-prob path takes "
                         "one split over the vocabulary on the tensor-parallel mesh (FSDP2 gathers the rest)")
    _, offset = compute_local_shape_and_global_offset(weight.shape, mesh, placements)
    return weight.to_local(), VocabShard(mesh.get_group(), int(offset[0]), int(weight.shape[0]))


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch's `clip_grad_norm_` (L2, the same scale factor), also over gradients on different
    device meshes (FSDP2 x TP): each mesh's norm is completed with `full_tensor`, then combined.
    Returns the total norm as a plain tensor."""
    params = [p for p in parameters if p.grad is not None]
    meshes: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        meshes.setdefault(p.grad.device_mesh if is_dtensor(p.grad) else None, []).append(p.grad)
    if len(meshes) <= 1:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if is_dtensor(norm) else norm
    parts = []
    for grads in meshes.values():
        part = torch.nn.utils.get_total_norm(grads)
        parts.append((part.full_tensor() if is_dtensor(part) else part).float().cpu())
    total = torch.linalg.vector_norm(torch.stack(parts))
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    with torch.no_grad():
        for p in params:
            p.grad.mul_(float(coef))
    return total


__all__ = ["clip_grad_norm", "copies", "is_dtensor", "local", "vocab_rows"]
