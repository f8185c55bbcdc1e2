"""Same-process weight sync (in-process actor and rollout engine) against its physical bound: one
torch copy of every weight.

    ./dev python benchmarks/bench_weight_sync.py [--rounds 5] [--engine hf]

What is timed is `WorkerGroups.sync_weights`, the call every step makes, on in-process worker groups
built from a config as `rlcore train` builds them (the ~20M-parameter Llama of
`bench_lora_sync.py`), against a loop of `dst.copy_(src)` from each actor parameter into the
engine's tensor of the same name: the least any sync into a separate engine copy can do. Bytes
copied are counted by a `TorchDispatchMode` over one more call of each (every `copy_` and every
`_to_copy`, e.g. a `.cpu()` staging copy of a CUDA tensor; views are free), so a sync that staged
buckets in host memory would show twice the bytes of the bound on a GPU. Rounds are interleaved
(sync, bound, sync, ...); CPU seconds (this process, user + system) beside wall seconds; the table
shows medians and the ratio sync / bound from the same run.

On a CPU, host and device are one memory, so this measures the sync's own overhead (bucket plan,
gather, dispatch, name lookup); the GPU figure (`benchmarks/gpu_check.py`, grpo phase's
`time/weight_sync_s`) is the one the host round trip used to dominate.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_lora_sync import build_model, groups_for
from torch.utils._python_dispatch import TorchDispatchMode


class CopiedBytes(TorchDispatchMode):
    """Bytes written by copies (`copy_`, `_to_copy`) while active."""

    COPIES = {torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default}

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in self.COPIES:
            self.bytes += out.numel() * out.element_size()
        return out


def measure(fn: Callable[[], None]) -> tuple[float, float]:
    """(wall s, CPU s of this process) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def copied_bytes(fn: Callable[[], None]) -> int:
    """Bytes one call copies (counted on a separate call: the counting costs time)."""
    counter = CopiedBytes()
    with counter:
        fn()
    return counter.bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--engine", default="hf", choices=["hf"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench_weight_sync_") as tmp_name:
        tmp = Path(tmp_name)
        model = build_model(tmp / "model")
        groups = groups_for(model, tmp, args.engine, "full", rank=8)
        try:
            actor = groups.actor.workers[0]  # type: ignore[union-attr]
            engine = groups.rollout.workers[0].engine  # type: ignore[union-attr]
            targets = engine._named_targets()
            pairs = [(targets[name], p.detach()) for name, p in actor.model.state_dict().items() if name in targets]
            weight_bytes = sum(src.numel() * src.element_size() for _, src in pairs)

            def bound() -> None:
                with torch.no_grad():
                    for dst, src in pairs:
                        dst.copy_(src)

            calls = {"sync": groups.sync_weights, "one copy": bound}
            copied = {name: copied_bytes(fn) for name, fn in calls.items()}  # also the warm-up
            runs: dict[str, list[tuple[float, float]]] = {name: [] for name in calls}
            for _ in range(args.rounds):
                for name, fn in calls.items():
                    runs[name].append(measure(fn))
        finally:
            groups.close()
    print(f"weights: {weight_bytes / 2**20:.1f} MiB in {len(pairs)} tensors; {args.rounds} interleaved rounds, medians")
    print(f"{'':<10} {'wall s':>9} {'CPU s':>9} {'MiB copied':>11}")
    medians = {}
    for name, rows in runs.items():
        wall, cpu = (statistics.median(col) for col in zip(*rows, strict=True))
        medians[name] = (wall, cpu, copied[name])
        print(f"{name:<10} {wall:>9.4f} {cpu:>9.4f} {copied[name] / 2**20:>11.1f}")
    (sw, sc, sb), (bw, bc, bb) = medians["sync"], medians["one copy"]
    print(f"ratio sync / one copy: wall {sw / bw:.2f}x, CPU {sc / bc:.2f}x, bytes {sb / bb:.2f}x")


if __name__ == "__main__":
    main()
