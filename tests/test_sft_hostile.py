"""`rlcore sft` with tools on a few hundred generated hostile rows (a seeded generator): tool-call
arguments nested past the agent loop's limit or the JSON parser's (50,000 deep), wrong types in
every field a row holds (conversations and prompt/response rows), empty strings, absurd numbers,
bytes that are not UTF-8, calls with no tools given, calls to tools that are not given. Each row, after a good one, goes through the data
layer itself (`SFTDataset`, what `rlcore sft` builds before anything loads): with
`data.on_bad_row=error` it is refused in one line naming the file, the row and the field; with
`skip` it is counted and the good row kept. None raises anything else, none hangs. A handful go
through `rlcore.cli.main(["sft", ...])` in this process: exit 2, one line, no traceback, and no
worker started. The tokenizer is a byte-level BPE with a Qwen2.5-style template that lists tools
in the prompt (`tests/test_sft_tools.py`)."""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path

import pytest
from own_model import save_qwen2_model, train_bpe
from test_sft_tools import LOOKUP, QWEN25_TEMPLATE, conversation  # tests/ is on sys.path

from rlcore.cli import CONFIG_DIR, main
from rlcore.data.io import write_rows
from rlcore.data.schema import DatasetError
from rlcore.data.sft import SFTDataset
from rlcore.rewards.tools import tool_schemas


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile_sft")
    (root / "lookup.py").write_text(LOOKUP)
    tokenizer = train_bpe([""], vocab_size=300)  # bytes only: every text tokenizes, in a second
    tokenizer.chat_template = QWEN25_TEMPLATE
    return {"root": root, "tokenizer": tokenizer, "tool": f"{root / 'lookup.py'}:lookup",
            "schemas": tool_schemas([f"{root / 'lookup.py'}:lookup"])}


def nested(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


def call(name: object = "lookup", arguments: object = '{"key": "sky"}', **extra: object) -> dict:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}, **extra}]}


def with_call(assistant: dict) -> list:
    rows = conversation("sky")
    rows[1] = assistant
    return rows


def hostile_row(rng: random.Random) -> tuple[object, str]:
    """One bad row (a dict, or the raw bytes of its JSON line) and the field its refusal names."""
    kind = rng.randrange(17)
    if kind == 0:  # arguments nested past the agent loop's limit, as JSON text or an object
        depth = rng.choice([33, 100, 900, 5_000, 50_000])
        return {"messages": with_call(call(arguments=nested(depth)))}, "messages"
    if kind == 1:  # ... or past the JSON parser's, in the line itself
        line = json.dumps({"messages": with_call(call(arguments={"a": "X"}))})
        # the JSON parser's own limit is the recursion limit, which a test process may have raised: then
        # the row parses and the agent loop's 32 levels refuse it (both name the row)
        return line.replace('"X"', nested(rng.choice([1_500, 50_000]))).encode(), "<json>|messages"
    if kind == 2:
        args = rng.choice(["{key: sky", "[1, 2]", "5", '"text"', "null" + "x", '{"key": ' + "9" * 5000 + "}", "{" * 3000])
        return {"messages": with_call(call(arguments=args))}, "messages"
    if kind == 3:
        args = rng.choice([[1, 2], 5, True, 1e308, "[]"])
        return {"messages": with_call(call(arguments=args))}, "messages"
    if kind == 4:  # the call's own shape
        bad = rng.choice([call(name=5), call(name=""), call(name=None), call(name=["lookup"]),
                          {"role": "assistant", "content": None, "tool_calls": "lookup"},
                          {"role": "assistant", "content": None, "tool_calls": [5]},
                          {"role": "assistant", "content": None, "tool_calls": {"function": {"name": "lookup"}}},
                          {"role": "assistant", "content": None, "tool_calls": []}])
        return {"messages": with_call(bad)}, "messages"
    if kind == 5:  # a call to a tool not given
        name = rng.choice(["delete_everything", "LOOKUP", "lookup ", "x" * 300, "\u202elookup", "lookup\x00"])
        return {"messages": with_call(call(name=name))}, "messages"
    if kind == 6:  # hermes text the agent loop cannot read, or naming an unknown tool
        text = rng.choice(["<tool_call>{bad</tool_call>", "<tool_call>" + nested(50_000) + "</tool_call>",
                           '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', "<tool_call>{",
                           '<tool_call>{"name": 5}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>'])
        return {"messages": with_call({"role": "assistant", "content": text})}, "messages"
    if kind == 7:  # the messages themselves
        value = rng.choice(["", "hi", 5, None, {}, [], [5], [{"role": 5, "content": "x"}], [{"content": "x"}],
                            [{"role": "robot", "content": "x"}], [{"role": "", "content": "x"}],
                            [{"role": "user", "content": 5}], [{"role": "user", "content": ["x"]}],
                            [{"role": "user", "content": "hi"}], [{"role": "assistant", "content": "x"}],
                            [{"role": "user", "content": "q", "tool_calls": [{"name": "lookup"}]},
                             {"role": "assistant", "content": "a"}]])
        return {"messages": value}, "messages"
    if kind == 8:  # a tool message of the wrong types
        rows = conversation("sky")
        rows[2] = rng.choice([{"role": "tool", "content": 5}, {"role": "tool", "content": None},
                              {"role": "tool", "content": {"a": 1}}, {"role": "tool"}])
        return {"messages": rows}, "messages"
    if kind == 9:  # the row's own tools
        tools = rng.choice([5, "not json", "[1, 2]", '{"type": "function"}', [{"nope": 1}], json.dumps([nested(80)]),
                            "[" * 50_000 + "]" * 50_000, [{"function": {"name": 5}}], True, {"function": {}}])
        return {"messages": conversation("sky"), "tools": tools}, "tools"
    if kind == 10:  # own tools that do not name the tool called
        tools = [{"type": "function", "function": {"name": rng.choice(["other", "", "lookup2"]), "parameters": {}}}]
        return {"messages": conversation("sky"), "tools": tools}, "messages"
    if kind == 11:  # bytes that are not UTF-8 in the line
        line = json.dumps({"messages": conversation("sky")}).encode()
        return line.replace(b"sky", bytes(rng.randrange(0x80, 0x100) for _ in range(3)), 1), "messages"
    if kind == 12:  # not an object at all
        return rng.choice([(b"[1, 2]", "<row>"), (b"5", "<row>"), (b'"row"', "<row>"), (b"null", "<row>"), (b"{", "<json>")])
    if kind == 13:  # a tool_call_id of a type a dictionary cannot hold
        rows = conversation("sky")
        rows[1]["tool_calls"][0]["id"] = [rng.randrange(9)]
        rows[2]["tool_call_id"] = [1]
        return {"messages": rows}, "messages"
    if kind == 14:  # an assistant turn opening the conversation, or none at all
        return {"messages": rng.choice([conversation("sky")[1:], conversation("sky")[:1]])}, "messages"
    if kind == 15:
        return {"messages": with_call(call(arguments={"key": rng.choice([float("inf"), -1e308, 2**80])} | {
            "deep": json.loads(nested(40))}))}, "messages"
    # a prompt/response row (after a good one): a response that calls what it cannot, or of the wrong type
    prompt = conversation("sky")[:1]
    response, field = rng.choice([('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', "response"),
                                  ("<tool_call>" + nested(50_000) + "</tool_call>", "response"),
                                  ("<tool_call>{bad</tool_call>", "response"), (5, "response"), ("", "response"),
                                  (None, "response"), (["blue"], "response")])
    if rng.random() < 0.3:
        prompt, field = rng.choice([5, [], [{"role": "user"}], json.loads(nested(500)), [[{"role": "user"}]]]), "prompt"
        response = "blue"
    return {"prompt": prompt, "response": response}, field


