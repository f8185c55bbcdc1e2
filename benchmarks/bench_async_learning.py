"""Sync vs one_step vs async GRPO on a long-tailed length workload: throughput, trainer idle time
and time to the tiny task's 90% greedy accuracy, side by side from one run (issue 42).

    ./dev python benchmarks/bench_async_learning.py [--seeds 3] [--max-len 1024] [--prompts 16] [--n 8]
        [--modes sync,one_step,async:1,async:2,async:4] [--target 0.9] [--val-every 2] [--max-steps 30]
        [--weight-sync step|generation] [--device cpu|cuda] [--model tiny|5m|PATH] [--out FILE.json]
    ./dev python benchmarks/bench_async_learning.py --quick   # smoke: 1 seed, sync and async:1, a few tiny steps

The runs the README reports (the issue's workload, responses 4 to 1,024 tokens; ~900 CPU s for 5
seeds here, ~20 s of CPU per run), and the same with an update slower than generation:

    ./dev python benchmarks/bench_async_learning.py --seeds 5 --max-len 1024 --prompts 16 --n 8 --lr 1e-4 \
        --val-every 1 --max-steps 24 --out /tmp/bench_async_learning.json
    ./dev python benchmarks/bench_async_learning.py --seeds 3 --max-len 1024 --prompts 16 --n 8 --lr 1e-4 \
        --val-every 1 --max-steps 24 --trainer-delay 8

The workload. The tiny example (`./dev rlcore example build`: two-digit additions, SFT-warmed
policy, GSM8K strict reward, greedy start ~33%) with every sampled response made long-tailed: each
row's length is drawn from the lognormal `bench_lengths.py` uses (median 64, p99 1,024 tokens for
`--max-len 1024`; median and p99 scale with `--max-len`, so 256 gives median 16, p99 256), clamped
to [4, max-len] (`bench_vs_trl.lognormal_quantile` at a seeded uniform: the step's sampling seed, so
every mode draws the same lengths at the same step). The rollout engine is rlcore's own hf decode
loop (`LongTailEngine`, a subclass plugged in as `rollout.backend=module:Class`) that decodes each
sampled row to its drawn length instead of stopping at the end token: the model still writes its
answer and end token where it wants to (the reward decodes up to the first end token, so rewards
are the task's), then goes on sampling, so every generation costs its drawn length in decode steps.
Greedy validation is left alone (it stops at the end token, ~6 tokens): accuracy is the task's.

What is trained (`--filler`). By default (`generated`) a row's response mask ends at its first end
token, as a real response does: the tokens decoded after it cost generation time and are not
trained. `trained` trains them too, so the update's tokens are long-tailed as well; but they are
text after the end token, which nothing in the model's training anchors: ~95% of the trained tokens
carry no signal, their distribution moves freely with each update, and a sample drawn from the
policy one update old lands on tokens the current policy has made unlikely, whose gradients are
large. Measured at full length (seed 0, 8 steps, `/tmp`-only diagnostic runs of this workload): with
the filler trained, the actor's gradient norm before clipping (at 1.0) was 0.56-0.80 for sync from
step 2 and up to 8.5 for the others (one_step 1.8-8.5, async:1 0.6-4.8), their KL to the reference 2.7-3.8 against sync's 0.73 after 8
steps, and greedy accuracy 0.32-0.38 against sync's 0.62 at step 8 (one_step with
`actor.tis_cap=2`: 0.42); with the filler generated but not trained, sync and one_step both
reached 0.89 at step 4 (grad norms 1.5-2.6 for both). So the filler, not staleness, held the
off-policy modes back; a real run's long responses are the model's own reasoning, trained and
rewarded, not text after its end.

Per mode (`trainer.off_policy` sync, one_step on a thread, async:S = `trainer.off_policy=async
trainer.max_staleness=S actor.behaviour_correction=decoupled` with `trainer.async_weight_sync`
`--weight-sync`), per seed, one process each, the modes interleaved per seed: steps until greedy
`val/acc` (validated every `--val-every` steps) first reaches `--target`, and the wall and CPU
seconds to get there (this process tree, from `fit()`'s start: validation included, the same
for every mode); samples per second of wall and of CPU time (the samples trained, over the steps
after the first, a warm-up); the trainer's idle fraction over the same steps (`trainer_idle`: the
wall time between two steps' records less the trainer's own work, summed, over the wall time; so
also the waits no phase times, as one_step's and async's validation waiting for the generation in
flight). A run stops
at the target or at `--max-steps`. The table shows mean +- sd over seeds and the ratios to sync;
"within noise" compares the steps to the target: |mean - sync mean| <= sqrt(sd^2 + sd_sync^2).

A slower update (`--trainer-delay S`): here generation takes ~20x the update (the trained tokens
are the ~6 up to each row's end token), so the async producer is never more than one version
ahead and async:2 and async:4 train at staleness 1 like async:1. `--trainer-delay` makes the
trainer sleep S seconds after each step (counted as its work), as a large model's update on a GPU
would take, so the producer runs up to `max_staleness` ahead; "samples by lag" shows what each
run trained at each staleness.

On a GPU: `--device cuda` sets `trainer.device=cuda` (the same decode loop and update run on
it); `--model PATH` swaps the policy (its tokenizer must render the example's chat prompts; a
model that has not learnt the task never reaches the target: then only the throughput columns
mean anything; `5m` is bench_async's random ~5M Llama). The cuda path has not run here (no GPU).
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
import threading
import time
from pathlib import Path
from typing import Any

import torch
from bench_async import five_m_model, mode_overrides, tree_cpu_s
from bench_vs_trl import lognormal_quantile

from rlcore.rollout.base import SamplingParams
from rlcore.rollout.hf import HFRolloutEngine

LENGTHS_ENV = "RLCORE_BENCH_LONG_TAIL"  # "low,median,p99,high": how the engine draws lengths (set by the parent)
FILLER_ENV = "RLCORE_BENCH_FILLER"  # "generated" (the default) or "trained": what becomes of a row's tokens after its end token
FILLER = ("generated", "trained")
COLUMNS = ("steps_to_target", "wall_s_to_target", "cpu_s_to_target", "samples_per_wall_s", "samples_per_cpu_s",
           "trainer_idle_frac", "generated_length_mean", "trained_length_mean", "final_acc")


def length_spec(max_len: int) -> tuple[int, float, float, int]:
    """(low, median, p99, high) of the workload at `max_len`: bench_lengths.py's median 64 / p99 1,024, scaled."""
    return 4, max_len / 16, float(max_len), max_len


