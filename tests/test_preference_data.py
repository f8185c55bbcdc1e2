"""Preference data: row validation that names file/row/field, tokenization into the RL response
layout (EOS inside the mask), KTO's mismatched pairs, and the config switches for dpo/kto."""

from __future__ import annotations

import pytest
import torch

from rlcore.config import ConfigError, config_from_dict, set_key
from rlcore.data import DataError, DataValidationError, write_rows
from rlcore.data.preference import (
    PreferenceDataset,
    PreferenceLoader,
    collate_unpaired,
    sequence_log_prob_sums,
    sequence_view,
    validate_preference_row,
)
from rlcore.example.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_pairwise_errors_name_file_row_and_field(tmp_path, tok):
    rows = [
        {"prompt": "1+1=", "chosen": "#### 2", "rejected": "#### 3"},
        {"prompt": "1+2=", "chosen": "#### 3"},
        {"prompt": [{"role": "user", "content": "2+2="}], "chosen": [{"role": "user", "content": "#### 4"}], "rejected": "#### 5"},
        {"prompt": "3+3=", "chosen": "#### 6", "rejected": "#### 6"},
        {"prompt": 7, "chosen": "#### 6", "rejected": "#### 5"},
    ]
    f = write_rows(rows, tmp_path / "pairs.jsonl")
    with pytest.raises(DataValidationError) as err:
        PreferenceDataset(f, tok, kind="pairwise")
    where = {(e.row, e.field) for e in err.value.errors}
    assert where == {(1, "rejected"), (2, "chosen[0].role"), (3, "rejected"), (4, "prompt")}
    assert all(e.file == str(f) for e in err.value.errors)
    assert f"{f}: row 1: field 'rejected': missing" in str(err.value)
    # "skip" keeps the good row and counts the rest
    ds = PreferenceDataset(f, tok, kind="pairwise", on_bad_row="skip")
    assert len(ds) == 1 and ds.stats["bad_rows"] == 4


def test_unpaired_label_must_be_bool():
    errors = validate_preference_row({"prompt": "1+1=", "completion": "#### 2", "label": 1}, "f.parquet", 7, "unpaired")
    assert [(e.file, e.row, e.field) for e in errors] == [("f.parquet", 7, "label")]
    assert "expected true (desirable) or false" in errors[0].message
    assert validate_preference_row({"prompt": "1+1=", "completion": "#### 2", "label": False}, "f", 0, "unpaired") == []


def test_mixed_kinds_are_refused(tmp_path, tok):
    a = write_rows([{"prompt": "1+1=", "chosen": "#### 2", "rejected": "#### 3"}], tmp_path / "a.jsonl")
    b = write_rows([{"prompt": "1+1=", "completion": "#### 2", "label": True}], tmp_path / "b.jsonl")
    with pytest.raises(DataError, match="unpaired file among pairwise files"):
        PreferenceDataset([a, b], tok)


def test_pairs_tokenize_like_rl_responses(tmp_path, tok):
    rows = [
        {"prompt": [{"role": "user", "content": "12+9="}], "chosen": "#### 21", "rejected": [{"role": "assistant", "content": "#### 111"}]},
        {"prompt": "5+5=", "chosen": "#### 10", "rejected": "#### 0"},  # plain-text prompt: no template
    ]
    ds = PreferenceDataset(write_rows(rows, tmp_path / "p.jsonl"), tok)  # mixed str/list columns: JSON lines
    assert ds.kind == "pairwise"
    batch = ds.collate([ds[0], ds[1]], ["a", "b"])
    eos, pad = tok.eos_token_id, tok.pad_token_id
    chat_prompt = tok("<s><|user|>12+9=<|end|><|assistant|>", add_special_tokens=False)["input_ids"]
    assert ds[0].prompt_ids == chat_prompt
    assert ds[1].prompt_ids == tok("5+5=")["input_ids"]
    # prompts LEFT-padded to one width, responses RIGHT-padded to one width shared by both sides
    p_w = len(chat_prompt)
    r_w = len(ids(tok, "#### 111")) + 1
    assert batch["chosen_responses"].shape == batch["rejected_responses"].shape == (2, r_w)
    assert batch["rejected_responses"][0].tolist() == ids(tok, "#### 111") + [eos]
    assert batch["chosen_responses"][1].tolist() == ids(tok, "#### 10") + [eos] + [pad] * (r_w - 5)
    assert batch["chosen_response_mask"][1].tolist() == [1.0] * 5 + [0.0] * (r_w - 5)
    row1 = batch["chosen_input_ids"][1]
    n_p1 = len(ds[1].prompt_ids)
    assert row1[: p_w - n_p1].eq(pad).all() and row1[p_w - n_p1 : p_w].tolist() == ds[1].prompt_ids
    assert batch["chosen_position_ids"][1, p_w - n_p1].item() == 0
    view = sequence_view(batch, "rejected_")
    assert view["input_ids"].shape == (2, p_w + r_w) and set(view.keys()) >= {"responses", "response_mask"}


