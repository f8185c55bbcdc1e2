"""Tools cannot crash a run: whatever a tool returns and whatever tool-call text a model writes
becomes a counted error the model reads, never an exception out of the rollout.

Fuzzed with seeded random inputs (thousands each): tool-call texts through `parse_tool_calls` (JSON
nested past Python's recursion limit, megabytes long, lone-surrogate escapes, bytes decoded with
`surrogateescape`, broken tags), and tool results through the real path a rollout takes: the
sandboxed tool pool's worker processes, the agent's tool message, the chat template and a real
ChatML BPE tokenizer (lone surrogates, bytes, huge and deeply nested values, str subclasses,
exceptions with hostile messages). Then a real taught model's agent rollout with a hostile tool."""

from __future__ import annotations

import json
import random
import string

import pytest

from rlcore.rewards.tools import ToolPool
from rlcore.rollout.agent import MAX_ARGUMENT_DEPTH, ChatTurns, _Episode, model_text, nesting_depth, parse_tool_calls

SEED = 25


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _random_json(r: random.Random, depth: int) -> object:
    if depth <= 0 or r.random() < 0.3:
        return r.choice([None, True, 1, -2.5, 10**r.randint(1, 30), "x", "\u00e9\u4e2d", "", float("nan")])
    if r.random() < 0.5:
        return [_random_json(r, depth - 1) for _ in range(r.randint(0, 3))]
    return {r.choice(["a", "expression", "\u00fc", ""]): _random_json(r, depth - 1) for _ in range(r.randint(0, 3))}


def _nested(depth: int, leaf: str = "1") -> str:
    return "[" * depth + leaf + "]" * depth


def _call_text(r: random.Random) -> str:
    """One random piece of an assistant turn: a call in one of many broken or hostile shapes."""
    kind = r.randrange(12)
    if kind == 0:  # nested far past the recursion limit, in the call or in its arguments
        depth = r.choice([MAX_ARGUMENT_DEPTH + 1, 999, 1000, 5000, 100_000])
        return (f"<tool_call>{_nested(depth)}</tool_call>" if r.random() < 0.5 else
                f'<tool_call>{{"name": "f", "arguments": {{"x": {_nested(depth)}}}}}</tool_call>')
    if kind == 1:  # nesting inside arguments given as a JSON string
        return f'<tool_call>{{"name": "f", "arguments": {json.dumps(json.dumps({"x": json.loads(_nested(r.randint(1, 60)))}))}}}</tool_call>'
    if kind == 2:  # lone surrogates through JSON escapes, in the name and the arguments
        s = "\\ud" + r.choice("89ab") + f"{r.randrange(256):02x}"
        return f'<tool_call>{{"name": "f{s}", "arguments": {{"x": "a{s}"}}}}</tool_call>'
    if kind == 3:  # bytes that are not UTF-8, decoded the way a shell wrapper does
        return "<tool_call>" + bytes(r.randrange(256) for _ in range(r.randint(1, 64))).decode("utf-8", "surrogateescape") + "</tool_call>"
    if kind == 4:  # big
        return '<tool_call>{"name": "f", "arguments": {"x": "' + "y" * (10**6 if r.random() < 0.1 else 10**5) + '"}}</tool_call>'
    if kind == 5:  # random JSON values in every position
        return f'<tool_call>{json.dumps({"name": _random_json(r, 2), "arguments": _random_json(r, 6)})}</tool_call>'
    if kind == 6:  # a well-formed call
        return f'<tool_call>{json.dumps({"name": "calculator", "arguments": {"expression": "1+2"}})}</tool_call>'
    if kind == 7:  # integers too long for Python's int parser
        return '<tool_call>{"name": "f", "arguments": {"x": ' + "9" * r.choice([4301, 50_000]) + "}}</tool_call>"
    if kind == 8:  # tags broken, doubled, nested
        return r.choice(["<tool_call>", "</tool_call>", "<tool_call><tool_call>{}</tool_call></tool_call>",
                         "<tool_call>" * r.randint(1, 500)])
    if kind == 9:
        return "".join(r.choice(string.printable) for _ in range(r.randint(0, 200)))
    if kind == 10:
        return "".join(chr(r.randrange(0x110000)) for _ in range(r.randint(1, 50)))
    return f'<tool_call>{{"name": "f", "arguments": {json.dumps(json.dumps(_random_json(r, 4)))}}}</tool_call>'


