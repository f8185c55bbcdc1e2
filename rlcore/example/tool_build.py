"""Build the tool example: its tokenizer, data, and a small Llama warm-started (by `rlcore sft`'s
recipe, on multi-turn chat data) to call a calculator on only some of its samples.

Like the arithmetic example (`rlcore.example.build`), it comes from a seed with no downloads, is
cached under `$RLCORE_CACHE/examples/tiny-tool-v<TOOL_BUILDER_VERSION>-seed<seed>` (a temporary
folder renamed into place, `.complete` written last), and is built in a child process
with one thread (this CPU's own kernels by default, ~100 CPU seconds; `pinned=True` for the
arithmetic example's portable float path, ~2.5x slower), so rebuilds on one machine give the same
weights. `rlcore example build --task tool` builds it; `rlcore/configs/tiny_tool_grpo.yaml`
trains it with GRPO and the calculator tool.

The start is measured with the agent loop itself (`rlcore.rollout.agent` on the HF engine, the
calculator in the sandboxed tool pool): greedy accuracy, sampled accuracy, how often sampled
trajectories call the tool, and how often a call names the problem's own expression.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlcore.config import sft_config_from_dict
from rlcore.data import PromptLoader, RLDataset
from rlcore.data.io import write_rows
from rlcore.example.build import (
    COMPLETE,
    MANIFEST,
    _build_in_pinned_process,
    default_cache_dir,
    enter_pinned_process,
    float_env,
    native_env,
    weights_sha256,
)
from rlcore.example.model import TinyModelSpec, make_model
from rlcore.example.tokenizer import build_tool_tokenizer
from rlcore.example.tool_task import TOOL_NAME, draw_problems, rl_row, sft_rows
from rlcore.example.warm_start import save_model
from rlcore.rewards.gsm8k import compute_score
from rlcore.rewards.tools import ToolPool
from rlcore.rollout import HFRolloutEngine, SamplingParams
from rlcore.rollout.agent import AgentLoop, AgentSettings
from rlcore.trainer.sft import run_sft_config

log = logging.getLogger(__name__)

# Bump whenever anything below changes what gets built (task, tokenizer, model, SFT recipe).
TOOL_BUILDER_VERSION = 2  # 2: the SFT recipe trains on the actor worker (same loss to float tolerance, other bits)
TOOL_SPEC = "rlcore.example.tools:calculator"


@dataclass(frozen=True)
class ToolRecipe:
    """Everything that decides the tool example, besides the seed."""

    n_train: int = 2000  # RL training prompts
    n_val: int = 200
    n_sft_problems: int = 20000  # the pool SFT rows are drawn from (never a validation problem)
    tool_prob: float = 0.4  # how often the teacher calls the calculator (else it answers directly, carries lost)
    sft_steps: int = 800  # 600 steps at tool_prob 0.3 had not learned to copy the tool's result yet
    sft_batch_size: int = 32
    sft_lr: float = 1e-3
    sft_warmup_steps: int = 50
    model: TinyModelSpec = field(default_factory=TinyModelSpec)
    eval_n: int = 4  # samples per validation prompt for the sampled numbers
    max_new_tokens: int = 32  # per assistant turn (a call is 26 tokens)
    max_total_tokens: int = 64  # a whole trajectory: call, tool turn, answer (~41 tokens)
    max_turns: int = 3

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ToolRecipe:
        return cls(**{**d, "model": TinyModelSpec(**d["model"])})


@dataclass
class ToolExample:
    root: Path
    model_dir: Path
    train_file: Path
    val_file: Path
    sft_file: Path
    seed: int
    builder_version: int
    tool: str  # the tool's spec, for rollout.agent.tools
    max_new_tokens: int
    max_total_tokens: int
    max_turns: int
    sft_greedy_accuracy: float  # validation accuracy, greedy, with the tool available
    sft_sample_accuracy: float  # single samples at temperature 1
    sft_tool_call_rate: float  # share of sampled trajectories that call the tool
    sft_correct_call_rate: float  # share of sampled trajectories whose first call is the problem's expression
    sft_greedy_tool_call_rate: float
    eval_n: int
    sft_metrics: dict[str, Any]
    build_time_s: float
    weights_sha256: str
    pinned: bool
    float_env: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("model_dir", "train_file", "val_file", "sft_file"):
            d[k] = os.path.relpath(d[k], self.root)
        d["root"] = "."
        return d

    @classmethod
    def from_json(cls, root: Path, d: dict[str, Any]) -> ToolExample:
        d = dict(d, root=root)
        for k in ("model_dir", "train_file", "val_file", "sft_file"):
            d[k] = root / d[k]
        return cls(**d)


def default_tool_example_dir(seed: int) -> Path:
    return default_cache_dir() / "examples" / f"tiny-tool-v{TOOL_BUILDER_VERSION}-seed{seed}"


def load_tool_example(out_dir: Path) -> ToolExample | None:
    """The finished tool example in `out_dir`, or None (no complete build of this version)."""
    out_dir = Path(out_dir)
    if not (out_dir / COMPLETE).exists():
        return None
    manifest = json.loads((out_dir / MANIFEST).read_text())
    if manifest.get("builder_version") != TOOL_BUILDER_VERSION:
        return None
    return ToolExample.from_json(out_dir.resolve(), manifest)


def build_tool_example(out_dir: Path | None = None, seed: int = 0, force: bool = False, recipe: ToolRecipe | None = None,
                       log_fn: Callable[[str], None] | None = None, pinned: bool = False) -> ToolExample:
    """Build (or return the cached) tool example for `seed` (see the module docstring), in a child
    process with one thread: this CPU's kernels by default (about 100 CPU seconds here), or the
    arithmetic example's portable float path with `pinned` (about 2.5x slower)."""
    out_dir = Path(out_dir) if out_dir is not None else default_tool_example_dir(seed)
    if not force:
        cached = load_tool_example(out_dir)
        if cached is not None:
            return cached
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    say = log_fn or log.info
    recipe = recipe or ToolRecipe()
    try:
        if pinned:
            _build_in_pinned_process(tmp, seed, recipe, say, task="tool")
        else:
            _build_in_pinned_process(tmp, seed, recipe, say, task="tool-native", env=native_env())
        (tmp / COMPLETE).write_text("ok\n")
        if out_dir.exists():
            if not force and load_tool_example(out_dir) is not None:  # another process won the race
                shutil.rmtree(tmp, ignore_errors=True)
                return load_tool_example(out_dir)  # type: ignore[return-value]
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return load_tool_example(out_dir)  # type: ignore[return-value]


