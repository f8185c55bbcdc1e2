"""Throughput of one GRPO step on the tiny example, generation and update separately.

    ./dev python benchmarks/bench_step.py [--steps 5] [--prompts 32] [--n 8]

Runs a short GRPO run on the in-process backend and prints, per phase, the mean over the
steps after the first (which pays for warm-up): tokens per second of generation (new response
tokens) and of the actor update (all prompt+response tokens, forward+backward), and seconds
per phase.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

from rlcore.cli import CONFIG_DIR, tiny_example_overrides
from rlcore.config import load_config
from rlcore.example import build_tiny_example
from rlcore.trainer.run import make_trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    args = parser.parse_args()

    example = build_tiny_example()
    with tempfile.TemporaryDirectory() as out:
        overrides = tiny_example_overrides(example, out) + [
            f"trainer.total_steps={args.steps}",
            f"data.train_batch_size={args.prompts}",
            f"actor.ppo_mini_batch_size={args.prompts // 2}",
            f"rollout.n={args.n}",
            "trainer.val_before_train=false",
            "trainer.val_every=1000000",
            "trainer.save_every=1000000",
            "data.val_files=[]",
            "trainer.loggers=[]",
        ]
        history = make_trainer(load_config(CONFIG_DIR / "tiny_grpo.yaml", overrides)).fit()

    steady = history[1:] or history
    keys = [
        "throughput/generate_tok_s",
        "throughput/update_actor_tok_s",
        "time/generate_s",
        "time/reward_s",
        "time/old_log_prob_s",
        "time/update_actor_s",
        "time/weight_sync_s",
        "time/step_s",
        "response_length/mean",
    ]
    summary = {k: round(statistics.mean(m[k] for m in steady if k in m), 4) for k in keys if any(k in m for m in steady)}
    print(f"GRPO step on the tiny example: {args.prompts} prompts x n={args.n}, {len(steady)} steps measured")
    for k, v in summary.items():
        print(f"  {k:32s} {v:>12,.4f}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
