"""Build the built-in tiny example: tokenizer, data, and an SFT-warmed small Llama.

Everything comes from a seed (no hub, no downloads) and is cached under
`$RLCORE_CACHE/examples/tiny-v<BUILDER_VERSION>-seed<seed>`. A build happens in a temporary
folder renamed into place with `.complete` written last, so an interrupted build is never
mistaken for a finished one and a second call returns at once.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from rlcore.data.chat import prompt_ids
from rlcore.data.io import write_rows
from rlcore.example.evaluate import evaluate_accuracy
from rlcore.example.model import TinyModelSpec, make_model
from rlcore.example.task import format_response, prompt_messages, rl_row, sft_rows, split_problems
from rlcore.example.tokenizer import build_tokenizer
from rlcore.trainer.sft import SFTConfig, run_sft, save_model

log = logging.getLogger(__name__)

# Bump whenever anything below changes what gets built (task, tokenizer, model, SFT recipe).
BUILDER_VERSION = 4
COMPLETE = ".complete"
MANIFEST = "example.json"


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the example, besides the seed."""

    n_train: int = 4000
    n_val: int = 400
    carry_fraction: float = 0.7  # share of train/val problems with a units carry (natural: 0.45)
    drop_carry_prob: float = 0.65  # how often the flawed teacher loses the units carry
    sft_steps: int = 1500
    sft_batch_size: int = 32
    sft_lr: float = 1e-3  # 3e-3 made loss spikes and, on some seeds, no learning at all
    sft_warmup_steps: int = 100
    model: TinyModelSpec = field(default_factory=TinyModelSpec)
    eval_n: int = 8  # pass@n reported for the SFT start
    max_new_tokens: int = 10


@dataclass
class TinyExample:
    root: Path
    model_dir: Path
    train_file: Path
    val_file: Path
    sft_file: Path
    seed: int
    builder_version: int
    vocab_size: int
    pad_token_id: int
    bos_token_id: int
    eos_token_id: int
    max_prompt_length: int  # longest prompt in the data, in tokens
    max_response_length: int  # longest correct response incl. EOS, in tokens
    sft_greedy_accuracy: float  # validation accuracy of the SFT model, greedy
    sft_sample_accuracy: float  # validation accuracy of single samples at temperature 1
    sft_pass_at_n: float  # pass@n at temperature 1
    eval_n: int
    sft_metrics: dict[str, Any]
    build_time_s: float
    num_threads: int

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("root", "model_dir", "train_file", "val_file", "sft_file"):
            d[k] = os.path.relpath(d[k], self.root) if k != "root" else "."
        return d

    @classmethod
    def from_json(cls, root: Path, d: dict[str, Any]) -> "TinyExample":
        d = dict(d)
        d["root"] = root
        for k in ("model_dir", "train_file", "val_file", "sft_file"):
            d[k] = root / d[k]
        return cls(**d)


def default_cache_dir() -> Path:
    return Path(os.environ.get("RLCORE_CACHE", Path.home() / ".cache" / "rlcore"))


def default_example_dir(seed: int) -> Path:
    return default_cache_dir() / "examples" / f"tiny-v{BUILDER_VERSION}-seed{seed}"


def load_tiny_example(out_dir: Path) -> TinyExample | None:
    """The finished example in `out_dir`, or None if there is no complete build there."""
    out_dir = Path(out_dir)
    if not (out_dir / COMPLETE).exists():
        return None
    return TinyExample.from_json(out_dir.resolve(), json.loads((out_dir / MANIFEST).read_text()))


