"""Peak memory and time: naive full log-softmax vs the chunked fused path, forward + backward, CPU.

    ./dev python benchmarks/bench_logprob_memory.py [--tokens 8192 --vocab 32000 --hidden 256]

How memory is measured (and why): torch's CPU allocations bypass tracemalloc, so each variant
runs in a fresh subprocess that (1) imports torch and does a tiny warm-up of the same variant
so one-time allocations are already resident, (2) allocates the inputs, (3) resets the kernel's
peak-RSS mark (write "5" to /proc/self/clear_refs; Linux >= 4.0) and records the current RSS,
(4) runs forward + backward (grads w.r.t. hidden and weight of a loss using log-prob and
entropy), (5) reads the peak RSS (VmHWM). "extra MB" = peak - RSS before the step: memory the
step itself needed, including its outputs and the two gradient tensors. Where clear_refs is not
writable it falls back to getrusage's ru_maxrss, which cannot be reset, so the numbers then
only count memory above the earlier high-water mark (the output says which method ran).
Children run with MALLOC_MMAP_THRESHOLD_=65536: glibc then serves every tensor above 64 KB
with its own mmap and unmaps it on free, so RSS tracks live tensors. (By default the threshold
drifts up to 32 MB, tiles below that land on the heap, and freed heap memory that is not given
back would be charged to the chunked variants as if it were still in use.)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {
    "naive": dict(kind="naive"),
    "chunked t=1024": dict(kind="fused", chunk_tokens=1024, chunk_vocab=None),
    "chunked t=256": dict(kind="fused", chunk_tokens=256, chunk_vocab=None),
    "chunked t=1024 v=4096": dict(kind="fused", chunk_tokens=1024, chunk_vocab=4096),
}


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _step(torch, variant, hidden, weight, targets, ref, adv):
    from rlcore.triton_kernels import fused_token_logprobs, naive_token_logprobs

    if variant["kind"] == "naive":
        out = naive_token_logprobs(hidden, weight, targets)
    else:
        out = fused_token_logprobs(hidden, weight, targets, backend="torch",
                                   chunk_tokens=variant["chunk_tokens"], chunk_vocab=variant["chunk_vocab"])
    loss = (out.logprobs * adv).sum() + 0.01 * out.entropy.sum()
    return torch.autograd.grad(loss, [hidden, weight])


def _inputs(torch, n, h, v, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).requires_grad_(True)
    weight = (torch.randn(v, h, generator=g) / h**0.5).requires_grad_(True)
    targets = torch.randint(0, v, (n,), generator=g)
    ref = -5.0 + torch.randn(n, generator=g)
    adv = torch.randn(n, generator=g)
    return hidden, weight, targets, ref, adv


def child(name: str, n: int, h: int, v: int) -> dict:
    import torch

    variant = VARIANTS[name]
    _step(torch, variant, *_inputs(torch, 64, h, 512))  # warm-up: lazy init is not the step's cost
    inputs = _inputs(torch, n, h, v)
    reset = _reset_peak()
    before_kb = _rss_kb("VmRSS") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    grads = _step(torch, variant, *inputs)
    seconds = time.perf_counter() - t0
    peak_kb = _rss_kb("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    checksum = float(grads[0].double().abs().sum() + grads[1].double().abs().sum())
    return {"extra_mb": (peak_kb - before_kb) / 1024, "seconds": seconds,
            "method": "VmHWM after clear_refs" if reset else "ru_maxrss delta", "checksum": checksum}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.tokens, args.hidden, args.vocab)))
        return

    n, h, v = args.tokens, args.hidden, args.vocab
    root = str(Path(__file__).resolve().parents[1])
    pythonpath = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=pythonpath, MALLOC_MMAP_THRESHOLD_="65536")
    print(f"tokens={n} vocab={v} hidden={h}, fp32, forward+backward (grads of hidden and weight), "
          f"torch {__import__('torch').__version__}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    print(f"one [tokens, vocab] fp32 tensor = {n * v * 4 / 2**20:.0f} MB; "
          f"grad_weight = {v * h * 4 / 2**20:.1f} MB, grad_hidden = {n * h * 4 / 2**20:.1f} MB")
    results = {}
    for name in VARIANTS:
        cmd = [sys.executable, __file__, "--child", name, "--tokens", str(n), "--vocab", str(v), "--hidden", str(h)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    base = results["naive"]
    print(f"memory method: {base['method']} (peak RSS during the step minus RSS before it, fresh process "
          "each, MALLOC_MMAP_THRESHOLD_=65536 so freed tensors leave RSS)")
    print(f"{'variant':<24}{'extra MB':>10}{'vs naive':>10}{'seconds':>10}{'vs naive':>10}")
    for name, r in results.items():
        print(f"{name:<24}{r['extra_mb']:>10.0f}{base['extra_mb'] / r['extra_mb']:>9.1f}x"
              f"{r['seconds']:>10.2f}{r['seconds'] / base['seconds']:>9.2f}x")
    sums = {k: r["checksum"] for k, r in results.items()}
    spread = (max(sums.values()) - min(sums.values())) / max(abs(x) for x in sums.values())
    print(f"gradient checksums agree to {spread:.1e} (relative)")


if __name__ == "__main__":
    main()
