"""PPO step time on Ray with a reward model on its own pool: reward-model scoring overlapped with
the rule scorer, the old log-probs and the critic's values (`reward_model.overlap: true`, the
default) vs the serial order (`false`: score, wait, then the rest).

    ./dev python benchmarks/bench_reward_model.py [--steps 6] [--prompts 32] [--n 4] [--max-new-tokens 48] [--rounds 2]

Pools (1 CPU each, 3 logical CPUs on the 2-core machine): `default` holds actor, reference,
rollout and reward; `critic` the critic; `rm` the reward model. The reward model is the tiny
example's SFT backbone under a fresh score head (a real sequence classifier of the policy's size,
as reward models usually are; its scores do not matter for speed). Generation is made heavier than
the tiny recipe's (temperature 8, 48 new tokens: long responses), so scoring and values are a real
share of the step, as on real models. Each mode runs in its own process (one Ray session each),
modes interleaved for `--rounds`; step time is the mean over the steps after the first (warm-up);
CPU seconds are those of the driver and every Ray process under it over the same steps (psutil,
read after each step). The overlap can only use a core the other phases leave free: on the shared
2-core machine that is what the load of other work leaves.
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
from pathlib import Path

from rlcore.cli import CONFIG_DIR, tiny_example_overrides
from rlcore.config import load_config
from rlcore.example import build_tiny_example

OVERLAPPED = ("reward", "old_log_prob", "values", "reward_model")  # the phases scoring may run beside


def make_reward_model(example, folder: Path) -> Path:
    """The SFT backbone under a fresh score head, saved as a reward model folder (tokenizer included)."""
    import torch

    from rlcore.workers.loading import load_sequence_classifier
    from rlcore.workers.tokenizer import copy_tokenizer, load_tokenizer

    if (folder / "config.json").is_file():
        return folder
    tok = load_tokenizer(str(example.model_dir))
    model = load_sequence_classifier(example.model_dir, "float32", torch.device("cpu"), key="model.path", new_head_ok=True,
                                     pad_token_id=tok.pad_token_id)
    model.save_pretrained(folder)
    copy_tokenizer(Path(example.model_dir), folder)
    return folder


def run_mode(overlap: bool, args: argparse.Namespace) -> dict:
    from rlcore.trainer.run import make_trainer

    example = build_tiny_example()
    out = tempfile.mkdtemp(prefix="rl-", dir="/tmp")  # Ray socket paths must stay < 107 bytes
    try:
        overrides = tiny_example_overrides(example, os.path.join(out, "run")) + [
            f"reward_model.path={args.rm}",
            f"reward_model.overlap={str(overlap).lower()}",
            f"trainer.total_steps={args.steps}",
            f"data.train_batch_size={args.prompts}",
            f"actor.ppo_mini_batch_size={args.prompts}",
            f"rollout.n={args.n}",
            f"rollout.max_new_tokens={args.max_new_tokens}",
            "rollout.temperature=8.0",
            "trainer.val_before_train=false",
            "trainer.val_every=1000000",
            f"trainer.save_every={args.steps}",
            "trainer.loggers=[jsonl]",
            "trainer.device=cpu",
            "trainer.backend=ray",
            "health.enabled=false",  # temperature 8 makes entropy and reward jumps no one should read here
            "ray.num_cpus=3",
            f"ray.temp_dir={os.path.join(out, 'ray')}",
            "ray.pools={default: {cpus_per_bundle: 1}, critic: {cpus_per_bundle: 1}, rm: {cpus_per_bundle: 1}}",
            "ray.roles={critic: critic, reward_model: rm}",
        ]
        cfg = load_config(CONFIG_DIR / "tiny_ppo.yaml", overrides)
        cpu: dict[str, float] = {}

        def tree_cpu(step: int, metrics: dict) -> None:
            """CPU seconds of this process and every descendant alive (the Ray workers), at each step."""
            import psutil

            me = psutil.Process()
            total = 0.0
            for proc in [me, *me.children(recursive=True)]:
                try:
                    times = proc.cpu_times()
                    total += times.user + times.system
                except psutil.Error:
                    pass
            cpu[str(step)] = total

        history = make_trainer(cfg, step_hooks=[tree_cpu]).fit()
    finally:
        shutil.rmtree(out, ignore_errors=True)
    steady = history[1:]
    phases = sorted({k for m in steady for k in m if k.startswith("time/") and k not in ("time/step_s", "time/validate_s")})
    return {
        "step_s": [m["time/step_s"] for m in steady],
        "steady_cpu_s": cpu[str(args.steps)] - cpu["1"],  # the process tree over the steps after the first
        "phases": {k[5:-2]: statistics.mean(m.get(k, 0.0) for m in steady) for k in phases},
        "response_length": statistics.mean(m["response_length/mean"] for m in history),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rm", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child", choices=["serial", "overlap"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step is warm-up)")
    if args.child:
        print("RESULT " + json.dumps(run_mode(args.child == "overlap", args)), flush=True)
        return

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a token file in the shared home may change under us
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    example = build_tiny_example()  # build (or reuse) once, before the children race for it
    rm_dir = make_reward_model(example, Path(tempfile.gettempdir()) / "rlcore-bench-rm")
    results: dict[str, list[dict]] = {"serial": [], "overlap": []}
    for _ in range(args.rounds):
        for mode in ("serial", "overlap"):
            cmd = [sys.executable, __file__, "--child", mode, "--steps", str(args.steps), "--prompts", str(args.prompts),
                   "--n", str(args.n), "--max-new-tokens", str(args.max_new_tokens), "--rm", str(rm_dir)]
            start = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True)
            wall = time.perf_counter() - start
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                sys.exit(f"{mode} run failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
            result = json.loads(lines[-1][len("RESULT "):])
            result["wall_s"] = wall
            results[mode].append(result)

    print(f"PPO on Ray, tiny example with a reward model: {args.prompts} prompts x {args.n} samples, max_new_tokens="
          f"{args.max_new_tokens}, temperature 8, {args.steps} steps (first excluded), {args.rounds} interleaved rounds; "
          "pools default (actor, ref, rollout, reward), critic, rm: 1 CPU each")
    for mode, runs in results.items():
        for i, r in enumerate(runs):
            phases = "  ".join(f"{k}={v:.3f}s" for k, v in sorted(r["phases"].items()) if v >= 0.005)
            scoring = sum(r["phases"].get(k, 0.0) for k in OVERLAPPED)
            steps = len(r["step_s"])
            print(f"  {mode:7s} round {i + 1}: {statistics.mean(r['step_s']):.3f} s/step wall, "
                  f"{r['steady_cpu_s'] / steps:.3f} s/step CPU (driver + Ray workers); scoring+log-probs+values "
                  f"{scoring:.3f} s; whole run {r['wall_s']:.1f} s wall; mean response {r['response_length']:.1f} tokens")
            print(f"          phases: {phases}")
    for i in range(args.rounds):
        serial, overlap = results["serial"][i], results["overlap"][i]
        step = statistics.mean(serial["step_s"]) / statistics.mean(overlap["step_s"])
        part = sum(serial["phases"].get(k, 0.0) for k in OVERLAPPED) / sum(overlap["phases"].get(k, 0.0) for k in OVERLAPPED)
        print(f"  round {i + 1}: overlap speed-up over serial: {step:.2f}x per step, {part:.2f}x on scoring + log-probs + "
              f"values; CPU per step overlap/serial {overlap['steady_cpu_s'] / serial['steady_cpu_s']:.2f}")
    print("  (in overlap mode time/reward_model is only the wait the critic's values and the log-probs did not hide)")


if __name__ == "__main__":
    main()
