"""`rlcore plan`'s predicted per-rank peaks against measured ones: the same small configs, for real,
on 2-4 gloo ranks of this machine.

Each case is a role of one run config. The planner simulates one step of it at the layout (fake
tensors, the fake process group: `rlcore.plan.simulate`, every layer, no extrapolation). Then the
same config runs for real: `world` processes on gloo, the role's worker (`ActorWorker`,
`CriticWorker`, `ReferenceWorker`) set up as in a run, from a model folder with weights; each rank
runs a warm-up step (AdamW makes its state), then the measured step, on rows of the config's
maximum length filling two micro-batches per rank. Measured on rank 0, two ways:

- tracked: torch's `MemTracker` over the real tensors (every storage alive, by kind): the same
  accounting as the prediction, but of the real code path (`run_update`, its packing and
  balancing, the policy loss, metrics): the difference is what the simulation leaves out;
- RSS: the process's peak resident memory during the step (`VmHWM`, reset through
  `/proc/self/clear_refs` before it) minus its resident memory before it, plus the tensor bytes
  alive before it (what the prediction counts at the step's start). Independent of torch's
  accounting: it also sees the allocator's overhead, Python objects and gloo's buffers. glibc is
  told to return freed buffers (`MALLOC_MMAP_THRESHOLD_`), as a GPU's caching allocator reuses them.

    ./dev python benchmarks/bench_plan.py              # every case
    ./dev python benchmarks/bench_plan.py actor-fsdp2  # one
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve()
MIB = 2**20

# A ~8M-parameter Llama with grouped-query attention (4 query / 2 key-value heads), untied head.
MODEL = dict(vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False)
PROMPT, RESPONSE = 128, 384  # every row 512 tokens
BASE = ["data.train_files=[unused.parquet]", f"data.max_prompt_length={PROMPT}", f"rollout.max_new_tokens={RESPONSE}",
        "data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "rollout.n=4", "actor.max_tokens_per_micro_batch=2048",
        "actor.recompute_old_log_prob=always", "trainer.device=cpu"]
CASES: dict[str, dict[str, Any]] = {
    "actor-fsdp2": dict(role="actor", world=2, overrides=[]),
    "actor-fsdp2-bf16-ckpt": dict(role="actor", world=2, overrides=["model.dtype=bfloat16", "model.gradient_checkpointing=true"]),
    "actor-sp2": dict(role="actor", world=2, overrides=["actor.ulysses_sequence_parallel_size=2"]),
    "actor-sp2-bf16-ckpt": dict(role="actor", world=2, overrides=["actor.ulysses_sequence_parallel_size=2", "model.dtype=bfloat16",
                                                                  "model.gradient_checkpointing=true"]),
    "actor-fsdp4": dict(role="actor", world=4, overrides=["data.train_batch_size=8", "actor.ppo_mini_batch_size=8"]),
    "actor-tp2": dict(role="actor", world=2, overrides=["actor.layout.data_parallel=1", "actor.layout.tensor_parallel=2"]),
    "actor-fsdp2-tp2": dict(role="actor", world=4, overrides=["actor.layout.data_parallel=2", "actor.layout.tensor_parallel=2"]),
    "critic-fsdp2": dict(role="critic", world=2, overrides=["algorithm.name=ppo", "algorithm.adv_estimator=gae"]),
    "ref-fsdp2": dict(role="ref", world=2, overrides=["actor.use_kl_loss=true"]),
}


def write_model(folder: Path) -> Path:
    """The case's model as a Hugging Face folder with weights (seeded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**MODEL)).save_pretrained(folder)
    return folder


def case_config(case: dict[str, Any], model_dir: Path):
    from rlcore.config import load_config

    world = case["world"]
    ray = ["trainer.backend=ray", f"actor.world_size={world}", f"critic.world_size={world}"]
    return load_config(None, [f"model.path={model_dir}", *BASE, *ray, *case["overrides"]])


def predict(case: dict[str, Any], model_dir: Path) -> dict[str, Any]:
    """The planner's peak for the case (every layer simulated)."""
    from rlcore.plan.models import ModelFacts, read_config
    from rlcore.plan.roles import role_plans
    from rlcore.plan.simulate import Layout, simulate

    config = case_config(case, model_dir)
    plan = next(p for p in role_plans(config) if p.role == case["role"])
    model_config = read_config(model_dir, "model.path")
    layout = config.layout_of(case["role"])
    peak = simulate(plan, model_config, Layout(layout.data_parallel, layout.sequence_parallel, layout.tensor_parallel),
                    uniform=ModelFacts.of(model_config, plan.head, "m").uniform, exact=True)
    return {"total": peak.total, **peak.kinds}


