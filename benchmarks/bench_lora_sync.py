"""Actor -> rollout weight sync: the full model vs LoRA (merged adapted layers, or the adapter).

    ./dev python benchmarks/bench_lora_sync.py [--engines hf,vllm] [--rounds 3] [--rank 8]

What is timed is `WorkerGroups.sync_weights`, the call every step makes, on in-process worker
groups built from a config as `rlcore train` builds them (actor, rollout, reward): with
`rollout.lora_sync` unset and no LoRA, every tensor of the model goes bucket by bucket; with
`actor.lora` and `lora_sync=merged`, only the tensors of the layers the adapter changes, merged
(W + s B A, from the gathered float32 masters; all-linear, or q_proj and v_proj only, whose
attention layers are then sent whole: q, k, v and o reload together); with `lora_sync=adapter` (vLLM), the adapter's
own tensors, which vLLM loads by request (`LoRARequest`) and applies beside the base weights.

The model: a ~20M-parameter Llama (hidden 512, 6 layers, intermediate 1536, tied embeddings, the
example's tokenizer) built here from a config; the adapter: rank `--rank`, alpha 2 x rank,
all-linear, its B drawn at random (a trained-looking adapter). Bytes are those of the tensors one
sync sends (counted from the same buckets the sync gathers). Each variant builds its groups once
(vLLM allows one engine per process: the variants run one after another, each its `--rounds`
syncs after one warm-up sync); the table shows medians, and CPU seconds (this process, user +
system) beside wall seconds, because the machine may be shared. With `--generate`, each variant's
engine also decodes 32 prompts x 4 samples x 32 tokens after its syncs (tokens/s): what the
adapter costs at generation.

On a real model the attention and MLP layers are nearly all of it: an all-linear merged sync then
sends nearly the full model (what changes is nearly all of it), while the adapter is ~0.1-1%.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from rlcore.config import load_config
from rlcore.protocol import Batch
from rlcore.rollout import SamplingParams
from rlcore.trainer.groups import WorkerGroups
from rlcore.trainer.roles import build_worker_groups, placement


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def build_model(folder: Path) -> Path:
    from rlcore.example.build import save_untrained_model
    from rlcore.example.model import TinyModelSpec

    spec = TinyModelSpec(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8, head_dim=64,
                         max_position_embeddings=256)
    return save_untrained_model(folder, seed=0, spec=spec)


# variant -> (rollout.lora_sync, actor.lora.target_modules); "full": no LoRA
VARIANTS = {"full": (None, None), "merged": ("merged", "all-linear"), "merged q,v": ("merged", "[q_proj,v_proj]"),
            "adapter": ("adapter", "all-linear")}


def groups_for(model: Path, tmp: Path, engine: str, variant: str, rank: int) -> WorkerGroups:
    overrides = [f"model.path={model}", f"data.train_files=[{tmp / 'unused.parquet'}]", f"trainer.output_dir={tmp / 'run'}",
                 "trainer.device=cpu", f"rollout.backend={engine}", "reward.num_workers=0", "algorithm.use_reference=false",
                 "rollout.vllm.kv_cache_gib=0.25", "rollout.vllm.max_model_len=256"]
    sync, targets = VARIANTS[variant]
    if sync is not None:
        overrides += [f"actor.lora.rank={rank}", f"actor.lora.alpha={2 * rank}", f"rollout.lora_sync={sync}",
                      f"actor.lora.target_modules={targets}"]
    groups = build_worker_groups(placement(load_config(None, overrides)))
    actor = groups.actor.workers[0]
    if variant != "full":
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in actor.model.named_parameters():
                if ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return groups


def sent_bytes(groups: WorkerGroups) -> int:
    actor = groups.actor.workers[0]
    if groups.weight_sync == "adapter":
        tensors, _ = actor.adapter_for_rollout()
        return sum(t.numel() * t.element_size() for t in tensors.values())
    return sum(t.numel() * t.element_size() for names in actor.weight_bucket_plan() for _, t in actor.gather_weight_bucket(names))


def decode_speed(groups: WorkerGroups, vocab: int, reps: int = 3) -> float:
    """Generated tokens per second, median of `reps` generations of the same prompts."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, vocab, (32, 16), generator=g)
    prompts = Batch(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                    meta={"uid": np.array([str(i) for i in range(32)], dtype=object)})
    sampling = SamplingParams(n=4, max_new_tokens=32, seed=0, temperature=1.0)
    speeds = []
    for _ in range(reps):
        start = time.perf_counter()
        out = groups.rollout.generate_sequences(prompts, sampling)
        speeds.append(float(out["response_mask"].sum()) / (time.perf_counter() - start))
    return statistics.median(speeds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", default="hf,vllm")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--generate", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model = build_model(tmp / "model")
        for engine in args.engines.split(","):
            variants = ["full", "merged", "merged q,v"] + (["adapter"] if engine == "vllm" else [])
            for variant in variants:
                groups = groups_for(model, tmp, engine, variant, args.rank)
                try:
                    actor = groups.actor.workers[0]
                    groups.sync_weights()  # warm-up (first-call allocations)
                    times = []
                    for _ in range(args.rounds):
                        c0, w0 = cpu_seconds(), time.perf_counter()
                        groups.sync_weights()
                        times.append((time.perf_counter() - w0, cpu_seconds() - c0))
                    vocab = int(actor.model.get_output_embeddings().weight.shape[0])
                    rows.append({"engine": engine, "variant": variant, "bytes": sent_bytes(groups),
                                 "wall": statistics.median(t[0] for t in times), "cpu": statistics.median(t[1] for t in times),
                                 "params": actor.param_counts[1], "tok_s": decode_speed(groups, vocab) if args.generate else None})
                finally:
                    groups.close()
    mib = 2**20
    print(f"\nweight sync per step, ~{rows[0]['params'] / 1e6:.1f}M-param Llama, LoRA rank {args.rank} all-linear, "
          f"median of {args.rounds}")
    print(f"{'engine':<7}{'sync':<12}{'MiB sent':>10}{'wall ms':>10}{'CPU ms':>10}{'bytes vs full':>15}{'wall vs full':>14}"
          + (f"{'decode tok/s':>14}" if args.generate else ""))
    for r in rows:
        full = next(f for f in rows if f["engine"] == r["engine"] and f["variant"] == "full")
        print(f"{r['engine']:<7}{r['variant']:<12}{r['bytes'] / mib:>10.2f}{r['wall'] * 1e3:>10.1f}{r['cpu'] * 1e3:>10.1f}"
              f"{r['bytes'] / full['bytes']:>14.3f}x{r['wall'] / full['wall']:>13.3f}x"
              + (f"{r['tok_s']:>14,.0f}" if args.generate else ""))


if __name__ == "__main__":
    main()
