"""Rollout throughput, vLLM vs HF, on the same tiny model and prompts, plus weight-sync time.

    ./dev python benchmarks/bench_rollout.py [--prompts 32 --n 8 --new-tokens 64 --repeats 2]

The model is a random Llama (vocab 2048, hidden 256, 4 layers, tied embeddings) saved to a temp
folder; no EOS is configured, so every row generates exactly `--new-tokens` tokens and both
backends do the same work. Tokens/s counts response tokens (prompts x n x new tokens) over the
wall time of `generate`, best of `--repeats` after one warm-up call. The weight update sends the
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


def time_engine(engine, batch, params, repeats: int) -> tuple[float, int]:
    """(best seconds, response tokens) for `engine.generate(batch, params)` after a warm-up."""
    from rlcore.rollout import SamplingParams

    engine.generate(batch.take(list(range(2))), SamplingParams(n=2, max_new_tokens=4))
    best, tokens = float("inf"), 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = engine.generate(batch, params)
        best = min(best, time.perf_counter() - t0)
        tokens = int(out["response_mask"].sum())
    return best, tokens


@torch.inference_mode()
def time_hf_generate(model, batch, params, repeats: int) -> tuple[float, int]:
    ids = batch["input_ids"].repeat_interleave(params.n, dim=0)
    mask = batch["attention_mask"].repeat_interleave(params.n, dim=0)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=params.temperature,
                             top_k=0, max_new_tokens=params.max_new_tokens, min_new_tokens=params.max_new_tokens,
                             pad_token_id=0)
        best = min(best, time.perf_counter() - t0)
    return best, int(ids.shape[0] * (out.shape[1] - ids.shape[1]))


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
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    from rlcore.rollout import HFRolloutEngine, SamplingParams

    results: dict[str, tuple[float, int, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tiny"
        model = make_model(path)
        batch = prompt_batch(args.prompts)
        params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.new_tokens, seed=0)
        print(f"tiny Llama {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params; "
              f"{args.prompts} prompts x n={args.n} x {args.new_tokens} new tokens; "
              f"torch threads {torch.get_num_threads()}")

        hf = HFRolloutEngine.from_pretrained(str(path), eos_token_ids=[], pad_token_id=0)
        secs, toks = time_engine(hf, batch, params, args.repeats)
        results["hf"] = (secs, toks, time_update(hf, model))
        # transformers' own generate on the same rows: the baseline FIELD_NOTES compared vLLM with
        secs, toks = time_hf_generate(hf.model, batch, params, args.repeats)
        results["hf-generate"] = (secs, toks, float("nan"))
        del hf

        if importlib.util.find_spec("vllm") is None:
            print("vllm is not installed: hf only")
        else:
            from rlcore.rollout.vllm import VLLMRolloutEngine

            t0 = time.perf_counter()
            engine = VLLMRolloutEngine.from_pretrained(str(path), eos_token_ids=[], pad_token_id=0,
                                                       max_model_len=512, kv_cache_gib=1.0, seed=0,
                                                       max_num_seqs=args.prompts * args.n, max_num_batched_tokens=8192)
            start = time.perf_counter() - t0
            try:
                secs, toks = time_engine(engine, batch, params, args.repeats)
                results["vllm"] = (secs, toks, time_update(engine, model))
            finally:
                engine.close()
            print(f"vllm engine start: {start:.1f} s")

    print(f"{'backend':<12}{'tokens':>8}{'seconds':>9}{'tokens/s':>10}{'weight update ms':>18}")
    for name, (secs, toks, upd) in results.items():
        print(f"{name:<12}{toks:>8}{secs:>9.2f}{toks / secs:>10.0f}{upd * 1e3:>18.1f}")
    if "vllm" in results:
        hf_tps = results["hf"][1] / results["hf"][0]
        vllm_tps = results["vllm"][1] / results["vllm"][0]
        gen_tps = results["hf-generate"][1] / results["hf-generate"][0]
        print(f"vllm / hf throughput: {vllm_tps / hf_tps:.2f}x (rlcore's hf backend: own KV-cache decode loop)")
        print(f"vllm / transformers generate: {vllm_tps / gen_tps:.2f}x")


if __name__ == "__main__":
    main()