def _batch(config, rows: int, seed: int):
    from rlcore.data.preference import sequence_tensors
    from rlcore.protocol import Batch

    g = torch.Generator().manual_seed(seed)
    vocab = MODEL["vocab_size"]
    prompts = [torch.randint(1, vocab, (PROMPT,), generator=g).tolist() for _ in range(rows)]  # distinct prompts: nothing shared
    responses = [torch.randint(1, vocab, (RESPONSE,), generator=g).tolist() for _ in range(rows)]
    t = sequence_tensors(prompts, responses, pad_id=0)
    n, r = t["responses"].shape
    t.update(advantages=torch.randn(n, r, generator=g), old_log_probs=-3.0 + 0.1 * torch.randn(n, r, generator=g),
             ref_log_probs=-3.0 + 0.1 * torch.randn(n, r, generator=g), values=torch.randn(n, r, generator=g),
             returns=torch.randn(n, r, generator=g))
    return Batch(tensors=t)


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _peak_tracker():
    """Torch's `MemTracker`, for the overall peak only: its per-module statistics are dropped when
    a top-level module runs its forward again in one step (the next micro-batch; MemTracker
    refuses that otherwise), and frozen parameters (the reference's) get no gradient hooks (it
    would hook them and fail). The peak and its kinds are kept."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class PeakTracker(MemTracker):
        def _pre_fw_hook(self, module, inputs):  # type: ignore[no-untyped-def]
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                if set(self._mod_tracker.parents) - {self._mod_tracker.get_known_fqn(module)} == {"Global"}:
                    self.reset_mod_stats()
            super()._pre_fw_hook(module, inputs)

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):  # type: ignore[no-untyped-def]
            trainable = all(p.requires_grad for p in module.parameters())
            return super()._track_module_params_and_buffers(module, install_grad_hooks=install_grad_hooks and trainable)

    return PeakTracker()


def _rank_main(args: argparse.Namespace) -> None:
    """One gloo rank of a case: set up the worker, warm up, measure one step (rank 0 writes it)."""
    import gc

    import torch.distributed as dist

    from rlcore.config import role_spec
    from rlcore.workers.actor import ActorWorker, ReferenceWorker
    from rlcore.workers.critic import CriticWorker

    torch.set_num_threads(1)
    case = CASES[args.case]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank, world_size=case["world"])
    try:
        config = case_config(case, Path(args.model))
        role = case["role"]
        worker = {"actor": ActorWorker, "critic": CriticWorker, "ref": ReferenceWorker}[role](role_spec(config, role), args.rank, case["world"])
        worker.setup()
        shard = worker.ranks_per_shard
        dp = case["world"] // shard
        rows = config.data.train_batch_size * config.rollout.n // dp
        batch = _batch(config, rows, seed=args.rank // shard)  # the ranks of a sequence/tensor-parallel group hold the same rows
        step = {"actor": lambda: worker.update_actor(batch, config.rollout.n), "critic": lambda: worker.update_critic(batch, config.rollout.n),
                "ref": lambda: worker.compute_ref_log_prob(batch)}[role]
        step()
        gc.collect()
        tracker = _peak_tracker()
        tracker.track_external(worker.model, getattr(worker, "optimizer", None))
        before = sum(v["Total"] for v in tracker.get_tracker_snapshot("current").values())
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        rss0 = _status("VmRSS")
        started = time.process_time()
        with tracker:
            step()
        cpu = time.process_time() - started
        hwm = _status("VmHWM")
        if args.rank == 0:
            peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
            tracked = {getattr(k, "value", k): int(v) for k, v in peak.items()}
            Path(args.out).write_text(json.dumps({"tracked": tracked, "rss": hwm - rss0 + before, "before": before,
                                                  "cpu_s": cpu}))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(name: str, model_dir: Path, timeout: float = 600) -> dict[str, Any]:
    """Run case `name` on its gloo ranks (fresh processes of this script); rank 0's measurement."""
    case = CASES[name]
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20), "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen([sys.executable, str(HERE), "--rank-of", name, "--rank", str(r), "--port", str(port),
                                   "--model", str(model_dir), "--out", str(out)], env=env) for r in range(case["world"])]
        try:
            codes = [p.wait(timeout=timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(codes):
            raise RuntimeError(f"{name}: a rank exited with {codes}")
        return json.loads(out.read_text())


KIND_OF = {"Parameter": "params", "Buffer": "params", "Gradient": "grads", "Optstate": "optimizer", "Activation": "activations",
           "Temp": "activations", "Other": "other"}


def compare(name: str, model_dir: Path) -> dict[str, Any]:
    """Predicted and measured peaks of case `name` (bytes), their ratios, and the measured kinds."""
    predicted = predict(CASES[name], model_dir)
    measured = measure(name, model_dir)
    kinds: dict[str, int] = {}
    for key, value in measured["tracked"].items():
        if key != "Total":
            kinds[KIND_OF.get(key, "other")] = kinds.get(KIND_OF.get(key, "other"), 0) + value
    tracked = measured["tracked"]["Total"]
    return {"case": name, "predicted": predicted["total"], "tracked": tracked, "rss": measured["rss"],
            "vs_tracked": predicted["total"] / tracked, "vs_rss": predicted["total"] / measured["rss"],
            "predicted_kinds": {k: v for k, v in predicted.items() if k != "total"}, "tracked_kinds": kinds,
            "cpu_s": measured["cpu_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="*", default=list(CASES))
    parser.add_argument("--rank-of")
    parser.add_argument("--rank", type=int)
    parser.add_argument("--port", type=int)
    parser.add_argument("--model")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.rank_of:
        args.case = args.rank_of
        _rank_main(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(Path(tmp) / "model")
        print(f"{'case':<24}{'predicted':>11}{'tracked':>11}{'RSS':>11}{'pred/tracked':>14}{'pred/RSS':>10}  predicted vs tracked by kind (MiB)")
        for name in args.cases:
            r = compare(name, model_dir)
            kinds = ", ".join(f"{k} {r['predicted_kinds'].get(k, 0) / MIB:.1f}/{r['tracked_kinds'].get(k, 0) / MIB:.1f}"
                              for k in ("params", "grads", "grads in flight", "optimizer", "activations", "gathered", "other")
                              if r["predicted_kinds"].get(k) or r["tracked_kinds"].get(k))
            print(f"{name:<24}{r['predicted'] / MIB:>10.1f}M{r['tracked'] / MIB:>10.1f}M{r['rss'] / MIB:>10.1f}M"
                  f"{r['vs_tracked']:>14.3f}{r['vs_rss']:>10.3f}  {kinds}", flush=True)


if __name__ == "__main__":
    main()
