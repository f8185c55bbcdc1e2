"""Step throughput of GRPO, synchronous vs one-step off-policy vs async (`trainer.off_policy`), in
process and on Ray, with CPU seconds beside wall time.

    ./dev python benchmarks/bench_async.py [--backend inprocess|ray|both] [--rounds 2] [--steps 6]
        [--prompts 32] [--n 8] [--max-new-tokens 48] [--temperature 8] [--recompute auto|always]
        [--model tiny|5m]

In process, one-step mode runs the rollout worker on a thread of this one (`trainer.overlap_with:
thread`, the default) and, as a second variant, in a child process (`process`), the cores split between it and the
training thread (`rlcore.cpus`), so step k+1's generation overlaps step k's scoring, log-probs
and update. On Ray the rollout and reward workers sit in a `gen` pool (1 CPU) and the
actor and reference in `default` (1 CPU). Each run is its own process (one Ray session per
process); the variants are interleaved `--rounds` times, so a slow spell of this shared machine
hits them alike. Per run: wall and CPU seconds (this process and all its descendants: reward
sandboxes, Ray's workers) per step over the steps after the first (warm-up). Generation is made
heavier than the tiny recipe's (temperature 8, 48 new tokens: long responses) so that it is a real
share of the step, as on real models. `--model 5m` swaps the tiny example's policy for a ~5M
parameter Llama of the same vocabulary (random weights: its answers are noise, the work is real).
The sync run skips the old-log-prob pass by default (one mini-batch: exactly on-policy); the
one-step run cannot; `--recompute always` makes both run it. `async:S` runs
`trainer.off_policy=async trainer.max_staleness=S actor.behaviour_correction=decoupled` (S = 1, 2;
on Ray the controller's producer thread sends the generate calls to the rollout worker on `gen`),
`async:S:C` with `trainer.async_chunk_prompts=C` (in process: a weight sync waits for C prompts'
generation).
"wait" is the share of step time the trainer spent in `time/generate` (sync: generating; one_step
and async: waiting for samples).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from rlcore.cli import CONFIG_DIR, tiny_example_overrides
from rlcore.config import load_config
from rlcore.example import build_tiny_example

# in process, one_step runs the rollout worker on a thread (the default) or in a child process;
# async:S at trainer.max_staleness=S, in process on a thread, on Ray from the controller's thread
MODES = {"inprocess": ("sync", "one_step:thread", "one_step:process", "async:1", "async:2", "async:2:4"),
         "ray": ("sync", "one_step", "async:1", "async:2")}


def mode_overrides(mode: str) -> list[str]:
    """The config overrides of a MODES entry."""
    off_policy, _, variant = mode.partition(":")
    if off_policy == "async":
        staleness, _, chunk = variant.partition(":")
        return ["trainer.off_policy=async", f"trainer.max_staleness={staleness}", "actor.behaviour_correction=decoupled",
                *([f"trainer.async_chunk_prompts={chunk}"] if chunk else [])]
    return [f"trainer.off_policy={off_policy}", f"trainer.overlap_with={variant or 'thread'}"]


def tree_cpu_s() -> float:
    """User + system CPU seconds of this process and every live descendant."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.Error:  # exited meanwhile
            pass
    return total


