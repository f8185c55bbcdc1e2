"""Where the actor update's time goes on CPU, and what each efficiency switch changes.

    ./dev python benchmarks/bench_update.py [--variants fp32,bf16,bf16-cast-once] [--rounds 3]
        [--prompts 8] [--n 4] [--micro-tokens 2048] [--profile fp32,bf16] [--shape small|tiny]

The timed call is the real `ActorWorker.update_actor`: in-process, one optimizer step (as
on-policy GRPO takes it) over `--prompts` prompts x `--n` samples, prompts of 48-128 tokens and
responses of 32-256, packed into micro-batches of at most `--micro-tokens` tokens, each prompt held
once per micro-batch as the default config does. The model is a Llama with grouped-query attention
built here from a config (`--shape small`: hidden 256, 4 layers, 8/4 heads, vocab 4096, 4.0M
parameters; `tiny`: the shape of the built-in example). Variants are config overrides of the same
worker, run interleaved `--rounds` times each (a variant named twice runs as two workers: what the
machine's noise alone does); the table shows medians, wall and CPU seconds (this process, one
torch thread: the machine may be shared), the model FLOP/s (`rlcore.flops`: 6 x the matmul weights
x tokens, the head on response tokens, causal attention pairs) and the CPU-second rate over this
machine's matmul rate measured in the same run (float32 and bf16 GEMMs of the update's MLP shape,
[micro-tokens x hidden] @ [hidden x intermediate]; best of 10 in CPU seconds of the thread, before
and after the timed updates). Compiled variants start from an empty inductor cache (a temporary
TORCHINDUCTOR_CACHE_DIR unless one is set), so their first update shows a cold compile.

Variants (`--variants`, comma-separated):
  fp32              float32 weights and compute (the CPU default)
  bf16-default      actor.mixed_precision=bf16 with every other key at its default (runs on older trees too)
  bf16              actor.mixed_precision=bf16, compute copies cast per micro-batch (actor.cast_once=false)
  bf16-cast-once    bf16, compute copies cast once per optimizer step (actor.cast_once=true)
  fp32-compile      fp32 with each decoder layer under torch.compile (actor.compile=true)
  bf16-cast-once-compile

The profile (`--profile`, variants to profile; `none` to skip): one more update of each under
torch.profiler, every operator's self CPU time put in the part of the model that ran it. Forward
operators belong to the innermost part they ran in (the attention projections q/k/v/o, the
attention kernel, RoPE, the MLP, the RMSNorms, the embedding, the LM head's log-prob, the policy
loss, `LocalPolicy`'s casts to bf16 compute copies and its float32 gradient accumulation into the
masters, the optimizer step, ...), marked by wrapping those modules' forwards and functions in
`record_function` ranges; a backward operator belongs to the part whose forward operator made its
autograd node (matched by the profiler's sequence numbers). Shares are of the profiled update's
operator time (the profiler's own overhead inflates small operators).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_CACHE = tempfile.TemporaryDirectory(prefix="bench_update_inductor_")  # a cold compile: no cached graphs
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", _CACHE.name)

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from rlcore.config import load_config, role_spec  # noqa: E402
from rlcore.data.preference import sequence_tensors  # noqa: E402
from rlcore.flops import ModelFlops, causal_pairs  # noqa: E402
from rlcore.protocol import Batch  # noqa: E402
from rlcore.workers.actor import ActorWorker  # noqa: E402

SHAPES = {
    "small": dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4),
    "tiny": dict(vocab_size=112, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=8),
}

VARIANTS: dict[str, list[str]] = {
    "fp32": ["actor.mixed_precision=none"],
    "bf16-default": ["actor.mixed_precision=bf16"],
    "bf16": ["actor.mixed_precision=bf16", "actor.cast_once=false"],
    "bf16-cast-once": ["actor.mixed_precision=bf16", "actor.cast_once=true"],
    "fp32-compile": ["actor.mixed_precision=none", "actor.compile=true"],
    "bf16-cast-once-compile": ["actor.mixed_precision=bf16", "actor.cast_once=true", "actor.compile=true"],
}


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    c0, w0 = cpu_seconds(), time.perf_counter()
    out = fn()
    return time.perf_counter() - w0, cpu_seconds() - c0, out


def grpo_batch(prompts: int, n: int, vocab: int, seed: int) -> Batch:
    """`prompts` prompts of 48-128 tokens, each with `n` responses of 32-256 tokens; random ids."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = [torch.randint(3, vocab, (int(torch.randint(48, 129, (1,), generator=g)),), generator=g).tolist()
                  for _ in range(prompts)]
    rows_p, rows_r = [], []
    for p in prompt_ids:
        for _ in range(n):
            rows_p.append(p)
            rows_r.append(torch.randint(3, vocab, (int(torch.randint(32, 257, (1,), generator=g)),), generator=g).tolist())
    t = sequence_tensors(rows_p, rows_r, pad_id=0)
    rows, r = t["responses"].shape
    t["advantages"] = torch.randn(rows, 1, generator=g).expand(rows, r).contiguous()
    t["old_log_probs"] = (-torch.log(torch.tensor(float(vocab))) + 0.05 * torch.randn(rows, r, generator=g)) * t["response_mask"]
    return Batch(tensors=t)  # `n` consecutive rows per prompt


