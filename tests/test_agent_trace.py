"""What a person debugging an agent run reads: trace.jsonl's recorded conversations (the model's text
per turn, each call's name and arguments, the tool's result, cut and with secrets redacted, for
`trainer.trace_samples` trajectories per step), `rlcore trace` printing one, the trace keys refused
when they would change nothing, the agent numbers validation reports per data source, and
validation's own record (val_trace.jsonl), from which every `val/agent/*` number is recomputed.

The rollouts are the real agent loop and sandboxed tool pool on the tool example's tokenizer, with
an engine that stands in for the model by writing a script of turns per sample (the texts and
numbers checked here are the loop's bookkeeping, not a model's skill)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rlcore.cli import main
from rlcore.config import ConfigError, load_config
from rlcore.data import PromptLoader, RLDataset
from rlcore.data.io import write_rows
from rlcore.example.tokenizer import build_tool_tokenizer
from rlcore.protocol import Batch
from rlcore.rewards.tools import ToolPool
from rlcore.rollout import SamplingParams
from rlcore.rollout.agent import AgentLoop, AgentSettings, sample_key
from rlcore.trainer.metrics import agent_metrics, answer_uses_tool_result
from rlcore.trainer.step_log import StepLog, log_settings
from rlcore.trainer.tracing import (
    format_trajectory,
    read_trace,
    recorded_conversation,
    sample_records,
    step_record,
    traced_rows,
)
from rlcore.trainer.validation import RLValidator, agent_numbers, agent_validation_metrics, recorded_agent_numbers

TOOL = '''
def lookup(key: str, api_key: str = "") -> str:
    """A value from the user's store.

    Args:
        key: what to look up
        api_key: the store's credential
    """
    if key == "secret":
        return "see https://admin:hunter2@db.internal/table?token=abc123 for the value 42"
    if key == "long":
        return "x" * 500
    if key == "broken":
        raise KeyError(key)
    return key.upper()
'''

# Per prompt (one sample each), the turns the stand-in model writes: a call, then an answer.
SCRIPTS = {
    "q0": ['<tool_call>{"name": "lookup", "arguments": {"key": "secret", "api_key": "sk-live-1"}}</tool_call>', "#### 42"],
    "q1": ['<tool_call>{"name": "lookup", "arguments": {"key": "long"}}</tool_call>', "#### 7"],
    "q2": ["#### 3"],  # answers without a call
    "q3": ['<tool_call>{"name": "lookup", "arguments": {"key": "broken"}}</tool_call>', "#### 0"],
    "q4": ['<tool_call>{"name": "lookup", "arguments": {"key": "abc"}}</tool_call>', "#### ABC"],
}


class ScriptedModel:
    """Stands in for the model: answers each sample's context with the next turn of its script."""

    def __init__(self, tokenizer, scripts: dict[int, list[str]]) -> None:
        self.tokenizer, self.scripts = tokenizer, scripts
        self.pad_token_id = tokenizer.pad_token_id
        self.turn: dict[int, int] = {}

    def generate_turns(self, contexts, params, max_tokens, keys):
        out = []
        for key in keys:
            k = self.turn[key] = self.turn.get(key, -1) + 1
            ids = self.tokenizer.encode(self.scripts[key][k], add_special_tokens=False) + [self.tokenizer.eos_token_id]
            out.append((ids, [0.0] * len(ids)))
        return out


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    """One agent rollout of the five scripted prompts, two data sources, with the real tool pool."""
    root = tmp_path_factory.mktemp("trace")
    (root / "store.py").write_text(TOOL)
    tokenizer = build_tool_tokenizer()
    rows = [{"prompt": [{"role": "user", "content": q}], "data_source": "store/a" if i < 3 else "store/b",
             "reward_model": {"ground_truth": "x", "style": "rule"}} for i, q in enumerate(SCRIPTS)]
    dataset = RLDataset([write_rows(rows, root / "p.parquet")], tokenizer, max_prompt_length=32)
    batch = next(PromptLoader(dataset, batch_size=5, seed=0, shuffle=False, drop_last=False).epoch_batches())
    with ToolPool([f"{root / 'store.py'}:lookup"], num_workers=2, max_chars=300) as pool:
        scripts = {sample_key(uid, 0): SCRIPTS[q] for uid, q in zip(batch.meta["uid"], SCRIPTS)}
        loop = AgentLoop(ScriptedModel(tokenizer, scripts), tokenizer, [tokenizer.eos_token_id],
                         AgentSettings(max_turns=3, max_total_tokens=400), tools=pool)
        gen = loop.generate(batch, SamplingParams(n=1, max_new_tokens=200))
    gen.tensors["scores"] = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0])
    return gen


