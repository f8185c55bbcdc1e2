"""The tiny example's SFT warm start (rlcore.example.warm_start): response-only loss, micro-batching, schedule, determinism, saving."""

from __future__ import annotations

import math

import pytest
import torch

from rlcore.example.model import TinyModelSpec, make_model
from rlcore.example.tokenizer import build_tokenizer
from rlcore.example.warm_start import IGNORE_INDEX, WarmStartSettings, backward_batch, lr_at, run_warm_start, tokenize_sft_row

SPEC = TinyModelSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def rows(n: int = 8) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"{i}+{i}="}], "response": f"#### {2 * i}"} for i in range(n)]


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_labels_cover_response_and_eos_only(tok):
    ids, labels = tokenize_sft_row({"prompt": [{"role": "user", "content": "1+2="}], "response": "#### 3"}, tok)
    toks = tok.convert_ids_to_tokens(ids)
    assert toks == ["<s>", "<|user|>", "1", "+", "2", "=", "<|end|>", "<|assistant|>", "####", " ", "3", "</s>"]
    assert labels[:8] == [IGNORE_INDEX] * 8 and labels[8:] == ids[8:]
    # A plain-string prompt is used as is.
    ids, labels = tokenize_sft_row({"prompt": "Q:", "response": "A"}, tok)
    assert tok.convert_ids_to_tokens(ids) == ["Q", ":", "A", "</s>"] and labels == [IGNORE_INDEX] * 2 + ids[2:]


def test_lr_schedule_warmup_then_cosine():
    cfg = WarmStartSettings(lr=1e-3, warmup_steps=4, min_lr_ratio=0.1)
    assert [lr_at(s, 24, cfg) for s in range(4)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert lr_at(14, 24, cfg) == pytest.approx(1e-4 + 9e-4 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(24, 24, cfg) == pytest.approx(1e-4)


def test_loss_decreases_on_a_tiny_batch(tok):
    model = make_model(tok, SPEC, seed=0)
    m = run_warm_start(model, tok, rows(8), WarmStartSettings(lr=1e-2, batch_size=8, micro_batch_size=4, epochs=40, warmup_steps=2))
    assert m["steps"] == 40
    assert m["loss_last"] < 0.3 * m["loss_first"]
    assert m["tokens"] == 40 * sum(len(r["response"]) - 3 + 1 for r in rows(8))  # "####" is one token; + EOS


def test_micro_batching_gives_the_same_gradient(tok):
    # Responses of different lengths: a per-micro-batch mean would weight tokens unevenly.
    examples = [tokenize_sft_row(r, tok) for r in rows(8)] + [tokenize_sft_row({"prompt": "x", "response": "1" * 9}, tok)] * 2
    grads, losses = [], []
    for micro in (10, 3, 1):
        model = make_model(tok, SPEC, seed=0)
        loss, n = backward_batch(model, examples, micro, tok.pad_token_id)
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        losses.append(loss)
    assert n == sum(len(r["response"]) - 3 + 1 for r in rows(8)) + 2 * 10  # "####" is one token; + EOS
    assert losses[1] == pytest.approx(losses[0], rel=1e-6) and losses[2] == pytest.approx(losses[0], rel=1e-6)
    for g in grads[1:]:
        for k in g:
            torch.testing.assert_close(g[k], grads[0][k], atol=1e-7, rtol=1e-4)
    # The loss is the mean over response tokens: check against a direct computation.
    model = make_model(tok, SPEC, seed=0)
    nll = []
    for ids, labels in examples:
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1], -1)
        nll += [-logp[t, y].item() for t, y in enumerate(labels[1:]) if y != IGNORE_INDEX]
    assert losses[0] == pytest.approx(sum(nll) / len(nll), rel=1e-5)


def test_deterministic_given_seed_and_saved_model_reloads(tok, tmp_path):
    from transformers import AutoModelForCausalLM

    out = []
    for i in range(2):
        model = make_model(tok, SPEC, seed=1)
        run_warm_start(model, tok, rows(12), WarmStartSettings(batch_size=4, micro_batch_size=2, epochs=2, seed=5,
                                                output_dir=str(tmp_path / f"m{i}")))
        out.append(params(model))
    for k in out[0]:
        assert torch.equal(out[0][k], out[1][k]), k
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m0")
    x = torch.tensor([[1, 4, 10, 81, 11, 89, 7, 5]])
    torch.testing.assert_close(reloaded(input_ids=x).logits, model(input_ids=x).logits, atol=1e-5, rtol=1e-5)


def test_bad_batch_config_is_rejected(tok):
    model = make_model(tok, SPEC, seed=0)
    with pytest.raises(ValueError, match="not a multiple of micro_batch_size 3"):
        run_warm_start(model, tok, rows(8), WarmStartSettings(batch_size=8, micro_batch_size=3))