def draw_lengths(rows: int, seed: int, spec: tuple[int, float, float, int]) -> torch.Tensor:
    """`rows` response lengths from the lognormal of `spec`, drawn from `seed`."""
    low, median, p99, high = spec
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(rows, generator=g, dtype=torch.float64).clamp(1e-9, 1 - 1e-9)
    return torch.tensor([lognormal_quantile(float(q), median, p99, low, high) for q in u], dtype=torch.long)


class LongTailEngine(HFRolloutEngine):
    """rlcore's hf engine, each sampled row decoded to a drawn length (`draw_lengths`, the spec in
    $RLCORE_BENCH_LONG_TAIL) rather than stopping at its end token; greedy calls (validation) as is.
    With $RLCORE_BENCH_FILLER=generated (the default) a row's response mask ends at its first end
    token, as a real response does: the tokens after it cost their decode steps but are not trained;
    `trained` trains them too. `generated` counts the sampled rows and tokens of this process."""

    generated = [0, 0]  # sampled rows, tokens decoded for them (this process, every engine)
    _count = threading.Lock()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._forced = threading.local()  # a forced decode ignores end tokens on its own thread only
        super().__init__(*args, **kwargs)
        raw = os.environ.get(LENGTHS_ENV)
        self.spec = None if not raw else tuple(float(x) for x in raw.split(","))
        self.train_filler = os.environ.get(FILLER_ENV, "generated") == "trained"

    @property  # type: ignore[override]
    def _eos(self) -> torch.Tensor:
        forced = getattr(self._forced, "eos", None)
        return self._eos_all if forced is None else forced

    @_eos.setter
    def _eos(self, value: torch.Tensor) -> None:
        self._eos_all = value

    def _decode(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams,
                limits: torch.Tensor | None = None, keys: torch.Tensor | None = None, switch: Any = None) -> Any:
        if self.spec is None or not params.do_sample or limits is not None:
            return super()._decode(prompt_ids, prompt_mask, params, limits=limits, keys=keys, switch=switch)
        low, median, p99, high = self.spec
        rows = prompt_ids.shape[0] * params.n
        lengths = draw_lengths(rows, params.seed or 0, (int(low), median, p99, int(min(high, params.max_new_tokens))))
        self._forced.eos = self._eos_all[:0]
        try:
            tokens, mask, log_probs, versions = super()._decode(prompt_ids, prompt_mask, params, limits=lengths.to(self.device),
                                                                keys=keys, switch=switch)
        finally:
            self._forced.eos = None
        with self._count:
            self.generated[0] += rows
            self.generated[1] += int(mask.sum())
        if not self.train_filler:
            mask = mask * up_to_first(tokens, mask, self._eos_all)
        return tokens, mask, log_probs, versions


