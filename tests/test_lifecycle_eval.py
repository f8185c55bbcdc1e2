"""Held-out evaluation: exact per-token KL against an independent reference computation, and
accuracy against the example's own yardstick (`rlcore.example.evaluate_accuracy`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlcore.lifecycle.evaluation import evaluate_model, response_token_kl
from rlcore.protocol import Batch


def _tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=17, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(cfg).eval()


def test_response_token_kl_matches_torch_distributions():
    p_model, q_model = _tiny_llama(0), _tiny_llama(1)
    prompts = torch.tensor([[0, 3, 4], [5, 6, 7]])
    responses = torch.tensor([[8, 9, 0], [10, 11, 12]])
    response_mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    attn = torch.cat([torch.tensor([[0, 1, 1], [1, 1, 1]]), response_mask.long()], 1)
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    gen = Batch(tensors={"input_ids": torch.cat([prompts, responses], 1), "attention_mask": attn,
                         "position_ids": pos, "responses": responses, "response_mask": response_mask})
    kl, mask = response_token_kl(p_model, q_model, gen, chunk=1)
    with torch.no_grad():
        kw = dict(input_ids=gen["input_ids"], attention_mask=attn, position_ids=pos)
        lp, lq = p_model(**kw).logits[:, 2:5], q_model(**kw).logits[:, 2:5]
    expected = torch.distributions.kl_divergence(torch.distributions.Categorical(logits=lp),
                                                 torch.distributions.Categorical(logits=lq)) * response_mask
    torch.testing.assert_close(kl, expected, rtol=1e-5, atol=1e-6)
    assert kl[0, 2] == 0 and (kl[response_mask.bool()] > 0).all()
    self_kl, _ = response_token_kl(p_model, p_model, gen)
    assert float(self_kl.abs().max()) < 1e-6


@pytest.mark.slow
def test_evaluate_model_agrees_with_the_example_yardstick(tiny_example):
    from rlcore.example import evaluate_accuracy

    res = evaluate_model(tiny_example.model_dir, tiny_example.val_file, tiny_example.model_dir,
                         max_prompt_length=32, max_new_tokens=12, limit=96)
    ref = evaluate_accuracy(tiny_example.model_dir, None, tiny_example.val_file, max_new_tokens=12, limit=96)
    assert res.num_prompts == 96
    # Two greedy decoders whose logits differ in the last bits: exact, since the example's greedy choices
    # lead by > 1e-3 logits (test_example_build), so no answer can flip.
    assert res.accuracy == pytest.approx(ref["accuracy"])
    assert res.mean_reward == pytest.approx(res.accuracy)  # gsm8k-style reward: 1 if right, else 0
    assert res.kl_to_reference == pytest.approx(0.0, abs=1e-6)
    assert 1.0 <= res.response_length <= 12.0
    again = evaluate_model(tiny_example.model_dir, tiny_example.val_file, None, max_prompt_length=32,
                           max_new_tokens=12, limit=96)
    assert np.isclose(again.accuracy, res.accuracy) and again.kl_to_reference == 0.0