GROUPS = SimpleNamespace(rollout=None, actor=None)  # in-process, not data-parallel: no ranks to derive


def test_trace_records_the_conversation_of_a_sample_of_trajectories(rollout, tmp_path, capsys):
    samples = sample_records(rollout, GROUPS, n=1)
    record = step_record(3, "sync", {"samples": samples}, {}, {}, conversations=3, max_chars=80)
    recorded = [s for s in record["samples"] if s.get("conversation")]
    assert [s["request_id"] for s in recorded] == ["0-0/0", "0-2/0", "0-4/0"] == \
        [record["samples"][i]["request_id"] for i in traced_rows(5, 3)]  # evenly spread: first, middle, last
    first = recorded[0]
    assert first["prompt"] == [{"role": "user", "content": "q0"}] and first["reward"] == 1.0 and first["finish"] == "answer"
    call, result = first["turns"][0], first["turns"][1]
    assert call["kind"] == "assistant" and call["text"].startswith('<tool_call>{"name": "lookup"')
    assert result["kind"] == "tool" and result["tool"] == "lookup" and result["ok"]
    # secrets redacted: a secret-named argument whole, a URL's credentials and query values
    assert result["arguments"] == {"key": "secret", "api_key": "***"}
    assert "hunter2" not in json.dumps(record) and "abc123" not in json.dumps(record) and "sk-live" not in json.dumps(record)
    assert result["result"] == "see https://***@db.internal/table?token=*** for the value 42"
    assert first["turns"][-1]["text"] == "#### 42"
    # the others keep their counts, not their texts
    others = [s for s in record["samples"] if not s.get("conversation")]
    assert len(others) == 2 and all("prompt" not in s and all("text" not in t and "result" not in t for t in s["turns"])
                                    for s in others)
    long_call = sample_records(rollout, GROUPS, n=1)[1]
    cut = step_record(3, "sync", {"samples": [long_call]}, {}, {}, conversations=1, max_chars=80)["samples"][0]
    assert cut["turns"][1]["result"] == "x" * 80 + "... [220 more chars]"  # the pool cut it to 300, the trace to 80

    (tmp_path / "trace.jsonl").write_text(json.dumps(record) + "\n")
    assert main(["trace", str(tmp_path), "--sample", "2"]) == 0
    shown = capsys.readouterr().out
    assert shown.splitlines()[0] == ("step 3, conversation 3 of 3 | request 0-4/0 | reward 1.0 | finished: answer | "
                                     "answer holds the tool result: yes")  # "ABC" is in "#### ABC"
    assert "[user] q4" in shown and '  -> lookup({"key": "abc"}) ok' in shown and "[tool lookup] ABC" in shown
    assert shown.rstrip().endswith("#### ABC")
    assert main(["trace", str(tmp_path), "--step", "9"]) == 2
    assert "no step 9" in capsys.readouterr().err
    broken = format_trajectory(*recorded_conversation(tmp_path, 3, 1)[:2])
    assert "answer holds" not in broken.splitlines()[0]  # no tool answered q2
    assert "[assistant, turn 1" in broken and "#### 3" in broken  # q2 answered without a call


def test_a_failed_call_shows_its_error(rollout):
    rec = step_record(1, "sync", {"samples": sample_records(rollout, GROUPS, n=1)}, {}, {}, 5, 200)["samples"][3]
    text = format_trajectory(1, rec)
    assert '-> lookup({"key": "broken"}) error: KeyError' in text and "[tool lookup] Error: KeyError" in text


def test_a_run_without_agent_records_prompt_and_response():
    gen = Batch(tensors={"response_mask": torch.ones(2, 3), "scores": torch.tensor([0.0, 1.0])},
                meta={"uid": np.array(["a", "b"], dtype=object), "response_text": np.array(["12", "13"], dtype=object),
                      "prompt_messages": [[{"role": "user", "content": "6+6="}], [{"role": "user", "content": "6+7="}]]})
    rec = step_record(1, "sync", {"samples": sample_records(gen, GROUPS, n=1)}, {}, {}, 1, 100)["samples"]
    assert rec[0]["conversation"] and rec[0]["response"] == "12" and "response" not in rec[1]
    assert format_trajectory(1, rec[0]).splitlines()[2:] == ["[user] 6+6=", "[assistant] 12"]


