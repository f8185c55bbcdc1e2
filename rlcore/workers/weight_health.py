"""The health of a trained model's weights, for the run-health guard: the parameter norm (to stop
a run whose weights explode) and the count of non-finite values in parameters and optimizer state
(to stop a NaN model before it is saved). Both over every rank of an FSDP2 group."""

from __future__ import annotations

import math

import torch
from torch import nn

from rlcore.workers.fsdp import is_sharded
from rlcore.workers.parallel.tensors import copies, local
from rlcore.workers.ranks import global_sums
from rlcore.workers.trainable import Trainable


def _reshard(model: nn.Module) -> None:
    """Every FSDP2 module back to its sharded parameters (each rank then holds only its shard)."""
    if is_sharded(model):
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def weight_health(trained: Trainable, device: torch.device) -> tuple[float, float]:
    """(parameter L2 norm, count of non-finite elements in parameters and optimizer state), summed
    over ranks: what the run-health guard needs to stop an exploding or NaN model before it is saved."""
    _reshard(trained.model)  # after a forward FSDP2 may hold full parameters: summed over ranks, they count twice
    with torch.no_grad():
        # each rank's shards, weighted by the ranks holding the same one (a norm's weight on every
        # tensor-parallel rank, a plain tensor on every rank), so that the sums count each element once
        params = _by_copies([p.detach() for p in trained.model.parameters()])
        states = _by_copies([v.detach() for state in trained.optimizer.state.values() for v in state.values()
                             if isinstance(v, torch.Tensor) and v.is_floating_point()])
        squares = sum(_norm(ts) ** 2 / n for n, ts in params.items())
        # A finite norm means finite elements (a NaN or inf anywhere makes it NaN or inf): count only otherwise.
        bad = sum(_nonfinite(ts, _norm(ts)) / n for group in (params, states) for n, ts in group.items())
    squares, bad = global_sums([squares, bad], device)
    return math.sqrt(squares) if math.isfinite(squares) else math.inf, bad


def _by_copies(tensors: list[torch.Tensor]) -> dict[int, list[torch.Tensor]]:
    """Local shards grouped by how many ranks of the world hold the same one."""
    groups: dict[int, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(copies(t), []).append(local(t))
    return groups


def _norm(tensors: list[torch.Tensor]) -> float:
    """L2 norm over all elements of `tensors` (float32 or wider), in a few fused kernels."""
    if not tensors:
        return 0.0
    return float(torch.nn.utils.get_total_norm([t.float() if t.dtype.itemsize < 4 else t for t in tensors]))


def _nonfinite(tensors: list[torch.Tensor], norm: float) -> float:
    """Non-finite elements of `tensors`, whose L2 norm is `norm` (0 when that is finite)."""
    if math.isfinite(norm):
        return 0.0
    return float(sum(int((~torch.isfinite(t)).sum()) for t in tensors))