def up_to_first(tokens: torch.Tensor, mask: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """[N, R] 1 up to and including each row's first end token among its real tokens, 0 after it."""
    is_end = torch.isin(tokens, ends) & (mask > 0)
    position = torch.arange(tokens.shape[1], device=tokens.device)
    first = torch.where(is_end.any(-1), is_end.long().argmax(-1), tokens.shape[1])
    return (position.unsqueeze(0) <= first.unsqueeze(-1)).to(mask.dtype)


def run_one(mode: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """Train one run in this process until the target accuracy or `--max-steps`; its numbers."""
    from rlcore.cli import CONFIG_DIR, tiny_example_overrides
    from rlcore.config import load_config
    from rlcore.example import build_tiny_example
    from rlcore.trainer.run import make_trainer
    from rlcore.trainer.run_state import TrainingStopped

    example = build_tiny_example()
    out = tempfile.mkdtemp(prefix="rl-", dir="/tmp")
    steps: list[dict[str, Any]] = []
    try:
        overrides = tiny_example_overrides(example, os.path.join(out, "run")) + [
            f"trainer.total_steps={args.max_steps}", f"trainer.seed={seed}", f"data.train_batch_size={args.prompts}",
            f"actor.ppo_mini_batch_size={args.prompts}", f"actor.optim.lr={args.lr}", f"rollout.n={args.n}", f"rollout.max_new_tokens={args.max_len}",
            f"rollout.backend={Path(__file__).stem}:LongTailEngine", "trainer.val_before_train=false",
            f"trainer.val_every={args.val_every}", f"trainer.save_every={args.max_steps}", "trainer.loggers=[jsonl]",
            "trainer.trace=false", f"trainer.device={args.device}", *mode_overrides(mode),
            *([f"trainer.async_weight_sync={args.weight_sync}"] if mode.startswith("async") else []),
            "health.enabled=false",  # the filler tokens' entropy and KL are not the task's
        ]
        if args.model == "5m":
            overrides.append(f"model.path={five_m_model(str(example.model_dir), os.path.join(out, 'model5m'))}")
        elif args.model != "tiny":
            overrides.append(f"model.path={args.model}")
        cfg = load_config(CONFIG_DIR / "tiny_grpo.yaml", overrides)

        def record(step: int, metrics: dict[str, Any]) -> None:
            steps.append({"step": step, "wall": time.perf_counter() - t0, "cpu": tree_cpu_s() - c0,
                          **{k: float(v) for k, v in metrics.items() if k in KEPT or k.startswith("async/")}})
            if reached(metrics, args.target):
                raise TrainingStopped(f"val/acc {metrics['val/acc']:.3f} >= {args.target}")
            time.sleep(args.trainer_delay)  # a slower update: the producer runs ahead meanwhile

        trainer = make_trainer(cfg, step_hooks=[record])
        engine = engine_class()
        engine.generated[:] = [0, 0]
        t0, c0 = time.perf_counter(), tree_cpu_s()
        try:
            trainer.fit()
        except TrainingStopped:
            pass
    finally:
        shutil.rmtree(out, ignore_errors=True)
    rows, tokens = engine.generated
    return {**summarize_run(steps, args.prompts * args.n, args.target, args.trainer_delay),
            "generated_length_mean": tokens / max(rows, 1)}


def engine_class() -> type[LongTailEngine]:
    """The engine class as `rollout.backend` imports it: under the module's own name, which run as a
    script (`__main__`) is another copy with its own counts."""
    from bench_async_learning import LongTailEngine as imported

    return imported


def reached(metrics: dict[str, Any], target: float) -> bool:
    """Whether this step's validation reached `target` (val/acc is a float32 mean: 360/400 is 0.89999998)."""
    return metrics.get("val/acc", 0.0) >= target - 1e-6


KEPT = ("val/acc", "time/step_s", "time/generate_s", "time/weight_sync_s", "time/weight_sync_wait_s", "time/validate_s",
        "response_length/mean")


def trainer_idle(step: dict[str, Any], wall_before: float, delay: float = 0.0) -> tuple[float, float]:
    """The seconds since the last step's record that the trainer was not working, and those seconds:
    its work is the step less its waits (for samples; the weight sync, which in one_step is mostly
    the wait for the generation in flight, and takes milliseconds itself on the tiny model) plus
    validation, and `delay` (`--trainer-delay`, slept after the last record, stands for update work);
    whatever else passed, it waited (e.g. for a generation in flight before validating). One
    measure for every mode."""
    work = (step["time/step_s"] - step.get("time/generate_s", 0.0) - step.get("time/weight_sync_s", 0.0)
            - step.get("time/weight_sync_wait_s", 0.0) + step.get("time/validate_s", 0.0) + delay)
    wall = step["wall"] - wall_before
    return min(max(wall - work, 0.0), wall), wall


def summarize_run(steps: list[dict[str, Any]], samples_per_step: int, target: float, delay: float = 0.0) -> dict[str, Any]:
    """One run's columns (COLUMNS) from its per-step records."""
    hit = next((s for s in steps if reached(s, target)), None)
    steady = steps[1:] or steps
    span_wall = steady[-1]["wall"] - steps[0]["wall"] if len(steps) > 1 else steps[0]["wall"]
    span_cpu = steady[-1]["cpu"] - steps[0]["cpu"] if len(steps) > 1 else steps[0]["cpu"]
    idle = [trainer_idle(s, before["wall"], delay) for before, s in zip(steps, steps[1:])] or [trainer_idle(steps[0], 0.0)]
    accs = [s["val/acc"] for s in steps if "val/acc" in s]
    return {
        "steps_to_target": hit["step"] if hit else None,
        "wall_s_to_target": hit["wall"] if hit else None,
        "cpu_s_to_target": hit["cpu"] if hit else None,
        "samples_per_wall_s": samples_per_step * len(steady) / max(span_wall, 1e-9),
        "samples_per_cpu_s": samples_per_step * len(steady) / max(span_cpu, 1e-9),
        "trainer_idle_frac": sum(waited for waited, _ in idle) / max(sum(wall for _, wall in idle), 1e-9),
        "trained_length_mean": statistics.mean(s["response_length/mean"] for s in steps),
        "final_acc": accs[-1] if accs else None,
        "steps_run": len(steps), "acc_curve": [(s["step"], s["val/acc"]) for s in steps if "val/acc" in s],
        "dropped_groups": sum(s.get("async/dropped_groups", 0.0) for s in steps),
        "samples_by_lag": {key.rsplit("_", 1)[1]: sum(s.get(key, 0.0) for s in steps)
                           for key in sorted({k for s in steps for k in s if k.startswith("async/staleness_")})},
    }


def child_args(args: argparse.Namespace) -> list[str]:
    return ["--max-len", str(args.max_len), "--prompts", str(args.prompts), "--n", str(args.n), "--lr", str(args.lr), "--target", str(args.target),
            "--val-every", str(args.val_every), "--max-steps", str(args.max_steps), "--weight-sync", args.weight_sync,
            "--trainer-delay", str(args.trainer_delay),
            "--device", args.device, "--model", args.model]


def mean_sd(values: list[float | None]) -> tuple[float | None, float | None, int]:
    """Mean and sample sd of the values that are not None, and how many there were."""
    got = [v for v in values if v is not None]
    if not got:
        return None, None, 0
    return statistics.mean(got), (statistics.stdev(got) if len(got) > 1 else 0.0), len(got)


def report(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> dict[str, Any]:
    """Print the table and ratios to sync; the per-mode summary."""
    summary: dict[str, Any] = {}
    for mode, rs in runs.items():
        summary[mode] = {c: dict(zip(("mean", "sd", "count"), mean_sd([r[c] for r in rs]))) for c in COLUMNS}
    head = f"  {'mode':10s}" + "".join(f"{c:>24s}" for c in COLUMNS)
    print(head)
    for mode, cols in summary.items():
        cells = []
        for c in COLUMNS:
            m, sd, k = cols[c]["mean"], cols[c]["sd"], cols[c]["count"]
            cell = "-" if m is None else f"{m:.3g} +- {sd:.2g}" + ("" if k == len(runs[mode]) else f" ({k}/{len(runs[mode])})")
            cells.append(f"{cell:>24s}")
        print(f"  {mode:10s}" + "".join(cells))
    base = summary.get("sync")
    if base is not None:
        for mode, cols in summary.items():
            if mode == "sync":
                continue
            ratio = {c: (cols[c]["mean"] / base[c]["mean"]) if cols[c]["mean"] and base[c]["mean"] else None
                     for c in ("samples_per_wall_s", "samples_per_cpu_s", "wall_s_to_target", "cpu_s_to_target", "steps_to_target")}
            a, b = cols["steps_to_target"], base["steps_to_target"]
            noise = None
            if a["mean"] is not None and b["mean"] is not None:
                noise = abs(a["mean"] - b["mean"]) <= (a["sd"] ** 2 + b["sd"] ** 2) ** 0.5
            cols["vs_sync"] = {**ratio, "steps_within_noise": noise}
            shown = "  ".join(f"{k} {v:.2f}x" for k, v in ratio.items() if v is not None)
            print(f"  {mode} vs sync: {shown}; steps to target within seed noise: {noise}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--modes", default="sync,one_step,async:1,async:2,async:4")
    parser.add_argument("--max-len", type=int, default=1024, help="longest response (tokens); the lengths scale with it")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4, help="actor learning rate (5x the tiny recipe's 2e-5: "
                        "each update moves the policy further, a harder test of staleness; with --filler trained the filler "
                        "dilutes the answer's share of the token-mean loss: at 2e-5 greedy accuracy moved 33% -> 38% in 10 "
                        "steps at --max-len 256)")
    parser.add_argument("--filler", choices=FILLER, default="generated", help="the tokens a row decodes past its end "
                        "token: generated (decoded, not trained: a real response ends at its end token) or trained "
                        "(the update's tokens long-tailed too; nothing anchors them, see the module doc)")
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--trainer-delay", type=float, default=0.0, help="seconds the trainer sleeps after each step: "
                        "an update slower than generation (a large model's on a GPU), so that async runs up to "
                        "max_staleness ahead; the wall columns include it")
    parser.add_argument("--val-every", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--weight-sync", choices=["step", "generation"], default="step")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--model", default="tiny", help="tiny (the example's), 5m (random ~5M Llama) or a model folder")
    parser.add_argument("--out", default=None, help="write the runs and the summary as JSON here")
    parser.add_argument("--quick", action="store_true", help="smoke: 1 seed, sync and async:1, 3 tiny steps")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.modes, args.max_len, args.prompts, args.n = 1, "sync,async:1", 32, 4, 4
        args.max_steps, args.val_every = 3, 1
    if args.max_steps < 2:
        parser.error("--max-steps must be >= 2 (the first step is warm-up)")
    if args.child:
        print("RESULT " + json.dumps(run_one(args.child[0], int(args.child[1]), args)), flush=True)
        return

    from rlcore.example import build_tiny_example

    build_tiny_example()  # build (or reuse) once, before the children race for it
    modes = args.modes.split(",")
    env = {**os.environ, LENGTHS_ENV: ",".join(str(x) for x in length_spec(args.max_len)), FILLER_ENV: args.filler}
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    started, cpu0 = time.perf_counter(), sum(os.times()[:4])
    for seed in range(args.seeds):
        for mode in modes[seed % len(modes):] + modes[:seed % len(modes)]:  # a different mode first each seed
            t = time.perf_counter()
            proc = subprocess.run([sys.executable, __file__, "--child", mode, str(seed), *child_args(args)],
                                  capture_output=True, text=True, env=env)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                sys.exit(f"{mode} seed {seed} failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
            r = {"seed": seed, **json.loads(lines[-1][len("RESULT "):]), "process_wall_s": time.perf_counter() - t}
            runs[mode].append(r)
            print(f"  {mode} seed {seed}: steps to {args.target}: {r['steps_to_target']} ({r['wall_s_to_target']} s wall, "
                  f"{r['cpu_s_to_target']} CPU s); {r['samples_per_wall_s']:.2f} samples/s wall; idle "
                  f"{r['trainer_idle_frac']:.2f}; samples by lag {r['samples_by_lag']}; acc {r['acc_curve']}", flush=True)
    low, median, p99, high = length_spec(args.max_len)
    print(f"GRPO on the tiny task, long-tailed responses (lognormal median {median:g}, p99 {p99:g}, in [{low}, {high}] tokens), "
          f"the tokens past a row's end token {args.filler}; {args.prompts} prompts x {args.n} samples, model {args.model}, "
          f"device {args.device}, async weight sync "
          f"{args.weight_sync}; target greedy val/acc {args.target} (validated every {args.val_every} steps, at most "
          f"{args.max_steps} steps); {args.seeds} seeds, one process per run, interleaved; cores here: {os.cpu_count()}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; mean +- sd over seeds")
    summary = report(runs, args)
    total = {"wall_s": time.perf_counter() - started, "cpu_s": sum(os.times()[:4]) - cpu0}  # with the finished children
    print(f"  whole benchmark: {total['wall_s']:.0f} s wall, {total['cpu_s']:.0f} CPU s")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs, "summary": summary, "total": total}, indent=1))
        print(f"  wrote {args.out}")


if __name__ == "__main__":
    main()
