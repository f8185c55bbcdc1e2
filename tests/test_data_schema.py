"""Row validation and RLDataset loading: errors name file, row and field; skip policy counts."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlcore.data import DataError, DataValidationError, RLDataset, read_rows, validate_rows, write_rows
from rlcore.example.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def good_row(q: str = "12+35=", gt: str = "47") -> dict:
    return {
        "data_source": "tiny_arith",
        "prompt": [{"role": "user", "content": q}],
        "reward_model": {"ground_truth": gt, "style": "rule"},
        "extra_info": {"k": 1},
    }


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# Each bad row and the (row, field) its error must name.
BAD_CASES = [
    ({"data_source": "d", "reward_model": {"ground_truth": "1"}}, "prompt"),
    ({**good_row(), "reward_model": {"ground_truth": 47}}, "reward_model.ground_truth"),
    ({**good_row(), "prompt": [{"role": "robot", "content": "hi"}]}, "prompt[0].role"),
    ({**good_row(), "prompt": ""}, "prompt"),
    ({**good_row(), "prompt": []}, "prompt"),
    ({**good_row(), "prompt": [{"role": "user", "content": "  "}]}, "prompt"),
    ({**good_row(), "data_source": None}, "data_source"),
    ({**good_row(), "reward_model": "47"}, "reward_model"),
    ({**good_row(), "extra_info": [1, 2]}, "extra_info"),
    ({**good_row(), "prompt": [{"role": "user", "content": 5}]}, "prompt[0].content"),
]


def test_validate_rows_reports_every_bad_row_with_row_and_field():
    rows = [good_row()] + [r for r, _ in BAD_CASES] + [good_row()]
    errors = validate_rows(rows, "f.jsonl")
    got = [(e.row, e.field) for e in errors]
    assert got == [(i + 1, field) for i, (_, field) in enumerate(BAD_CASES)]
    assert all(e.file == "f.jsonl" for e in errors)
    e = errors[1]
    assert str(e).startswith("f.jsonl: row 2: field 'reward_model.ground_truth':") and "int" in str(e)


def test_jsonl_bad_rows_raise_naming_file_row_field(tmp_path, tok):
    rows = [good_row(), {**good_row(), "prompt": [{"role": "robot", "content": "x"}]}, good_row(),
            {**good_row(), "reward_model": {"ground_truth": 3}}]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(DataValidationError) as info:
        RLDataset([path], tok, max_prompt_length=32)
    errs = info.value.errors
    assert [(e.row, e.field) for e in errs] == [(1, "prompt[0].role"), (3, "reward_model.ground_truth")]
    msg = str(info.value)
    assert f"{path}: row 1: field 'prompt[0].role'" in msg and f"{path}: row 3: field 'reward_model.ground_truth'" in msg


def test_parquet_missing_prompt_and_wrong_ground_truth_type(tmp_path, tok):
    # Parquet columns are typed, so a bad type affects the whole column: every row is reported.
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"data_source": "d", "reward_model": {"ground_truth": 1}},
        {"data_source": "d", "reward_model": {"ground_truth": 2}},
    ]), path)
    with pytest.raises(DataValidationError) as info:
        RLDataset([path], tok, max_prompt_length=32)
    got = [(e.file, e.row, e.field) for e in info.value.errors]
    assert got == [(str(path), 0, "prompt"), (str(path), 0, "reward_model.ground_truth"),
                   (str(path), 1, "prompt"), (str(path), 1, "reward_model.ground_truth")]


def test_parquet_empty_prompt_and_bad_role(tmp_path, tok):
    path = write_rows([good_row(), {**good_row(), "prompt": [{"role": "user", "content": ""}]},
                       {**good_row(), "prompt": [{"role": "bot", "content": "1+1="}]}], tmp_path / "x.parquet")
    with pytest.raises(DataValidationError) as info:
        RLDataset([path], tok, max_prompt_length=32)
    assert [(e.row, e.field) for e in info.value.errors] == [(1, "prompt"), (2, "prompt[0].role")]
    assert "empty prompt" in info.value.errors[0].message


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_skip_policy_counts_and_keeps_good_rows(tmp_path, tok, suffix):
    rows = [good_row("1+2=", "3"), {**good_row(), "prompt": [{"role": "bot", "content": "x"}]},
            good_row("3+4=", "7"), {**good_row(), "data_source": ""}, good_row("5+6=", "11")]
    path = write_rows(rows, tmp_path / f"d{suffix}")
    ds = RLDataset([path], tok, max_prompt_length=32, on_bad_row="skip")
    assert ds.stats == {"rows_read": 5, "bad_rows": 2, "too_long": 0, "kept": 3}
    assert [it.ground_truth for it in ds] == ["3", "7", "11"]
    assert [it.row for it in ds] == [0, 2, 4] and [it.index for it in ds] == [0, 1, 2]
    assert [(e.row, e.field) for e in ds.bad_rows] == [(1, "prompt[0].role"), (3, "data_source")]


def test_long_prompts_dropped_and_counted_or_raise(tmp_path, tok):
    # Template adds <s><|user|> ... <|end|><|assistant|>: 4 tokens around the content.
    rows = [good_row("1+2="), good_row("1" * 20), good_row("3+4=")]
    path = write_rows(rows, tmp_path / "d.jsonl")
    ds = RLDataset([path], tok, max_prompt_length=8)
    assert ds.stats["too_long"] == 1 and len(ds) == 2
    with pytest.raises(DataValidationError, match=r"row 1: field 'prompt': 24 tokens, longer than max_prompt_length=8"):
        RLDataset([path], tok, max_prompt_length=8, on_long_prompt="error")


def test_chat_template_rendering_and_plain_prompts(tmp_path, tok):
    rows = [good_row("12+35="), {**good_row(), "prompt": "plain 1+1="},
            {**good_row(), "prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]}]
    path = write_rows(rows, tmp_path / "d.jsonl")
    ds = RLDataset([path], tok, max_prompt_length=64)
    assert ds[0].raw_prompt == "<s><|user|>12+35=<|end|><|assistant|>"
    assert tok.convert_ids_to_tokens(ds[0].input_ids) == ["<s>", "<|user|>", "1", "2", "+", "3", "5", "=", "<|end|>", "<|assistant|>"]
    assert ds[1].raw_prompt == "plain 1+1=" and tok.decode(ds[1].input_ids) == "plain 1+1="
    assert ds[2].raw_prompt == "<s><|system|>S<|end|><|user|>U<|end|><|assistant|>"
    # Without the template, message contents are joined with newlines.
    plain = RLDataset([path], tok, max_prompt_length=64, apply_chat_template=False)
    assert plain[2].raw_prompt == "S\nU" and tok.decode(plain[2].input_ids) == "S\nU"


def test_bad_json_line_names_row(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(good_row()) + "\n{not json\n")
    with pytest.raises(DataError, match=r"d.jsonl: row 1: field '<json>'"):
        read_rows(path)


def test_multiple_files_keep_order_and_extra_info(tmp_path, tok):
    a = write_rows([good_row("1+1=", "2")], tmp_path / "a.parquet")
    b = write_rows([good_row("2+2=", "4"), {**good_row("3+3=", "6"), "extra_info": None}], tmp_path / "b.jsonl")
    ds = RLDataset([a, b], tok, max_prompt_length=32)
    assert [(it.file, it.row, it.ground_truth) for it in ds] == [(str(a), 0, "2"), (str(b), 0, "4"), (str(b), 1, "6")]
    assert ds[0].extra_info == {"k": 1} and ds[2].extra_info == {}