def actor(model_dir: Path, overrides: list[str], prompts: int, n: int, micro_tokens: int) -> ActorWorker:
    """An in-process actor whose update is one optimizer step over `prompts` x `n` rows."""
    cfg = load_config(None, [
        f"model.path={model_dir}", "data.train_files=[unused.parquet]", "trainer.device=cpu",
        f"data.train_batch_size={prompts}", f"actor.ppo_mini_batch_size={prompts}", f"rollout.n={n}", "actor.ppo_epochs=1",
        f"actor.max_tokens_per_micro_batch={micro_tokens}", "actor.optim.lr=1e-6", *overrides,
    ])
    worker = ActorWorker(role_spec(cfg, "actor"))
    worker.setup()
    return worker


def matmul_rate(m: int, k: int, n: int, dtype: torch.dtype, repeats: int = 10) -> float:
    """FLOP/s of an [m, k] @ [k, n] GEMM in `dtype` on this CPU per CPU second of this thread (what a
    shared machine does not stretch), best of `repeats` after a warm-up."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=g).to(dtype), torch.randn(k, n, generator=g).to(dtype)
    a @ b
    best = math.inf
    for _ in range(repeats):
        t0 = time.thread_time()
        a @ b
        best = min(best, time.thread_time() - t0)
    return 2.0 * m * k * n / best


# ----------------------------------------------------------------------------- the profile

PART = "part::"  # prefix of the record_function ranges that mark a part of the model


def tagged(part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(PART + part):
            return fn(*args, **kwargs)

    return run


@contextmanager
def parts_marked(model: torch.nn.Module) -> Iterator[None]:
    """Wrap the model's modules and rlcore's functions in `part::` ranges for the profile; undone after."""
    from transformers import AttentionInterface

    from rlcore.workers import attention, forward, fsdp, loops, packed

    undo: list[Callable[[], None]] = []

    def patch(owner: Any, name: str, part: str) -> None:
        old = getattr(owner, name)
        if isinstance(owner, torch.nn.Module) and "forward" not in vars(owner):
            undo.append(lambda: delattr(owner, name))
        else:
            undo.append(lambda: setattr(owner, name, old))
        setattr(owner, name, tagged(part, old))

    for module in model.modules():
        kind = type(module).__name__
        if kind.endswith("RMSNorm"):
            patch(module, "forward", "RMSNorm")
        elif kind.endswith("MLP"):
            patch(module, "forward", "MLP")
        elif kind.endswith("RotaryEmbedding"):
            patch(module, "forward", "RoPE")
        elif kind.endswith("Attention"):
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                patch(getattr(module, proj), "forward", "attention q/k/v/o")
        elif isinstance(module, torch.nn.Embedding):
            patch(module, "forward", "embedding")
    modeling = sys.modules[type(model).__module__] if type(model).__module__ in sys.modules else None
    for mod in {sys.modules[type(m).__module__] for m in model.modules()} | ({modeling} - {None}):
        if hasattr(mod, "apply_rotary_pos_emb"):
            patch(mod, "apply_rotary_pos_emb", "RoPE")
    AttentionInterface.register(attention.VARLEN, tagged("attention kernel", attention._attention))
    undo.append(lambda: AttentionInterface.register(attention.VARLEN, attention._attention))
    patch(forward, "fused_token_logprobs", "LM head log-prob")
    patch(forward, "_packing", "packing")
    patch(packed.PackedRows, "scatter", "packing")
    patch(fsdp.LocalPolicy, "_copy_of", "casts to compute copies")
    patch(fsdp, "_grad_to_master", "grads to fp32 masters")
    patch(loops, "clip_grad_norm", "grad clip")
    patch(loops, "weight_health", "weight health")
    try:
        yield
    finally:
        for fn in reversed(undo):
            fn()


def part_of_range(name: str) -> str | None:
    """The part a profiler range names, or None for an operator."""
    if name.startswith(PART):
        return name[len(PART):]
    if name.startswith("Optimizer.step"):
        return "optimizer step"
    if name.startswith("Optimizer.zero_grad"):
        return "optimizer zero_grad"
    if name.startswith("FSDP::"):
        return "FSDP2"
    return None


BACKWARD = "autograd::engine::evaluate_function: "


def attribute(events: list[Any]) -> dict[str, float]:
    """Self CPU seconds per part (module docstring): forward operators by their innermost range,
    backward ones by the part of the forward operator with their autograd node's sequence number."""
    def enclosing(e: Any) -> tuple[str | None, Any]:
        """(the innermost range's part, or None; the backward node event met first, or None)."""
        while e is not None:
            part = part_of_range(e.name)
            if part is not None:
                return part, None
            if e.name.startswith(BACKWARD):
                return None, e
            e = e.cpu_parent
        return None, None

    forward_part: dict[int, str] = {}
    for e in events:
        if e.sequence_nr >= 0 and not e.name.startswith(BACKWARD):
            part, node = enclosing(e)
            if part is not None and node is None:
                forward_part.setdefault(e.sequence_nr, part)
    seconds: dict[str, float] = defaultdict(float)
    for e in events:
        part, node = enclosing(e)
        if part is None and node is not None:
            part = forward_part.get(node.sequence_nr)
        seconds[part or "other (autograd, glue)"] += e.self_cpu_time_total / 1e6
    return seconds


