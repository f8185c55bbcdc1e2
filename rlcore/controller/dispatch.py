"""How one controller call becomes per-rank calls, and how their results come back.

A worker method is tagged with `@register(dispatch=...)`; the group looks the tag up and asks
`plan_dispatch` for (rank, args, kwargs) per call plus a `collect` function. Planning and
collecting are pure functions of the arguments, so every backend (in-process, Ray) shares them
and only differs in how it runs the per-rank calls.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlcore.protocol import Batch

__all__ = [
    "Dispatch",
    "MethodSpec",
    "Plan",
    "balanced_partitions",
    "collect_methods",
    "plan_dispatch",
    "register",
]

_SPEC_ATTR = "__rlcore_method__"


class Dispatch(str, enum.Enum):
    """How arguments are spread over the ranks of a group."""

    ONE_TO_ALL = "one_to_all"    # same args to every rank -> list of per-rank results
    RANK_ZERO = "rank_zero"      # rank 0 only -> its result
    DP_COMPUTE = "dp_compute"    # Batch args split in contiguous equal parts -> concat in order
    DP_BALANCED = "dp_balanced"  # like DP_COMPUTE, parts balanced by token count, order restored
    # (both: one part per data-parallel shard of `ranks_per_shard` consecutive ranks, see MethodSpec)
    COLLECTIVE = "collective"    # same args to every rank (they run a collective) -> rank 0's result


@dataclass(frozen=True)
class MethodSpec:
    """What `@register` records on a worker method."""

    dispatch: Dispatch = Dispatch.ONE_TO_ALL
    blocking: bool = True  # False: `wg.method(...)` returns a future instead of the result
    # data-parallel modes: consecutive ranks that get the same part (a sequence-parallel group,
    # which splits each sequence among its ranks); the worker instance sets it, see Worker
    ranks_per_shard: int = 1


def register(dispatch: Dispatch | Callable = Dispatch.ONE_TO_ALL, blocking: bool = True):
    """Mark a worker method as callable through a WorkerGroup, with its dispatch mode.

    `@register(dispatch=Dispatch.DP_COMPUTE)`; a bare `@register` means ONE_TO_ALL. Only
    registered methods can be called through a group, so helpers stay private to the worker.
    """
    if callable(dispatch) and not isinstance(dispatch, Dispatch):  # bare @register
        setattr(dispatch, _SPEC_ATTR, MethodSpec())
        return dispatch
    spec = MethodSpec(Dispatch(dispatch), bool(blocking))

    def deco(fn: Callable) -> Callable:
        setattr(fn, _SPEC_ATTR, spec)
        return fn

    return deco


def collect_methods(cls: type) -> dict[str, MethodSpec]:
    """Registered methods of a worker class, by name (inherited ones included)."""
    out = {}
    for name in dir(cls):
        spec = getattr(getattr(cls, name, None), _SPEC_ATTR, None)
        if isinstance(spec, MethodSpec):
            out[name] = spec
    return out


@dataclass
class Plan:
    """Per-rank calls for one controller call, and how to merge their results."""

    calls: list[tuple[int, tuple, dict]]    # (rank, args, kwargs)
    collect: Callable[[list[Any]], Any]     # per-call results (same order as calls) -> result


def plan_dispatch(mode: Dispatch, world_size: int, args: tuple, kwargs: dict,
                  method: str = "?", ranks_per_shard: int = 1) -> Plan:
    """Split one call into per-rank calls according to `mode`; the data-parallel modes split
    into `world_size / ranks_per_shard` parts, each sent to that many consecutive ranks."""
    mode = Dispatch(mode)
    if mode is Dispatch.ONE_TO_ALL:
        return Plan([(r, args, kwargs) for r in range(world_size)], list)
    if mode is Dispatch.RANK_ZERO:
        return Plan([(0, args, kwargs)], lambda results: results[0])
    if mode is Dispatch.COLLECTIVE:
        return Plan([(r, args, kwargs) for r in range(world_size)], lambda results: results[0])
    return _plan_dp(world_size, args, kwargs, method, balanced=mode is Dispatch.DP_BALANCED,
                    ranks_per_shard=ranks_per_shard)


# ----- data-parallel dispatch -----------------------------------------------------------------


def _plan_dp(world_size: int, args: tuple, kwargs: dict, method: str, balanced: bool,
             ranks_per_shard: int = 1) -> Plan:
    """Pad every Batch argument to a multiple of the shard count, give each shard its part (every
    rank of a shard the same part), and undo both the reordering and the padding on the way back,
    from the first rank of each shard."""
    if ranks_per_shard < 1 or world_size % ranks_per_shard:
        raise ValueError(f"{method}: {ranks_per_shard} ranks per shard do not divide world size {world_size}")
    shards = world_size // ranks_per_shard
    where = [(i, None) for i, a in enumerate(args) if isinstance(a, Batch)]
    where += [(None, k) for k, v in kwargs.items() if isinstance(v, Batch)]
    if not where:
        raise TypeError(f"{method}: data-parallel dispatch needs a Batch argument, got none")
    batches = [args[i] if k is None else kwargs[k] for i, k in where]
    n = len(batches[0])
    for (i, k), b in zip(where, batches):
        if len(b) != n:
            name = f"argument {i}" if k is None else f"argument {k!r}"
            raise ValueError(f"{method}: Batch {name} has {len(b)} rows, the first Batch has {n}")
    if n == 0:
        raise ValueError(f"{method}: cannot dispatch an empty Batch")

    padded = [b.pad_to_multiple(shards)[0] for b in batches]
    n_pad = len(padded[0]) - n
    if balanced:
        with_mask = [b for b in padded if "attention_mask" in b.tensors]
        if not with_mask:
            raise KeyError(f"{method}: DP_BALANCED needs an 'attention_mask' tensor in the Batch")
        lengths = with_mask[0]["attention_mask"].sum(-1).cpu().numpy().astype(np.int64)
        parts = balanced_partitions(lengths, shards)
        per_shard = [[b.take(p) for b in padded] for p in parts]
    else:
        per = len(padded[0]) // shards
        parts = [np.arange(r * per, (r + 1) * per) for r in range(shards)]
        chunks = [b.chunk(shards) for b in padded]  # equal parts: len is a multiple
        per_shard = [[c[r] for c in chunks] for r in range(shards)]

    calls = []
    for rank in range(world_size):
        pieces = per_shard[rank // ranks_per_shard]  # the same objects for a shard's ranks (Ray sends them once)
        a, kw = list(args), dict(kwargs)
        for (i, k), piece in zip(where, pieces):
            if k is None:
                a[i] = piece
            else:
                kw[k] = piece
        calls.append((rank, tuple(a), kw))

    def collect(results: list[Any]) -> Any:
        return _collect_dp(results[::ranks_per_shard], parts, n, n_pad, method)

    return Plan(calls, collect)


def _collect_dp(results: list[Any], parts: list[np.ndarray], n: int, n_pad: int,
                method: str) -> Any:
    """Concat per-rank Batches back into the original sample order, padding removed.

    A rank may return `m` rows per input row (rollout with n samples per prompt), as long as
    they are consecutive per input row and `m` is the same on every rank. A rank may also return
    `(Batch, value)` (a batch and its metrics): the batches come back as above, the values one per rank.
    """
    if all(r is None for r in results):
        return None
    if all(isinstance(r, tuple) and len(r) == 2 and isinstance(r[0], Batch) for r in results):
        return _collect_dp([r[0] for r in results], parts, n, n_pad, method), [r[1] for r in results]
    if not all(isinstance(r, Batch) for r in results):
        return results  # per-rank values (e.g. metrics dicts) are returned as they are
    n_in = [len(p) for p in parts]
    m, rem = divmod(sum(len(r) for r in results), sum(n_in))
    if rem or m == 0 or any(len(r) != m * k for r, k in zip(results, n_in)):
        raise ValueError(
            f"{method}: ranks returned {[len(r) for r in results]} rows for inputs of "
            f"{n_in} rows; data-parallel results need the same whole number of rows per input row"
        )
    out = Batch.concat(results)
    perm = np.concatenate(parts)
    if n_pad == 0 and np.array_equal(perm, np.arange(len(perm))):
        return out
    inv = np.empty_like(perm)
    inv[perm] = np.arange(len(perm))
    rows = (inv[:n, None] * m + np.arange(m)[None, :]).reshape(-1)  # drops padded inputs (>= n)
    return out.take(rows)


# ----- balanced partitions --------------------------------------------------------------------


def balanced_partitions(lengths: np.ndarray, k: int) -> list[np.ndarray]:
    """k equal-size index sets with near-equal length sums.

    Uses `rlcore.packing.balanced_partitions` (native) when present, else a greedy fallback;
    either way the result is checked to cover every index exactly once.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    try:
        from rlcore.packing import balanced_partitions as impl
    except ImportError as e:
        if e.name not in ("rlcore.packing", "rlcore"):
            raise
        impl = _greedy_partitions
    parts = [np.asarray(p, dtype=np.int64).reshape(-1) for p in impl(lengths, k, equal_size=True)]
    flat = np.sort(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
    if len(parts) != k or not np.array_equal(flat, np.arange(len(lengths))):
        raise RuntimeError(
            f"balanced_partitions returned {len(parts)} parts that do not cover indices "
            f"0..{len(lengths) - 1} exactly once"
        )
    return parts


def _greedy_partitions(lengths: np.ndarray, k: int, equal_size: bool = True) -> list[list[int]]:
    """Longest first into the lightest part that still has room; each part sorted."""
    n = len(lengths)
    cap = -(-n // k) if equal_size else n
    parts: list[list[int]] = [[] for _ in range(k)]
    sums = [0] * k
    for i in sorted(range(n), key=lambda i: -int(lengths[i])):
        j = min((j for j in range(k) if len(parts[j]) < cap), key=lambda j: (sums[j], j))
        parts[j].append(i)
        sums[j] += int(lengths[i])
    return [sorted(p) for p in parts]
