"""The hardware a plan is for: nodes x devices of one memory size, and how much of it a layout may use.

Every size is bounded before anything is simulated, each bound with its reason: the planner
simulates FSDP over every device of the hardware (its cost grows with their number), a
tensor-parallel group lies within a node, and a device's memory is a real device's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

from rlcore.errors import RLCoreError

GIB = 2**30
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*")  # one way to match each text: no backtracking blow-up
MAX_ARGUMENT_CHARS = 64  # "80GiB", "0.15": a longer argument is quoted cut short

# The planner simulates each role over every device (torch's fake process group): FSDP2 makes a
# shard of every parameter per device, so a simulation's time grows with the device count
# (~1 minute at 16,384 devices on a laptop core). A larger run repeats the same data-parallel
# shards: plan a part of it.
MAX_DEVICES = 2**14
MAX_DEVICES_PER_NODE = 1024  # a node is one fast interconnect domain (8 GPUs; 72 in an NVL72 rack)
MIN_DEVICE_MEMORY = 1        # bytes: a toy model's plan may ask for a few hundred KB
MAX_DEVICE_MEMORY = 2**50    # 1 PiB: a thousand times the largest accelerators' memory


class PlanInputError(RLCoreError, ValueError):
    """A planner argument or config the planner cannot use; the message names it."""


def shown(text: str) -> str:
    """`text` as an error message quotes it: repr, cut short when long (a 10,000-digit argument
    is named, not printed)."""
    return repr(text) if len(text) <= MAX_ARGUMENT_CHARS else f"{text[:24]!r}... ({len(text):,} characters)"


def parse_size(text: str, what: str = "--device-memory") -> int:
    """Bytes of "80GiB", "80 GB", "141GiB", "1.5TiB" (GiB = 2^30, GB = 10^9; a bare number is
    bytes), between `MIN_DEVICE_MEMORY` and `MAX_DEVICE_MEMORY`."""
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise PlanInputError(f"{what}: {shown(text)} is not a size (examples: 80GiB, 141GiB, 96GB)")
    whole, _, decimals = match.group(1).partition(".")
    whole, decimals = whole.lstrip("0") or "0", decimals[:32]
    # exact arithmetic (no float overflow) on a few dozen digits at most: a longer whole part is far too large
    value = (int(whole) + Fraction(int(decimals or "0"), 10 ** len(decimals))) * _UNITS[unit] if len(whole) <= 32 else None
    if value is not None and value < MIN_DEVICE_MEMORY:
        raise PlanInputError(f"{what}: {shown(text)} is less than one byte")
    if value is None or value > MAX_DEVICE_MEMORY:
        raise PlanInputError(f"{what}: {shown(text)} is more than 1 PiB, a thousand times the memory of the largest devices")
    return int(value)


def parse_fraction(text: str, what: str = "--headroom") -> float:
    """0.1 of "10%" or "0.1"."""
    try:
        value = float(text[:-1]) / 100 if text.strip().endswith("%") else float(text)
    except ValueError:
        raise PlanInputError(f"{what}: {shown(text)} is not a fraction (examples: 10%, 0.1)") from None
    if not 0 <= value < 1:  # also refuses nan
        raise PlanInputError(f"{what}: {shown(text)} must lie in [0, 1)")
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
        if self.devices_per_node > MAX_DEVICES_PER_NODE:
            raise PlanInputError(f"--devices-per-node {self.devices_per_node}: at most {MAX_DEVICES_PER_NODE:,} (a node is "
                                 "the devices of one fast interconnect, 8 GPUs in most servers, 72 in an NVL72 rack)")
        if self.nodes * self.devices_per_node > MAX_DEVICES:
            raise PlanInputError(f"--nodes {self.nodes} x --devices-per-node {self.devices_per_node}: more than {MAX_DEVICES:,} "
                                 "devices, beyond what the planner simulates (FSDP shards every parameter per device, so "
                                 "a simulation's time grows with their number); plan a part of the cluster: a larger run "
                                 "repeats its data-parallel shards")
        if not MIN_DEVICE_MEMORY <= self.device_memory <= MAX_DEVICE_MEMORY:
            raise PlanInputError(f"--device-memory {self.device_memory} bytes: must lie between 1 byte and 1 PiB")

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def usable(self) -> int:
        return int(self.device_memory * (1 - self.headroom))

    def check_tensor_parallel(self, sizes: list[int] | None) -> None:
        """Refuse (naming --tensor-parallel) a size that is not a group of a node's devices."""
        for tp in sizes or ():
            if tp < 1 or self.devices_per_node % tp:
                raise PlanInputError(f"--tensor-parallel {tp}: a tensor-parallel group lies within a node, so its size must "
                                     f"divide --devices-per-node {self.devices_per_node}")

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


__all__ = ["GIB", "MAX_DEVICES", "MAX_DEVICES_PER_NODE", "MAX_DEVICE_MEMORY", "MIN_DEVICE_MEMORY", "Hardware", "PlanInputError",
           "gib", "parse_fraction", "parse_size", "shown"]