def test_parse_tool_calls_never_raises_on_thousands_of_hostile_turns():
    r = random.Random(SEED)
    readable = unreadable = 0
    for _ in range(3000):
        text = "".join(_call_text(r) for _ in range(r.randint(1, 3)))
        for call in parse_tool_calls(text):
            if call.error is None:
                assert isinstance(call.name, str) and isinstance(call.arguments, dict)
                assert nesting_depth(call.arguments) <= MAX_ARGUMENT_DEPTH
                json.dumps(call.arguments)  # what the trace and the reward's extra_info do with it
                readable += 1
            else:
                assert call.error.startswith("InvalidToolCall: ") and len(call.error) < 400
                unreadable += 1
            assert _encodable(model_text(call.name)[0]) and _encodable(model_text(call.error or "")[0])
    assert readable > 300 and unreadable > 1000  # both kinds were exercised
    deep = parse_tool_calls(f'<tool_call>{{"name": "f", "arguments": {_nested(100_000)}}}</tool_call>')
    assert [c.error for c in deep] == [f"InvalidToolCall: nested deeper than {MAX_ARGUMENT_DEPTH} levels"]


HOSTILE_TOOL = r'''
import random

class Text(str):
    """A str subclass: the driver could not unpickle it (this module is the worker's, not the driver's)."""

class Loud(Exception):
    def __str__(self):
        raise RuntimeError("no message for you")

def _nested(depth, leaf):
    for _ in range(depth):
        leaf = [leaf]
    return leaf

def hostile(seed: int):
    """Returns (or raises) something hostile, chosen by the seed.

    Args:
        seed: which
    """
    r = random.Random(seed)
    kind = r.randrange(16)
    if kind == 0:
        return "ok " + chr(0xD800 + r.randrange(0x800)) + " tail"
    if kind == 1:
        return bytes(r.randrange(256) for _ in range(40)).decode("utf-8", "surrogateescape")
    if kind == 2:
        return bytes(r.randrange(256) for _ in range(40))
    if kind == 3:
        return _nested(r.choice([10, 900, 5000]), "x")
    if kind == 4:
        return {"a": _nested(r.randint(1, 50), {"b": "\udc80"})}
    if kind == 5:
        return "y" * r.choice([10**5, 10**7])
    if kind == 6:
        return Text("a str subclass")
    if kind == 7:
        raise ValueError("bad \udc80 input " * r.randint(1, 10**5))
    if kind == 8:
        raise Loud()
    if kind == 9:
        return 10 ** 5000
    if kind == 10:
        return {(1, 2): "tuple key"}
    if kind == 11:
        return object()
    if kind == 12:
        return float("nan")
    if kind == 13:
        return {"plain": ["json", 1, 2.5, None]}
    if kind == 14:
        return "\u00e9\u4e2d\U0001F600 fine"
    raise SystemExit(3)
'''


