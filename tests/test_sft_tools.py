"""SFT renders tools and tool calls exactly as RL does (rlcore.chat: one rendering for RL prompts,
agent rollouts and SFT conversations), on a user's own tool task: a Qwen2 folder whose byte-level
BPE tokenizer carries a Qwen2.5-style template that renders tool schemas into the system turn and
OpenAI-style `tool_calls` as hermes `<tool_call>` blocks, and the user's `lookup` tool given as
`file.py:function`. Built in about a second, no downloads.

The RL side is the real path: `prompt_loader` (what the recipes load prompts with, tools from
`rollout.agent.tools`) and the agent loop with the real sandboxed tool pool, on an engine that
stands in for the model by writing a fixed script of assistant turns (the model is not what is
tested; the ids around its turns are)."""

from __future__ import annotations

import json

import pytest
import torch
from own_model import IM_END, save_qwen2_model, train_bpe

from rlcore.chat import ChatTurns, conversation_ids
from rlcore.config import config_from_dict, load_sft_config
from rlcore.data.io import write_rows
from rlcore.data.schema import DataValidationError
from rlcore.data.sft import IGNORE_INDEX, SFTDataset, tokenize_messages
from rlcore.rewards.tools import ToolPool, ToolSpecError, tool_schemas
from rlcore.rollout import SamplingParams
from rlcore.rollout.agent import AgentLoop, AgentSettings, parse_tool_calls
from rlcore.trainer.loaders import prompt_loader
from rlcore.trainer.preflight import PreflightError, sft_preflight
from rlcore.workers.tokenizer import end_token_ids, load_tokenizer

# Qwen2.5-Instruct's template, as it renders tools (into the system turn), assistant tool calls
# (hermes blocks after the content) and tool results (grouped into one user turn).
QWEN25_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}"
    "{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LOOKUP = '''
TABLE = {"banana": "yellow", "sky": "blue", "grass": "green", "coal": "black"}


def lookup(key: str) -> str:
    """The color of a thing, from the user's table.

    Args:
        key: the thing, e.g. "banana"
    """
    return TABLE.get(key, "unknown")
