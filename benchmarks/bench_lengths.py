"""Actor update on long-tailed lengths: packed sequences (model.use_remove_padding=true) vs padded.

    ./dev python benchmarks/bench_lengths.py [--rows 64] [--rounds 3] [--max-tokens 4096]

The workload real RL post-training has: prompts of 32-256 tokens (uniform), responses lognormal
(median 64, p99 ~1,024 tokens, capped at 2,048). A ~5M-parameter Llama (GQA) is built here from a
config and saved; each variant is a real `ActorWorker` (in-process) loading it, and the timed call
is `update_actor`: one optimizer step over all rows, micro-batches packed to `--max-tokens` real
tokens, forward + backward + AdamW through the shared update loop. The variants run interleaved,
`--rounds` times each; the table shows medians, and the ratios come from this one run. CPU seconds
(this process, user + system) are shown beside wall seconds: the machine may be shared.

Computed/real tokens are what the worker reports in its metrics (`perf/actor_compute_token_ratio`,
from the shapes its forwards ran on). The issue asks for packed/padded tokens/s >= 2x and
computed/real <= 1.05 packed.

A second table decides the CPU attention for packed rows: one packed row of `--max-tokens`
tokens, forward + backward, under rlcore's `rlcore_varlen` (causal SDPA per sequence) and under
transformers' own packed path (sdpa with a dense block-diagonal [T, T] mask it builds from the
position ids), same weights, interleaved.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from rlcore.config import load_config, role_spec
from rlcore.data.preference import sequence_tensors
from rlcore.protocol import Batch
from rlcore.workers.actor import ActorWorker
from rlcore.workers.packed import pack_rows

VOCAB = 4096


def model_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=704, num_hidden_layers=5, num_attention_heads=8,
                       num_key_value_heads=4, max_position_embeddings=4096, tie_word_embeddings=True, pad_token_id=0)


def lengths(rows: int, seed: int) -> tuple[list[int], list[int]]:
    """Prompt lengths U[32, 256]; response lengths lognormal, median 64, p99 1,024 (sigma = ln 16 / z_0.99)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(32, 257, (rows,), generator=g)
    sigma = math.log(1024 / 64) / 2.3263
    responses = torch.exp(math.log(64) + sigma * torch.randn(rows, generator=g)).round().clamp(1, 2048).long()
    return prompts.tolist(), responses.tolist()


def rl_batch(rows: int, seed: int) -> Batch:
    prompt_lens, response_lens = lengths(rows, seed)
    g = torch.Generator().manual_seed(seed + 1)
    t = sequence_tensors([torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in prompt_lens],
                         [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in response_lens], pad_id=0)
    r = t["responses"].shape[1]
    t["advantages"] = torch.randn(rows, 1, generator=g).expand(rows, r).contiguous()
    return Batch(tensors=t)  # one prompt, `rows` samples


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def actor(model_dir: Path, packed: bool, max_tokens: int, rows: int) -> ActorWorker:
    cfg = load_config(None, [
        f"model.path={model_dir}", "data.train_files=[unused.parquet]", "trainer.device=cpu",
        "data.train_batch_size=1", "actor.ppo_mini_batch_size=1", f"rollout.n={rows}", "actor.ppo_epochs=1",
        f"actor.max_tokens_per_micro_batch={max_tokens}", f"model.use_remove_padding={str(packed).lower()}",
        "actor.optim.lr=1e-6",
    ])
    worker = ActorWorker(role_spec(cfg, "actor"))
    worker.setup()
    return worker


def timed(fn) -> tuple[float, float, object]:
    c0, w0 = cpu_seconds(), time.perf_counter()
    out = fn()
    return time.perf_counter() - w0, cpu_seconds() - c0, out