@pytest.mark.slow
def test_every_hostile_tool_result_reaches_the_model_as_text_and_failures_are_counted(own_model, tmp_path):
    """2,000 hostile results through the real pool (worker processes, pickled replies), the
    agent's tool message, the ChatML template and the BPE tokenizer: each renders and tokenizes;
    a result that is not valid text is a counted error."""
    from rlcore.rollout.agent import AgentLoop
    from rlcore.workers.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(own_model.model_dir))
    turns = ChatTurns(tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    (tmp_path / "hostile.py").write_text(HOSTILE_TOOL)
    n = 2000
    with ToolPool([f"{tmp_path}/hostile.py:hostile"], num_workers=2, timeout_s=30.0, memory_mb=1024, max_chars=300) as pool:
        for i in range(n):
            pool.submit(i, "hostile", {"seed": i})
        outcomes = []
        while pool.pending:
            outcomes += pool.poll(1.0)
    assert sorted(o.call_id for o in outcomes) == list(range(n))
    loop = AgentLoop.__new__(AgentLoop)  # only its tool-message method is exercised here
    ok = errors = 0
    for o in outcomes:
        ep = _Episode(row=0, key=0, prompt_ids=[], messages=[])
        message = loop._result(ep, o.name, o.text, o.ok, o.error, o.timed_out, o.latency_s)
        ids = turns.between(im_end, [message])  # raised TypeError (TextEncodeInput) on lone surrogates before
        assert ids and _encodable(message["content"]) and len(message["content"]) <= 300 + len("Error: ")
        assert ep.tool_errors == (0 if ep.trace[-1]["ok"] else 1)
        ok += ep.trace[-1]["ok"]
        errors += ep.tool_errors
    by_kind = {}
    for o in outcomes:
        by_kind.setdefault(random.Random(o.call_id).randrange(16), []).append(o)
    assert all(not o.ok for k in (0, 1, 2, 4, 7, 8, 9, 10, 11, 12, 15) for o in by_kind[k])
    assert all(o.ok and o.text == "a str subclass" for o in by_kind[6])
    assert all(o.ok and json.loads(o.text) == {"plain": ["json", 1, 2.5, None]} for o in by_kind[13])
    assert all(o.ok and o.truncated and o.text == "y" * 300 for o in by_kind[5])
    assert "not valid Unicode" in by_kind[0][0].text and "tool returned bytes" in by_kind[2][0].text
    assert by_kind[8][0].text == "Error: Loud" and by_kind[15][0].text == "Error: SystemExit: 3"
    assert ok > 300 and errors > 1000 and ok + errors == n


HOSTILE_CALCULATOR = r'''
def calculator(expression: str):
    """A calculator that answers in every way a broken tool can.

    Args:
        expression: a sum
    """
    kind = sum(map(ord, expression)) % 5
    if kind == 0:
        return "12" + chr(0xDC80)  # bytes that were not UTF-8, decoded with surrogateescape
    if kind == 1:
        return expression.encode()
    if kind == 2:
        out = "x"
        for _ in range(5000):
            out = [out]
        return out
    if kind == 3:
        raise ValueError("cannot add " + chr(0xD800) * 3)
    return "x" * 10**6
'''


@pytest.mark.slow
def test_an_agent_rollout_with_a_hostile_tool_finishes_and_counts_its_errors(tmp_path, tmp_path_factory):
    """A real taught model calling a calculator that returns lone surrogates, bytes, 5,000-deep
    lists, a megabyte, or raises with surrogates in its message: the rollout finishes, each bad
    result is an error the model reads, counted, and every tool turn was tokenized."""
    from test_agent import SAMPLED, _loop, _prompts, _taught_caller  # tests/ is on sys.path

    folder, tokenizer, _ = _taught_caller("llama", tmp_path_factory)
    (tmp_path / "broken.py").write_text(HOSTILE_CALCULATOR)
    with ToolPool([f"{tmp_path}/broken.py:calculator"], num_workers=2, timeout_s=20.0, max_chars=200) as pool:
        loop, _ = _loop(folder, tokenizer, pool)
        gen = loop.generate(_prompts(tokenizer, 8, tmp_path), SAMPLED)
    calls, errors = int(gen.meta["agent_tool_calls"].sum()), int(gen.meta["agent_tool_errors"].sum())
    assert calls >= 8 and 0 < errors <= calls
    tool_messages = [m for messages in gen.meta["agent_messages"] for m in messages if m["role"] == "tool"]
    assert tool_messages and all(_encodable(m["content"]) and len(m["content"]) <= 200 + len("Error: ") for m in tool_messages)
    kinds = {k for m in tool_messages for k in ("not valid Unicode", "tool returned bytes", "is not JSON", "cannot add")
             if k in m["content"]}
    assert len(kinds) >= 2, kinds
    assert set(gen.meta["agent_finish"]) <= {"answer", "max_turns", "max_total_tokens", "max_new_tokens", "end_token"}
