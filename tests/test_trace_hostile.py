"""`rlcore trace RUN_DIR` on a few hundred generated hostile trace files and arguments (a seeded
generator): bytes that are not UTF-8, lines cut short, JSON of the wrong shape or types, nesting
past the parser's limit, empty strings, absurd numbers in `--step`/`--sample`, paths that are not
a run. Each case runs `rlcore.cli.main` in this process with stderr captured, and ends in
milliseconds: exit 2 and one line naming the file (and the line, where one is at fault) or the
argument; or, where the asked conversation is still readable beside unreadable lines, exit 0 with
the conversation and one note naming the lines skipped. None prints a traceback. One real
subprocess checks the console a user sees."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from timing import scaled  # tests/ is on sys.path (pytest rootdir conftest)

from rlcore.cli import main

GOOD_SAMPLE = {"conversation": True, "request_id": "0-1/0", "reward": 1.0, "finish": "answer",
               "prompt": [{"role": "user", "content": "8382+2427="}],
               "turns": [{"turn": 1, "kind": "assistant", "text": "<tool_call>...</tool_call>", "tokens": 26},
                         {"turn": 1, "kind": "tool", "tool": "calculator", "arguments": {"expression": "8382+2427"},
                          "ok": True, "error": None, "latency_s": 0.01, "result": "10809"},
                         {"turn": 2, "kind": "assistant", "text": "#### 10809", "tokens": 8}],
               "episode": {"turns": 2, "tool_calls": 1, "tool_errors": 0, "answer_has_tool_result": True}}


def good_record(step: int) -> bytes:
    return json.dumps({"step": step, "samples": [GOOD_SAMPLE, {**GOOD_SAMPLE, "request_id": "0-2/0"}]}).encode() + b"\n"


def nested(depth: int, open_: str = "[", close: str = "]") -> str:
    return open_ * depth + close * depth


def hostile_line(rng: random.Random) -> bytes:
    """One line that is not a step record rlcore could have written."""
    kind = rng.randrange(14)
    if kind == 0:  # bytes that are not UTF-8, alone or inside a JSON string
        return bytes(rng.randrange(0x80, 0x100) for _ in range(rng.randint(1, 40))) + b"\n"
    if kind == 1:
        noise = bytes(rng.randrange(0x80, 0x100) for _ in range(4))
        return b'{"step": 1, "samples": [{"conversation": true, "prompt": "\xff\xfe' + noise + b'"}]}\n'
    if kind == 2:  # a record cut short (a killed run), or JSON that is not a record
        whole = good_record(rng.randint(0, 9))
        return whole[: rng.randint(1, len(whole) - 3)] + b"\n"
    if kind == 3:
        return rng.choice([b"[1, 2, 3]", b"42", b'"a string"', b"null", b"true", b"{}", b'""', b"{,}", b"\x00\x00",
                           b"NaN", b"-Infinity", b'{"samples": []}']) + b"\n"
    if kind == 4:  # a step of the wrong type (a float the parser makes of 1e999 too)
        step = rng.choice(['"3"', "1.5", "true", "null", "[]", "{}", "1e999", "NaN", '""', "-0.0"])
        return f'{{"step": {step}, "samples": []}}\n'.encode()
    if kind == 5:
        samples = rng.choice(['{}', '"x"', "5", "[1, 2]", '[null]', '[[]]', '[""]'])
        return f'{{"step": 2, "samples": {samples}}}\n'.encode()
    if kind == 6:
        flag = rng.choice(['"yes"', "1", "null", "[]"])
        return f'{{"step": 2, "validation": {flag}, "samples": []}}\n'.encode()
    if kind == 7:  # nesting past the parser's limit, as a line or inside a record
        depth = rng.choice([1_500, 10_000, 100_000])
        body = nested(depth) if rng.random() < 0.5 else nested(depth, '{"a":', "}").replace('{"a":}', '{"a":1}')
        return (body if rng.random() < 0.5 else f'{{"step": 1, "samples": [{{"x": {body}}}]}}').encode() + b"\n"
    if kind == 8:  # nesting the parser takes, deeper than any record rlcore writes
        inner = nested(rng.randint(70, 900))
        return f'{{"step": 1, "samples": [{{"conversation": true, "turns": [{{"arguments": {inner}}}]}}]}}\n'.encode()
    if kind == 9:  # a number of more than 4,300 digits
        return f'{{"step": {"9" * rng.randint(4_301, 20_000)}, "samples": []}}\n'.encode()
    if kind == 10:
        return b'{"step": 1, "samples": [' + b"\x80" * rng.randint(1, 10) + b"]}\n"
    if kind == 11:  # control characters, a BOM in the middle, a lone surrogate escape is valid JSON: keep it a non-record
        return rng.choice([b"\x1b[31m red \x1b[0m", b"\xef\xbb\xbf{\"step\": }", b'["\\udc80"]', b"\t\x0b\x0c x"]) + b"\n"
    if kind == 12:
        return b"{" * rng.randint(1, 5000) + b"\n"
    return json.dumps(rng.choice([[{"step": 1}], {"step": [1]}, {"step": {"n": 1}}, {"Step": 1}])).encode() + b"\n"


def bad_sample(rng: random.Random) -> tuple[dict, str]:
    """A recorded conversation whose fields `rlcore trace` reads are of the wrong shape, and the field named."""
    kind = rng.randrange(3)
    if kind == 0:
        return {**GOOD_SAMPLE, "prompt": rng.choice([5, {"role": "user"}, [1, 2], ["hi"], True, 1e308])}, "prompt"
    if kind == 1:
        return {**GOOD_SAMPLE, "turns": rng.choice(["abc", {"kind": "tool"}, [1], ["x"], [[]], 0])}, "turns"
    turns = [dict(t) for t in GOOD_SAMPLE["turns"]]
    turns[1]["latency_s"] = rng.choice(["0.5", None, [], {}, True, ""])
    return {**GOOD_SAMPLE, "turns": turns}, "turns[1].latency_s"


@dataclass
class Case:
    name: str
    lines: list[bytes] | None  # trace.jsonl's lines; None: no file
    args: list[str] = field(default_factory=list)
    code: int = 2
    says: tuple[str, ...] = ()  # what the one line must contain (besides the file's path)
    shown: str = ""  # exit 0: how the conversation printed starts
    run_dir: str | None = None  # a RUN_DIR other than the case's folder
    file: str = "trace.jsonl"  # where `lines` go (val_trace.jsonl: what --validation reads)


def cases(rng: random.Random) -> list[Case]:
    out: list[Case] = []
    for i in range(90):  # nothing readable: one error naming the file and the first unreadable lines
        bad = [hostile_line(rng) for _ in range(rng.randint(1, 4))]
        out.append(Case(f"unreadable-{i}", bad, says=("no step recorded a conversation", "unreadable line(s) (line ")))
    for i in range(90):  # a readable step beside unreadable lines: shown, and one note naming them
        bad = [hostile_line(rng) for _ in range(rng.randint(1, 5))]
        at = rng.randint(0, len(bad))
        lines = bad[:at] + [good_record(7)] + bad[at:]
        out.append(Case(f"skipped-{i}", lines, ["--step", "7", "--sample", str(rng.randint(0, 1))], code=0,
                        says=("rlcore: note:", f"skipped {len(bad)} unreadable line(s)"), shown="step 7, conversation"))
    for i in range(40):  # the asked conversation has fields of the wrong shape: named with its line
        sample, name = bad_sample(rng)
        lines = [good_record(1), json.dumps({"step": 2, "samples": [sample]}).encode() + b"\n"]
        out.append(Case(f"bad-sample-{i}", lines, ["--step", "2"], says=("line 2: step 2, --sample 0:", f"field '{name}'")))
    absurd = ["99999999999999999999999999999", "-1", "-99999999999999999999", "0", str(2**63), "8", "1000000000"]
    for i in range(40):  # absurd step and sample numbers on a good file
        step, sample = rng.choice(absurd), rng.choice(absurd + ["1", "0"])
        says = ("no step",) if step != "0" else ("--sample is 0..1",) if sample not in ("0", "1") else ()
        code = 0 if step == "0" and sample in ("0", "1") else 2
        out.append(Case(f"absurd-{i}", [good_record(0)], ["--step", step, "--sample", sample], code=code, says=says,
                        shown="step 0, conversation" if code == 0 else ""))
    for i in range(20):  # --validation reads val_trace.jsonl, as hostile as trace.jsonl
        bad = [hostile_line(rng) for _ in range(rng.randint(1, 3))]
        if i % 2:
            out.append(Case(f"validation-{i}", [*bad, good_record(5).replace(b'"step": 5', b'"step": 5, "validation": true')],
                            ["--validation"], code=0, says=("rlcore: note:", f"skipped {len(bad)} unreadable line(s)"),
                            shown="validation at step 5, conversation 1 of 2", file="val_trace.jsonl"))
        else:
            out.append(Case(f"validation-{i}", bad, ["--validation", "--step", "0"], file="val_trace.jsonl",
                            says=("no validation recorded a conversation", "unreadable line(s) (line ")))
    for i in range(30):  # what argparse refuses: not integers
        flag = rng.choice(["--step", "--sample"])
        value = rng.choice(["1e9", "inf", "nan", "", " ", "0x10", "1.0", "abc", "9" * 5000, "\x00", "--", "１e3"])
        out.append(Case(f"argparse-{i}", [good_record(0)], [flag, value], says=(f"argument {flag}",)))
    out += [Case("no-file", None, says=("no such file",)),
            Case("empty-file", [], says=("none is readable",)),
            Case("blank-lines", [b"\n", b"   \n", b"\t\n"], says=("none is readable",)),
            Case("trace-is-a-folder", None, says=("not a file",)),
            Case("empty-run-dir", None, says=("RUN_DIR is empty",), run_dir=""),
            Case("validation-absent", [good_record(3)], ["--validation"], says=("no such file",), file="val_trace.jsonl")]
    return out


@pytest.mark.timeout(300)
def test_rlcore_trace_on_hostile_files_and_arguments_exits_2_with_one_line(tmp_path, capsys):
    rng = random.Random(38)
    slowest = 0.0
    checked = cases(rng)
    assert len(checked) >= 290
    for n, case in enumerate(checked):
        run = tmp_path / f"{n:03d}"
        run.mkdir()
        trace = run / case.file
        if case.name == "validation-absent":
            (run / "trace.jsonl").write_bytes(b"".join(case.lines or []))
        elif case.lines is not None:
            trace.write_bytes(b"".join(case.lines))
        elif case.name == "trace-is-a-folder":
            trace.mkdir()
        start = time.perf_counter()
        try:
            code = main(["trace", str(run) if case.run_dir is None else case.run_dir, *case.args])
        except SystemExit as stop:  # argparse's refusal
            code = stop.code
        slowest = max(slowest, time.perf_counter() - start)
        out, err = capsys.readouterr()
        where = f"{case.name}: exit {code}\nstdout: {out[:300]!r}\nstderr: {err[:600]!r}"
        assert code == case.code, where
        assert "Traceback" not in err and "Traceback" not in out, where
        said = err.strip().splitlines()
        if case.name.startswith("argparse"):  # argparse's usage line, then its one error line
            assert said[-1].startswith("rlcore trace: error: ") and all(s in said[-1] for s in case.says), where
            continue
        if code == 0:
            assert out.startswith(case.shown), where
            assert len(said) == (1 if case.says else 0), where
        else:
            assert len(said) == 1 and said[0].startswith("rlcore: error: ") and not out, where
        if said:
            line = said[0]
            assert all(s in line for s in case.says), where
            if case.run_dir is None:
                assert str(trace) in line, where
    assert slowest < 60, f"a case took {slowest:.1f} s"  # never hangs: each is milliseconds here


@pytest.mark.slow  # a real process; the same refusals in process: test_rlcore_trace_on_hostile_files_and_arguments_exits_2_with_one_line
def test_the_console_shows_one_line_and_no_traceback(tmp_path):
    """The one real process: what a user's terminal gets for a file that is nothing but bad lines."""
    (tmp_path / "trace.jsonl").write_bytes(b"\xff\xfe\x00garbage\n" + nested(50_000).encode() + b"\n" + b'{"step": "x"}\n')
    done = subprocess.run([sys.executable, "-c", "import sys; from rlcore.cli import main; sys.exit(main())",
                           "trace", str(tmp_path), "--step", "99999999999999999999"],
                          capture_output=True, text=True, timeout=scaled(120), env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    assert done.returncode == 2 and not done.stdout
    assert done.stderr.splitlines() == [
        f"rlcore: error: {tmp_path / 'trace.jsonl'}: no step recorded a conversation (none is readable); skipped 3 "
        "unreadable line(s) (line 1: not UTF-8 (byte 0xff at column 1); line 2: nested too deep for the JSON parser; "
        "line 3: field 'step': expected an integer, got str)"]


def test_a_reader_that_stops_early_is_no_error(tmp_path, monkeypatch):
    """`rlcore trace RUN | head -1`: the pipe closes after the first line; the command still exits 0
    without a traceback (in this process: stdout is a pipe whose reading end is closed)."""
    (tmp_path / "trace.jsonl").write_bytes(good_record(1))
    read, write = os.pipe()
    os.close(read)
    with os.fdopen(write, "w") as closed:
        monkeypatch.setattr(sys, "stdout", closed)
        assert main(["trace", str(tmp_path)]) == 0
        monkeypatch.undo()