def build_tiny_example(out_dir: Path | None = None, seed: int = 0, force: bool = False,
                       recipe: Recipe | None = None, log_fn: Callable[[str], None] | None = None) -> TinyExample:
    """Build (or return the cached) tiny example for `seed`."""
    out_dir = Path(out_dir) if out_dir is not None else default_example_dir(seed)
    if not force:
        cached = load_tiny_example(out_dir)
        if cached is not None:
            return cached
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _build_into(tmp, seed, recipe or Recipe(), log_fn or log.info)
        (tmp / COMPLETE).write_text("ok\n")  # written last: the build is whole
        if out_dir.exists():
            if not force and load_tiny_example(out_dir) is not None:  # another process won the race
                shutil.rmtree(tmp, ignore_errors=True)
                return load_tiny_example(out_dir)  # type: ignore[return-value]
            shutil.rmtree(out_dir)  # stale partial build, or force
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return load_tiny_example(out_dir)  # type: ignore[return-value]


def _build_into(root: Path, seed: int, recipe: Recipe, say: Callable[[str], None]) -> TinyExample:
    start = time.perf_counter()
    root.mkdir(parents=True)
    tokenizer = build_tokenizer()
    train, val, rest = split_problems(seed, recipe.n_train, recipe.n_val, recipe.carry_fraction)
    train_file = write_rows([rl_row(p, "train", i) for i, p in enumerate(train)], root / "data" / "train.parquet")
    val_file = write_rows([rl_row(p, "val", i) for i, p in enumerate(val)], root / "data" / "val.parquet")
    # SFT draws from every problem except validation ones; each draw asks the flawed teacher anew.
    sft = sft_rows(train + rest, recipe.sft_steps * recipe.sft_batch_size, seed + 1, recipe.drop_carry_prob)
    sft_file = write_rows(sft, root / "data" / "sft.parquet")

    # fork_rng: building the example leaves the caller's torch RNG untouched.
    with torch.random.fork_rng(devices=[]):
        model = make_model(tokenizer, recipe.model, seed)
        cfg = SFTConfig(lr=recipe.sft_lr, batch_size=recipe.sft_batch_size, micro_batch_size=recipe.sft_batch_size,
                        epochs=1, max_steps=recipe.sft_steps, warmup_steps=recipe.sft_warmup_steps, seed=seed,
                        log_every=250)
        say(f"tiny example: SFT of a {sum(p.numel() for p in model.parameters()):,}-parameter Llama "
            f"for {recipe.sft_steps} steps")
        metrics = run_sft(model, tokenizer, sft, cfg, log=say)
        model_dir = root / "model"
        save_model(model, tokenizer, model_dir)
        greedy = evaluate_accuracy(model, tokenizer, val_file, greedy=True, max_new_tokens=recipe.max_new_tokens)
        sampled = evaluate_accuracy(model, tokenizer, val_file, greedy=False, n=recipe.eval_n, temperature=1.0,
                                    max_new_tokens=recipe.max_new_tokens, seed=seed)

    all_probs = train + val
    max_prompt = max(len(prompt_ids(prompt_messages(p), tokenizer)[1]) for p in all_probs)
    max_resp = max(len(tokenizer(format_response(p.answer), add_special_tokens=False)["input_ids"]) + 1 for p in all_probs)
    example = TinyExample(
        root=root.resolve(), model_dir=model_dir.resolve(), train_file=train_file.resolve(),
        val_file=val_file.resolve(), sft_file=sft_file.resolve(), seed=seed, builder_version=BUILDER_VERSION,
        vocab_size=model.config.vocab_size, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        max_prompt_length=max_prompt, max_response_length=max_resp,
        sft_greedy_accuracy=greedy["accuracy"], sft_sample_accuracy=sampled["accuracy"],
        sft_pass_at_n=sampled[f"pass@{recipe.eval_n}"], eval_n=recipe.eval_n,
        sft_metrics={k: v for k, v in metrics.items() if k != "losses"},
        build_time_s=time.perf_counter() - start, num_threads=torch.get_num_threads(),
    )
    (root / MANIFEST).write_text(json.dumps(example.to_json(), indent=1) + "\n")
    say(f"tiny example built in {example.build_time_s:.0f}s: SFT greedy val acc {greedy['accuracy']:.3f}, "
        f"pass@{recipe.eval_n} {example.sft_pass_at_n:.3f}")
    return example
