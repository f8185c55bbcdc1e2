"""How many torch threads a compute thread gets: from the cores this process really has.

The one helper every compute thread uses: the trainer process (`rlcore train`, in-process
workers), each Ray worker (sized by its bundle's CPUs) and the two threads of the in-process
one-step overlap (generation and training splitting the cores).

Cores a process has = its CPU affinity (`os.sched_getaffinity`: cpusets, `taskset`, Ray's or
Slurm's pinning), capped by its cgroup's CPU quota (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us` /
`cpu.cfs_period_us`: a container's `--cpus`), never below 1. `os.cpu_count()` counts the machine's
cores, which a container or a shared node does not have.

An explicit `OMP_NUM_THREADS` wins: it is then the intra-op thread count of every compute thread,
whatever the cores. `./dev` sets it to 1 unless it is set already (the developer machines are
2-core boxes shared by several processes, where more threads than free cores makes torch 10-60x
slower); run `OMP_NUM_THREADS=2 ./dev ...` to pick another number, or outside `./dev`, with it
unset, to size from the cores.
"""

from __future__ import annotations

import math
import os
from pathlib import Path


def cgroup_cpu_limit(proc_cgroup: str | Path = "/proc/self/cgroup", root: str | Path = "/sys/fs/cgroup") -> float | None:
    """CPUs the cgroup quota of this process allows (quota / period), or None without a quota.
    The smallest quota of the process's own cgroup and its ancestors up to the mount's root
    (v2 unified, or the v1 `cpu` controller)."""
    root = Path(root)
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":  # cgroup v2: "0::/path"
            for folder in _with_ancestors(root, rel, ("", "unified")):
                limits += _v2_limit(folder / "cpu.max")
        elif "cpu" in controllers.split(","):
            for folder in _with_ancestors(root, rel, (controllers, "cpu", "cpu,cpuacct")):
                limits += _v1_limit(folder)
    return min(limits) if limits else None


def _with_ancestors(root: Path, rel: str, mounts: tuple[str, ...]) -> list[Path]:
    """The cgroup folder and its parents under each candidate mount point that exists."""
    out = []
    for mount in mounts:
        base = root / mount if mount else root
        if not base.is_dir():
            continue
        folder = base / rel.strip("/")
        while True:
            out.append(folder)
            if folder == base:
                break
            folder = folder.parent
    return out


def _v2_limit(path: Path) -> list[float]:
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return []
    return [] if quota == "max" else [int(quota) / int(period)]


def _v1_limit(folder: Path) -> list[float]:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return []
    return [quota / period] if quota > 0 and period > 0 else []


def available_cpus() -> float:
    """Cores this process may use: its affinity, capped by its cgroup quota; at least 1."""
    try:
        cores = float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        cores = float(os.cpu_count() or 1)
    limit = cgroup_cpu_limit()
    return max(1.0, min(cores, limit) if limit is not None else cores)


def explicit_threads() -> int | None:
    """`OMP_NUM_THREADS` when it is set to a positive integer, else None."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    try:
        n = int(value)
    except ValueError:
        return None
    return n if n > 0 else None


def sized_threads(cores: float | None = None) -> int:
    """Threads for `cores` CPUs (default: all this process has), capped by what it has: the
    whole cores, at least 1. Ignores `OMP_NUM_THREADS` (see `intra_op_threads`)."""
    have = available_cpus()
    return max(1, math.floor(min(cores, have) if cores is not None else have))


def intra_op_threads(cores: float | None = None) -> int:
    """Threads for one compute thread given `cores` CPUs for it: an explicit `OMP_NUM_THREADS`,
    else `sized_threads(cores)`."""
    explicit = explicit_threads()
    return explicit if explicit is not None else sized_threads(cores)


def split_cores(parts: int) -> list[float]:
    """This process's whole cores shared by `parts` threads working at once, the first ones
    taking the remainder (3 cores, 2 parts: 2 and 1); each at least 1."""
    total = math.floor(available_cpus())
    base, extra = divmod(total, parts)
    return [float(max(1, base + (i < extra))) for i in range(parts)]


def use_cores(cores: float | None = None, threads: int | None = None) -> int:
    """Set the calling thread's torch intra-op threads: `threads`, or `intra_op_threads(cores)`;
    returns the number. torch keeps the count per thread once a thread has run an op, so a
    thread that calls this first keeps it when another thread sets its own."""
    import torch

    n = threads if threads is not None else intra_op_threads(cores)
    torch.get_num_threads()  # make torch initialise this thread's count now, not later from the global one
    # torch's own binding (torch._C), not the `torch.set_num_threads` attribute: an in-process vLLM CPU engine replaces that
    # with a no-op for the whole process once it starts (vllm/v1/worker/cpu_worker.py), which would
    # leave this thread's count silently unchanged. The count is per thread: the engine's keeps its own.
    torch._C.set_num_threads(n)
    return n


def core_groups(parts: int) -> list[list[int]] | None:
    """This process's cores (its affinity) in `parts` contiguous groups of equal size, one per rank
    of a tensor-parallel engine (the first groups get the remainder); None when it has fewer cores
    than `parts` or no affinity to read (then nothing should be pinned)."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    if len(cores) < parts:
        return None
    base, extra = divmod(len(cores), parts)
    groups, start = [], 0
    for i in range(parts):
        size = base + (i < extra)
        groups.append(cores[start:start + size])
        start += size
    return groups


__all__ = ["available_cpus", "cgroup_cpu_limit", "core_groups", "explicit_threads", "intra_op_threads", "sized_threads",
           "split_cores", "use_cores"]
