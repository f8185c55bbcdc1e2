"""benchmarks/bench_vs_trl.py's long-tail workload forces each response's length through the
model's forward, so rlcore's decode loop and transformers' `generate` (TRL's and the evaluation's)
do exactly the same work. TRL itself is not in the lock and not needed here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlcore.protocol import Batch
from rlcore.rollout import HFRolloutEngine, SamplingParams

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_vs_trl.py"
PAD, BOS, EOS, VOCAB = 0, 1, 2, 64
FIRST = 3  # shortest prompt the table covers
LENGTHS = [5, 1, 17, 9, 30, 2]  # response length (EOS included) for prompt lengths 3..8


def bench_module():
    spec = importlib.util.spec_from_file_location("bench_vs_trl", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def controlled_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
    cfg.bench_length_control = {"eos_token_id": EOS, "first_prompt_length": FIRST, "lengths": LENGTHS,
                                "suppress_token_ids": [PAD, BOS]}
    return LlamaForCausalLM(cfg).eval()


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    lengths = list(range(FIRST, FIRST + len(LENGTHS)))
    g = torch.Generator().manual_seed(1)
    ids = torch.full((len(lengths), max(lengths)), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, -n:] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[i, -n:] = 1
    return ids, mask


def response_lengths(responses: torch.Tensor) -> list[int]:
    """Tokens up to and including the first EOS; specials other than EOS must not appear before it."""
    out = []
    for row in responses.tolist():
        n = row.index(EOS) + 1
        assert PAD not in row[: n - 1] and BOS not in row[: n - 1]
        out.append(n)
    return out


def test_forced_lengths_match_in_rlcore_rollout_and_generate(monkeypatch):
    bench = bench_module()
    monkeypatch.setattr(LlamaForCausalLM, "forward", LlamaForCausalLM.forward)  # the patch is undone after
    bench.install_length_control()
    model = controlled_model()
    ids, mask = prompts()
    n = 3

    batch = Batch(tensors={"input_ids": ids, "attention_mask": mask},
                  meta={"uid": np.array([f"p{i}" for i in range(len(ids))], dtype=object)}, info={})
    out = HFRolloutEngine(model, PAD, [EOS]).generate(batch, SamplingParams(n=n, max_new_tokens=40, seed=0))
    assert out["response_mask"].sum(dim=1).long().tolist() == [x for x in LENGTHS for _ in range(n)]
    assert response_lengths(out["responses"]) == [x for x in LENGTHS for _ in range(n)]

    with torch.no_grad():
        gen = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=40,
                             pad_token_id=PAD, eos_token_id=EOS)
    assert response_lengths(gen[:, ids.shape[1]:]) == LENGTHS

    # Training forwards (no cache) are untouched, and so is a model without the table.
    with torch.no_grad():
        patched = model(input_ids=ids, attention_mask=mask).logits
        del model.config.bench_length_control
        plain = model(input_ids=ids, attention_mask=mask, past_key_values=None).logits
    assert torch.equal(patched, plain)


def test_long_tail_score_is_the_share_of_digits():
    bench = bench_module()
    assert bench.long_tail_score("bench_longtail", "a1b2") == 0.5
    assert bench.long_tail_score("bench_longtail", "") == 0.0
