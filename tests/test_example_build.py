"""The real built-in example (built once per session by the `tiny_example` fixture, cached
under $RLCORE_CACHE): loadable offline, and an SFT start that RL can improve."""

from __future__ import annotations

import pytest

from rlcore.data import RLDataset, read_rows, write_rows
from rlcore.example import build_tiny_example, evaluate_accuracy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def loaded(tiny_example):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_example.model_dir, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(tiny_example.model_dir, local_files_only=True)
    return model, tok


def test_cached_second_call_returns_the_same_build(tiny_example):
    again = build_tiny_example(seed=0)
    assert again.root == tiny_example.root and again.sft_greedy_accuracy == tiny_example.sft_greedy_accuracy


def test_data_files_are_disjoint_and_load_as_rl_datasets(tiny_example, loaded):
    _, tok = loaded
    train = RLDataset([tiny_example.train_file], tok, max_prompt_length=tiny_example.max_prompt_length)
    val = RLDataset([tiny_example.val_file], tok, max_prompt_length=tiny_example.max_prompt_length)
    assert train.stats["kept"] == train.stats["rows_read"] == 4000 and len(val) == 400
    assert not {it.raw_prompt for it in train} & {it.raw_prompt for it in val}
    assert tiny_example.max_prompt_length <= 16 and tiny_example.max_response_length <= 10
    assert {it.data_source for it in val} == {"tiny_arith"}
    sft = read_rows(tiny_example.sft_file)
    assert {r["prompt"][0]["content"] for r in sft}.isdisjoint({r["prompt"][0]["content"] for r in read_rows(tiny_example.val_file)})


def test_sft_start_is_wrong_greedily_on_carries_but_samples_right(tiny_example, loaded, tmp_path):
    model, tok = loaded
    ex = tiny_example
    assert 0.2 <= ex.sft_greedy_accuracy <= 0.6
    assert ex.sft_pass_at_n - ex.sft_greedy_accuracy >= 0.3
    greedy = evaluate_accuracy(ex.model_dir, None, ex.val_file)
    assert greedy["accuracy"] == pytest.approx(ex.sft_greedy_accuracy, abs=0.01)  # the saved model is the evaluated one
    rows = read_rows(ex.val_file)
    carry = write_rows([r for r in rows if r["extra_info"]["carry"]], tmp_path / "carry.parquet")
    plain = write_rows([r for r in rows if not r["extra_info"]["carry"]], tmp_path / "plain.parquet")
    assert evaluate_accuracy(model, tok, plain)["accuracy"] >= 0.95
    assert evaluate_accuracy(model, tok, carry)["accuracy"] <= 0.4
    # The right answer to a carry problem is within reach of sampling: what RL needs.
    assert evaluate_accuracy(model, tok, carry, greedy=False, n=8)["pass@8"] >= 0.8
