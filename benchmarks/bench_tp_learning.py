"""Does a tensor-parallel run learn like the one-process run? The tiny example, GRPO and PPO.

    ./dev python benchmarks/bench_tp_learning.py                    # GRPO: one process (2 seeds) vs TP
    ./dev python benchmarks/bench_tp_learning.py --algorithm ppo    # PPO: one process (2 seeds) vs TP critic
    ./dev python benchmarks/bench_tp_learning.py --steps 30 --only tp
    ./dev python benchmarks/bench_tp_learning.py --only one --seeds 1
    ./dev python benchmarks/bench_tp_learning.py --only tp --rollout-data-parallel 2   # two vLLM TP-2 engines

GRPO (`rlcore/configs/tiny_grpo.yaml`, lr 1e-5 as in README): the one-process run (in-process
backend, hf rollout) at seeds 0 and 1 (how far two seeds land apart is the noise to judge by),
and at seed 0 the run on Ray with the actor (and its reference, colocated) at FSDP x TP = 2 x 2
(`actor.layout`) and the rollout a vLLM engine of tensor-parallel size 2 (`rollout.layout`).
PPO (`rlcore/configs/tiny_ppo.yaml`): the same, the TP run with actor and critic at tensor
parallel 2 (`actor.layout`, `critic.layout`) and the hf rollout. Each run is its own
`rlcore train` process; printed: greedy validation accuracy (`val/acc`) before training and at
every validation step, and the run's wall and CPU seconds (the process tree's user + system:
the machine may be shared, so compare CPU seconds; Ray's workers are not in that tree).
`--rollout-data-parallel 2` (GRPO): two vLLM engines of tensor-parallel size 2, four vLLM ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlcore.cli import CONFIG_DIR, tiny_example_overrides
from rlcore.example import build_tiny_example

# six Ray workers start at once (four actor ranks, rollout, reward): at load 17-21 on 2 cores the
# actor's did not finish starting within the default 600 s (ray.init_timeout_s), so allow longer
SLOW_START = "ray.init_timeout_s=2400"
TP_RUNS = {
    "grpo": ["trainer.backend=ray", "actor.layout={data_parallel: 2, tensor_parallel: 2}", "ray.colocate=[[actor, ref]]",
             "rollout.backend=vllm", "rollout.layout={tensor_parallel: 2}", "rollout.vllm.kv_cache_gib=0.25", SLOW_START],
    "ppo": ["trainer.backend=ray", "actor.layout={tensor_parallel: 2}", "critic.layout={tensor_parallel: 2}",
            "ray.colocate=[[actor, critic]]", SLOW_START],
}


def run(name: str, config: Path, overrides: list[str], out: Path) -> dict:
    """One `rlcore train` in its own process; its validation accuracies, wall and CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "rlcore.cli", "train", str(config), *overrides], env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        print(f"  {name}: failed (rc {proc.returncode})\n{proc.stderr[-3000:]}")
        return {}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    acc = [(int(r.get("step", 0)), r["val/acc"]) for r in rows if "val/acc" in r]
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    print(f"  {name:44} val/acc " + "  ".join(f"step {s}: {a:.4f}" for s, a in acc) + f"   ({wall:.0f} s wall, {cpu:.0f} s CPU)")
    return {"acc": acc, "wall": wall, "cpu": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithm", choices=["grpo", "ppo"], default="grpo")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--only", choices=["all", "one", "tp"], default="all")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="the one-process runs' seeds")
    parser.add_argument("--rollout-data-parallel", type=int, default=1,
                        help="GRPO's TP run: vLLM engines (each of tensor-parallel size 2)")
    args = parser.parse_args()
    if args.rollout_data_parallel > 1 and args.algorithm != "grpo":
        parser.error("--rollout-data-parallel: the PPO run's rollout is the hf backend (no vLLM engines)")
    example = build_tiny_example()
    config = CONFIG_DIR / f"tiny_{args.algorithm}.yaml"
    common = [f"trainer.total_steps={args.steps}", "trainer.val_every=10", "trainer.save_every=1000",
              "trainer.loggers=[jsonl]", "reward.num_workers=1"]
    if args.algorithm == "grpo":
        common.append("actor.optim.lr=1e-5")
    print(f"tiny example, {args.algorithm}, {args.steps} steps; greedy validation accuracy on {example.val_file.name}")
    with tempfile.TemporaryDirectory(prefix="bench_tp_learning_") as tmp:
        variants = []
        if args.only in ("all", "one"):
            variants += [(f"one process, seed {seed}", [f"trainer.seed={seed}"]) for seed in args.seeds]
        if args.only in ("all", "tp"):
            what = ("actor FSDP x TP 2x2 + vLLM rollout TP 2" if args.algorithm == "grpo" else "actor TP 2 + critic TP 2")
            extra = ["trainer.seed=0", *TP_RUNS[args.algorithm]]
            if args.rollout_data_parallel > 1:
                dp = args.rollout_data_parallel
                what += f" x {dp} engines"
                extra.append(f"rollout.layout={{data_parallel: {dp}, tensor_parallel: 2}}")
            variants.append((f"{what}, seed 0", extra))
        for i, (name, extra) in enumerate(variants):
            out = Path(tmp) / f"run{i}"
            run(name, config, [*tiny_example_overrides(example, str(out)), *common, *extra], out)


if __name__ == "__main__":
    main()