def five_m_model(example_model: str, out: str) -> str:
    """A ~5M-parameter Llama with the tiny example's tokenizer and vocabulary, saved to `out`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shutil.copytree(example_model, out, ignore=shutil.ignore_patterns("*.safetensors", "config.json"))
    base = LlamaConfig.from_pretrained(example_model)
    cfg = LlamaConfig(vocab_size=base.vocab_size, hidden_size=320, intermediate_size=960, num_hidden_layers=5,
                      num_attention_heads=5, num_key_value_heads=5, head_dim=64,
                      max_position_embeddings=base.max_position_embeddings, tie_word_embeddings=True,
                      pad_token_id=base.pad_token_id, bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    print(f"5m model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters", file=sys.stderr)
    model.save_pretrained(out)
    return out


def run_one(backend: str, mode: str, args: argparse.Namespace) -> dict:
    """Train `args.steps` steps in this process; per-step wall and CPU seconds, phase means."""
    from rlcore.trainer.run import make_trainer

    example = build_tiny_example()
    out = tempfile.mkdtemp(prefix="rl-", dir="/tmp")  # Ray socket paths must stay < 107 bytes
    marks: list[tuple[float, float]] = []
    try:
        overrides = tiny_example_overrides(example, os.path.join(out, "run")) + [
            f"trainer.total_steps={args.steps}", f"data.train_batch_size={args.prompts}",
            f"actor.ppo_mini_batch_size={args.prompts}", f"rollout.n={args.n}",
            f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.temperature={args.temperature}",
            "rollout.backend=hf", "trainer.val_before_train=false", "trainer.val_every=1000000",
            f"trainer.save_every={args.steps}", "trainer.loggers=[jsonl]", "trainer.device=cpu",
            f"trainer.backend={backend}", *mode_overrides(mode),
            f"actor.recompute_old_log_prob={args.recompute}",
            "health.enabled=false",  # random 5M weights: their entropy and KL mean nothing
        ]
        if args.model == "5m":
            overrides.append(f"model.path={five_m_model(str(example.model_dir), os.path.join(out, 'model5m'))}")
        if backend == "ray":
            overrides += ["ray.num_cpus=2", f"ray.temp_dir={os.path.join(out, 'ray')}",
                          "ray.pools={default: {cpus_per_bundle: 1}, gen: {cpus_per_bundle: 1}}",
                          "ray.roles={rollout: gen, reward: gen}"]
        cfg = load_config(CONFIG_DIR / "tiny_grpo.yaml", overrides)
        hook = lambda step, metrics: marks.append((time.perf_counter(), tree_cpu_s()))  # noqa: E731
        marks.append((time.perf_counter(), tree_cpu_s()))
        history = make_trainer(cfg, step_hooks=[hook]).fit()
    finally:
        shutil.rmtree(out, ignore_errors=True)
    steady = history[1:]
    phases = sorted({k for m in steady for k in m if k.startswith("time/") and k not in ("time/step_s", "time/validate_s")})
    return {
        "wall_s": [b[0] - a[0] for a, b in zip(marks[1:], marks[2:])],
        "cpu_s": [b[1] - a[1] for a, b in zip(marks[1:], marks[2:])],
        "phases": {k[5:-2]: statistics.mean(m.get(k, 0.0) for m in steady) for k in phases},
        "staleness_max": [m["rollout/staleness_max"] for m in history],
        "response_length": statistics.mean(m["response_length/mean"] for m in history),
        "wait": statistics.mean(m.get("time/generate_s", 0.0) / m["time/step_s"] for m in steady),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", choices=["inprocess", "ray", "both"], default="inprocess")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=8.0)
    parser.add_argument("--recompute", choices=["auto", "always"], default="auto")
    parser.add_argument("--model", choices=["tiny", "5m"], default="tiny")
    parser.add_argument("--child", nargs=2, metavar=("BACKEND", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be >= 3 (the first step is warm-up)")
    if args.child:
        print("RESULT " + json.dumps(run_one(args.child[0], args.child[1], args)), flush=True)
        return

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a token file in the shared home may change under us
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    build_tiny_example()  # build (or reuse) once, before the children race for it
    backends = ["inprocess", "ray"] if args.backend == "both" else [args.backend]
    passed = ["--steps", str(args.steps), "--prompts", str(args.prompts), "--n", str(args.n), "--max-new-tokens",
              str(args.max_new_tokens), "--temperature", str(args.temperature), "--recompute", args.recompute,
              "--model", args.model]
    results: dict[tuple[str, str], dict[str, list[float]]] = {}
    for _ in range(args.rounds):
        for backend in backends:
            for mode in MODES[backend]:
                proc = subprocess.run([sys.executable, __file__, "--child", backend, mode, *passed], capture_output=True, text=True)
                lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
                if proc.returncode != 0 or not lines:
                    sys.exit(f"{backend} {mode} run failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
                r = json.loads(lines[-1][len("RESULT "):])
                acc = results.setdefault((backend, mode), {"wall_s": [], "cpu_s": [], "staleness": []})
                acc["wall_s"] += r["wall_s"]
                acc["cpu_s"] += r["cpu_s"]
                acc["staleness"] = r["staleness_max"]
                acc.setdefault("phases", []).append(r["phases"])  # type: ignore[arg-type]
                acc.setdefault("resp", []).append(r["response_length"])
                acc.setdefault("wait", []).append(r["wait"])

    print(f"GRPO, {args.model} model: {args.prompts} prompts x {args.n} samples, max_new_tokens={args.max_new_tokens}, "
          f"temperature {args.temperature}, {args.steps} steps per run (first excluded), {args.rounds} interleaved rounds, "
          f"old-log-prob pass: {args.recompute}; cores here: {os.cpu_count()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    for backend in backends:
        print(f" {backend}" + (" (rollout+reward on pool 'gen', actor+ref on 'default', 1 CPU each)" if backend == "ray" else
                              " (one_step: rollout on a thread, or in a child process)"))
        per = {}
        for mode in MODES[backend]:
            r = results[(backend, mode)]
            wall, cpu = statistics.median(r["wall_s"]), statistics.median(r["cpu_s"])
            per[mode] = (wall, cpu)
            phases = {k: statistics.mean(p.get(k, 0.0) for p in r["phases"]) for k in r["phases"][0]}  # type: ignore[union-attr]
            shown = "  ".join(f"{k}={v:.2f}" for k, v in sorted(phases.items()) if v >= 0.005)
            print(f"  {mode:16s} median {wall:.3f} s wall, {cpu:.3f} CPU s per step (CPU/wall {cpu / wall:.2f}); staleness "
                  f"{[int(s) for s in r['staleness']]}; mean response {statistics.mean(r['resp']):.1f} tokens; "  # type: ignore[arg-type]
                  f"wait {statistics.mean(r['wait']):.2f}")  # type: ignore[arg-type]
            print(f"                   phases (s): {shown}")
        ws, cs = per["sync"]
        for mode in MODES[backend][1:]:
            wo, co = per[mode]
            print(f"  {mode} vs sync: {ws / wo:.2f}x steps/s (wall), {co / cs:.2f}x CPU s per step")
    print("  (in one_step and async modes time/generate is only the wait the overlap did not hide)")


if __name__ == "__main__":
    main()
