"""Data files that cannot be read say which file, row and field: bytes that are not UTF-8 (parquet
and JSON lines, RL and preference rows), and files that are missing, empty, of an unknown format
or not what their suffix says. Every such error is an RLCoreError (the CLI prints it cleanly)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlcore.data import DataError, DatasetError, DataValidationError, RLDataset, peek_fields, read_rows, write_rows
from rlcore.data.preference import PreferenceDataset
from rlcore.errors import RLCoreError
from rlcore.example.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def raw_strings(values: list[bytes]) -> pa.Array:
    """An arrow string array holding exactly these bytes (pyarrow refuses invalid UTF-8 from Python str)."""
    offsets = np.cumsum([0] + [len(v) for v in values]).astype(np.int32)
    return pa.Array.from_buffers(pa.string(), len(values), [None, pa.py_buffer(offsets.tobytes()), pa.py_buffer(b"".join(values))])


def messages(contents: list[bytes], role: str) -> pa.Array:
    """One single-message chat per row: [{role, content}]."""
    structs = pa.StructArray.from_arrays([pa.array([role] * len(contents)), raw_strings(contents)], names=["role", "content"])
    return pa.ListArray.from_arrays(pa.array(range(len(contents) + 1), pa.int32()), structs)


def rl_parquet(path: Path) -> Path:
    """Four RL rows; row 1's prompt content and row 2's data_source are not UTF-8."""
    reward_model = pa.StructArray.from_arrays([pa.array(["2", "4", "6", "8"]), pa.array(["rule"] * 4)],
                                              names=["ground_truth", "style"])
    table = pa.table({
        "prompt": messages([b"1+1=", b"2+\xff2=", b"3+3=", b"4+4="], "user"),
        "data_source": raw_strings([b"tiny_arith", b"tiny_arith", b"tiny\xe9arith", b"tiny_arith"]),
        "reward_model": reward_model,
    })
    pq.write_table(table, path)
    return path


def rl_line(prompt: str, source: str = "tiny_arith") -> bytes:
    row = {"prompt": [{"role": "user", "content": prompt}], "data_source": source,
           "reward_model": {"ground_truth": "2", "style": "rule"}}
    return json.dumps(row, ensure_ascii=False).encode()


def rl_jsonl(path: Path) -> Path:
    """The same four rows as JSON lines, the bad bytes in the same places."""
    lines = [rl_line("1+1="), rl_line("2+@2=").replace(b"@", b"\xff"), rl_line("3+3=", "tiny@arith").replace(b"@", b"\xe9"),
             rl_line("4+4=")]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


RL_BAD = [(1, "prompt[0].content", "byte 0xff"), (2, "data_source", "byte 0xe9")]


@pytest.mark.parametrize("make", [rl_parquet, rl_jsonl], ids=["parquet", "jsonl"])
def test_rl_rows_that_are_not_utf8_name_file_row_and_field(tmp_path, tok, make):
    path = make(tmp_path / ("d.parquet" if make is rl_parquet else "d.jsonl"))
    with pytest.raises(DataValidationError) as info:
        RLDataset([path], tok, max_prompt_length=32)
    assert isinstance(info.value, RLCoreError)
    found = [(e.file, e.row, e.field) for e in info.value.errors]
    assert found == [(str(path), row, field) for row, field, _ in RL_BAD]
    for error, (row, field, byte) in zip(info.value.errors, RL_BAD):
        assert str(error).startswith(f"{path}: row {row}: field '{field}': not valid UTF-8") and byte in str(error)

    # on_bad_row=skip: the undecodable rows go like any bad row, counted; the others load.
    ds = RLDataset([path], tok, max_prompt_length=32, on_bad_row="skip")
    assert [it.row for it in ds.items] == [0, 3] and ds.stats["bad_rows"] == 2
    assert "1+1=" in ds.items[0].raw_prompt and "4+4=" in ds.items[1].raw_prompt

    # Read on its own, the first undecodable row is the error.
    with pytest.raises(DataError, match=r"row 1: field 'prompt\[0\].content': not valid UTF-8"):
        read_rows(path)


def test_preference_rows_that_are_not_utf8_name_file_row_and_field(tmp_path, tok):
    pairs = pa.table({
        "prompt": raw_strings([b"1+1=", b"2+2=", b"3+3="]),
        "chosen": raw_strings([b"#### 2", b"#### 4", b"#### 6"]),
        "rejected": messages([b"#### 3", b"#### 5", b"#### \xc3"], "assistant"),
    })
    parquet = tmp_path / "pairs.parquet"
    pq.write_table(pairs, parquet)
    unpaired = tmp_path / "unpaired.jsonl"
    lines = [{"prompt": "1+1=", "completion": "#### 2", "label": True}, {"prompt": "2+2=", "completion": "#### @", "label": False}]
    unpaired.write_bytes(b"\n".join(json.dumps(r).encode().replace(b"@", b"\xfe") for r in lines) + b"\n")

    with pytest.raises(DataValidationError) as info:
        PreferenceDataset([parquet], tok, kind="pairwise")
    assert [(e.row, e.field) for e in info.value.errors] == [(2, "rejected[0].content")]
    assert "not valid UTF-8: byte 0xc3" in str(info.value) and str(parquet) in str(info.value)

    with pytest.raises(DataValidationError) as info:
        PreferenceDataset([unpaired], tok)  # kind detected from the readable rows
    assert [(e.row, e.field) for e in info.value.errors] == [(1, "completion")]
    kept = PreferenceDataset([unpaired], tok, on_bad_row="skip")
    assert len(kept) == 1 and kept.kind == "unpaired"


def test_a_bad_byte_in_a_field_name_or_outside_strings(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "ok", "extra\xff": 1}\n\xff{"prompt": "x"}\n')
    rows = read_rows(path, keep_unreadable=True)
    assert [(e.row, e.field) for e in rows[0].errors] == [(0, "extra\\xff")]  # printable: no lone surrogate
    assert [(e.row, e.field) for e in rows[1].errors] == [(1, "<json>")]
    assert "not valid JSON" in str(rows[1].errors[0])


def test_a_byte_order_mark_is_not_an_error(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + rl_line("1+1=") + b"\n")
    assert read_rows(path)[0]["data_source"] == "tiny_arith"
    assert "prompt" in peek_fields(path)


def test_unusable_files_are_refused_naming_them(tmp_path, tok):
    good = write_rows([json.loads(rl_line("1+1="))], tmp_path / "good.parquet")
    not_parquet = tmp_path / "text.parquet"
    not_parquet.write_text("prompt,answer\n1+1=,2\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    cases = {
        tmp_path / "missing.parquet": "dataset file not found",
        tmp_path: "not a file",
        tmp_path / "data.csv": "unknown dataset format '.csv'",
        not_parquet: "not a readable parquet file",
        empty: "no rows",
    }
    (tmp_path / "data.csv").write_text("a,b\n")
    for path, message in cases.items():
        with pytest.raises(DatasetError, match=message) as info:
            peek_fields(path)
        assert str(path) in str(info.value) and isinstance(info.value, RLCoreError)
        if path != empty:
            with pytest.raises(DatasetError, match=message):
                RLDataset([path], tok, max_prompt_length=32)
    with pytest.raises(DatasetError, match="no usable prompts"):
        RLDataset([empty], tok, max_prompt_length=32)
    assert peek_fields(good)[:3] == ["prompt", "data_source", "reward_model"]


def test_a_data_source_column_of_the_wrong_type_is_named_with_its_rows_and_skip_skips_it(tmp_path, tok, tiny_example, caplog):
    """An integer data_source (all rows of a parquet column, some rows of a JSON-lines file) is
    refused before any model loads naming the key, file, column, type and first rows (not as "no
    built-in scorer"); with data.on_bad_row=skip those rows are skipped when the data loads, counted."""
    from rlcore.cli import CONFIG_DIR, tiny_example_overrides
    from rlcore.config import load_config
    from rlcore.trainer.preflight import preflight_problems

    def row(i: int, source: object) -> dict:
        return {"prompt": [{"role": "user", "content": f"{i}+1="}], "data_source": source,
                "reward_model": {"ground_truth": str(i + 1), "style": "rule"}}

    ints = write_rows([row(i, 7) for i in range(6)], tmp_path / "ints.parquet")
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(json.dumps(row(i, 3 if i in (2, 4) else "tiny_arith")) + "\n" for i in range(6)))
    base = tiny_example_overrides(tiny_example, str(tmp_path / "run"))
    config = load_config(CONFIG_DIR / "tiny_grpo.yaml", base + [f"data.train_files=[{ints}]", f"data.val_files=[{mixed}]"])
    problems = preflight_problems(config)
    assert problems == [
        f"data.train_files[0]: {ints}: column 'data_source' holds int values where a non-empty string (the scorer's "
        "name) is expected, in 6 row(s), first rows 0 (int 7), 1 (int 7), 2 (int 7); write them as strings, or set "
        "data.on_bad_row=skip to skip such rows (counted)",
        f"data.val_files[0]: {mixed}: column 'data_source' holds int values where a non-empty string (the scorer's "
        "name) is expected, in 2 row(s), first rows 2 (int 3), 4 (int 3); write them as strings, or set "
        "data.on_bad_row=skip to skip such rows (counted)",
    ]
    skipping = load_config(CONFIG_DIR / "tiny_grpo.yaml", base + [f"data.val_files=[{mixed}]", "data.on_bad_row=skip"])
    assert preflight_problems(skipping) == []
    with caplog.at_level("WARNING", logger="rlcore.data.dataset"):
        data = RLDataset([mixed], tok, max_prompt_length=64, on_bad_row="skip")
    assert len(data) == 4 and data.stats["bad_rows"] == 2 and [item.row for item in data.items] == [0, 1, 3, 5]
    assert "skipped 2 bad row(s)" in caplog.text and "row 2: field 'data_source': expected a non-empty string, got int 3" in caplog.text
    with pytest.raises(DataValidationError, match=r"mixed.jsonl: row 2: field 'data_source': expected a non-empty string, got int 3"):
        RLDataset([mixed], tok, max_prompt_length=64)
