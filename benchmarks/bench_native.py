"""rlcore._native against the Python/torch code it replaces, measured side by side in one run.

    ./dev python benchmarks/bench_native.py [--quick]

Prints one table of ratios with PASS/FAIL against each floor and always exits 0 (benchmarks
inform; tests assert behaviour). What each row measures:

- GAE, B=1024 x T=4096 float32: the native kernel vs verl's per-timestep torch loop (one
  iteration per token position over all rows, list of columns, torch.stack). The torch loop
  costs the same for every timestep, so it is timed over the last T/4 positions and scaled by 4
  (said in the output). Also the native kernel's memory throughput: it reads rewards, values and
  mask and writes advantages and returns, 5 x B x T x 4 bytes of traffic; the yardstick is
  numpy copying an array of half those bytes (read + write = the same traffic). The floor is
  against ``src.copy()``, which like the kernel writes into freshly allocated memory (page
  faults and kernel zeroing included); copying into an existing array is shown too, as the
  pure-bandwidth bound that no function returning new arrays reaches.
- Group advantages, 65,536 samples in groups of 8 (GRPO): native vs verl's loop over uids
  (dict of lists of score tensors, torch.mean / torch.std per group, per-sample assignment).
- Balanced partitions, 8,192 long-tailed lengths into 16 equal-size parts: native vs the pure
  Python heap implementation of the same algorithm; also the spread (max - min) / mean of the
  part totals, which must be no worse than Python's.
- Packing, 4,096 long-tailed lengths: tokens a micro-batch scheme provisions per real token.
  Fixed-size micro-batches of 8 padded to their longest sample: sum(8 x longest) / real.
  Token-budget packing with a padding-free (varlen) layout: every micro-batch is provisioned
  at the full budget, so bins x budget / real (the last, partly filled bin included).

Timings are the best of several runs on whatever cores this machine lends the process (rayon
uses all of them; RAYON_NUM_THREADS caps it). On a shared machine the ratios move between runs.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections import defaultdict
from collections.abc import Callable

import numpy as np
import torch

from rlcore import _native
from rlcore.packing import balanced_partitions, balanced_partitions_python, pack_token_budget

ROWS: list[tuple[str, str, str, str, str, bool | None]] = []


def best_time(fn: Callable[[], object], repeats: int, warmup: bool = True) -> float:
    if warmup:
        fn()  # page in inputs, start the thread pool
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def row(name: str, native: str, baseline: str, ratio: str, floor: str, ok: bool | None) -> None:
    ROWS.append((name, native, baseline, ratio, floor, ok))


# ----------------------------------------------------------------------------- GAE


def verl_gae_loop(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float,
                  steps: int) -> torch.Tensor:
    """verl's masked GAE loop, run over the last ``steps`` positions only."""
    nextvalues = 0
    lastgaelam = 0
    advantages_reversed = []
    length = rewards.shape[-1]
    for t in reversed(range(length - steps, length)):
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * mask[:, t] + (1 - mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * mask[:, t] + (1 - mask[:, t]) * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    return advantages + values[:, length - steps:]


def bench_gae(quick: bool) -> None:
    b, t = 1024, 4096
    rng = np.random.default_rng(0)
    r = rng.standard_normal((b, t), dtype=np.float32)
    v = rng.standard_normal((b, t), dtype=np.float32)
    lengths = rng.integers(t // 8, t + 1, size=b)
    m = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)

    native = best_time(lambda: _native.gae(r, v, m, 0.99, 0.95), 3 if quick else 10)
    steps = t // 16 if quick else t // 4
    rt, vt, mt = (torch.from_numpy(x) for x in (r, v, m))
    loop = best_time(lambda: verl_gae_loop(rt, vt, mt, 0.99, 0.95, steps), 1 if quick else 2, warmup=False)
    loop *= t / steps
    speedup = loop / native
    row("GAE 1024x4096 vs torch loop", f"{native * 1e3:.1f} ms", f"{loop * 1e3:.0f} ms*",
        f"{speedup:.0f}x", ">= 30x", speedup >= 30)

    traffic = 5 * b * t * 4
    src = np.ones(traffic // 2 // 4, np.float32)
    dst = np.empty_like(src)
    fresh = best_time(lambda: src.copy(), 3 if quick else 10)
    into = best_time(lambda: np.copyto(dst, src), 3 if quick else 10)
    gbs, fresh_gbs, into_gbs = (traffic / x / 1e9 for x in (native, fresh, into))
    row("GAE GB/s vs copy to a new array", f"{gbs:.1f} GB/s", f"{fresh_gbs:.1f} GB/s", f"{gbs / fresh_gbs:.2f}",
        ">= 0.33", gbs / fresh_gbs >= 1 / 3)
    row("  vs copy into an existing array", "", f"{into_gbs:.1f} GB/s", f"{gbs / into_gbs:.2f}", "", None)
    print(f"* torch loop timed over the last {steps} of {t} positions and scaled x{t // steps} "
          "(its cost per position is constant)")


# ----------------------------------------------------------------------------- group advantages


def verl_grpo_loop(scores: torch.Tensor, index: np.ndarray, epsilon: float = 1e-6) -> torch.Tensor:
    """verl's per-uid GRPO loop (compute_grpo_outcome_advantage without the token broadcast)."""
    scores = scores.clone()
    id2score = defaultdict(list)
    id2mean, id2std = {}, {}
    bsz = scores.shape[0]
    for i in range(bsz):
        id2score[index[i]].append(scores[i])
    for idx in id2score:
        if len(id2score[idx]) == 1:
            id2mean[idx], id2std[idx] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            group = torch.stack(id2score[idx])
            id2mean[idx], id2std[idx] = torch.mean(group), torch.std(group)
    for i in range(bsz):
        scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
    return scores


def bench_group(quick: bool) -> None:
    n, g = 65_536, 8
    rng = np.random.default_rng(1)
    scores = (rng.random(n) < 0.4).astype(np.float32) + rng.standard_normal(n).astype(np.float32) * 0.1
    ids = np.repeat(np.arange(n // g, dtype=np.int64), g)
    uids = np.array([f"uid-{i}" for i in ids], dtype=object)

    native = best_time(lambda: _native.group_advantages(scores, ids, "grpo", 1e-6), 5 if quick else 20)
    shuffled = rng.permutation(n)
    native_shuffled = best_time(
        lambda: _native.group_advantages(scores[shuffled], ids[shuffled], "grpo", 1e-6), 5 if quick else 20)
    sub = n // 8 if quick else n
    st = torch.from_numpy(scores[:sub].copy())
    loop = best_time(lambda: verl_grpo_loop(st, uids[:sub]), 1, warmup=False) * (n / sub)
    ref = verl_grpo_loop(torch.from_numpy(scores[:4096].copy()), uids[:4096]).numpy()
    err = float(np.abs(_native.group_advantages(scores[:4096], ids[:4096], "grpo", 1e-6) - ref).max())
    speedup = loop / native
    row("GRPO 65,536 samples / 8 vs uid loop", f"{native * 1e3:.2f} ms", f"{loop * 1e3:.0f} ms",
        f"{speedup:.0f}x", ">= 100x", speedup >= 100)
    row("  (ids shuffled, max |diff| vs loop)", f"{native_shuffled * 1e3:.2f} ms", "", f"diff {err:.1e}", "", None)


# ----------------------------------------------------------------------------- partitions


def bench_partitions(quick: bool) -> None:
    rng = np.random.default_rng(2)
    lengths = np.clip(rng.lognormal(6.5, 1.0, size=8192), 16, 8192).astype(np.int64)
    k = 16
    native = best_time(lambda: balanced_partitions(lengths, k, True), 3 if quick else 10)
    python = best_time(lambda: balanced_partitions_python(lengths, k, True), 1 if quick else 3, warmup=False)
    speedup = python / native
    row("Partitions 8,192 -> 16 equal vs Python", f"{native * 1e3:.2f} ms", f"{python * 1e3:.1f} ms",
        f"{speedup:.0f}x", ">= 10x", speedup >= 10)

    def spread(parts: list[list[int]]) -> float:
        totals = np.array([lengths[p].sum() for p in parts], np.float64)
        return float((totals.max() - totals.min()) / totals.mean())

    s_native = spread(balanced_partitions(lengths, k, True))
    s_python = spread(balanced_partitions_python(lengths, k, True))
    s_contig = spread([list(range(i, i + len(lengths) // k)) for i in range(0, len(lengths), len(lengths) // k)])
    row("  spread (max-min)/mean of totals", f"{s_native:.2e}", f"{s_python:.2e}",
        f"contiguous {s_contig:.2f}", "<= Python", s_native <= s_python)


# ----------------------------------------------------------------------------- packing


def bench_packing(quick: bool) -> None:
    rng = np.random.default_rng(3)
    lengths = np.clip(rng.lognormal(6.5, 1.0, size=4096), 16, 8192).astype(np.int64)
    real = int(lengths.sum())
    mb_size, budget = 8, 16_384
    fixed = [lengths[i:i + mb_size] for i in range(0, len(lengths), mb_size)]
    fixed_ratio = sum(len(mb) * int(mb.max()) for mb in fixed) / real
    native = best_time(lambda: pack_token_budget(lengths, budget), 3 if quick else 10)
    bins = pack_token_budget(lengths, budget)
    packed_ratio = len(bins) * budget / real
    lower = math.ceil(real / budget)
    row("Packing: provisioned / real tokens", f"{packed_ratio:.3f}", f"{fixed_ratio:.3f} fixed-8",
        f"{len(bins)} bins (>= {lower})", "<= 1.05", packed_ratio <= 1.05)
    row("  packing time, 4,096 samples", f"{native * 1e3:.2f} ms", "", "", "", None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and smaller baselines (smoke run)")
    args = parser.parse_args()
    start = time.perf_counter()
    threads = os.environ.get("RAYON_NUM_THREADS") or f"{os.cpu_count()} (all cores)"
    print(f"rlcore._native benchmark: rayon threads {threads}, torch threads {torch.get_num_threads()}")
    bench_gae(args.quick)
    bench_group(args.quick)
    bench_partitions(args.quick)
    bench_packing(args.quick)

    header = ("benchmark", "native", "baseline", "ratio", "floor", "result")
    table = [header] + [(n, a, b, r, f, "" if ok is None else ("PASS" if ok else "FAIL")) for n, a, b, r, f, ok in ROWS]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    print()
    for i, line in enumerate(table):
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print(f"\ntotal {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