def test_unpaired_batch_rotates_completions_for_the_kl_pairs(tmp_path, tok):
    rows = [{"prompt": f"{i}+1=", "completion": f"#### {i + 1}", "label": i % 2 == 0} for i in range(3)]
    ds = PreferenceDataset(write_rows(rows, tmp_path / "k.jsonl"), tok, kind="unpaired")
    batch = collate_unpaired(list(ds.items), ds.pad_token_id, ["0", "1", "2"])
    assert batch["label"].tolist() == [1.0, 0.0, 1.0]
    resp = batch["responses"]
    # row i's mismatched pair: its own prompt, the completion of row i-1 (row 0 takes row 2's)
    assert torch.equal(batch["kl_responses"], resp[[2, 0, 1]])
    assert torch.equal(batch["kl_input_ids"][:, : batch["input_ids"].shape[1] - resp.shape[1]],
                       batch["input_ids"][:, : batch["input_ids"].shape[1] - resp.shape[1]])


def test_sequence_log_prob_sums():
    lp = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -9.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert sequence_log_prob_sums(lp, mask).tolist() == [-3.0, -0.5]
    assert sequence_log_prob_sums(lp, mask, average=True).tolist() == [-1.5, -0.5]


def test_loader_resumes_the_same_order(tmp_path, tok):
    rows = [{"prompt": f"{i}+1=", "chosen": f"#### {i + 1}", "rejected": f"#### {i}"} for i in range(10)]
    ds = PreferenceDataset(write_rows(rows, tmp_path / "p.jsonl"), tok)
    a = PreferenceLoader(ds, batch_size=3, seed=5)
    a.next_batch()
    state = a.state_dict()
    b = PreferenceLoader(ds, batch_size=3, seed=5)
    b.load_state_dict(state)
    assert a.next_batch()["index"].tolist() == b.next_batch()["index"].tolist()


def _cfg(**algo_and_pref):
    tree = {"model": {"path": "m"}, "data": {"train_files": ["t"]}, "algorithm": {"name": "dpo"}}
    for k, v in algo_and_pref.items():
        set_key(tree, k.split("__"), v)
    return config_from_dict(tree)


def test_config_preference_section():
    cfg = _cfg(preference__loss_type="robust", preference__label_smoothing=0.2)
    assert cfg.needs_reference and cfg.preference.beta == 0.1
    with pytest.raises(ConfigError, match="label_smoothing applies to loss_type sigmoid or robust, not ipo"):
        _cfg(preference__loss_type="ipo", preference__label_smoothing=0.1)
    with pytest.raises(ConfigError, match="dpo needs the reference model"):
        _cfg(algorithm__use_reference=False)
    with pytest.raises(ConfigError, match="preference.loss_type"):
        _cfg(preference__loss_type="hinge")
    with pytest.raises(ConfigError, match="preference.label_smoothing"):
        _cfg(preference__label_smoothing=0.5)