def write_case(root: Path, n: int, row: object) -> Path:
    path = root / f"case{n:03d}.jsonl"
    prompt_response = isinstance(row, dict) and "response" in row
    good = json.dumps({"prompt": conversation("banana")[:1], "response": "yellow"} if prompt_response
                      else {"messages": conversation("banana")}).encode()
    bad = row if isinstance(row, bytes) else json.dumps(row).encode()
    path.write_bytes(good + b"\n" + bad + b"\n")
    return path


@pytest.mark.timeout(300)
def test_hostile_sft_rows_are_refused_naming_row_and_field_or_skipped(task, tmp_path, caplog):
    rng = random.Random(38)
    tokenizer, schemas = task["tokenizer"], task["schemas"]
    slowest, refusals = 0.0, 0
    for n in range(300):
        row, field = hostile_row(rng)
        path = write_case(tmp_path, n, row)
        start = time.perf_counter()
        with pytest.raises(DatasetError) as err:
            SFTDataset([path], tokenizer, max_length=100_000, tools=schemas)
        message = str(err.value)
        where = f"case {n}: {message[:400]}"
        assert message.startswith("1 bad row(s) in the dataset: ") and "\n" not in message, where  # one line
        # 'messages' or where in it ('messages[0].content')
        assert any(f"{path}: row 1: field '{f}" in message for f in field.split("|")), where
        assert len(message) < 700, where  # the value is named, never printed whole
        with caplog.at_level(logging.WARNING, logger="rlcore.data.sft"):
            kept = SFTDataset([path], tokenizer, max_length=100_000, tools=schemas, on_bad_row="skip")
        assert [e.row for e in kept.examples] == [0] and kept.stats["bad_rows"] == 1, where
        assert any(f"row 1: field '{f}" in caplog.text for f in field.split("|")), where
        caplog.clear()
        slowest = max(slowest, time.perf_counter() - start)
        refusals += 1
    assert refusals == 300 and slowest < 60, f"a case took {slowest:.1f} s"  # never hangs: milliseconds each


