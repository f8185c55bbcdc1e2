"""Training memory of the actor: full fine-tuning vs LoRA, on a ~20M-parameter Llama.

    ./dev python benchmarks/bench_lora_memory.py [--rank 8] [--rounds 2] [--steps 3] [--max-tokens 256]

The model (hidden 512, 6 layers, intermediate 1536, 8 heads, tied embeddings; the example's
tokenizer) is built here from a config and saved. Each variant runs in a FRESH PYTHON PROCESS (so
one variant's freed-but-cached memory cannot hide in the other's numbers), `--rounds` times,
alternating: a real `ActorWorker` (in-process backend, float32, CPU) loads the model (LoRA:
rank `--rank`, alpha 2 x rank, all-linear) and takes `--steps` `update_actor` steps on one
synthetic batch (32 rows, prompts 64 + responses 64 tokens, micro-batches of `--max-tokens`
tokens: 256 keeps activations small beside the weights' state, as on a real LLM, where weights,
gradients and AdamW state take tens of GB and one micro-batch's activations far less).

How memory is measured, in the child:
- optimizer state: the bytes of every tensor in `optimizer.state` after the steps (AdamW's exp_avg,
  exp_avg_sq, step), exact;
- gradients: the bytes of every `.grad` after the last backward, exact;
- peak training memory: the process's peak resident set (`getrusage(RUSAGE_SELF).ru_maxrss`) over
  the whole run, and beside it the peak minus the resident set right after `setup()` (model loaded,
  nothing trained yet): what training added at its peak (gradients, optimizer state, activations,
  allocator caching). RSS counts what the CPU allocator holds, so it is an upper bound of what
  torch had allocated; on CUDA the child reports `torch.cuda.max_memory_allocated()` instead.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def child(args: argparse.Namespace) -> None:
    from rlcore.config import load_config, role_spec
    from rlcore.data.preference import sequence_tensors
    from rlcore.protocol import Batch
    from rlcore.workers.actor import ActorWorker

    overrides = [
        f"model.path={args.model}", "data.train_files=[unused.parquet]", "trainer.device=auto", "data.train_batch_size=1",
        "actor.ppo_mini_batch_size=1", "rollout.n=32", f"actor.max_tokens_per_micro_batch={args.max_tokens}", "actor.optim.lr=1e-4",
    ]
    if args.variant == "lora":
        overrides += [f"actor.lora.rank={args.rank}", f"actor.lora.alpha={2 * args.rank}"]
    worker = ActorWorker(role_spec(load_config(None, overrides), "actor"))
    worker.setup()
    cuda = worker.device.type == "cuda"
    after_setup = rss_bytes()
    vocab = int(worker.model.get_output_embeddings().weight.shape[0])
    g = torch.Generator().manual_seed(0)
    t = sequence_tensors([torch.randint(3, vocab, (64,), generator=g).tolist() for _ in range(32)],
                         [torch.randint(3, vocab, (64,), generator=g).tolist() for _ in range(32)], pad_id=0)
    t["advantages"] = torch.randn(32, 1, generator=g).expand(32, 64).contiguous()
    batch = Batch(tensors=t)
    batch = batch.union(worker.compute_log_prob(batch).select("old_log_probs"))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.steps):
        metrics = worker.update_actor(batch, 32)
    opt = worker.optimizer
    state_bytes = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in worker.model.parameters() if p.grad is not None)
    param_bytes = sum(p.numel() * p.element_size() for p in worker.model.parameters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({
        "trainable": metrics["actor/trainable_params"], "total": metrics["actor/total_params"], "param_bytes": param_bytes,
        "grad_bytes": grad_bytes, "optimizer_bytes": state_bytes, "rss_after_setup": after_setup, "peak_rss": peak,
        "cuda_peak": torch.cuda.max_memory_allocated() if cuda else None,
    }))


def build_model(folder: Path) -> Path:
    from rlcore.example.build import save_untrained_model
    from rlcore.example.model import TinyModelSpec

    spec = TinyModelSpec(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8, head_dim=64,
                         max_position_embeddings=256)
    return save_untrained_model(folder, seed=0, spec=spec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per micro-batch")
    p.add_argument("--child", dest="variant", choices=["full", "lora"])
    p.add_argument("--model")
    args = p.parse_args()
    if args.variant:
        return child(args)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "model")
        runs: dict[str, list[dict]] = {"full": [], "lora": []}
        for _ in range(args.rounds):
            for variant in runs:
                out = subprocess.run([sys.executable, __file__, "--child", variant, "--model", str(model), "--rank", str(args.rank),
                                      "--steps", str(args.steps), "--max-tokens", str(args.max_tokens)], capture_output=True, text=True, check=True)
                runs[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
    mib = 2**20
    rows = {}
    print(f"\nactor training memory, {args.steps} update_actor steps, micro-batches of {args.max_tokens} tokens, fresh process "
          f"per run, {args.rounds} runs each (median)")
    print(f"{'variant':<10}{'trainable':>12}{'total':>12}{'params MiB':>12}{'grads MiB':>11}{'optim MiB':>11}"
          f"{'peak RSS MiB':>14}{'peak-setup MiB':>16}")
    for variant, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if rs[0][k] is not None}
        med["train_peak"] = statistics.median(r["peak_rss"] - r["rss_after_setup"] for r in rs)
        rows[variant] = med
        name = variant if variant == "full" else f"lora r={args.rank}"
        print(f"{name:<10}{int(med['trainable']):>12,}{int(med['total']):>12,}{med['param_bytes'] / mib:>12.1f}"
              f"{med['grad_bytes'] / mib:>11.2f}{med['optimizer_bytes'] / mib:>11.2f}{med['peak_rss'] / mib:>14.0f}"
              f"{med['train_peak'] / mib:>16.0f}" + (f"  cuda peak {med['cuda_peak'] / mib:.0f} MiB" if "cuda_peak" in med else ""))
    full, lora = rows["full"], rows["lora"]
    print(f"\nfull / LoRA: optimizer state {full['optimizer_bytes'] / lora['optimizer_bytes']:.1f}x, gradients "
          f"{full['grad_bytes'] / lora['grad_bytes']:.1f}x, peak RSS {full['peak_rss'] / lora['peak_rss']:.2f}x, "
          f"training's addition to the peak {full['train_peak'] / max(lora['train_peak'], 1):.2f}x")


if __name__ == "__main__":
    main()
