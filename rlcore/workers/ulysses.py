"""Ulysses sequence parallelism: a long packed row split along its tokens over a group of ranks.

Each group of `size` consecutive ranks receives the same rows (the dispatch gives a shard to all
of its ranks, `Worker.ranks_per_shard`). Every rank runs embeddings, MLPs and norms on its slice
of the packed row (`PackedRows.shard`: `T / size` tokens, their global position ids, so RoPE is
unchanged), and around attention trades sequence for heads with one all-to-all each way:

    q, k, v [1, H, T/size, D]  --all-to-all-->  [1, H/size, T, D]   every token, a subset of heads
    varlen attention over the whole row's cu_seqlens (each sequence causal to itself)
    out [1, T, H/size, D]      --all-to-all-->  [1, T/size, H, D]

Key/value heads fewer than `size` (grouped-query attention) are repeated up to `size` first.
A rank scores the response tokens whose predictor lies in its slice; `gather` sums the `[N, R]`
results over the group (each entry comes from exactly one rank), differentiably, so every rank
holds the full log-probs or values and computes the same loss as one process would.

Why the step is the one-process step: the update loop (`rlcore.workers.loops`) normalises each
rank's loss by token and row counts summed over *all* ranks. The `size` ranks of a group hold the
same rows, so those counts are `size` times the batch's and each rank's share is `1/size` of its
group's loss: the shares over all ranks sum to the one-process loss L, and the loop's scale
(world size, because FSDP averages gradients) makes F = sum of scaled shares = world_size * L. The
all-reduce and all-to-alls are linear maps whose backward is their adjoint (sum of the incoming
gradients, the reverse all-to-all), so the gradients on all ranks together are dF/dtheta, and
FSDP's average over all world ranks (its mesh spans dp x sp) leaves exactly dL/dtheta.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlcore.workers.attention import varlen_attention
from rlcore.workers.packed import SharedPrompts
from rlcore.workers.parallel.shapes import ulysses_problem
from rlcore.workers.ranks import distributed_world

_ATTRIBUTE = "rlcore_sequence_parallel"


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's sequence-parallel group: `size` ranks, this one at `rank` within it."""

    group: Any  # torch.distributed ProcessGroup
    size: int
    rank: int

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        *,
        scale: float | None,
        dropout: float = 0.0,
        shared: SharedPrompts | None = None,
    ) -> torch.Tensor:
        """Attention of the whole packed row from this rank's slice: query `[1, H, T/size, D]`,
        key/value `[1, H_kv, T/size, D]`; returns this slice's output `[1, T/size, H, D]`. `shared`:
        the row's shared-prompt responses, as in `varlen_attention`."""
        if key.shape[1] < self.size:  # every rank needs a key/value head of its own
            key, value = (t.repeat_interleave(self.size // t.shape[1], dim=1) for t in (key, value))
        q, k, v = (self._all_heads_to_all_tokens(t) for t in (query, key, value))
        out = varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale=scale, dropout=dropout, shared=shared)
        return self._all_tokens_to_all_heads(out)

    def gather(self, shares: torch.Tensor) -> torch.Tensor:
        """The sum over the group of each rank's `shares` (zero where another rank computed the
        entry); gradients flow back to every rank's share."""
        import torch.distributed._functional_collectives as funcol

        return funcol.wait_tensor(funcol.all_reduce(shares, "sum", self.group))

    def _all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """Part i of dim 0 to rank i; returns part i from rank i, in rank order (differentiable)."""
        import torch.distributed._functional_collectives as funcol

        return funcol.wait_tensor(funcol.all_to_all_single_autograd(x.contiguous(), None, None, self.group))

    def _all_heads_to_all_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """`[1, H, T/size, D]` (this rank's tokens, every head) -> `[1, H/size, T, D]`. What is sent
        is laid out so that what arrives is `[T, H/size, D]` in memory, returned as a view."""
        _, heads, width, dim = x.shape
        send = x[0].transpose(0, 1).reshape(width, self.size, heads // self.size, dim).transpose(0, 1)  # [to rank i, token, head, D]
        parts = self._all_to_all(send)  # [from rank i (its tokens), token, my heads, D] = [T, H/size, D]
        return parts.view(1, self.size * width, heads // self.size, dim).transpose(1, 2)

    def _all_tokens_to_all_heads(self, x: torch.Tensor) -> torch.Tensor:
        """`[1, T, H/size, D]` (every token, this rank's heads) -> `[1, T/size, H, D]`."""
        _, tokens, heads, dim = x.shape
        width = tokens // self.size
        parts = self._all_to_all(x[0].reshape(self.size, width, heads, dim))  # [from rank i (its heads), my token, head, D]
        return parts.transpose(0, 1).reshape(1, width, self.size * heads, dim)


def head_problem(num_heads: int, num_kv_heads: int, size: int) -> str | None:
    """Why a model with these attention heads cannot be split over `size` ranks (None: it can)."""
    return ulysses_problem(num_heads, num_kv_heads, size)


def model_heads(config: Any) -> tuple[int, int]:
    """(attention heads, key/value heads) of a transformers config (or its text config)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    return heads, int(getattr(text, "num_key_value_heads", None) or heads)


def enable_sequence_parallel(model: nn.Module, size: int, device: torch.device, key: str) -> SequenceParallel | None:
    """Split `model`'s packed forwards over sequence-parallel groups of `size` consecutive ranks
    (a collective the first time: every rank of the role calls it). Refused (ValueError naming
    `key`) when `size` does not divide the world size or the model's heads. None, and nothing
    changed, for size 1."""
    if size == 1:
        return None
    world = distributed_world()
    if world % size:
        raise ValueError(f"{key}={size} does not divide the {world} ranks of this role")
    problem = head_problem(*model_heads(model.config), size)
    if problem:
        raise ValueError(f"{key}={size}: {problem} (Ulysses splits attention heads over the sequence-parallel ranks)")
    sp = _group(size, device)
    setattr(model, _ATTRIBUTE, sp)
    return sp


def use_sequence_parallel_group(model: nn.Module, group: Any) -> SequenceParallel:
    """Split `model`'s packed forwards over the ranks of `group` (a layout's "sp" mesh dim: see
    `rlcore.workers.parallel.apply_layout`, which checks the heads first)."""
    sp = SequenceParallel(group, dist.get_world_size(group), dist.get_rank(group))
    setattr(model, _ATTRIBUTE, sp)
    return sp


_GROUPS: dict[tuple[str, int], tuple[Any, SequenceParallel]] = {}


def _group(size: int, device: torch.device) -> SequenceParallel:
    """This rank's group of `size` in a (data, sequence) mesh over the world, made once per process
    group (roles sharing a process, and a model reloaded from a checkpoint, reuse it)."""
    world_group = dist.group.WORLD
    cached = _GROUPS.get((device.type, size))
    if cached is not None and cached[0] is world_group:
        return cached[1]
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (distributed_world() // size, size), mesh_dim_names=("dp", "sp"))
    group = mesh.get_group("sp")
    sp = SequenceParallel(group, size, dist.get_rank(group))
    _GROUPS[(device.type, size)] = (world_group, sp)
    return sp


def sequence_parallel_of(model: nn.Module) -> SequenceParallel | None:
    """The sequence-parallel group `model`'s packed forwards split over, if any."""
    return getattr(model, _ATTRIBUTE, None)


__all__ = ["SequenceParallel", "enable_sequence_parallel", "head_problem", "model_heads", "sequence_parallel_of",
           "use_sequence_parallel_group"]