def test_validation_reports_what_agent_episodes_did_per_data_source(rollout):
    meta = {k: list(rollout.meta[k]) for k in ("agent_turns", "agent_tool_calls", "agent_tool_errors", "agent_trace")}
    sources = [str(s) for s in rollout.meta["data_source"]]
    m = agent_validation_metrics(meta, sources)
    assert m["val/agent/turns_mean"] == pytest.approx(9 / 5)  # four call-then-answer episodes, one direct answer
    assert m["val/agent/tool_calls_mean"] == pytest.approx(4 / 5) and m["val/agent/tool_call_rate"] == pytest.approx(4 / 5)
    assert m["val/agent/tool_error_rate"] == pytest.approx(1 / 4)  # lookup("broken") raised
    # of the three a tool answered, q4's answer holds the result ("ABC"); q0's and q1's do not
    assert m["val/agent/answer_has_tool_result"] == pytest.approx(1 / 3)
    assert m["val/store/a/agent/tool_calls_mean"] == pytest.approx(2 / 3) and m["val/store/b/agent/tool_error_rate"] == 0.5
    assert m["val/store/b/agent/answer_has_tool_result"] == 1.0
    # training reports the same numbers under agent/ (one formula)
    train = agent_metrics(rollout)
    assert {k: train[f"agent/{k.removeprefix('val/agent/')}"] for k in m if k.startswith("val/agent/")} == \
        {k: v for k, v in m.items() if k.startswith("val/agent/")}


