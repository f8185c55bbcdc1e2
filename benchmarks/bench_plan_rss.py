"""`rlcore plan`'s modelled process resident memory against the peak RSS of real gloo ranks.

The planner predicts two numbers per role and layout: the tensor peak (fake-tensor simulation,
`rlcore.plan.simulate`; what `benchmarks/bench_plan.py` checks against torch's tracker) and the
process's resident memory (`rlcore.plan.process`: the tensor peak plus the interpreter and
libraries, what loading the model leaves behind and what glibc keeps of freed buffers, from
constants measured by `--calibrate`). This runs the actor's update for real on 2 gloo ranks (the
`ActorWorker` as a run sets it up, from a model folder with random weights, glibc's default
allocator settings as `rlcore train` has them) and reads each rank's `VmHWM` (the peak RSS of the
whole process: imports, loading, a warm-up step and a measured step).

    ./dev python benchmarks/bench_plan_rss.py                 # the two models no test uses
    ./dev python benchmarks/bench_plan_rss.py --calibrate     # the phases behind rlcore.plan.process's constants

`--calibrate` runs bench_plan.py's 8M Llama (the model the tests use) at float32 and bf16 with
checkpointing and prints, per rank, the RSS after imports (the baseline), after loading (and the
bytes of the rank's shards then), and the peak; rlcore/plan/process.py's constants come from it.
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
from typing import Any

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))
MIB = 2**20

PROMPT, RESPONSE = 64, 192  # rows of 256 tokens; one row per micro-batch, two per rank per step
BASE = ["data.train_files=[unused.parquet]", f"data.max_prompt_length={PROMPT}", f"rollout.max_new_tokens={RESPONSE}",
        "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "rollout.n=2", "actor.max_tokens_per_micro_batch=256",
        "actor.recompute_old_log_prob=always", "trainer.device=cpu", "trainer.backend=ray", "actor.world_size=2"]

# Models no test uses (random weights, written here; nothing downloaded).
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # ~46.6M parameters: Qwen2 with grouped-query attention (8 query / 2 key-value heads), tied embeddings
    "qwen2-47m": ("Qwen2", dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=10,
                                num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True)),
    # ~106M parameters: Llama, multi-head attention, untied head
    "llama-106m": ("Llama", dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                                 num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=1024, tie_word_embeddings=False)),
}
CASES = {"float32": [], "bf16-ckpt": ["model.dtype=bfloat16", "model.gradient_checkpointing=true"]}
# Calibration: the test model at this file's lengths and at bench_plan.py's (rows of 512 tokens filling two
# 2,048-token micro-batches per rank): two tensor peaks of one model, which separate the step's fixed
# overhead from what grows with the tensor peak.
CALIBRATION = {"float32": [], "float32-long": ["data.max_prompt_length=128", "rollout.max_new_tokens=384", "data.train_batch_size=4",
                                               "actor.ppo_mini_batch_size=4", "rollout.n=4", "actor.max_tokens_per_micro_batch=2048"]}


def write_model(name: str, folder: Path) -> Path:
    import torch
    import transformers

    family, shape = MODELS[name]
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**shape)
    getattr(transformers, f"{family}ForCausalLM")(config).save_pretrained(folder)
    return folder


def _config(model_dir: Path, overrides: list[str]):
    from rlcore.config import load_config

    return load_config(None, [f"model.path={model_dir}", *BASE, *overrides])


def predict(model_dir: Path, overrides: list[str]) -> dict[str, int]:
    """The planner's tensor peak (every layer simulated) and modelled process RSS, rank 0 of FSDP 2."""
    from rlcore.plan.models import ModelFacts, read_config
    from rlcore.plan.process import process_rss
    from rlcore.plan.roles import role_plans
    from rlcore.plan.simulate import Layout, simulate

    config = _config(model_dir, overrides)
    actor = next(p for p in role_plans(config) if p.role == "actor")
    model_config = read_config(model_dir, "model.path")
    facts = ModelFacts.of(model_config, actor.head, "model.path")
    peak = simulate(actor, model_config, Layout(2), uniform=facts.uniform, exact=True)
    rss = process_rss(actor, facts.parameters, peak)
    return {"tensor": peak.total, "rss": rss.total, "parameters": facts.parameters}


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _rank_main(args: argparse.Namespace) -> None:
    """One gloo rank: RSS after imports, after loading, and the process's peak after two steps."""
    import torch
    import torch.distributed as dist

    from rlcore.workers.actor import ActorWorker

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=2)
    try:
        import bench_plan  # the sibling benchmark's batch of distinct rows, at this file's lengths

        config = _config(Path(args.model), json.loads(args.overrides))
        bench_plan.PROMPT, bench_plan.RESPONSE = config.data.max_prompt_length, config.rollout.max_new_tokens
        bench_plan.MODEL = {"vocab_size": json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]}
        baseline = _status("VmRSS")
        worker = ActorWorker(config, args.rank, 2)
        worker.setup()
        loaded, load_peak = _status("VmRSS"), _status("VmHWM")
        shards = sum(p.to_local().nbytes if hasattr(p, "to_local") else p.nbytes for p in worker.model.parameters())
        batch = bench_plan._batch(config, config.data.train_batch_size * config.rollout.n // 2, seed=args.rank)
        started = time.process_time()
        for _ in range(2):  # the warm-up (AdamW makes its state) and the measured step
            worker.update_actor(batch, config.rollout.n)
        Path(args.out).with_suffix(f".{args.rank}.json").write_text(json.dumps({
            "baseline": baseline, "loaded": loaded, "load_peak": load_peak, "shards": shards,
            "peak": _status("VmHWM"), "end": _status("VmRSS"), "cpu_s": time.process_time() - started}))
    finally:
        dist.destroy_process_group()


def measure(model_dir: Path, overrides: list[str], timeout: float = 900) -> list[dict[str, Any]]:
    """Both ranks' RSS phases (bytes), fresh processes of this script, glibc's default settings."""
    from bench_plan import _free_port

    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank.json"
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | {"OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen([sys.executable, str(HERE), "--rank", str(r), "--port", str(port), "--model", str(model_dir),
                                   "--overrides", json.dumps(overrides), "--out", str(out)], env=env) for r in range(2)]
        try:
            codes = [p.wait(timeout=timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(codes):
            raise RuntimeError(f"a rank exited with {codes}")
        return [json.loads(out.with_suffix(f".{r}.json").read_text()) for r in range(2)]


def _cpu() -> float:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def calibrate(tmp: Path) -> None:
    import bench_plan

    model_dir = bench_plan.write_model(tmp / "calibration")
    print(f"{'case':<14}{'rank':>5}{'baseline':>10}{'loaded':>9}{'load peak':>11}{'shards':>9}{'peak':>9}{'end':>9}"
          f"{'tensor peak':>13}  (MiB)")
    for case, overrides in CALIBRATION.items():
        tensor = predict(model_dir, overrides)["tensor"]
        for r, m in enumerate(measure(model_dir, overrides)):
            print(f"{case:<14}{r:>5}" + "".join(f"{m[k] / MIB:>{w}.1f}" for k, w in
                                                  (("baseline", 10), ("loaded", 9), ("load_peak", 11), ("shards", 9), ("peak", 9), ("end", 9)))
                  + f"{tensor / MIB:>13.1f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=list(MODELS))
    parser.add_argument("--case", action="append", choices=list(CASES), help="repeatable; default both")
    parser.add_argument("--calibrate", action="store_true")
    parser.add_argument("--rank", type=int)
    parser.add_argument("--port", type=int)
    parser.add_argument("--model")
    parser.add_argument("--overrides")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.rank is not None:
        _rank_main(args)
        return
    started, cpu0 = time.monotonic(), _cpu()
    with tempfile.TemporaryDirectory() as tmp:
        if args.calibrate:
            calibrate(Path(tmp))
        else:
            print("| model | case | parameters | tensor peak (fake-tensor simulation) | process RSS (modelled) "
                  "| measured peak RSS, rank 0 / 1 | modelled / measured (rank 0 / 1) |")
            print("|---|---|---|---|---|---|---|")
            for name in args.models:
                model_dir = write_model(name, Path(tmp) / name)
                for case in args.case or list(CASES):
                    p = predict(model_dir, CASES[case])
                    ranks = measure(model_dir, CASES[case])
                    peaks = [r["peak"] for r in ranks]
                    print(f"| {name} | {case} | {p['parameters'] / 1e6:.1f}M | {p['tensor'] / MIB:.0f} MiB | {p['rss'] / MIB:.0f} MiB "
                          f"| {peaks[0] / MIB:.0f} / {peaks[1] / MIB:.0f} MiB | {p['rss'] / peaks[0]:.2f} / {p['rss'] / peaks[1]:.2f} |",
                          flush=True)
    print(f"\n{_cpu() - cpu0:.0f} CPU s, {time.monotonic() - started:.0f} s wall")


if __name__ == "__main__":
    main()
