"""The hardware a plan is for: nodes x devices of one memory size, and how much of it a layout may use."""

from __future__ import annotations

import re
from dataclasses import dataclass

from rlcore.errors import RLCoreError

GIB = 2**30
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class PlanInputError(RLCoreError, ValueError):
    """A planner argument or config the planner cannot use; the message names it."""


def parse_size(text: str, what: str = "--device-memory") -> int:
    """Bytes of "80GiB", "80 GB", "141GiB", "1.5TiB" (GiB = 2^30, GB = 10^9; a bare number is bytes)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise PlanInputError(f"{what}: {text!r} is not a size (examples: 80GiB, 141GiB, 96GB)")
    value = float(match.group(1)) * _UNITS[unit]
    if value <= 0:
        raise PlanInputError(f"{what}: {text!r} must be positive")
    return int(value)


def parse_fraction(text: str, what: str = "--headroom") -> float:
    """0.1 of "10%" or "0.1"."""
    try:
        value = float(text[:-1]) / 100 if text.strip().endswith("%") else float(text)
    except ValueError:
        raise PlanInputError(f"{what}: {text!r} is not a fraction (examples: 10%, 0.1)") from None
    if not 0 <= value < 1:
        raise PlanInputError(f"{what}: {text!r} must lie in [0, 1)")
    return value


@dataclass(frozen=True)
class Hardware:
    """`nodes` x `devices_per_node` devices of `device_memory` bytes each. A layout fits when its
    simulated per-rank peak is at most `usable` = (1 - headroom) of a device: the headroom is what
    the simulation does not see (the CUDA context, NCCL buffers, the caching allocator's
    fragmentation)."""

    nodes: int
    devices_per_node: int
    device_memory: int
    headroom: float = 0.1

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.devices_per_node < 1:
            raise PlanInputError(f"--nodes {self.nodes} --devices-per-node {self.devices_per_node}: both must be >= 1")

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def usable(self) -> int:
        return int(self.device_memory * (1 - self.headroom))

    def device_counts(self, limit: int | None = None) -> list[int]:
        """Device counts a role may take, ascending: powers of two within a node (1, 2, 4, ... up to a
        node), then whole nodes, up to `limit` devices (default: all of them)."""
        limit = self.devices if limit is None else limit
        counts = []
        d = 1
        while d < self.devices_per_node and d <= limit:
            counts.append(d)
            d *= 2
        counts += [k * self.devices_per_node for k in range(1, limit // self.devices_per_node + 1)]
        return sorted(set(c for c in counts if c <= limit))

    def describe(self) -> str:
        return (f"{self.nodes} node{'s' * (self.nodes > 1)} x {self.devices_per_node} devices of {gib(self.device_memory)} "
                f"(a layout fits in {gib(self.usable)} per device: {self.headroom:.0%} headroom)")


def gib(size: float) -> str:
    """Bytes as GiB with one decimal ("72.0 GiB"), MiB below one GiB ("310.5 MiB")."""
    return f"{size / GIB:,.1f} GiB" if abs(size) >= GIB else f"{size / 2**20:,.1f} MiB"


__all__ = ["GIB", "Hardware", "PlanInputError", "gib", "parse_fraction", "parse_size"]
