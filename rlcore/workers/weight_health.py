"""The health of a trained model's weights, for the run-health guard: the parameter norm (to stop
a run whose weights explode) and the count of non-finite values in parameters and optimizer state
(to stop a NaN model before it is saved). Both over every rank of an FSDP2 group."""

from __future__ import annotations

import math

import torch
from torch import nn

from rlcore.workers.fsdp import is_sharded
from rlcore.workers.ranks import global_sums
from rlcore.workers.trainable import Trainable


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (possibly FSDP2-sharded) tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


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
    squares, bad = 0.0, 0.0
    _reshard(trained.model)  # after a forward FSDP2 may hold full parameters: summed over ranks, they count twice
    with torch.no_grad():
        for p in trained.model.parameters():
            local = _local(p.detach()).float()
            squares += float(local.square().sum())
            bad += float((~torch.isfinite(local)).sum())
        for state in trained.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    bad += float((~torch.isfinite(_local(value.detach()))).sum())
    squares, bad = global_sums([squares, bad], device)
    return math.sqrt(squares) if math.isfinite(squares) else math.inf, bad
