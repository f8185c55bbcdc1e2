"""Agent rollouts (rlcore.rollout.agent) on the HF engine with real tiny models taught in seconds to
call a calculator (a Llama and a Qwen2 with grouped-query attention, the tool example's tokenizer),
the sandboxed tool pool (rlcore.rewards.tools), the chat template's turns on a ChatML BPE tokenizer,
what the reward sees, the masks in advantages and losses, config refusals and preflight.

Token exactness: the ids the actor scores are the engine's own ids for each turn, recorded as the
engine returned them, plus the rendered tool turns, and the actor's log-probs of the model tokens
equal the engine's. Concurrency: a sample whose tool hangs does not hold back the others."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rlcore.algos import agg_loss, compute_advantage, get_policy_loss, kl_loss
from rlcore.config import ConfigError, load_config
from rlcore.data import PromptLoader, RLDataset
from rlcore.data.io import write_rows
from rlcore.data.sft import tokenize_messages
from rlcore.example.model import TinyModelSpec, make_model
from rlcore.example.tokenizer import build_tool_tokenizer
from rlcore.example.tool_task import draw_problems, rl_row, sft_rows
from rlcore.example.warm_start import backward_batch, save_model
from rlcore.protocol import Batch
from rlcore.rewards.tools import ToolPool, ToolSpecError, load_tools
from rlcore.rollout import HFRolloutEngine, SamplingParams
from rlcore.rollout.agent import AgentLoop, AgentSettings, ChatTurns, InteractionReply, parse_tool_calls, sample_key
from rlcore.trainer.metrics import agent_metrics
from rlcore.trainer.preflight import preflight_problems
from rlcore.workers.reward import final_answer, trajectory_info

CALC = "rlcore.example.tools:calculator"

TOOLS_FILE = '''
import os, time

def slow_calc(expression: str) -> str:
    """Like the calculator, but "1111+..." hangs and "2222+..." raises.

    Args:
        expression: a sum
    """
    if expression.startswith("1111"):
        time.sleep(30)
    if expression.startswith("2222"):
        raise ZeroDivisionError("boom")
    a, b = expression.split("+")
    return str(int(a) + int(b))

def misbehave(mode: str) -> str:
    """A tool that fails in every way a tool can.

    Args:
        mode: how to fail
    """
    if mode == "hang":
        time.sleep(30)
    if mode == "raise":
        raise ValueError("no such thing")
    if mode == "exit":
        os._exit(7)
    if mode == "memory":
        return str(len(bytearray(3 * 2**30)))
    if mode == "object":
        return object()
    if mode == "json":
        return {"a": [1, 2]}
    if mode == "long":
        return "x" * 500
    return mode
'''


def _arch(name: str, tokenizer) -> torch.nn.Module:
    spec = TinyModelSpec(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, head_dim=32)
    if name == "llama":
        return make_model(tokenizer, spec, seed=0)
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=-(-len(tokenizer) // 8) * 8, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True,
                      pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id)
    model = Qwen2ForCausalLM(cfg)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


_CALLERS: dict[str, tuple[Path, object, torch.nn.Module]] = {}


def _taught_caller(arch: str, tmp_path_factory) -> tuple[Path, object, torch.nn.Module]:
    """(folder, tokenizer, model): a one-layer model taught in ~2 s (60 SFT steps on the tool example's
    chat data, the teacher calling the calculator 70% of the time) to open its answer with a call;
    its arguments are often wrong, which these tests do not care about."""
    if arch not in _CALLERS:
        tokenizer = build_tool_tokenizer()
        model = _arch(arch, tokenizer)
        examples = [tokenize_messages(r["messages"], tokenizer) for r in sft_rows(draw_problems(5, 400), 60 * 48, 1, 0.7)]
        optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model.train()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            for step in range(60):
                optim.zero_grad()
                backward_batch(model, examples[step * 48:(step + 1) * 48], 48, tokenizer.pad_token_id)
                optim.step()
        model.eval()
        folder = tmp_path_factory.mktemp(f"caller-{arch}")
        save_model(model, tokenizer, folder)
        _CALLERS[arch] = (folder, tokenizer, model)
    return _CALLERS[arch]


# `./dev fast` teaches and rolls out the Llama caller only (each costs a model taught to call tools and a
# rollout); the Qwen2 one (grouped-query attention) runs in the full suite.
@pytest.fixture(scope="module", params=["llama", pytest.param("qwen2", marks=pytest.mark.slow)])
def caller(request, tmp_path_factory):
    """The calling model on a Llama and on a Qwen2 with grouped-query attention."""
    return _taught_caller(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def llama_caller(tmp_path_factory):
    return _taught_caller("llama", tmp_path_factory)


def _prompts(tokenizer, n: int, tmp_path: Path, seed: int = 9, questions: list[str] | None = None) -> Batch:
    rows = [rl_row(p, "val", i) for i, p in enumerate(draw_problems(seed, n))]
    for row, q in zip(rows, questions or []):
        row["prompt"][0]["content"] = q
    dataset = RLDataset([write_rows(rows, tmp_path / f"prompts{seed}.parquet")], tokenizer, max_prompt_length=32)
    return next(PromptLoader(dataset, batch_size=n, seed=0, shuffle=False, drop_last=False).epoch_batches())


class Recording:
    """The real HF engine, with every turn it returned kept exactly as returned."""

    def __init__(self, engine: HFRolloutEngine) -> None:
        self.engine = engine
        self.pad_token_id = engine.pad_token_id
        self.turns: dict[tuple[int, tuple[int, ...]], tuple[list[int], list[float]]] = {}  # (sample key, context)
        self.batches: list[int] = []

    def generate_turns(self, contexts, params, max_tokens, keys):
        out = self.engine.generate_turns(contexts, params, max_tokens, keys)
        self.batches.append(len(contexts))
        for key, ctx, turn in zip(keys, contexts, out):
            self.turns[key, tuple(ctx)] = turn
        return out


SETTINGS = AgentSettings(max_turns=3, max_total_tokens=80)
SAMPLED = SamplingParams(n=4, temperature=1.0, max_new_tokens=32, seed=3)


@pytest.fixture(scope="module")
def calc_pool():
    with ToolPool([CALC], num_workers=2, timeout_s=5.0) as pool:
        yield pool


@pytest.fixture(scope="module")
def rollout(caller, calc_pool, tmp_path_factory):
    """One sampled agent rollout of 8 prompts x 4 samples, and the recording engine that made it."""
    folder, tokenizer, _ = caller
    loop, engine = _loop(folder, tokenizer, calc_pool)
    return loop.generate(_prompts(tokenizer, 8, tmp_path_factory.mktemp("prompts")), SAMPLED), engine


def _loop(folder, tokenizer, tools, settings=SETTINGS, interaction=None):
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    engine = Recording(HFRolloutEngine(model, tokenizer.pad_token_id, [tokenizer.eos_token_id]))
    return AgentLoop(engine, tokenizer, [tokenizer.eos_token_id], settings, tools=tools, interaction=interaction), engine



def test_ids_scored_are_the_engines_turns_plus_rendered_tool_turns(caller, rollout):
    _, tokenizer, _ = caller
    gen, engine = rollout
    turns = ChatTurns(tokenizer)
    prompt_len = gen["prompts"].shape[1]
    multi = 0
    for i in range(len(gen)):
        ids = gen["prompts"][i][gen["attention_mask"][i, :prompt_len].bool()].tolist()
        prompt_len_i = len(ids)
        # Rebuild the sample from the recorded engine turns and the template's rendering of what followed each.
        groups: list[tuple[dict, list[dict]]] = []
        for m in gen.meta["agent_messages"][i][1:]:
            if m["role"] == "assistant":
                groups.append((m, []))
            else:
                groups[-1][1].append(m)
        assert len(groups) == gen.meta["agent_turns"][i]
        mask: list[int] = []
        for k, (assistant, followers) in enumerate(groups):
            new, _ = engine.turns[sample_key(gen.meta["uid"][i], i % SAMPLED.n), tuple(ids)]
            assert tokenizer.decode(new[:-1] if new[-1] == tokenizer.eos_token_id else new,
                                    skip_special_tokens=False) == assistant["content"]
            ids, mask = ids + new, mask + [1] * len(new)
            if k + 1 < len(groups):
                rendered = turns.between(new[-1], followers)
                ids, mask = ids + rendered, mask + [0] * len(rendered)
        n = len(ids) - prompt_len_i
        assert gen["input_ids"][i][gen["attention_mask"][i].bool()].tolist() == ids
        assert gen["response_mask"][i, :n].tolist() == mask and not gen["response_mask"][i, n:].any()
        multi += len(groups) > 1
    assert multi >= 4, "the caller should have called the tool and gone on in several samples"
    assert engine.batches[0] == len(gen) and max(engine.batches[1:]) < len(gen)  # later rounds: only the callers


def test_actor_log_probs_equal_the_engines_on_model_tokens_only(caller, rollout):
    from rlcore.workers.attention import use_packed_attention
    from rlcore.workers.loops import MicroBatching
    from rlcore.workers.packed import pack_rows
    from rlcore.workers.policy import PolicyLogProbs

    model = caller[2]
    gen = rollout[0]
    mask = gen["response_mask"].bool()
    tool = (gen["attention_mask"][:, gen["prompts"].shape[1]:].bool()) & ~mask
    assert tool.any() and mask.any()
    # padded, packed, and packed with a prompt's n trajectories holding it once (rlcore's attention)
    for packed, share in ((True, False), (False, False), (True, True)):
        model.config._attn_implementation = "sdpa"
        if share:
            use_packed_attention(model)
        lp = PolicyLogProbs(temperature=1.0, chunk_tokens=1024, backend="torch", share_prompts=share).no_grad(
            model, gen, "lp", MicroBatching(64, packed, 4096, share_prompts=share), torch.device("cpu"))["lp"]
        torch.testing.assert_close(lp[mask], gen["rollout_log_probs"][mask], atol=2e-5, rtol=0)
    model.config._attn_implementation = "sdpa"
    assert pack_rows(gen["attention_mask"], gen["responses"].shape[1], gen["input_ids"]).shared_tokens > 0  # it did share
    assert not gen["rollout_log_probs"][tool].any()


def test_masked_tokens_get_no_advantage_and_no_gradient(rollout):
    gen = rollout[0]
    mask = gen["response_mask"].float()
    hole = (gen["attention_mask"][:, gen["prompts"].shape[1]:] > 0) & (mask == 0)
    assert hole.any()
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 2, (len(gen),), generator=g).float()
    from rlcore.rewards import scores_to_token_rewards

    rewards = scores_to_token_rewards(scores, mask)
    last = (mask * torch.arange(mask.shape[1])).argmax(-1)
    assert torch.equal(rewards[torch.arange(len(gen)), last], scores)  # the reward sits on the last model token
    uids = gen.meta["uid"]
    grpo, _ = compute_advantage("grpo", token_level_rewards=rewards, response_mask=mask, group_ids=uids)
    values = torch.randn(mask.shape, generator=g)
    gae, _ = compute_advantage("gae", token_level_rewards=rewards, response_mask=mask, values=values, gamma=0.99, lam=0.95)
    assert not grpo[hole].any() and not gae[hole].any()
    # GAE runs across the holes: what the critic says at tool tokens changes no advantage
    other = values.clone()
    other[hole] = 100.0
    gae2, _ = compute_advantage("gae", token_level_rewards=rewards, response_mask=mask, values=other, gamma=0.99, lam=0.95)
    torch.testing.assert_close(gae2, gae)

    logp = torch.randn(mask.shape, generator=g).requires_grad_()
    old, ref = logp.detach() + 0.1 * torch.randn(mask.shape, generator=g), logp.detach() - 0.2
    loss, _ = get_policy_loss("vanilla")(old, logp, gae, mask, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
                                         loss_agg_mode="token-mean")
    loss = loss + kl_loss(logp, ref, mask, "k3", "token-mean") + agg_loss(-logp.exp() * logp, mask, "token-mean")
    loss.backward()
    assert not logp.grad[hole].any() and logp.grad[mask.bool()].abs().sum() > 0


def test_tool_pool_turns_every_failure_into_an_error_the_model_reads(tmp_path):
    (tmp_path / "tools.py").write_text(TOOLS_FILE)
    with ToolPool([f"{tmp_path}/tools.py:misbehave"], num_workers=3, timeout_s=1.5, memory_mb=256, max_chars=100) as pool:
        modes = ["hang", "raise", "exit", "memory", "object", "json", "long", "fine"]
        for i, mode in enumerate(modes):
            pool.submit(i, "misbehave", {"mode": mode})
        pool.submit(100, "nope", {})
        pool.submit(101, "misbehave", {"wrong": 1})
        got: dict[int, object] = {}
        while pool.pending:
            for o in pool.poll(1.0):
                got[o.call_id] = o
        again = pool.poll(0.0)
        pool.submit(200, "misbehave", {"mode": "fine"})  # the pool still works after all that
        after = pool.poll(5.0)
    by_mode = {m: got[i] for i, m in enumerate(modes)}
    assert by_mode["hang"].timed_out and by_mode["hang"].text.startswith("Error: TimeoutError")
    assert by_mode["raise"].text == "Error: ValueError: no such thing" and not by_mode["raise"].ok
    assert "WorkerDied" in by_mode["exit"].text
    assert by_mode["memory"].text.startswith("Error: MemoryError")  # 3 GiB against a 256 MiB limit
    assert "tool returned object" in by_mode["object"].text
    assert by_mode["json"].ok and by_mode["json"].text == '{"a": [1, 2]}'
    assert by_mode["long"].ok and by_mode["long"].truncated and by_mode["long"].text == "x" * 100
    assert by_mode["fine"].ok and by_mode["fine"].text == "fine" and not by_mode["fine"].timed_out
    assert "UnknownTool" in got[100].text and "unexpected keyword argument 'wrong'" in got[101].text
    assert again == [] and [o.text for o in after] == ["fine"]


@pytest.mark.slow  # five child interpreters (~1 CPU s each); fast: test_user_code.py's hostile tool files
def test_tool_specs_and_schemas(tmp_path):
    (tmp_path / "tools.py").write_text(TOOLS_FILE + "\ndef bare(x):\n    return x\n")
    tools = load_tools([CALC, f"{tmp_path}/tools.py:slow_calc"])
    assert tools["calculator"].schema["function"]["parameters"]["required"] == ["expression"]
    for spec, message in ((f"{tmp_path}/tools.py:bare", "no schema"), (f"{tmp_path}/nope.py:f", "does not exist"),
                          ("rlcore.example.tools:nothing", "has no attribute")):
        with pytest.raises(ToolSpecError, match=message):
            load_tools([spec])
    with pytest.raises(ToolSpecError, match="second tool named 'calculator'"):
        load_tools([CALC, CALC])


HANGS_ONCE = '''
import os, time

def calculator(expression: str) -> str:
    """The calculator, except that the first call made (of all processes) takes 2 s.

    Args:
        expression: a sum
    """
    try:
        os.close(os.open(os.path.join(os.path.dirname(__file__), "first"), os.O_CREAT | os.O_EXCL))
        time.sleep(2)
    except FileExistsError:
        pass
    return "42"
'''


@pytest.mark.slow  # an agent rollout waiting out a hang; a hang in the pool, fast: test_tool_pool_turns_every_failure_...
def test_a_hanging_tool_holds_back_only_its_own_sample(llama_caller, tmp_path):
    folder, tokenizer, _ = llama_caller
    (tmp_path / "hangs_once.py").write_text(HANGS_ONCE)
    with ToolPool([f"{tmp_path}/hangs_once.py:calculator"], num_workers=2, timeout_s=10.0) as pool:
        loop, engine = _loop(folder, tokenizer, pool)
        starts: list[float] = []
        ends: list[float] = []
        generate_turns = engine.generate_turns

        def timed(*args, **kwargs):
            starts.append(time.monotonic())
            out = generate_turns(*args, **kwargs)
            ends.append(time.monotonic())
            return out

        engine.generate_turns = timed  # type: ignore[method-assign]
        gen = loop.generate(_prompts(tokenizer, 8, tmp_path), SamplingParams(n=1, do_sample=False, max_new_tokens=32))
    callers = int((gen.meta["agent_tool_calls"] > 0).sum())
    assert callers >= 3  # greedy, the caller calls on (nearly) every prompt
    latencies = sorted(t["latency_s"] for trace in gen.meta["agent_trace"] for t in trace if t["kind"] == "tool")
    assert latencies[-1] > 1.9 and latencies[-2] < 1.0  # one call took its 2 s
    # Round 2 (every caller but the slow one) ran at once; the slow sample's turn came ~2 s later, alone.
    assert engine.batches[1] == callers - 1 and starts[1] - ends[0] < 1.0
    assert engine.batches[-1] == 1 and starts[-1] - ends[0] > 1.5


def test_sampling_does_not_depend_on_which_samples_share_a_round(llama_caller, calc_pool, tmp_path):
    folder, tokenizer, _ = llama_caller
    batch = _prompts(tokenizer, 6, tmp_path)
    whole = _loop(folder, tokenizer, calc_pool)[0].generate(batch, SAMPLED)
    alone = _loop(folder, tokenizer, calc_pool)[0].generate(batch.take([2]), SAMPLED)
    rows = slice(8, 12)  # prompt 2's four samples
    width = alone["responses"].shape[1]
    assert torch.equal(whole["responses"][rows, :width], alone["responses"])
    assert list(whole.meta["agent_messages"][rows]) == list(alone.meta["agent_messages"])


class Quiz:
    """An environment: says "again" to the first answer and ends the episode at the second with a reward."""

    made = 0

    def __init__(self, data_source, ground_truth, extra_info):
        Quiz.made += 1
        self.truth = ground_truth

    def respond(self, messages):
        answers = sum(m["role"] == "assistant" for m in messages)
        if answers == 1:
            return "again"
        return InteractionReply(done=True, reward=0.5 if self.truth in messages[-1]["content"] else -0.5)


def test_an_interaction_answers_turns_and_ends_the_episode_with_a_reward(llama_caller, tmp_path):
    folder, tokenizer, _ = llama_caller
    Quiz.made = 0
    loop, engine = _loop(folder, tokenizer, None, AgentSettings(max_turns=4, max_total_tokens=120), interaction=Quiz)
    gen = loop.generate(_prompts(tokenizer, 3, tmp_path), SamplingParams(n=2, temperature=1.0, max_new_tokens=32, seed=1))
    assert Quiz.made == 6
    done = gen.meta["agent_finish"] == "interaction"
    assert done.any()
    for i in np.flatnonzero(done):
        roles = [m["role"] for m in gen.meta["agent_messages"][i]]
        assert roles == ["user", "assistant", "user", "assistant"] and gen.meta["agent_messages"][i][2]["content"] == "again"
        assert gen.meta["agent_reward"][i] in (0.5, -0.5)
    ids = gen["input_ids"][int(np.flatnonzero(done)[0])].tolist()
    assert tokenizer.decode(ids).count("<|user|>again<|end|><|assistant|>") == 1
    info = trajectory_info(gen.meta, int(np.flatnonzero(done)[0]), {"split": "val"})
    assert info["split"] == "val" and info["interaction_reward"] in (0.5, -0.5) and info["num_turns"] == 2


def test_the_reward_sees_the_whole_trajectory_and_the_final_answer(rollout):
    gen = rollout[0]
    # A sample whose first turn made a call the parser reads (an unreadable one is answered with
    # its parse error and leaves the message's tool_calls empty: test_parse_tool_calls).
    readable = [j for j in np.flatnonzero(gen.meta["agent_tool_calls"] > 0)
                if gen.meta["agent_messages"][j][1].get("tool_calls")]
    assert readable, "no sample's first turn called a tool readably"
    i = int(readable[0])
    messages = gen.meta["agent_messages"][i]
    info = trajectory_info(gen.meta, i, None)
    assert info["messages"] == list(messages) and info["num_tool_calls"] >= 1
    assert [m["role"] for m in messages[:3]] == ["user", "assistant", "tool"]
    call = messages[1]["tool_calls"][0]  # the assistant message names its call; the tool's answer names the tool
    assert call["name"] == "calculator" and messages[2]["name"] == "calculator"
    assert final_answer(messages) == [m for m in messages if m["role"] == "assistant"][-1]["content"]
    metrics = agent_metrics(gen)
    assert metrics["agent/tool_calls"] == gen.meta["agent_tool_calls"].sum() > 0
    assert 0 < metrics["agent/masked_token_frac"] < 1 and metrics["agent/turns_mean"] > 1
    assert math.isclose(sum(v for k, v in metrics.items() if k.startswith("agent/finish/")), 1.0)


def test_parse_tool_calls():
    text = ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call> and '
            '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call><tool_call>{oops}</tool_call>'
            '<tool_call>["a"]</tool_call><tool_call>{"name": "g"')
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls[:2]] == [("calculator", {"expression": "1+2"}), ("f", {"x": 1})]
    assert [c.error is not None for c in calls] == [False, False, True, True, True]
    assert "without </tool_call>" in calls[-1].error
    assert parse_tool_calls("#### 12") == []


def test_chat_turns_render_the_template_between_turns_on_chatml_bpe(own_model):
    from rlcore.workers.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(own_model.model_dir))
    turns = ChatTurns(tokenizer)
    assert turns.renders_tools
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert turns.closing(im_end) == "\n" and turns.closing(endoftext) is None
    # The full conversation, tokenized as one text, is the turns concatenated: prompt, the model's
    # turn with its end token, the rendered tool turn, the model's second turn.
    prompt = [{"role": "user", "content": "What color is the banana?"}]
    first, result, second = '<tool_call>{"name": "look", "arguments": {}}</tool_call>', "it is yellow", "yellow"
    conversation = [*prompt, {"role": "assistant", "content": first}, {"role": "tool", "content": result},
                    {"role": "assistant", "content": second}]
    whole = tokenizer(tokenizer.apply_chat_template(conversation, tokenize=False), add_special_tokens=False)["input_ids"]
    head = tokenizer(tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]
    model_turn = tokenizer(first, add_special_tokens=False)["input_ids"] + [im_end]
    between = turns.between(im_end, [{"role": "tool", "content": result}])
    tail = tokenizer(second, add_special_tokens=False)["input_ids"] + [im_end]
    assert head + model_turn + between + tail == whole[:len(head + model_turn + between + tail)]


def test_a_template_without_a_tool_role_is_refused(llama_caller, calc_pool):
    from rlcore.example.tokenizer import build_tokenizer

    engine = HFRolloutEngine(llama_caller[2], 0, [2])
    with pytest.raises(ValueError, match="does not render 'tool' messages"):
        AgentLoop(engine, build_tokenizer(), [2], AgentSettings(), tools=calc_pool)


def test_agent_config_keys_are_refused_at_load_naming_the_key(tmp_path):
    base = ["model.path=m", "data.train_files=[t.parquet]"]
    for overrides, message in (
        (["rollout.agent.max_turns=2"], "rollout.agent: max_turns is set, but the agent loop is off"),
        (["rollout.agent.interaction=a:B", "rollout.agent.tool_workers=3"], "tool_workers is set, but rollout.agent.tools is empty"),
        ([f"rollout.agent.tools=[{CALC}]", "rollout.agent.max_turn=2"], "rollout.agent.max_turn: unknown key"),
        ([f"rollout.agent.tools=[{CALC}]", "rollout.agent.max_total_tokens=1"], "rollout.agent.max_total_tokens"),
        ([f"rollout.agent.tools=[{CALC}]", "algorithm.name=dpo"], "rollout.agent: the 'dpo' control flow generates nothing"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(None, base + overrides)
    cfg = load_config(None, base + [f"rollout.agent.tools=[{CALC}, {tmp_path}/none.py:f]", "rollout.agent.interaction=nope:X"])
    problems = [p for p in preflight_problems(cfg) if p.startswith("rollout.agent")]
    assert len(problems) == 2 and problems[0].startswith("rollout.agent.tools[1]: ") and "does not exist" in problems[0]
    assert problems[1].startswith("rollout.agent.interaction: ") and "cannot import module 'nope'" in problems[1]
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "llama", "max_position_embeddings": 128}')
    cfg = load_config(None, [f"model.path={tmp_path / 'model'}", "data.train_files=[t.parquet]", f"rollout.agent.tools=[{CALC}]",
                             "data.max_prompt_length=32", "rollout.agent.max_total_tokens=100", "rollout.backend=hf"])
    assert [p for p in preflight_problems(cfg) if p.startswith("rollout.agent")] == [
        "rollout.agent.max_total_tokens: data.max_prompt_length (32) + rollout.agent.max_total_tokens (100) = 132 tokens "
        "exceeds the model's max_position_embeddings (128)"]


def test_keyed_draws_do_not_depend_on_the_batch():
    from rlcore.rollout.sampling import keyed_uniforms

    keys, positions = torch.arange(1000) * 7919, torch.arange(1000) % 50
    u = keyed_uniforms(3, keys, positions)
    assert torch.equal(u[10:20], keyed_uniforms(3, keys[10:20], positions[10:20]))
    assert 0.47 < float(u.mean()) < 0.53 and not torch.equal(u, keyed_uniforms(4, keys, positions))
