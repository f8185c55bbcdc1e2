"""Splitting a batch by sequence length: token-budget micro-batches and balanced rank shards.

The trainer calls two functions, both backed by the Rust extension (under ``RLCORE_NATIVE=off``,
see :mod:`rlcore.native`, by the pure-Python versions below, which give the same results):

- :func:`pack_token_budget`: micro-batches whose real token count stays within a budget, so
  every forward/backward pass does about the same work and padding-free (varlen) kernels never
  see an over-long pack.
- :func:`balanced_partitions`: split a batch across k data-parallel ranks (or k micro-batches)
  so each gets about the same number of tokens; the slowest rank sets the step time.

:func:`pack_token_budget_python` and :func:`balanced_partitions_python` are the same algorithms
in plain Python, with the same tie breaks, so they return the same results; the benchmark and
tests compare against them.
:func:`fixed_size_microbatches` is the naive split the packing replaces.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlcore import native

__all__ = [
    "pack_token_budget",
    "pack_token_budget_python",
    "balanced_partitions",
    "balanced_partitions_python",
    "fixed_size_microbatches",
]

Lengths = Sequence[int] | np.ndarray | Any


def pack_token_budget(lengths: Lengths, max_tokens: int) -> list[list[int]]:
    """Micro-batches of sample indices, each summing to at most ``max_tokens`` tokens.

    First-fit decreasing; a sample longer than the budget gets a micro-batch of its own.
    Indices ascend within a micro-batch; micro-batches are ordered by their first index.
    """
    fn = native.function("pack_token_budget")
    if fn is None:
        return pack_token_budget_python(lengths, max_tokens)
    bins: list[list[int]] = fn(lengths, int(max_tokens))
    return bins


def balanced_partitions(lengths: Lengths, k: int, equal_size: bool = True) -> list[list[int]]:
    """``k`` groups of sample indices with near-equal token totals (Karmarkar-Karp).

    ``equal_size=True`` gives every group len/k samples (the batch must divide evenly), which
    data-parallel ranks need; ``False`` balances totals only (micro-batches).
    """
    fn = native.function("balanced_partitions")
    if fn is None:
        return balanced_partitions_python(lengths, int(k), bool(equal_size))
    parts: list[list[int]] = fn(lengths, int(k), bool(equal_size))
    return parts


def fixed_size_microbatches(n: int, size: int) -> list[list[int]]:
    """Consecutive chunks of ``size`` indices over ``range(n)``; the last may be shorter."""
    if n < 0:
        raise ValueError(f"n: must be >= 0, got {n}")
    if size < 1:
        raise ValueError(f"size: must be >= 1, got {size}")
    return [list(range(start, min(start + size, n))) for start in range(0, n, size)]


# ----------------------------------------------------------------------------- pure Python


def _checked_lengths(lengths: Lengths) -> list[int]:
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"lengths: expected a 1-D array [batch], got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"lengths: expected an integer dtype, got {arr.dtype}")
    values = [int(x) for x in arr]
    for i, x in enumerate(values):
        if x < 0:
            raise ValueError(f"lengths: must be >= 0, got {x} at index {i}")
    return values


def pack_token_budget_python(lengths: Lengths, max_tokens: int) -> list[list[int]]:
    """First-fit decreasing in plain Python; same result as :func:`pack_token_budget`.

    Longest first (ties: lower index first), each into the leftmost open bin with room; a
    sample over the budget gets a bin that nothing else joins. O(n * bins): a reference, not
    for large batches.
    """
    values = _checked_lengths(lengths)
    if max_tokens < 1:
        raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
    bins: list[list[int]] = []
    free: list[int] = []  # -1 closes an oversize sample's bin, even to empty samples
    for i in sorted(range(len(values)), key=lambda i: (-values[i], i)):
        size = values[i]
        if size > max_tokens:
            bins.append([i])
            free.append(-1)
            continue
        for b, room in enumerate(free):
            if room >= size:
                bins[b].append(i)
                free[b] -= size
                break
        else:
            bins.append([i])
            free.append(max_tokens - size)
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def balanced_partitions_python(lengths: Lengths, k: int, equal_size: bool) -> list[list[int]]:
    """Karmarkar-Karp largest differencing in plain Python; same result as :func:`balanced_partitions`.

    A state is k sets ``[total, count, smallest index, items]`` kept sorted by
    (total desc, count desc, smallest index asc). The heap pops the state with the largest
    spread (ties: largest top total, then the earliest created); two popped states merge by
    pairing the i-th set of the first with the i-th from last of the second.
    """
    values = _checked_lengths(lengths)
    n = len(values)
    if k < 1:
        raise ValueError(f"k: must be >= 1, got {k}")
    if n < k:
        raise ValueError(f"lengths: need at least k={k} items to fill {k} partitions, got {n}")
    if equal_size and n % k:
        raise ValueError(f"lengths: equal_size needs a length divisible by k={k}, got {n} items")

    def order(sets: list[list[Any]]) -> list[list[Any]]:
        return sorted(sets, key=lambda s: (-s[0], -s[1], s[2]))

    empty_idx = float("inf")
    ranked = sorted(range(n), key=lambda i: (values[i], i))
    if equal_size:
        initial = [
            order([[values[i], 1, i, [i]] for i in ranked[start : start + k]]) for start in range(0, n, k)
        ]
    else:
        initial = [[[values[i], 1, i, [i]]] + [[0, 0, empty_idx, []] for _ in range(k - 1)] for i in ranked]

    heap: list[tuple[int, int, int, list[list[Any]]]] = []
    seq = 0

    def push(sets: list[list[Any]]) -> None:
        nonlocal seq
        heapq.heappush(heap, (-(sets[0][0] - sets[-1][0]), -sets[0][0], seq, sets))
        seq += 1

    for sets in initial:
        push(sets)
    while len(heap) > 1:
        a = heapq.heappop(heap)[3]
        b = heapq.heappop(heap)[3]
        merged = [
            [x[0] + y[0], x[1] + y[1], min(x[2], y[2]), x[3] + y[3]] for x, y in zip(a, reversed(b))
        ]
        push(order(merged))

    parts = [sorted(s[3]) for s in heap[0][3]]
    return sorted(parts, key=lambda p: p[0] if p else float("inf"))
