"""Weights from any trained layout to the rollout ranks, bucket by bucket, gathered to one rank.

The rollout engines take full tensors: vLLM's loaders slice each full checkpoint tensor for their
own tensor-parallel rank (`weight_loader` narrows it; on CPU the linear layers are then repacked,
so nothing can be written into a rank's shard in place), and the hf backend holds a whole model
per rank. So a sync must assemble each tensor once; the question is where and at what cost.

`gather_to_owner` assembles a bucket on one rank (the owner, which hands it to the rollout
ranks) with one `gather` of every rank's own shards: each rank sends the parts it is the first
holder of (a tensor replicated over the tensor-parallel ranks, a norm say, is sent by one of them),
as raw bytes in one buffer, and only the owner ever holds the full bucket. `full_tensor()`, what
`rlcore.workers.fsdp.gather_bucket` does, is an all-gather (two on a 2-D mesh): every rank then
materialises every full tensor of the bucket, and every rank receives the whole bucket.
`benchmarks/bench_parallel.py` measures both: bytes each rank receives and sends, peak bytes a
rank holds, bytes each rollout rank gets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlcore.workers.fsdp import sync_state
from rlcore.workers.parallel.tensors import is_dtensor


@dataclass
class SyncStats:
    """What one rank did for a sync (summed over its buckets)."""

    sent_bytes: int = 0       # this rank's shards put on the wire
    received_bytes: int = 0   # what arrived from other ranks
    peak_bytes: int = 0       # the most gathered / staged bytes this rank held at once
    buckets: int = 0
    per_bucket: list[int] = field(default_factory=list)  # full bytes of each bucket

    def add(self, other: SyncStats) -> None:
        self.sent_bytes += other.sent_bytes
        self.received_bytes += other.received_bytes
        self.peak_bytes = max(self.peak_bytes, other.peak_bytes)
        self.buckets += other.buckets
        self.per_bucket += other.per_bucket


def _first_holder(t: torch.Tensor) -> bool:
    """Whether this rank sends its shard of `t`: the first of the ranks holding the same one."""
    if not is_dtensor(t):
        return False  # a whole tensor on every rank: the owner has it already
    coordinate = t.device_mesh.get_coordinate()
    return all(c == 0 for c, p in zip(coordinate, t.placements) if not (p.is_shard() or _strided(p)))


def _strided(p: Any) -> bool:
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(p, _StridedShard)


def _piece(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]:
    """(offset, shape, local tensor) of this rank's shard of DTensor `t` in its global tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(offset), tuple(shape), t.to_local()


def gather_to_owner(model: nn.Module, names: list[str], owner: int = 0, *,
                    on_device: bool = False) -> tuple[list[tuple[str, torch.Tensor]], SyncStats]:
    """The full tensors of `names` on rank `owner` ([] on the others), assembled from every rank's
    shards with one gather; every rank of the model's process group calls it with the same names.
    One rank: the model's own tensors (views, no copy). The bucket is staged where the collective
    runs (on the GPU under NCCL, in host memory under gloo) and handed over on the host, unless
    `on_device` (the engine shares this process and device: it then copies device to device)."""
    state = sync_state(model)
    stats = SyncStats(buckets=1, per_bucket=[sum(state[n].numel() * state[n].element_size() for n in names)])
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [(n, _whole(state[n], on_device)) for n in names], stats
    rank, world = dist.get_rank(), dist.get_world_size()
    staging = _staging_device(state[names[0]]) if names else torch.device("cpu")
    params = dict(model.named_parameters(remove_duplicate=False))  # tied names: one parameter (state_dict detaches each)
    key = {name: id(params.get(name, state[name])) for name in names}
    distinct: dict[int, str] = {}  # tied names share one tensor: gathered once
    for name in names:
        distinct.setdefault(key[name], name)
    meta: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    parts: list[torch.Tensor] = []
    for name in distinct.values():
        t = state[name].detach()
        if _first_holder(t):
            offset, shape, local = _piece(t)
            if local.numel():
                meta.append((name, offset, shape))
                parts.append(local.contiguous().view(-1).to(staging).view(torch.uint8))
    mine = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=staging)
    sizes = [None] * world if rank == owner else None
    dist.gather_object((meta, mine.numel()), sizes, dst=owner)
    width = torch.tensor([mine.numel()], device=staging)
    dist.all_reduce(width, op=dist.ReduceOp.MAX)  # gather takes equal sizes
    send = torch.zeros(int(width), dtype=torch.uint8, device=staging)
    send[: mine.numel()] = mine
    stats.sent_bytes = mine.numel() if rank != owner else 0
    stats.peak_bytes = mine.numel() + send.numel()
    if rank != owner:
        dist.gather(send, None, dst=owner)
        return [], stats
    inbox = [torch.empty_like(send) for _ in range(world)]
    dist.gather(send, inbox, dst=owner)
    full = {name: _whole(state[name], True).to(staging) if not is_dtensor(state[name])
            else torch.empty(state[name].shape, dtype=state[name].dtype, device=staging) for name in distinct.values()}
    for r, ((their_meta, used), buffer) in enumerate(zip(sizes, inbox)):
        at = 0
        for name, offset, shape in their_meta:
            target = full[name]
            n = int(torch.Size(shape).numel()) * target.element_size()
            block = buffer[at: at + n].view(target.dtype).view(shape)
            target[tuple(slice(o, o + s) for o, s in zip(offset, shape))] = block
            at += n
        stats.received_bytes += used if r != owner else 0
    stats.peak_bytes = stats.peak_bytes + sum(b.numel() for b in inbox) + sum(t.numel() * t.element_size() for t in full.values())
    handed = full if on_device else {name: t.cpu() for name, t in full.items()}
    return [(name, handed[distinct[key[name]]]) for name in names], stats


def _staging_device(t: torch.Tensor) -> torch.device:
    """Where a bucket is assembled: the tensors' device when the process group's backend moves
    tensors there (NCCL on CUDA), else host memory (gloo)."""
    local = t.to_local() if is_dtensor(t) else t
    if local.is_cuda and dist.get_backend() == "nccl":
        return local.device
    return torch.device("cpu")


def _whole(t: torch.Tensor, on_device: bool) -> torch.Tensor:
    """A one-rank tensor as a plain tensor: a view where it is (`on_device`), else on the host."""
    plain = t.detach()
    if is_dtensor(plain):  # a one-rank mesh holds the whole tensor locally
        plain = plain.to_local()
    return plain if on_device else plain.cpu()


__all__ = ["SyncStats", "gather_to_owner"]
