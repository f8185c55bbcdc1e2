"""The critic's value model: deterministic in training mode (no dropout before the value head),
and a fresh head (the critic's value head, a reward model's score) drawn from the run's seed, not
from the process's RNG (a Ray worker's is seeded at random: FSDP2 ranks would shard different
heads)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rlcore.workers.loading import load_sequence_classifier, load_value_model

SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=2, max_position_embeddings=32)


def test_value_head_has_no_dropout(tmp_path):
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SIZES)).save_pretrained(tmp_path)
    model = load_value_model(tmp_path, "float32", torch.device("cpu"))
    model.train()
    ids = torch.randint(0, 64, (2, 8))
    first, second = model(input_ids=ids).logits, model(input_ids=ids).logits
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    model.eval()
    torch.testing.assert_close(model(input_ids=ids).logits, first, rtol=0, atol=0)


def _value_head(folder, seed):
    return load_value_model(folder, "float32", torch.device("cpu"), remove_padding=False, seed=seed).score


def _score_head(folder, seed):
    return load_sequence_classifier(folder, "float32", torch.device("cpu"), key="model.path", new_head_ok=True,
                                    pad_token_id=0, seed=seed, remove_padding=False).score


@pytest.mark.parametrize("load", [_value_head, _score_head], ids=["value_head", "score_head"])
def test_a_fresh_head_comes_from_the_seed_not_the_process_rng(tmp_path, load):
    """Two loads as two Ray ranks make them (each process's RNG seeded at random) give the same
    head; another seed another head; the caller's RNG stream is left as it was. Llama and a Qwen2
    with grouped-query attention."""
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SIZES)).save_pretrained(tmp_path / "llama")
    Qwen2ForCausalLM(Qwen2Config(**{**SIZES, "num_attention_heads": 4})).save_pretrained(tmp_path / "qwen2")
    for folder in (tmp_path / "llama", tmp_path / "qwen2"):
        heads = []
        for process_seed, seed in ((123, 7), (456, 7), (456, 8)):
            torch.manual_seed(process_seed)
            before = torch.random.get_rng_state()
            heads.append(load(folder, seed))
            assert torch.equal(torch.random.get_rng_state(), before)
        a, b, c = heads
        assert float(a.weight.detach().std()) == pytest.approx(0.02, rel=0.3)  # transformers' initializer_range
        assert torch.equal(a.weight, b.weight) and not torch.equal(a.weight, c.weight)
        if a.bias is not None:  # the value head's
            assert torch.equal(a.bias, b.bias) and not a.bias.any()


def test_a_fresh_value_head_is_reported_in_one_plain_line(tmp_path, capfd):
    """A critic started from a causal LM gets a new value head, which is expected: one line of
    rlcore's says so, not transformers' load report (a table with `score.weight | MISSING` and raw
    colour codes, which reads like a broken model). A folder that has a value head says nothing."""
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SIZES)).save_pretrained(tmp_path / "lm")
    capfd.readouterr()
    model = load_value_model(tmp_path / "lm", "float32", torch.device("cpu"), remove_padding=False, seed=3)
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and "Loading weights" not in line]
    assert lines == [f"rlcore: critic: a new value head (score, one value per token, drawn from seed 3) on the backbone "
                     f"of {tmp_path / 'lm'}; PPO trains it from there"]
    assert "\x1b[" not in err and "MISSING" not in err
    model.save_pretrained(tmp_path / "critic")
    load_value_model(tmp_path / "critic", "float32", torch.device("cpu"), remove_padding=False)
    assert "rlcore: critic" not in capfd.readouterr().err