def profile_update(worker: ActorWorker, batch: Batch, n: int) -> tuple[dict[str, float], float]:
    """Seconds per part of one update (`n` responses per prompt) under the profiler, and that update's wall seconds."""
    from torch.profiler import ProfilerActivity, profile

    loss = worker.policy_loss
    worker.policy_loss = tagged("loss", loss)
    try:
        with parts_marked(worker.model), profile(activities=[ProfilerActivity.CPU]) as prof:
            wall, _, _ = timed(lambda: worker.update_actor(batch, n))
    finally:
        worker.policy_loss = loss
    return attribute(list(prof.events())), wall


# ----------------------------------------------------------------------------- main

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default="fp32,bf16,bf16-cast-once")
    parser.add_argument("--profile", default="fp32,bf16", help="variants to profile, or none")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--micro-tokens", type=int, default=2048)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    kinds = [v for v in args.variants.split(",") if v]
    unknown = [v for v in kinds if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    # a variant named twice runs as two workers (an A/A check of what the order and the machine do)
    names = [kind if kinds.count(kind) == 1 else f"{kind}#{kinds[:i + 1].count(kind)}" for i, kind in enumerate(kinds)]
    profiled = [] if args.profile == "none" else [v for v in args.profile.split(",") if v]
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()

    shape = SHAPES[args.shape]
    batch = grpo_batch(args.prompts, args.n, shape["vocab_size"], args.seed)
    lens = batch["attention_mask"].sum(-1).tolist()
    tokens, head_tokens = sum(lens), float(batch["response_mask"].sum())
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=1024, tie_word_embeddings=True, pad_token_id=0, **shape))
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(tmp)
        del model
        flops = ModelFlops.from_model_dir(tmp).training(tokens, head_tokens, causal_pairs(lens))
        mlp = (args.micro_tokens, shape["hidden_size"], shape["intermediate_size"])
        before = {"fp32": matmul_rate(*mlp, torch.float32), "bf16": matmul_rate(*mlp, torch.bfloat16)}
        print(f"model: Llama {args.shape}, {params / 1e6:.2f}M parameters ({shape}), float32 masters, "
              f"{torch.get_num_threads()} torch thread; torch {torch.__version__}")
        print(f"batch: {args.prompts} prompts x n={args.n}: {len(lens)} rows, {tokens:,} tokens ({int(head_tokens):,} response), "
              f"micro-batches <= {args.micro_tokens} tokens; {flops / 1e9:.2f} model GFLOP per update")

        workers: dict[str, ActorWorker] = {}
        first: dict[str, tuple[float, float]] = {}
        for name, kind in zip(names, kinds):
            workers[name] = actor(Path(tmp), VARIANTS[kind], args.prompts, args.n, args.micro_tokens)
            wall, cpu, _ = timed(lambda w=workers[name]: w.update_actor(batch, args.n))  # warm-up; compiles
            first[name] = (wall, cpu)
        runs: dict[str, list[tuple[float, float]]] = {k: [] for k in names}
        for _ in range(args.rounds):
            for name, w in workers.items():
                wall, cpu, _ = timed(lambda w=w: w.update_actor(batch, args.n))
                runs[name].append((wall, cpu))
        # the machine's rate: the better of before and after the rounds (a shared machine has slow spells)
        rates = {k: max(v, matmul_rate(*mlp, torch.float32 if k == "fp32" else torch.bfloat16)) for k, v in before.items()}
        print(f"matmul rate, [{mlp[0]} x {mlp[1]}] @ [{mlp[1]} x {mlp[2]}], this run (best of before and after the "
              f"updates): float32 {rates['fp32'] / 1e9:.1f} GFLOP/s, bf16 {rates['bf16'] / 1e9:.1f} GFLOP/s")
        print(f"\nActorWorker.update_actor, {args.rounds} rounds interleaved, medians (first update apart: warm-up, compile)")
        print("  GFLOP/s: model FLOPs over wall seconds, and over CPU seconds; 'of mm': the CPU-second rate over the "
              "matmul rate above")
        print(f"  {'variant':24s} {'first wall':>10s} {'first cpu':>9s} {'wall s':>7s} {'cpu s':>7s} {'tok/s':>7s} "
              f"{'GFLOP/s':>8s} {'(cpu)':>7s} {'of fp32 mm':>10s} {'of bf16 mm':>10s} {'wall vs':>8s} {'cpu vs':>7s}")
        base = [statistics.median(r[i] for r in runs[names[0]]) for i in (0, 1)]
        for name, rs in runs.items():
            wall, cpu = statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)
            print(f"  {name:24s} {first[name][0]:10.2f} {first[name][1]:9.2f} {wall:7.2f} {cpu:7.2f} {tokens / wall:7,.0f} "
                  f"{flops / wall / 1e9:8.2f} {flops / cpu / 1e9:7.2f} {flops / cpu / rates['fp32']:10.1%} "
                  f"{flops / cpu / rates['bf16']:10.1%} {base[0] / wall:7.2f}x {base[1] / cpu:6.2f}x")
        print(f"  ('wall vs', 'cpu vs': {names[0]}'s seconds over the variant's)")

        for kind in profiled:
            name = next((n for n, k in zip(names, kinds) if k == kind), None)
            if name is None:
                continue
            seconds, wall = profile_update(workers[name], batch, args.n)
            total = sum(seconds.values())
            print(f"\nprofile of {name}: one update, {wall:.2f} s wall under the profiler, {total:.2f} s of operator self time")
            for part in sorted(seconds, key=seconds.get, reverse=True):  # type: ignore[arg-type]
                print(f"  {part:24s} {seconds[part]:7.3f} s {seconds[part] / total:6.1%}")


if __name__ == "__main__":
    main()