def build_tool_in_child(root: Path, seed: int, recipe: ToolRecipe, say: Callable[[str], None], pinned: bool) -> ToolExample:
    """The build itself, in the child process `build_tool_example` started (`rlcore.example.pinned_build`)."""
    if pinned:
        enter_pinned_process()
    else:
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)
    return _build_tool_into(root, seed, recipe, say, pinned=pinned)


_EXPRESSION = re.compile(r'"expression"\s*:\s*"([^"]*)"')


@torch.no_grad()
def evaluate_with_tool(model: Any, tokenizer: Any, val_file: Path, recipe: ToolRecipe, *, greedy: bool, n: int = 1,
                       seed: int = 0) -> dict[str, float]:
    """Accuracy of agent rollouts with the calculator (HF engine, sandboxed tool pool), the share of
    trajectories that call it, and the share whose first call is the problem's own expression."""
    dataset = RLDataset([val_file], tokenizer, max_prompt_length=64)
    batch = next(PromptLoader(dataset, batch_size=len(dataset), seed=0, shuffle=False, drop_last=False).epoch_batches())
    engine = HFRolloutEngine(model, pad_token_id=tokenizer.pad_token_id, eos_token_ids=[tokenizer.eos_token_id])
    settings = AgentSettings(max_turns=recipe.max_turns, max_total_tokens=recipe.max_total_tokens)
    with ToolPool([TOOL_SPEC], num_workers=1, timeout_s=10.0) as pool:
        loop = AgentLoop(engine, tokenizer, [tokenizer.eos_token_id], settings, tools=pool)
        params = SamplingParams(n=1 if greedy else n, do_sample=not greedy, temperature=1.0,
                                max_new_tokens=recipe.max_new_tokens, seed=seed)
        gen = loop.generate(batch, params)
    samples = len(gen)
    correct = calls = right_calls = 0.0
    for messages, truth in zip(gen.meta["agent_messages"], gen.meta["ground_truth"]):
        answers = [m for m in messages if m["role"] == "assistant"]
        correct += compute_score(answers[-1]["content"], truth)
        question = messages[0]["content"].rstrip("=")
        call = next((m for m in answers if "<tool_call>" in m["content"]), None)
        if call is not None:
            calls += 1
            found = _EXPRESSION.search(call["content"])
            right_calls += found is not None and found.group(1) == question
    return {"accuracy": correct / samples, "tool_call_rate": calls / samples, "correct_call_rate": right_calls / samples}


