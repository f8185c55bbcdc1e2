"""Rollout throughput, vLLM vs HF, on the same tiny model and prompts, plus weight-sync time.

    ./dev python benchmarks/bench_rollout.py [--prompts 32 --n 8 --new-tokens 64 --repeats 3]
        [--dtype bfloat16] [--threads 2] [--block-size 128]

The model is a random Llama (vocab 2048, hidden 256, 4 layers, tied embeddings) saved to a temp
folder; no EOS is configured, so every row generates exactly `--new-tokens` tokens and both
backends do the same work. Tokens/s counts response tokens (prompts x n x new tokens) over the
wall time of `generate`, best of `--repeats` rounds after one warm-up call; each round runs every
backend once, so a slow spell of this shared machine hits them alike. The weight update sends the
full state dict (as the actor's sync does) and times it until the engine has loaded it.
vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), hence the __main__ guard.
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def make_model(path: Path) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
        tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return model


def prompt_batch(num: int, seed: int = 0):
    from rlcore.protocol import Batch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 49, (num,), generator=g).tolist()
    width = max(lengths)
    ids = torch.zeros(num, width, dtype=torch.long)
    mask = torch.zeros(num, width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(3, 2048, (n,), generator=g)
        mask[i, width - n:] = 1
    return Batch(tensors={"input_ids": ids, "attention_mask": mask},
                 meta={"uid": np.array([str(i) for i in range(num)], dtype=object)}, info={})


def warm_up(engine) -> None:
    from rlcore.rollout import SamplingParams

    engine.generate(prompt_batch(2), SamplingParams(n=2, max_new_tokens=4))


def time_generate(engine, batch, params) -> tuple[float, int]:
    """(seconds, response tokens) of one `engine.generate(batch, params)`."""
    t0 = time.perf_counter()
    out = engine.generate(batch, params)
    return time.perf_counter() - t0, int(out["response_mask"].sum())


@torch.inference_mode()
def time_hf_generate(model, batch, params) -> tuple[float, int]:
    """transformers' own `generate` on the same rows (n copies of each prompt)."""
    ids = batch["input_ids"].repeat_interleave(params.n, dim=0)
    mask = batch["attention_mask"].repeat_interleave(params.n, dim=0)
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=params.temperature,
                         top_k=0, max_new_tokens=params.max_new_tokens, min_new_tokens=params.max_new_tokens,
                         pad_token_id=0)
    return time.perf_counter() - t0, int(ids.shape[0] * (out.shape[1] - ids.shape[1]))


def time_update(engine, model) -> float:
    params = list(model.named_parameters())
    t0 = time.perf_counter()
    engine.update_weights(params)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds; each round runs every backend once")
    ap.add_argument("--dtype", default="float32", help="of both engines (bfloat16 uses AMX where the CPU has it)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of both engines (default: as set, e.g. OMP_NUM_THREADS)")
    ap.add_argument("--block-size", type=int, default=None, help="vLLM KV block size (default: the backend's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from rlcore.rollout import HFRolloutEngine, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tiny"
        model = make_model(path)
        batch = prompt_batch(args.prompts)
        params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens, seed=0)
        print(f"tiny Llama {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params; "
              f"{args.prompts} prompts x n={args.n} x {args.new_tokens} new tokens; {args.dtype}; "
              f"torch threads {torch.get_num_threads()}")

        hf = HFRolloutEngine.from_pretrained(str(path), dtype=args.dtype, eos_token_ids=[], pad_token_id=0)
        runs = {
            "hf": lambda: time_generate(hf, batch, params),
            # the baseline FIELD_NOTES compared vLLM with
            "hf-generate": lambda: time_hf_generate(hf.model, batch, params),
        }
        updates = {"hf": lambda: time_update(hf, model)}
        engine = None
        if importlib.util.find_spec("vllm") is None:
            print("vllm is not installed: hf only")
        else:
            from rlcore.rollout.vllm import VLLMRolloutEngine

            t0 = time.perf_counter()
            engine = VLLMRolloutEngine.from_pretrained(
                str(path), dtype=args.dtype, eos_token_ids=[], pad_token_id=0, max_model_len=512, kv_cache_gib=1.0,
                seed=0, max_num_seqs=args.prompts * args.n, max_num_batched_tokens=8192, block_size=args.block_size,
            )
            cache = engine.llm.llm_engine.vllm_config.cache_config
            print(f"vllm engine start: {time.perf_counter() - t0:.1f} s; KV block size {cache.block_size}")
            runs["vllm"] = lambda: time_generate(engine, batch, params)
            updates["vllm"] = lambda: time_update(engine, model)
        try:
            warm_up(hf)
            if engine is not None:
                warm_up(engine)
            # Rounds interleave the backends so that drift in machine speed hits all of them alike.
            best: dict[str, tuple[float, int]] = {}
            for _ in range(args.repeats):
                for name, run in runs.items():
                    secs, toks = run()
                    if name not in best or secs < best[name][0]:
                        best[name] = (secs, toks)
            update_ms = {name: fn() * 1e3 for name, fn in updates.items()}
        finally:
            if engine is not None:
                engine.close()

    print(f"{'backend':<12}{'tokens':>8}{'seconds':>9}{'tokens/s':>10}{'weight update ms':>18}")
    tps = {}
    for name, (secs, toks) in best.items():
        tps[name] = toks / secs
        upd = f"{update_ms[name]:.1f}" if name in update_ms else "-"
        print(f"{name:<12}{toks:>8}{secs:>9.2f}{tps[name]:>10.0f}{upd:>18}")
    if "vllm" in tps:
        print(f"vllm / hf throughput: {tps['vllm'] / tps['hf']:.2f}x (rlcore's hf backend: own KV-cache decode loop)")
        print(f"vllm / transformers generate: {tps['vllm'] / tps['hf-generate']:.2f}x")


if __name__ == "__main__":
    main()