def bench_update(model_dir: Path, batch: Batch, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    workers = {"packed": actor(model_dir, True, args.max_tokens, len(batch)), "padded": actor(model_dir, False, args.max_tokens, len(batch))}
    batch = batch.union(workers["packed"].compute_log_prob(batch).select("old_log_probs"))  # same weights in both: valid for both
    for w in workers.values():  # warm-up: first-call allocations, and it empties the token tally
        w.update_actor(batch.take(range(min(8, len(batch)))), len(batch))
    runs: dict[str, list[tuple[float, float, dict]]] = {k: [] for k in workers}
    for _ in range(args.rounds):
        for name, w in workers.items():
            wall, cpu, metrics = timed(lambda w=w: w.update_actor(batch, len(batch)))
            runs[name].append((wall, cpu, metrics))
    real = float(batch["attention_mask"].sum())
    out = {}
    for name, rs in runs.items():
        m = rs[-1][2]
        assert m["perf/actor_real_tokens"] == real, (m["perf/actor_real_tokens"], real)
        out[name] = {"wall": statistics.median(r[0] for r in rs), "cpu": statistics.median(r[1] for r in rs),
                     "computed": m["perf/actor_compute_tokens"], "ratio": m["perf/actor_compute_token_ratio"]}
    return out


def bench_attention(model_dir: Path, batch: Batch, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """One packed row of about `--max-tokens` real tokens, forward + backward of the backbone."""
    take, total = [], 0
    for i, n in enumerate(batch["attention_mask"].sum(-1).tolist()):
        if total + n <= args.max_tokens:
            take.append(i)
            total += n
    rows = batch.take(take)
    packed = pack_rows(rows["attention_mask"], rows["responses"].shape[1])
    ids = packed.pack(rows["input_ids"])
    model = LlamaForCausalLM.from_pretrained(model_dir)
    from rlcore.workers.attention import register

    variants = {"rlcore_varlen": (register(), packed.backbone_kwargs()),
                "transformers sdpa, dense mask": ("sdpa", {"position_ids": packed.position_ids})}
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    for _ in range(args.rounds):
        for name, (impl, kwargs) in variants.items():
            model.set_attn_implementation(impl)

            def step(kwargs=kwargs) -> None:
                model.model(input_ids=ids, use_cache=False, **kwargs).last_hidden_state.square().mean().backward()

            wall, cpu, _ = timed(step)
            times[name].append((wall, cpu))
    return {k: {"wall": statistics.median(t[0] for t in v), "cpu": statistics.median(t[1] for t in v),
                "tokens": packed.tokens, "sequences": len(take)} for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()

    batch = rl_batch(args.rows, args.seed)
    prompt_lens, response_lens = lengths(args.rows, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = LlamaForCausalLM(model_config())
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(tmp)
        del model
        print(f"model: Llama, {params / 1e6:.2f}M parameters (hidden 256, 5 layers, 8 heads / 4 kv heads, vocab {VOCAB}, tied), "
              f"float32, {torch.get_num_threads()} torch thread")
        rs = sorted(response_lens)
        print(f"batch: {args.rows} rows; prompts {min(prompt_lens)}-{max(prompt_lens)} tokens; responses median "
              f"{statistics.median(rs):.0f}, p90 {rs[int(0.9 * len(rs))]}, max {rs[-1]}; padded width "
              f"{batch['input_ids'].shape[1]}; real tokens {int(batch['attention_mask'].sum()):,}")
        print(f"actor update: ActorWorker.update_actor, 1 optimizer step, micro-batches <= {args.max_tokens} real tokens; "
              f"{args.rounds} rounds interleaved, medians")
        update = bench_update(Path(tmp), batch, args)
        real = float(batch["attention_mask"].sum())
        print(f"  {'variant':8s} {'wall s':>8s} {'cpu s':>8s} {'real tok/s wall':>16s} {'real tok/s cpu':>15s} "
              f"{'computed tokens':>16s} {'computed/real':>14s}")
        for name, r in update.items():
            print(f"  {name:8s} {r['wall']:8.2f} {r['cpu']:8.2f} {real / r['wall']:16,.0f} {real / r['cpu']:15,.0f} "
                  f"{r['computed']:16,.0f} {r['ratio']:14.3f}")
        speed_wall = update["padded"]["wall"] / update["packed"]["wall"]
        speed_cpu = update["padded"]["cpu"] / update["packed"]["cpu"]
        ok_speed = min(speed_wall, speed_cpu) >= 2.0
        ok_ratio = update["packed"]["ratio"] <= 1.05
        print(f"  packed / padded tokens/s: {speed_wall:.2f}x wall, {speed_cpu:.2f}x cpu (>= 2x: {'PASS' if ok_speed else 'FAIL'})")
        print(f"  packed computed/real tokens: {update['packed']['ratio']:.3f} (<= 1.05: {'PASS' if ok_ratio else 'FAIL'}); "
              f"padded: {update['padded']['ratio']:.3f}")

        att = bench_attention(Path(tmp), batch, args)
        first = next(iter(att.values()))
        print(f"attention for packed rows: backbone forward+backward on one packed row of {first['tokens']:,} tokens "
              f"({first['sequences']} sequences), {args.rounds} rounds interleaved, medians")
        for name, r in att.items():
            print(f"  {name:32s} wall {r['wall']:7.2f} s   cpu {r['cpu']:7.2f} s")
        dense, ours = att["transformers sdpa, dense mask"], att["rlcore_varlen"]
        print(f"  rlcore_varlen is {dense['wall'] / ours['wall']:.2f}x faster wall, {dense['cpu'] / ours['cpu']:.2f}x cpu; "
              f"the dense mask alone is {first['tokens'] ** 2 / 2 ** 20:.0f} MiB (bool [T, T]) per forward")


if __name__ == "__main__":
    main()
