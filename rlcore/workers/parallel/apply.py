"""`apply_layout`: the one way a trained role's model (actor, reference, critic, reward model)
gets its layout: tensor parallelism, then Ulysses sequence parallelism, then FSDP2.

Order matters: DTensor's `parallelize_module` first makes the split matrices DTensors on the
"tp" mesh dim; FSDP2 (`fully_shard` on the flattened "dp" x "sp" dims) then shards those further
(`_StridedShard` on dim 0) and everything else (norms, a classifier head) over its own 1-D mesh.
Ulysses needs no parameter change: its group rides along the packed forward.

Why a step is the one-process step: each rank's loss is normalised by token and row counts summed
over the world (`rlcore.workers.loops`), in which the `sp * tp` ranks of a shard each count its
rows, and scaled by the world size. The tensor-parallel ranks of a shard compute one loss
together: their collectives' backward passes (DTensor's and the vocabulary-parallel head's,
`rlcore.triton_kernels.VocabShard`) leave each of them the full gradient of its own parameters
(its rows of a split matrix, all of a replicated one), so the `tp` copies do not add up. What
remains is Ulysses' and FSDP's argument (`rlcore.workers.ulysses`): FSDP averages over its
`dp * sp` ranks, which leaves exactly dL/dtheta.

Without a process group (one process) this is `shard_model`: unchanged, or the local
mixed-precision / offload policy. With `mesh` given (the memory planner, under torch's fake
process group on the meta device) no process group is made here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from rlcore.config import RoleSpec
from rlcore.workers.fsdp import shard_model
from rlcore.workers.packed import token_tally
from rlcore.workers.parallel.mesh import Layout, device_mesh, fsdp_mesh
from rlcore.workers.parallel.plans import parallelize
from rlcore.workers.parallel.shapes import sequence_parallel_problem
from rlcore.workers.ulysses import enable_sequence_parallel, use_sequence_parallel_group


def apply_layout(
    model: nn.Module,
    layout: Layout,
    device: torch.device,
    *,
    tp_key: str,
    sp_key: str,
    mixed_precision: str = "none",
    cpu_offload: bool = False,
    forward_methods: Mapping[str, Callable[..., Any]] | None = None,
    mesh: Any = None,
    cast_once: bool | str = False,
) -> nn.Module:
    """`model` split as `layout` says over the process group (every rank of the role calls it: it
    makes process groups the first time). `tp_key`, `sp_key`: the config keys of its tensor- and
    sequence-parallel sizes (`Config.layout_key`), named when the model's shape or architecture does
    not allow them. `forward_methods`: `shard_model`'s (the caller's computations outside
    `model.forward`). `mesh`: a ready `device_mesh(layout, ...)` (else made here). `cast_once`:
    `shard_model`'s (compute copies kept across a step's micro-batches)."""
    tp, sp = layout.tensor_parallel, layout.sequence_parallel
    if tp == 1:  # data and sequence parallelism as they always were
        if mesh is None:
            enable_sequence_parallel(model, sp, device, sp_key)
        elif sp > 1:
            use_sequence_parallel_group(model, mesh["sp"].get_group())
        return shard_model(model, device, mixed_precision, cpu_offload, forward_methods,
                           mesh=None if mesh is None else fsdp_mesh(mesh), cast_once=cast_once)
    problem = sequence_parallel_problem(model.config.to_dict(), sp, tp)
    if problem:
        raise ValueError(f"{sp_key}={sp}: {problem}, with {tp_key}={tp}")
    mesh = mesh if mesh is not None else device_mesh(layout, device.type)
    parallelize(model, mesh["tp"], tp_key)
    if sp > 1:
        use_sequence_parallel_group(model, mesh["sp"].get_group())
    token_tally(model).copies = tp
    return shard_model(model, device, mixed_precision, cpu_offload, forward_methods, mesh=fsdp_mesh(mesh), cast_once=cast_once)


def apply_role_layout(model: nn.Module, spec: RoleSpec[Any], device: torch.device, *, mixed_precision: str = "none",
                      cpu_offload: bool = False, forward_methods: Mapping[str, Callable[..., Any]] | None = None,
                      cast_once: bool | str = False) -> nn.Module:
    """`apply_layout` with the role's layout and keys (`RoleSpec.layout`, `tp_key`, `sp_key`)."""
    return apply_layout(model, spec.layout, device, tp_key=spec.tp_key, sp_key=spec.sp_key, mixed_precision=mixed_precision,
                        cpu_offload=cpu_offload, forward_methods=forward_methods, cast_once=cast_once)


__all__ = ["apply_layout", "apply_role_layout"]