def _build_tool_into(root: Path, seed: int, recipe: ToolRecipe, say: Callable[[str], None], pinned: bool) -> ToolExample:
    start = time.perf_counter()
    root.mkdir(parents=True)
    tokenizer = build_tool_tokenizer()
    val = draw_problems(seed, recipe.n_val)
    train = draw_problems(seed + 1, recipe.n_train, exclude=set(val))
    pool = draw_problems(seed + 2, recipe.n_sft_problems, exclude=set(val))
    train_file = write_rows([rl_row(p, "train", i) for i, p in enumerate(train)], root / "data" / "train.parquet")
    val_file = write_rows([rl_row(p, "val", i) for i, p in enumerate(val)], root / "data" / "val.parquet")
    sft_file = write_rows(sft_rows(pool, recipe.sft_steps * recipe.sft_batch_size, seed + 3, recipe.tool_prob),
                          root / "data" / "sft.parquet")

    with torch.random.fork_rng(devices=[]):
        init = root / "init"
        save_model(make_model(tokenizer, recipe.model, seed), tokenizer, init)
        say(f"tool example: SFT ({recipe.sft_steps} steps, rlcore sft's recipe) of a tiny Llama on multi-turn "
            f"calculator data (the teacher calls the tool {recipe.tool_prob:.0%} of the time)")
        config = sft_config_from_dict({
            "model": {"path": str(init)},
            "data": {"train_files": [str(sft_file)], "max_length": recipe.model.max_position_embeddings,
                     "tokenizer_check_rows": 0},
            "actor": {"optim": {"lr": recipe.sft_lr, "warmup_steps": recipe.sft_warmup_steps, "schedule": "cosine",
                                "min_lr_ratio": 0.1}},
            "trainer": {"total_steps": recipe.sft_steps, "batch_size": recipe.sft_batch_size, "seed": seed,
                        "output_dir": str(root / "sft"), "save_every": recipe.sft_steps, "keep_last": 1,
                        "val_before_train": False, "loggers": ["jsonl"], "device": "cpu", "resume": "disable"},
        })
        sft_start = time.perf_counter()
        out, history = run_sft_config(config)
        sft_seconds = time.perf_counter() - sft_start
        model_dir = root / "model"
        os.replace(out, model_dir)
        shutil.rmtree(root / "sft" / "checkpoints", ignore_errors=True)
        shutil.rmtree(init)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        greedy = evaluate_with_tool(model, tokenizer, val_file, recipe, greedy=True)
        sampled = evaluate_with_tool(model, tokenizer, val_file, recipe, greedy=False, n=recipe.eval_n, seed=seed)

    losses = [h["train/loss"] for h in history if "train/loss" in h]
    example = ToolExample(
        root=root.resolve(), model_dir=model_dir.resolve(), train_file=train_file.resolve(), val_file=val_file.resolve(),
        sft_file=sft_file.resolve(), seed=seed, builder_version=TOOL_BUILDER_VERSION, tool=TOOL_SPEC,
        max_new_tokens=recipe.max_new_tokens, max_total_tokens=recipe.max_total_tokens, max_turns=recipe.max_turns,
        sft_greedy_accuracy=greedy["accuracy"], sft_sample_accuracy=sampled["accuracy"],
        sft_tool_call_rate=sampled["tool_call_rate"], sft_correct_call_rate=sampled["correct_call_rate"],
        sft_greedy_tool_call_rate=greedy["tool_call_rate"], eval_n=recipe.eval_n,
        sft_metrics={"steps": len(losses), "loss_first": losses[0], "loss_last10": sum(losses[-10:]) / len(losses[-10:]),
                     "time_s": sft_seconds},
        build_time_s=time.perf_counter() - start, weights_sha256=weights_sha256(model_dir), pinned=pinned,
        float_env=float_env(),
    )
    (root / MANIFEST).write_text(json.dumps(example.to_json(), indent=1) + "\n")
    say(f"tool example built in {example.build_time_s:.0f}s: greedy val acc {example.sft_greedy_accuracy:.3f} "
        f"(calls the {TOOL_NAME} on {example.sft_greedy_tool_call_rate:.0%}); sampled acc {example.sft_sample_accuracy:.3f}, "
        f"tool calls {example.sft_tool_call_rate:.0%}, correct calls {example.sft_correct_call_rate:.0%}")
    return example


def tool_example_overrides(example: ToolExample, output_dir: str | None = None) -> list[str]:
    """Model and data paths of `example` for `rlcore/configs/tiny_tool_grpo.yaml` (and the output dir)."""
    out = [f"model.path={example.model_dir}", f"data.train_files=[{example.train_file}]",
           f"data.val_files=[{example.val_file}]"]
    return out + ([f"trainer.output_dir={output_dir}"] if output_dir is not None else [])


__all__ = ["TOOL_BUILDER_VERSION", "ToolExample", "ToolRecipe", "build_tool_example", "default_tool_example_dir",
           "evaluate_with_tool", "load_tool_example", "tool_example_overrides"]