def test_agent_rows_without_their_tools_name_the_key_and_the_first_rows(task, tmp_path, caplog):
    """200 tool conversations with no tools given: one line naming data.tools, the first rows and the
    count; skipped and counted with on_bad_row=skip; a row's own tools column answers for it."""
    tokenizer, schemas = task["tokenizer"], task["schemas"]
    rows = [{"messages": conversation(["banana", "sky", "grass"][i % 3])} for i in range(200)]
    rows[7] = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}  # no call
    path = write_rows(rows, tmp_path / "agent.parquet")
    with pytest.raises(DatasetError) as err:
        SFTDataset([path], tokenizer, max_length=4096)
    assert str(err.value) == (
        f"199 bad row(s) in the dataset: {path}: 199 rows (0, 1, 2, 3, 4, ...): field 'messages': calls tools, but no "
        "tools are given (data.tools is empty and the row has no 'tools' of its own): the chat template lists the tools "
        "in the prompt, so the model would learn calls against a prompt that lists none")
    with caplog.at_level(logging.WARNING, logger="rlcore.data.sft"):
        kept = SFTDataset([path], tokenizer, max_length=4096, on_bad_row="skip")
    assert [e.row for e in kept.examples] == [7] and kept.stats["bad_rows"] == 199
    assert "skipped 199 bad SFT row(s) (data.on_bad_row=skip): " in caplog.text and "199 rows (0, 1, 2, 3, 4, ...)" in caplog.text
    # a tool that is not among data.tools, or not in the row's own tools column (which wins for its row)
    other = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    rows = [{"messages": conversation("banana"), "tools": json.dumps(schemas)},
            {"messages": conversation("sky"), "tools": json.dumps(other)},
            {"messages": conversation("grass"), "tools": None}]
    path = write_rows(rows, tmp_path / "own.jsonl")
    with pytest.raises(DatasetError, match=r"own.jsonl: 2 rows \(1, 2\): field 'messages': calls 'lookup', which is not "
                                           r"among the tools given \(search\)$"):
        SFTDataset([path], tokenizer, max_length=4096, tools=other)
    with pytest.raises(DatasetError, match=r"own.jsonl: row 1: field 'messages': calls 'lookup', which is not among the "
                                           r"tools given \(search\)$"):  # its own column wins over data.tools
        SFTDataset([path], tokenizer, max_length=4096, tools=schemas)
    kept = SFTDataset([path], tokenizer, max_length=4096, tools=schemas, on_bad_row="skip")
    assert [e.row for e in kept.examples] == [0, 2] and kept.stats["bad_rows"] == 1


def _sft(task, tmp_path, data: Path, *overrides: str) -> list[str]:
    return ["sft", str(CONFIG_DIR / "tiny_sft.yaml"), f"model.path={task['model']}", f"data.train_files=[{data}]",
            "data.max_length=4096", "trainer.device=cpu", "trainer.loggers=[jsonl]", f"trainer.output_dir={tmp_path / 'out'}",
            *overrides]


@pytest.fixture(scope="module")
def model(task):
    """A tiny Qwen2 folder with the task's tokenizer (what `rlcore sft` loads the tokenizer from)."""
    save_qwen2_model(task["tokenizer"], task["root"] / "model", hidden_size=64, layers=1)
    return {**task, "model": str(task["root"] / "model")}


def test_rlcore_sft_refuses_hostile_agent_data_in_one_line_before_any_worker_starts(model, tmp_path, capsys, monkeypatch):
    import rlcore.trainer.sft as sft

    def no_workers(*args, **kwargs):
        raise AssertionError("a worker group was built: the data should have been refused first")

    monkeypatch.setattr(sft, "build_worker_groups", no_workers)
    deep = write_case(tmp_path, 0, {"messages": with_call(call(arguments=nested(50_000)))})
    plain = write_rows([{"messages": conversation(t)} for t in ("banana", "sky")], tmp_path / "plain.jsonl")
    (tmp_path / "search.json").write_text(json.dumps({"type": "function", "function": {"name": "search"}}))
    tools = f"data.tools=[{model['tool']}]"
    cases = [
        ([deep, tools], f"{deep}: row 1: field 'messages': message 1: tool_calls[0].function.arguments: nested deeper "
                        "than 32 levels"),
        ([deep, tools, "data.on_bad_row=skip", "trainer.batch_size=2"],  # skipped (a warning line): 1 row is left
         "data.train_files: 1 usable rows, fewer than one batch of trainer.batch_size=2"),
        ([plain], f"{plain}: 2 rows (0, 1): field 'messages': calls tools, but no tools are given (data.tools is empty"),
        ([plain, f"data.tools=[{tmp_path / 'search.json'}]"], "calls 'lookup', which is not among the tools given (search)"),
    ]
    for (data, *overrides), says in cases:
        argv = _sft(model, tmp_path, data, *overrides)
        assert main(argv) == 2, argv
        out, err = capsys.readouterr()
        lines = [line for line in err.splitlines() if not line.startswith("[transformers]")]
        # one error line, last; before it only the skip's warning (shown unless an earlier test in this
        # process set up Prefect's console logging, which then takes rlcore's records)
        assert not out and "Traceback" not in err and [ln for ln in lines if "error" in ln] == lines[-1:], err
        assert all("WARNING" in line for line in lines[:-1]) and len(lines) <= 1 + overrides.count("data.on_bad_row=skip")
        assert lines[-1].startswith("rlcore: error: ") and says in lines[-1], err