class ScriptedRollout:
    """Stands in for the rollout worker group: the real agent loop and tool pool, on a model that
    writes each prompt's script (`SCRIPTS`, by the prompt's text)."""

    world_size = 1

    def __init__(self, tokenizer, pool) -> None:
        self.tokenizer, self.pool = tokenizer, pool

    def generate_sequences(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        scripts = {sample_key(uid, 0): SCRIPTS[m[0]["content"]]
                   for uid, m in zip(prompts.meta["uid"], prompts.meta["prompt_messages"])}
        loop = AgentLoop(ScriptedModel(self.tokenizer, scripts), self.tokenizer, [self.tokenizer.eos_token_id],
                         AgentSettings(max_turns=3, max_total_tokens=400), tools=self.pool)
        return loop.generate(prompts, SamplingParams(n=1, max_new_tokens=200))


class AnswerReward:
    """Stands in for the reward group: 1 when the final answer is '#### 42' (what is scored is not tested here)."""

    world_size = 1

    def compute_reward(self, gen: Batch) -> tuple[Batch, dict[str, float | str]]:
        answers = [m[-1]["content"] for m in gen.meta["agent_messages"]]
        scores = torch.tensor([float(a == "#### 42") for a in answers])
        return Batch(tensors={"scores": scores, "acc": scores.clone()}, meta={"response_text": np.array(answers, dtype=object)}), {}


# [2] (fewer recorded conversations than validation samples) is the fast case; [5] runs in the full suite
@pytest.mark.parametrize("conversations", [pytest.param(5, marks=pytest.mark.slow), 2])
def test_validation_is_recorded_and_every_val_agent_number_recomputes_from_it(tmp_path, capsys, conversations):
    """RLValidator through the real agent loop and tool pool (model and reward stood in), its
    samples written by StepLog as val_trace.jsonl's record: every `val/agent/*` number the
    validation logged is recomputed from the record; with every conversation recorded (5 of 5),
    from the recorded turns and texts alone, with `trainer.trace_samples` of them (2) from the
    per-sample episode facts, which the recorded turns confirm."""
    (tmp_path / "store.py").write_text(TOOL)
    tokenizer = build_tool_tokenizer()
    rows = [{"prompt": [{"role": "user", "content": q}], "data_source": "store/a" if i < 3 else "store/b",
             "reward_model": {"ground_truth": "x", "style": "rule"}} for i, q in enumerate(SCRIPTS)]
    val_file = write_rows(rows, tmp_path / "val.parquet")
    config = load_config(None, ["model.path=m", f"data.train_files=[{val_file}]", f"data.val_files=[{val_file}]",
                                f"rollout.agent.tools=[{tmp_path / 'store.py'}:lookup]", "trainer.loggers=[jsonl]",
                                f"trainer.trace_samples={conversations}", f"trainer.output_dir={tmp_path / 'run'}"])
    loader = PromptLoader(RLDataset([val_file], tokenizer, max_prompt_length=32), batch_size=3, seed=0, shuffle=False,
                          drop_last=False)  # two batches: the records of both
    validator = RLValidator(config, loader)
    with ToolPool([f"{tmp_path / 'store.py'}:lookup"], num_workers=2, max_chars=300) as pool:
        groups = SimpleNamespace(rollout=ScriptedRollout(tokenizer, pool), reward=AnswerReward(), actor=None)
        metrics = validator.run(groups, step=0, policy_version=0)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with StepLog(log_settings(config), run_dir, "grpo", SimpleNamespace()) as steps:
        steps.validation(0, metrics, validator.samples)
    assert not (run_dir / "trace.jsonl").exists()  # training's file keeps training's records
    [line] = read_trace(run_dir, validation=True).lines
    record = line.record
    assert record["validation"] is True and record["step"] == 0 and len(record["samples"]) == 5
    logged = {k: v for k, v in metrics.items() if "/agent/" in k}
    assert {"val/agent/answer_has_tool_result", "val/store/a/agent/tool_error_rate"} <= logged.keys()
    assert recorded_agent_numbers(record) == logged  # from the per-sample facts the record holds
    assert [s["data_source"] for s in record["samples"]] == ["store/a"] * 3 + ["store/b"] * 2
    texts = [s for s in record["samples"] if s.get("conversation")]
    assert len(texts) == conversations
    for s in record["samples"]:  # the facts are what the recorded turns say
        kinds = [t["kind"] for t in s["turns"]]
        assert s["episode"]["turns"] == kinds.count("assistant") and s["episode"]["tool_calls"] == kinds.count("tool")
        assert s["episode"]["tool_errors"] == sum(t["kind"] == "tool" and not t["ok"] for t in s["turns"])
    for s in texts:  # ... and the answer's use of the tool what its recorded texts say
        assert s["episode"]["answer_has_tool_result"] == answer_uses_tool_result(s["turns"])
    if conversations == 5:  # every conversation recorded: the numbers from the trajectories alone
        facts = [{"turns": [t["kind"] for t in s["turns"]].count("assistant"),
                  "tool_calls": [t["kind"] for t in s["turns"]].count("tool"),
                  "tool_errors": sum(t["kind"] == "tool" and not t["ok"] for t in s["turns"]),
                  "answer_has_tool_result": answer_uses_tool_result(s["turns"])} for s in record["samples"]]
        assert agent_numbers(facts, [s["data_source"] for s in record["samples"]]) == logged
        assert logged["val/agent/answer_has_tool_result"] == pytest.approx(1 / 3)  # q4 copies "ABC"; q0, q1 do not
    # `rlcore trace --validation` prints one, and says whether its answer holds the tool's result
    assert main(["trace", str(run_dir), "--validation", "--step", "0", "--sample", str(conversations - 1)]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    assert head.startswith(f"validation at step 0, conversation {conversations} of {conversations} | request ")
    assert head.endswith("answer holds the tool result: yes")  # the last sample, q4
    assert main(["trace", str(run_dir)]) == 2  # training steps: none recorded here
    assert capsys.readouterr().err == f"rlcore: error: {run_dir / 'trace.jsonl'}: no such file (trainer.trace writes it in " \
                                      "trainer.output_dir)\n"


def test_trace_keys_are_refused_when_they_would_change_nothing():
    base = ["model.path=m", "data.train_files=[t.parquet]"]
    with pytest.raises(ConfigError, match="trainer: trace_samples is set, but trainer.trace is off"):
        load_config(None, [*base, "trainer.trace=false", "trainer.trace_samples=2"])
    with pytest.raises(ConfigError, match="trainer.trace_samples"):
        load_config(None, [*base, "trainer.trace_samples=-1"])
    with pytest.raises(ConfigError, match="trainer.trace_max_chars"):
        load_config(None, [*base, "trainer.trace_max_chars=3"])
    off = load_config(None, [*base, "trainer.trace=false"])
    assert off.trainer.trace_samples == 4  # a dumped config of a run without trace loads again
    load_config(None, [*base, *[f"trainer.{k}={v}" for k, v in off.trainer.model_dump().items() if k.startswith("trace")]])
