"""The ranks of a worker group: their number, and sums and maxima over them (plain values in one
process, without a process group).

Every rank of a trained role holds a share of each mini-batch; normalisers (token and row
counts) and reported numbers are summed over ranks so that each rank sees the values one
process with the whole batch would.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist


def distributed_world() -> int:
    """World size of the initialised process group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def max_over_ranks(value: int, device: torch.device) -> int:
    """The largest `value` of any rank."""
    if distributed_world() <= 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def global_sums(values: list[float], device: torch.device) -> list[float]:
    """Each value summed over ranks, in one collective (float64, so counts stay exact)."""
    if not (dist.is_available() and dist.is_initialized()) or not values:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return [float(v) for v in t.cpu()]


def global_sum(value: float, device: torch.device) -> float:
    """One value summed over ranks."""
    return global_sums([value], device)[0]


class RankSummedMeans:
    """Means of statistics collected as (sum, count) pairs, pooled over ranks when read.

    Every rank must have added the same names (they come from config, not data), because the
    sums of all names travel in one collective, in sorted name order.
    """

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.counts: dict[str, float] = defaultdict(float)

    def add(self, name: str, total: float, count: float) -> None:
        self.sums[name] += total
        self.counts[name] += count

    def means(self, device: torch.device) -> dict[str, float]:
        """name -> pooled mean over every rank; names nobody counted anything for are left out."""
        names = sorted(self.sums)
        pooled = global_sums([self.sums[n] for n in names] + [self.counts[n] for n in names], device)
        sums, counts = pooled[: len(names)], pooled[len(names):]
        return {n: s / c for n, s, c in zip(names, sums, counts) if c}
