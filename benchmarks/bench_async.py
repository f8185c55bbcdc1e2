"""Step throughput of GRPO on Ray, synchronous vs one-step off-policy (`trainer.off_policy`).

    ./dev python benchmarks/bench_async.py [--steps 6] [--prompts 32] [--n 8] [--max-new-tokens 48] [--temperature 8]

Separate rollout and actor workers: a `gen` pool (1 CPU) holds the rollout and reward workers,
the `default` pool (1 CPU) the actor and reference. In one-step mode step k+1's generation runs
in the gen pool while step k's log-probs and update run in the default pool. Each mode runs in
its own process (one Ray session per process) on the tiny example; steps/s is measured over the
steps after the first (warm-up). Checkpoints are off during the run (a checkpoint step does not
prefetch), validation too. Generation is made heavier than the tiny recipe's (temperature 8,
48 new tokens: long responses) so that it is a real share of the step, as on real models. On a
2-core machine shared with others the ratio is noisy: run twice.
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

from rlcore.cli import CONFIG_DIR, tiny_example_overrides
from rlcore.config import load_config
from rlcore.example import build_tiny_example


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    """Train `args.steps` steps in this process on Ray; per-step seconds and phase means."""
    from rlcore.trainer.run import make_trainer

    example = build_tiny_example()
    out = tempfile.mkdtemp(prefix="rl-", dir="/tmp")  # Ray socket paths must stay < 107 bytes
    try:
        overrides = tiny_example_overrides(example, os.path.join(out, "run")) + [
            f"trainer.total_steps={args.steps}",
            f"data.train_batch_size={args.prompts}",
            f"actor.ppo_mini_batch_size={args.prompts}",
            f"rollout.n={args.n}",
            f"rollout.max_new_tokens={args.max_new_tokens}",
            f"rollout.temperature={args.temperature}",
            "rollout.backend=hf",
            "trainer.val_before_train=false",
            "trainer.val_every=1000000",
            f"trainer.save_every={args.steps}",
            "trainer.loggers=[jsonl]",
            "trainer.device=cpu",
            "trainer.backend=ray",
            f"trainer.off_policy={mode}",
            "ray.num_cpus=2",
            f"ray.temp_dir={os.path.join(out, 'ray')}",
            "ray.pools={default: {cpus_per_bundle: 1}, gen: {cpus_per_bundle: 1}}",
            "ray.roles={rollout: gen, reward: gen}",
        ]
        cfg = load_config(CONFIG_DIR / "tiny_grpo.yaml", overrides)
        history = make_trainer(cfg).fit()
    finally:
        shutil.rmtree(out, ignore_errors=True)
    steady = history[1:]
    phases = sorted({k for m in steady for k in m if k.startswith("time/") and k not in ("time/step_s", "time/validate_s")})
    return {
        "step_s": [m["time/step_s"] for m in steady],
        "phases": {k[5:-2]: statistics.mean(m.get(k, 0.0) for m in steady) for k in phases},
        "staleness_max": [m["rollout/staleness_max"] for m in history],
        "response_length": statistics.mean(m["response_length/mean"] for m in history),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=8.0)
    parser.add_argument("--child", choices=["sync", "one_step"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step is warm-up)")
    if args.child:
        print("RESULT " + json.dumps(run_mode(args.child, args)), flush=True)
        return

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a token file in the shared home may change under us
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    build_tiny_example()  # build (or reuse) once, before the children race for it
    results = {}
    for mode in ("sync", "one_step"):
        cmd = [sys.executable, __file__, "--child", mode, "--steps", str(args.steps), "--prompts", str(args.prompts),
               "--n", str(args.n), "--max-new-tokens", str(args.max_new_tokens), "--temperature", str(args.temperature)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            sys.exit(f"{mode} run failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
        results[mode] = json.loads(lines[-1][len("RESULT "):])

    print(f"GRPO on Ray, tiny example: {args.prompts} prompts x {args.n} samples, max_new_tokens="
          f"{args.max_new_tokens}, temperature {args.temperature}, {args.steps} steps (first one excluded); "
          "rollout+reward on pool 'gen', actor+ref on pool 'default', 1 CPU each")
    print("  generation made heavier than the tiny recipe (its ~6-token answers at temperature 1 take ~0.07 s "
          "of a 0.5 s step): temperature 8 (near-uniform sampling, rarely EOS) and 48 new tokens give long responses, as in real RL runs where "
          "generation is a large share of the step")
    rates = {}
    for mode, r in results.items():
        mean_s = statistics.mean(r["step_s"])
        rates[mode] = 1.0 / mean_s
        phases = "  ".join(f"{k}={v:.2f}s" for k, v in sorted(r["phases"].items()) if v >= 0.005)
        print(f"  {mode:9s} {rates[mode]:.3f} steps/s ({mean_s:.2f} s/step; staleness per step "
              f"{[int(s) for s in r['staleness_max']]}; mean response {r['response_length']:.1f} tokens)")
        print(f"            phases: {phases}")
    print(f"  one_step / sync = {rates['one_step'] / rates['sync']:.2f}x steps/s")
    print("  (in one_step mode time/generate is only the wait the overlap did not hide)")


if __name__ == "__main__":
    main()