'''

THINGS = {"banana": "yellow", "sky": "blue", "grass": "green"}


def _call(thing: str) -> dict:
    """An assistant turn calling the tool, in OpenAI's format (arguments as a JSON string)."""
    return {"role": "assistant", "content": "",
            "tool_calls": [{"id": f"call_{thing}", "type": "function",
                            "function": {"name": "lookup", "arguments": json.dumps({"key": thing})}}]}


def conversation(thing: str) -> list[dict]:
    return [{"role": "user", "content": f"What color is the {thing}? Use the table."}, _call(thing),
            {"role": "tool", "tool_call_id": f"call_{thing}", "content": THINGS[thing]},
            {"role": "assistant", "content": THINGS[thing]}]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """A Qwen2 folder with the Qwen2.5-style tokenizer, the user's tool file, RL prompts and SFT rows."""
    root = tmp_path_factory.mktemp("tool_task")
    (root / "lookup.py").write_text(LOOKUP)
    tool = f"{root / 'lookup.py'}:lookup"
    # the BPE learns the task's text as the template renders it (bytes first, then its merges)
    bytes_only = train_bpe([""], vocab_size=300)
    bytes_only.chat_template = QWEN25_TEMPLATE
    texts = [bytes_only.apply_chat_template(conversation(t), tools=tool_schemas([tool]), tokenize=False) for t in THINGS]
    tokenizer = train_bpe(texts * 4, vocab_size=600)
    tokenizer.chat_template = QWEN25_TEMPLATE
    save_qwen2_model(tokenizer, root / "model", hidden_size=64, layers=2)
    rl_rows = [{"prompt": conversation(t)[:1], "data_source": "own/lookup",
                "reward_model": {"ground_truth": c, "style": "rule"}} for t, c in THINGS.items()]
    return {"root": root, "model": str(root / "model"), "tool": tool,
            "rl_file": write_rows(rl_rows, root / "rl.parquet"),
            "sft_file": write_rows([{"messages": conversation(t)} for t in THINGS], root / "sft.parquet")}


class ScriptedModel:
    """Stands in for the model: each generate_turns call answers every context with the next turn of
    its script (text the model writes, then <|im_end|>), as a model's engine returns its ids."""

    def __init__(self, tokenizer, script: list[str]) -> None:
        self.tokenizer, self.script = tokenizer, script
        self.pad_token_id = tokenizer.pad_token_id
        self.calls = 0
        self.end = tokenizer.convert_tokens_to_ids(IM_END)

    def generate_turns(self, contexts, params, max_tokens, keys):
        text = self.script[self.calls]
        self.calls += 1
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + [self.end]
        return [(ids, [0.0] * len(ids)) for _ in contexts]


def _rl_rollout(task, thing: str):
    """The RL prompt ids and trajectory of `thing`'s question, the model writing the hermes call
    Qwen2.5 writes (as literal text, not from rlcore) and then the color."""
    tokenizer = load_tokenizer(task["model"])
    config = config_from_dict({"model": {"path": task["model"]},
                               "data": {"train_files": [str(task["rl_file"])], "max_prompt_length": 400},
                               "rollout": {"agent": {"tools": [task["tool"]], "max_total_tokens": 200}}})
    loader = prompt_loader(config, tokenizer, [str(task["rl_file"])], train=False)
    batch = next(loader.epoch_batches())
    batch = batch.take([list(THINGS).index(thing)])  # file order
    assert batch.meta["prompt_messages"][0] == conversation(thing)[:1]
    script = [f'<tool_call>\n{{"name": "lookup", "arguments": {{"key": "{thing}"}}}}\n</tool_call>', THINGS[thing]]
    with ToolPool([task["tool"]], num_workers=1) as pool:
        loop = AgentLoop(ScriptedModel(tokenizer, script), tokenizer, end_token_ids(task["model"]),
                         AgentSettings(max_turns=3, max_total_tokens=200), tools=pool)
        gen = loop.generate(batch, SamplingParams(n=1, max_new_tokens=64))
    prompt = batch.tensors["input_ids"][0][batch.tensors["attention_mask"][0].bool()].tolist()
    response = gen.tensors["responses"][0][gen.tensors["attention_mask"][0, gen.tensors["prompts"].shape[1]:].bool()]
    mask = gen.tensors["response_mask"][0][: len(response)].long().tolist()
    return tokenizer, prompt, response.tolist(), mask, gen


@pytest.mark.parametrize("thing", ["banana", "grass"])
def test_sft_ids_of_a_tool_conversation_are_the_rl_rollouts_ids_and_masks(task, thing):
    tokenizer, rl_prompt, rl_response, rl_mask, gen = _rl_rollout(task, thing)
    assert gen.meta["agent_tool_calls"][0] == 1 and gen.meta["agent_tool_errors"][0] == 0  # parsed and ran the real tool
    assert gen.meta["agent_messages"][0][2]["content"] == THINGS[thing]  # ... which answered what the SFT row says

    schemas = tool_schemas([task["tool"]])  # data.tools: the same setting as rollout.agent.tools
    sft = SFTDataset([task["sft_file"]], tokenizer, max_length=512, tools=schemas, end_ids=end_token_ids(task["model"]))
    example = sft[list(THINGS).index(thing)]
    # The prompt: the RL prompt's ids exactly, tool schemas rendered into the system turn by the template.
    assert example.input_ids[:len(rl_prompt)] == rl_prompt
    system = tokenizer.decode(rl_prompt)
    assert "# Tools" in system and '"name": "lookup"' in system and system.index("# Tools") < system.index("What color")
    # The whole conversation: the trajectory's ids, trained exactly where RL's response_mask is 1.
    assert example.input_ids == rl_prompt + rl_response
    trained = [int(label != IGNORE_INDEX) for label in example.labels]
    assert trained == [0] * len(rl_prompt) + rl_mask
    # What is trained: the tool call as the model writes it (hermes, parsed back by the agent loop) and
    # the answer, each with <|im_end|>; the tool's result and the template's tokens are context.
    spans = tokenizer.decode([t for t, on in zip(example.input_ids, trained) if on])
    call = f'<tool_call>\n{{"name": "lookup", "arguments": {{"key": "{thing}"}}}}\n</tool_call>'
    assert spans == f"{call}{IM_END}{THINGS[thing]}{IM_END}"
    assert [(c.name, c.arguments) for c in parse_tool_calls(call)] == [("lookup", {"key": thing})]
    context = tokenizer.decode([t for t, on in zip(example.input_ids, trained) if not on][len(rl_prompt):])
    assert context == f"\n<|im_start|>user\n<tool_response>\n{THINGS[thing]}\n</tool_response>{IM_END}\n<|im_start|>assistant\n"


def test_verls_multi_turn_schema_with_a_tools_column_and_a_schema_file(task, tmp_path):
    tokenizer = load_tokenizer(task["model"])
    schemas = tool_schemas([task["tool"]])
    ends = end_token_ids(task["model"])
    expected = [e.input_ids for e in SFTDataset([task["sft_file"]], tokenizer, max_length=512, tools=schemas, end_ids=ends)]
    # verl's columns: `messages` and a per-row `tools` (its JSON text here; parquet), no data.tools at all
    rows = [{"messages": conversation(t), "tools": json.dumps(schemas)} for t in THINGS]
    own = SFTDataset([write_rows(rows, tmp_path / "verl.parquet")], tokenizer, max_length=512, end_ids=ends)
    assert [e.input_ids for e in own] == expected
    # JSON lines with the arguments as an object, the call in the agent loop's own {name, arguments} form
    rows = [{"messages": [m if m["role"] != "assistant" or "tool_calls" not in m else
                          {"role": "assistant", "content": None,
                           "tool_calls": [{"name": "lookup", "arguments": {"key": t}}]} for m in conversation(t)]}
            for t in THINGS]
    flat = SFTDataset([write_rows(rows, tmp_path / "flat.jsonl")], tokenizer, max_length=512, tools=schemas, end_ids=ends)
    assert [e.input_ids for e in flat] == expected
    # a .json schema file is a tools setting too (tools that need describing, not running)
    (tmp_path / "tools.json").write_text(json.dumps(schemas))
    assert tool_schemas([str(tmp_path / "tools.json")]) == schemas
    # without the schemas the prompt would be another one, listing no tools: refused (test_agent_data_...)
    with pytest.raises(DataValidationError, match="3 rows \\(0, 1, 2\\): field 'messages': calls tools, but no tools"):
        SFTDataset([task["sft_file"]], tokenizer, max_length=512, end_ids=ends)


def test_a_template_without_tool_calls_trains_the_hermes_text_the_agent_parses(own_model):
    """ChatML that renders role and content only: a tool_calls turn trains the hermes call the agent
    loop parses (never an empty turn), and the tool's result is context."""
    tokenizer = load_tokenizer(str(own_model.model_dir))
    messages = conversation("banana")
    ids, labels = tokenize_messages(messages, tokenizer, end_token_ids(str(own_model.model_dir)))
    trained = tokenizer.decode([t for t in labels if t != IGNORE_INDEX])
    call = '<tool_call>\n{"name": "lookup", "arguments": {"key": "banana"}}\n</tool_call>'
    assert trained == f"{call}{IM_END}yellow{IM_END}"
    assert [(c.name, c.arguments) for c in parse_tool_calls(trained)] == [("lookup", {"key": "banana"})]
    assert tokenizer.decode(ids).count("yellow") == 2  # the tool's result (context) and the answer (trained)


def test_bad_tool_calls_and_tools_are_named_by_row_and_field(task, tmp_path):
    tokenizer = load_tokenizer(task["model"])
    bad_args = conversation("sky")
    bad_args[1]["tool_calls"][0]["function"]["arguments"] = "{key: sky"
    rows = [{"messages": conversation("banana"), "tools": None},
            {"messages": bad_args, "tools": None},
            {"messages": conversation("grass"), "tools": "[{\"nope\": 1}]"},
            {"messages": [{"role": "user", "content": "hi", "tool_calls": []}, {"role": "assistant", "content": "x"}]}]
    file = write_rows(rows, tmp_path / "bad.jsonl")
    with pytest.raises(Exception) as err:
        SFTDataset([file], tokenizer, max_length=512)
    text = str(err.value)
    assert "4 bad row(s)" in text
    assert "row 0: field 'messages': calls tools, but no tools are given" in text  # no data.tools, none of its own
    assert "row 1: field 'messages': message 1: tool_calls[0].function.arguments: not JSON" in text
    assert "row 2: field 'tools': expected a list of" in text
    assert "row 3: field 'messages': message 0: a user message with tool_calls" in text
    with pytest.raises(ToolSpecError, match="no_such_tool"):
        tool_schemas([f"{task['root'] / 'lookup.py'}:no_such_tool"])


def test_data_tools_is_checked_before_anything_loads(task, tmp_path):
    config = load_sft_config(None, [f"model.path={task['model']}", f"data.train_files=[{task['sft_file']}]",
                                    f"data.tools=[{task['tool']},{tmp_path / 'missing.json'},nope.mod:fn]",
                                    f"trainer.output_dir={tmp_path / 'out'}"])
    with pytest.raises(PreflightError) as err:
        sft_preflight(config)
    text = str(err.value)
    assert "data.tools[1]:" in text and "missing.json" in text and "data.tools[2]:" in text and "data.tools[0]" not in text


def test_one_chat_turns_for_rl_and_sft(task):
    """The agent loop and SFT hold the same ChatTurns (rlcore.chat): the rendered call is the template's."""
    tokenizer = load_tokenizer(task["model"])
    turns = ChatTurns(tokenizer)
    assert turns.renders_tools and turns.renders_tool_calls
    assert turns.assistant_text(_call("sky")) == '<tool_call>\n{"name": "lookup", "arguments": {"key": "sky"}}\n</tool_call>'
    ids, trained = conversation_ids(conversation("sky"), turns, end_token_ids(task["model"]))
    assert len(ids) == len(trained) and sum(trained) > 0
    with pytest.raises(ValueError, match="opens with an assistant turn"):
        conversation_ids(conversation("sky")[1:], turns, end_token_ids(task["model"]))
    assert torch.tensor(trained).sum() < len(trained)


@pytest.mark.slow
def test_rlcore_sft_with_data_tools_teaches_calls_the_agent_loop_runs(task, tmp_path, capsys):
    """`rlcore sft` with `data.tools` on the tool conversations, then the RL path (prompts with
    rollout.agent.tools, the agent loop, the HF engine, greedy): the model writes calls the agent loop
    parses and runs, reads the tool's turn and answers. (Which key it looks up is the tiny model's
    memory of three rows, not what is tested: 60 steps leave it unsure which thing was asked.)"""
    from rlcore.cli import CONFIG_DIR, main
    from rlcore.rollout import HFRolloutEngine

    out = tmp_path / "sft"
    assert main(["sft", str(CONFIG_DIR / "tiny_sft.yaml"), f"model.path={task['model']}",
                 f"data.train_files=[{task['sft_file']}]", f"data.tools=[{task['tool']}]", "data.max_length=512",
                 "trainer.total_steps=60", "trainer.batch_size=3", "trainer.save_every=60", "trainer.device=cpu",
                 "trainer.loggers=[jsonl]", "actor.optim.lr=1e-2", "actor.optim.warmup_steps=2",
                 f"trainer.output_dir={out}"]) == 0
    model_dir = json.loads(capsys.readouterr().out)["model"]
    losses = [json.loads(line)["train/loss"] for line in (out / "metrics.jsonl").read_text().splitlines()[1:]]
    assert losses[-1] < 0.1 * losses[0]
    tokenizer = load_tokenizer(model_dir)
    config = config_from_dict({"model": {"path": model_dir},
                               "data": {"train_files": [str(task["rl_file"])], "max_prompt_length": 400},
                               "rollout": {"agent": {"tools": [task["tool"]], "max_total_tokens": 200}}})
    batch = next(prompt_loader(config, tokenizer, [str(task["rl_file"])], train=False).epoch_batches())
    engine = HFRolloutEngine.from_pretrained(model_dir, eos_token_ids=end_token_ids(model_dir))
    with ToolPool([task["tool"]], num_workers=1) as pool:
        loop = AgentLoop(engine, tokenizer, end_token_ids(model_dir), AgentSettings(max_turns=3, max_total_tokens=200), tools=pool)
        gen = loop.generate(batch, SamplingParams(n=1, do_sample=False, max_new_tokens=64))
    assert gen.meta["agent_finish"].tolist() == ["answer"] * 3 and gen.meta["agent_tool_errors"].tolist() == [0] * 3
    for messages in gen.meta["agent_messages"]:
        [call] = messages[1]["tool_calls"]
        assert call["name"] == "lookup" and call["arguments"]["key"] in THINGS, messages
        assert messages[2] == {"role": "tool", "name": "lookup", "content": THINGS[call["arguments"]["key"]]}
        assert messages[3]["content"] in THINGS.values()
