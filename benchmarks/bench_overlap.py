"""Can generation and a training step share one process? Sequential vs two threads vs two processes.

    ./dev python benchmarks/bench_overlap.py [--model tiny|5m|both] [--rounds 7] [--new-tokens 40]

One round times, on the same model size: generation alone (rlcore's HF decode loop, 16 prompts x
n=8, no EOS), a training step alone (forward + backward + AdamW on 64 x 52 tokens), both one after
the other, both at once on two threads of this process (the in-process one-step overlap: torch
ops release the GIL, the Python between them does not), and both at once with generation in a
separate, already warm process (no GIL shared; what Ray's one-step overlap does). Each runs at one
torch thread. The variants are interleaved per round; medians of wall and CPU seconds (this process
and the helper process) are printed, and the speed-ups over sequential. "ideal" is sequential /
the longer of the two parts: what a free second core could give at best.

`tiny` is the tiny example's size (hidden 128, 2 layers, vocab 32: ~0.56M parameters, its decode
loop mostly Python), `5m` a ~4.8M-parameter Llama (hidden 256, 5 layers, vocab 2048).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import threading
import time

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlcore.protocol import Batch
from rlcore.rollout import SamplingParams
from rlcore.rollout.hf import HFRolloutEngine

SIZES = {
    "tiny": dict(vocab_size=32, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=8, head_dim=32),
    "5m": dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=5, num_attention_heads=4, head_dim=64),
}


def make_model(size: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    c = SIZES[size]
    cfg = LlamaConfig(**c, num_key_value_heads=c["num_attention_heads"], max_position_embeddings=256,
                      tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(cfg)


def generate(engine: HFRolloutEngine, size: str, new_tokens: int) -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, SIZES[size]["vocab_size"], (16, 12), generator=g)
    prompts = Batch(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                    meta={"uid": np.array([str(i) for i in range(16)], dtype=object)}, info={})
    engine.generate(prompts, SamplingParams(n=8, max_new_tokens=new_tokens, temperature=1.0, seed=1))


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, size: str) -> None:
    ids = torch.randint(3, SIZES[size]["vocab_size"], (64, 52))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def helper(size: str, new_tokens: int, conn) -> None:
    """The other process: a warm engine that generates on request."""
    torch.set_num_threads(1)
    engine = HFRolloutEngine(make_model(size), 0, [])  # no EOS: every row generates all its tokens
    generate(engine, size, new_tokens)
    conn.send("ready")
    while conn.recv() == "go":
        generate(engine, size, new_tokens)
        conn.send("done")


def cpu_s(pid: int) -> float:
    """CPU seconds of this process and the helper process."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return r.ru_utime + r.ru_stime + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(size: str, rounds: int, new_tokens: int) -> None:
    torch.set_num_threads(1)
    model = make_model(size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine = HFRolloutEngine(make_model(size), 0, [])
    generate(engine, size, new_tokens)
    train_step(model, opt, size)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=helper, args=(size, new_tokens, there))
    proc.start()
    assert here.recv() == "ready"

    def in_thread() -> None:
        def gen() -> None:
            torch.get_num_threads()
            torch.set_num_threads(1)
            generate(engine, size, new_tokens)
        t = threading.Thread(target=gen)
        t.start()
        train_step(model, opt, size)
        t.join()

    def in_process() -> None:
        here.send("go")
        train_step(model, opt, size)
        assert here.recv() == "done"

    variants = {
        "generate": lambda: generate(engine, size, new_tokens),
        "train": lambda: train_step(model, opt, size),
        "sequential": lambda: (generate(engine, size, new_tokens), train_step(model, opt, size)),
        "threads": in_thread,
        "processes": in_process,
    }
    wall: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            c0, t0 = cpu_s(proc.pid), time.perf_counter()
            fn()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(cpu_s(proc.pid) - c0)
    here.send("stop")
    proc.join()
    w = {k: statistics.median(v) for k, v in wall.items()}
    c = {k: statistics.median(v) for k, v in cpu.items()}
    params = sum(p.numel() for p in model.parameters())
    print(f"{size} ({params / 1e6:.2f}M parameters), median of {rounds} interleaved rounds:")
    for name in variants:
        print(f"  {name:10s} {w[name]:.3f} s wall  {c[name]:.3f} CPU s")
    print(f"  speed-up over sequential: threads {w['sequential'] / w['threads']:.2f}x, processes "
          f"{w['sequential'] / w['processes']:.2f}x, ideal {w['sequential'] / max(w['generate'], w['train']):.2f}x; "
          f"CPU s vs sequential: threads {c['threads'] / c['sequential']:.2f}x, processes {c['processes'] / c['sequential']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["tiny", "5m", "both"], default="both")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--new-tokens", type=int, default=40)
    args = ap.parse_args()
    print(f"cores: {len(os.sched_getaffinity(0))}; load average {os.getloadavg()[0]:.1f} (this machine may be shared)")
    for size in (["tiny", "5m"] if args.model == "both" else [args.model]):
        measure(size, args.rounds, args.new_tokens)


if __name__ == "__main__":
    main()
