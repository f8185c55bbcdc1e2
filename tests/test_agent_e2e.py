"""Agent rollouts end to end on the tool example (built once and cached: `rlcore example build --task
tool`, ~2 CPU minutes the first time): GRPO with the calculator raises greedy validation accuracy
from the warm start's by far more than 25 points in 10 steps; the vLLM engine's turns are what the
actor scores and its log-probs are the actor's; on Ray, one step off-policy, with the vLLM rollout
in its own pool, the agent metrics and every turn of every sample reach metrics.jsonl and
trace.jsonl. Validation reports what the agent did (greedy and sampled), in metrics.jsonl and MLflow;
trace.jsonl records conversations `rlcore trace` prints; val_trace.jsonl records every validation
sample, from which every `val/agent/*` number is recomputed."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from conftest import train_on_ray  # tests/ is on sys.path (pytest rootdir conftest)
from tiny_runs import SCORE_IN_PROCESS  # tests/ is on sys.path

from rlcore.cli import CONFIG_DIR
from rlcore.config import load_config
from rlcore.tracking import read_jsonl

pytestmark = pytest.mark.slow
HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="module")
def tool_example():
    from rlcore.example.tool_build import build_tool_example

    return build_tool_example(seed=0)


def test_grpo_with_the_calculator_raises_greedy_val_acc_by_more_than_25_points(tool_example, tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    from rlcore.cli import main
    from rlcore.example.tool_build import tool_example_overrides
    from rlcore.example.tools import calculator
    from rlcore.trainer.run import run_training
    from rlcore.trainer.validation import recorded_agent_numbers

    out = tmp_path / "run"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = load_config(CONFIG_DIR / "tiny_tool_grpo.yaml", [*tool_example_overrides(tool_example, str(out)),
                                                              "trainer.loggers=[jsonl,mlflow]", f"tracking.mlflow_uri={uri}",
                                                              SCORE_IN_PROCESS])
    run_training(config)
    metrics = read_jsonl(out / "metrics.jsonl")
    val = {m["step"]: m["val/acc"] for m in metrics if "val/acc" in m}
    assert val[0] == pytest.approx(tool_example.sft_greedy_accuracy) and val[0] < 0.1
    assert val[10] >= val[0] + 0.25, val
    # Greedy validation ran the agent loop: the warm start never calls the tool greedily; GRPO makes it call
    # and use the result, per data source and overall, in metrics.jsonl and MLflow alike.
    agent = {m["step"]: {k: v for k, v in m.items() if "/agent/" in k} for m in metrics if "val/acc" in m}
    assert agent[0]["val/agent/tool_call_rate"] == pytest.approx(tool_example.sft_greedy_tool_call_rate)
    assert agent[0]["val/agent/turns_mean"] < 1.1 and agent[10]["val/agent/tool_calls_mean"] > 0.5
    assert agent[10]["val/agent/answer_has_tool_result"] > 0.5 and agent[10]["val/agent/tool_error_rate"] < 0.5
    assert agent[10]["val/tiny_tool_arith/agent/tool_call_rate"] == agent[10]["val/agent/tool_call_rate"]
    client = MlflowClient(tracking_uri=uri)
    run_id = (out / "mlflow_run_id").read_text().strip()
    history = client.get_metric_history(run_id, "val/agent/tool_call_rate")
    assert {m.step: m.value for m in history} == pytest.approx({s: a["val/agent/tool_call_rate"] for s, a in agent.items()})
    steps = [m for m in metrics if m["step"] > 0]
    for m in steps:
        assert m["agent/tool_calls"] > 0 and 1 < m["agent/turns_mean"] < 2 and 0 < m["agent/masked_token_frac"] < 0.5
        assert {"agent/tool_errors", "agent/tool_error_rate", "agent/tool_latency_mean_s", "agent/finish/answer"} <= m.keys()
    assert steps[-1]["agent/tool_calls_mean"] > steps[0]["agent/tool_calls_mean"]
    trace = read_jsonl(out / "trace.jsonl")
    sample = next(s for s in trace[0]["samples"] if len(s["turns"]) > 1)
    kinds = [t["kind"] for t in sample["turns"]]
    assert kinds[:4] == ["assistant", "tool", "rendered", "assistant"] and sample["request_id"].startswith(sample["uid"])
    tool = sample["turns"][1]
    assert tool["tool"] == "calculator" and tool["latency_s"] >= 0
    # each tool turn says whether the call succeeded: ok exactly when it recorded no error, and the
    # trained model's calls mostly do
    tool_turns = [t for rec in trace for s in rec["samples"] for t in s["turns"] if t["kind"] == "tool"]
    assert all(t["ok"] is (t["error"] is None) for t in tool_turns)
    assert sum(t["ok"] for t in tool_turns) > len(tool_turns) / 2
    # trainer.trace_samples (4) conversations a step, with the model's text, the call and the result
    for rec in trace:
        recorded = [s for s in rec["samples"] if s.get("conversation")]
        assert len(recorded) == 4 and all(s["prompt"][0]["role"] == "user" for s in recorded)
    called = next(s for rec in trace for s in rec["samples"] if s.get("conversation") and len(s["turns"]) > 1)
    call, result = called["turns"][0], called["turns"][1]
    assert call["text"].startswith("<tool_call>") and result["arguments"].keys() == {"expression"}
    if result["ok"]:  # the result the model read is the calculator's
        assert result["result"] == calculator(result["arguments"]["expression"])
    assert main(["trace", str(out), "--step", "10", "--sample", "3"]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("step 10, conversation 4 of 4") and "[user] " in shown and "[assistant, turn 1" in shown
    # every validation is recorded (val_trace.jsonl): each of its 200 greedy samples, from which every
    # val/agent/* number it logged is recomputed exactly; 4 of them with their conversation
    validations = {r["step"]: r for r in read_jsonl(out / "val_trace.jsonl")}
    assert validations.keys() == agent.keys() and not any(r.get("validation") for r in trace)
    for step, record in validations.items():
        assert record["validation"] is True and len(record["samples"]) == 200
        assert sum(bool(s.get("conversation")) for s in record["samples"]) == 4
        assert recorded_agent_numbers(record) == agent[step], step
    assert main(["trace", str(out), "--validation", "--step", "10"]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("validation at step 10, conversation 1 of 4") and "answer holds the tool result: " in shown


def test_sampled_validation_reports_the_agent_numbers(tool_example, tmp_path):
    """rollout.val_n=4: sampled validation through the agent loop; the warm start calls the tool on
    some samples (about as often as its build measured), so the sampled numbers differ from greedy's."""
    from rlcore.example.tool_build import tool_example_overrides
    from rlcore.trainer.run import run_training

    out = tmp_path / "run"
    run_training(load_config(CONFIG_DIR / "tiny_tool_grpo.yaml", [
        *tool_example_overrides(tool_example, str(out)), "trainer.loggers=[jsonl]", "trainer.total_steps=1",
        "trainer.val_before_train=false", "rollout.val_n=4", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8"]))
    val = next(m for m in read_jsonl(out / "metrics.jsonl") if "val/acc" in m)
    assert 0.15 < val["val/agent/tool_call_rate"] < 0.7 and val["val/agent/tool_calls_mean"] >= val["val/agent/tool_call_rate"]
    assert 1 < val["val/agent/turns_mean"] < 2 and "val/tiny_tool_arith/agent/tool_error_rate" in val
    assert "val/mean@4" in val and val["val/tiny_tool_arith/agent/tool_call_rate"] == val["val/agent/tool_call_rate"]
    # accuracy per data source beside the agent numbers (the example has one source: its numbers are the overall ones)
    assert val["val/tiny_tool_arith/acc"] == val["val/acc"] and val["val/tiny_tool_arith/mean@4"] == val["val/mean@4"]


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
@pytest.mark.vllm
def test_vllm_turns_are_what_the_actor_scores_and_their_log_probs_the_actors(tool_example):
    from transformers import AutoModelForCausalLM

    from rlcore.data import PromptLoader, RLDataset
    from rlcore.rewards.tools import ToolPool
    from rlcore.rollout import SamplingParams, make_rollout_engine
    from rlcore.rollout.agent import AgentLoop, AgentSettings, ChatTurns, sample_key
    from rlcore.workers.loops import MicroBatching
    from rlcore.workers.policy import PolicyLogProbs
    from rlcore.workers.tokenizer import load_tokenizer

    folder = str(tool_example.model_dir)
    tokenizer = load_tokenizer(folder)
    batch = next(PromptLoader(RLDataset([tool_example.val_file], tokenizer, 32), 16, 0, shuffle=False).epoch_batches())
    engine = make_rollout_engine("vllm", path=folder, eos_token_ids=[tokenizer.eos_token_id], kv_cache_gib=0.125,
                                 max_model_len=128, seed=0)
    turns: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    generate_turns = engine.generate_turns

    def recording(contexts, params, max_tokens, keys):
        out = generate_turns(contexts, params, max_tokens, keys)
        turns.update({(k, tuple(c)): ids for k, c, (ids, _) in zip(keys, contexts, out)})
        return out

    engine.generate_turns = recording  # type: ignore[method-assign]
    try:
        with ToolPool([tool_example.tool], num_workers=2) as pool:
            loop = AgentLoop(engine, tokenizer, [tokenizer.eos_token_id], AgentSettings(3, 64), tools=pool)
            params = SamplingParams(n=4, temperature=1.0, max_new_tokens=32, seed=5)
            gen = loop.generate(batch, params)
    finally:
        engine.close()
    chat = ChatTurns(tokenizer)
    prompt_len = gen["prompts"].shape[1]
    callers = 0
    for i in range(len(gen)):
        ids = gen["prompts"][i][gen["attention_mask"][i, :prompt_len].bool()].tolist()
        key = sample_key(gen.meta["uid"][i], i % params.n)
        groups: list[tuple[dict, list[dict]]] = []  # each assistant turn and the messages that followed it
        for m in gen.meta["agent_messages"][i][1:]:
            if m["role"] == "assistant":
                groups.append((m, []))
            else:
                groups[-1][1].append(m)
        for k, (_, followers) in enumerate(groups):
            new = turns[key, tuple(ids)]
            ids += new
            if k + 1 < len(groups):
                ids += chat.between(new[-1], followers)
        assert gen["input_ids"][i][gen["attention_mask"][i].bool()].tolist() == ids
        callers += int(gen.meta["agent_tool_calls"][i] > 0)
    assert callers >= 8
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    lp = PolicyLogProbs(temperature=1.0, chunk_tokens=1024, backend="torch").no_grad(
        model, gen, "lp", MicroBatching(64, True, 4096), torch.device("cpu"))["lp"]
    mask = gen["response_mask"].bool()
    torch.testing.assert_close(lp[mask], gen["rollout_log_probs"][mask], atol=1e-4, rtol=0)


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed")
@pytest.mark.ray
@pytest.mark.vllm
def test_agent_rollouts_on_ray_one_step_off_policy_with_the_vllm_rollout_in_its_own_pool(tool_example, tmp_path, ray_local):
    pytest.importorskip("ray")
    from rlcore.example.tool_build import tool_example_overrides

    out = tmp_path / "run"
    train_on_ray(CONFIG_DIR / "tiny_tool_grpo.yaml", [
        *tool_example_overrides(tool_example, str(out)), "trainer.loggers=[jsonl]",
        "trainer.total_steps=2", "trainer.save_every=100", "trainer.val_before_train=false", "trainer.val_every=100",
        "trainer.off_policy=one_step", "trainer.backend=ray", "rollout.backend=vllm", "rollout.vllm.kv_cache_gib=0.125",
        "rollout.vllm.max_model_len=128", "data.train_batch_size=16", "actor.ppo_mini_batch_size=8",
        "ray.pools={default: {cpus_per_bundle: 1}, gen: {cpus_per_bundle: 1}}", "ray.roles={rollout: gen, reward: gen}",
    ], address=ray_local)
    metrics = [m for m in read_jsonl(out / "metrics.jsonl") if m["step"] > 0]
    assert [m["rollout/staleness_max"] for m in metrics] == [0.0, 1.0]  # step 2 was generated during step 1's update
    assert all(m["agent/tool_calls"] > 0 and m["agent/turns_mean"] > 1 for m in metrics)
    assert all(m["rollout/logprob_diff_max"] < 1e-3 for m in metrics[:1])  # step 1: engine and actor on one policy
    trace = read_jsonl(out / "trace.jsonl")
    pids = {s["rollout_pid"] for rec in trace for s in rec["samples"]}
    assert os.getpid() not in pids and {w["pid"] for w in trace[0]["workers"]["rollout"]} == pids
    tool_turns = [t for rec in trace for s in rec["samples"] for t in s["turns"] if t["kind"] == "tool"]
    assert tool_turns and all(t["tool"] for t in tool_turns)
    # the conversations' texts cross from the Ray rollout workers: the prompt and the model's text of each turn
    recorded = [s for rec in trace for s in rec["samples"] if s.get("conversation")]
    assert len(recorded) == 4 * len(trace) and all(s["prompt"][0]["role"] == "user" and "text" in s["turns"][0] for s in recorded)
