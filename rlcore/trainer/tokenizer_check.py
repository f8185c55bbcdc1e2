"""Start-up check: the prompt ids rlcore trains on are the ids the model is served with.

rlcore tokenizes with `AutoTokenizer` (`rlcore.workers.tokenizer`), as vLLM and a user's own code
do. Two things can still make the ids differ without a word, and both are seen here on a sample
of the run's prompts, before any model loads:

- the serving side loads the folder another way: vLLM's own loader when the run rolls out with
  vLLM (`vllm.tokenizers.get_tokenizer`), else a fresh `AutoTokenizer`, each rendering the prompt
  through its own chat template;
- the folder's `tokenizer.json`, loaded as the file it is (`tokenizers.Tokenizer.from_file`, what
  the tokenizer was trained as, and what code that loads it directly gets), disagrees with what
  AutoTokenizer builds from it. transformers 5 builds `Qwen2Tokenizer` for every `qwen2` folder,
  with Qwen's pre-tokenizer: a BPE trained with another one then gives other ids, and a model
  fine-tuned one way scores near zero when run the other way.

A mismatch is an error naming the file and row, the prompt, both id lists and what to do;
`data.tokenizer_check_rows: 0` switches the check off.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcore.chat import encode_prompt, has_chat_template, render_prompt
from rlcore.config import Config
from rlcore.data.io import peek_rows
from rlcore.errors import RLCoreError
from rlcore.rollout_backends import resolve_backend, traits_of
from rlcore.workers.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


class TokenizerMismatchError(RLCoreError):
    """rlcore's prompt ids differ from the serving side's or from the folder's tokenizer.json."""


@dataclass(frozen=True)
class PromptSample:
    where: str  # "data.train_files[0] row 3"
    prompt: str | list[dict[str, str]]


Encoder = Callable[[str, bool], list[int]]  # (rendered text, templated) -> ids


def sample_prompts(keyed_files: Sequence[tuple[str, str]], rows_per_file: int, prompt_key: str = "prompt") -> list[PromptSample]:
    """Up to `rows_per_file` prompts from the start of each (config key, file); rows whose prompt
    is not a string or a list of messages are left to the dataset's own validation."""
    out: list[PromptSample] = []
    for key, file in keyed_files:
        for i, row in enumerate(peek_rows(file, rows_per_file, columns=[prompt_key])):
            value = row.get(prompt_key)
            if isinstance(value, str) or (isinstance(value, list) and value and all(
                    isinstance(m, dict) and "role" in m and "content" in m for m in value)):
                out.append(PromptSample(f"{key} row {i}", value))
    return out


def _serving(path: str, backend: str) -> tuple[str, Any]:
    """(name, tokenizer) of what serves the model: the backend's own loader where it has one (vLLM's
    for a vLLM run, its `serving_tokenizer` trait), else AutoTokenizer."""
    traits = traits_of(backend)
    if traits.serving_tokenizer is not None:
        module, _, function = traits.serving_tokenizer.partition(":")
        return f"{traits.label}'s tokenizer", getattr(importlib.import_module(module), function)(path)
    from transformers import AutoTokenizer

    return "AutoTokenizer", AutoTokenizer.from_pretrained(Path(path), local_files_only=True)


def _file_encoder(path: str) -> Encoder | None:
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(file))
    return lambda text, templated: list(raw.encode(text, add_special_tokens=not templated).ids)


def _show(ids: list[int], limit: int = 24) -> str:
    return f"{ids[:limit]}{' ...' if len(ids) > limit else ''} ({len(ids)} ids)"


def tokenization_problems(path: str, samples: Sequence[PromptSample], apply_chat_template: bool,
                          backend: str = "hf", key: str = "model.path") -> list[str]:
    """One line per disagreement found (rlcore vs serving, rlcore vs tokenizer.json), each with
    its count, the first prompt it was seen on and what to do; empty when all agree. `key`: the
    setting that names the folder (`reward_model.path` for the reward model's tokenizer)."""
    if not samples:
        return []
    ours = load_tokenizer(path)
    serving_name, serving = _serving(path, backend)
    file_encode = _file_encoder(path)
    ours_name = f"rlcore (AutoTokenizer: {type(ours).__name__})"
    first: dict[str, str] = {}
    counts: dict[str, int] = {}
    for sample in samples:
        text = render_prompt(sample.prompt, ours, apply_chat_template)
        templated = not isinstance(sample.prompt, str) and apply_chat_template and has_chat_template(ours)
        ids = encode_prompt(text, ours, templated)
        their_text = render_prompt(sample.prompt, serving, apply_chat_template)
        their_ids = encode_prompt(their_text, serving, templated)
        found = []
        if their_ids != ids:
            found.append(("serving", f"{ours_name} {_show(ids)} vs {serving_name} {_show(their_ids)}"
                          + ("" if their_text == text else f"; rendered {text!r:.200} vs {their_text!r:.200}")))
        if file_encode is not None:
            file_ids = file_encode(text, templated)
            if file_ids != ids:
                found.append(("file", f"tokenizer.json {_show(file_ids)} vs AutoTokenizer {_show(ids)}"))
        for kind, detail in found:
            counts[kind] = counts.get(kind, 0) + 1
            first.setdefault(kind, f"{sample.where} ({text!r:.120}): {detail}")
    n = len(samples)
    problems = []
    if "serving" in counts:
        problems.append(
            f"{key}: rlcore and {serving_name} tokenize {counts['serving']} of {n} sampled prompts differently, "
            f"e.g. {first['serving']}. The model would be trained on other ids than it is served with: make the folder "
            f"load as one tokenizer in both (its tokenizer_config.json's tokenizer_class, its chat template) "
            f"(data.tokenizer_check_rows=0 skips this check)")
    if "file" in counts:
        problems.append(
            f"{key}: {Path(path) / 'tokenizer.json'} loaded as the file and through AutoTokenizer "
            f"({type(ours).__name__}, what vLLM and transformers users load) tokenize {counts['file']} of {n} sampled "
            f"prompts differently, e.g. {first['file']}. transformers builds the architecture's own tokenizer class for "
            f"some model types (Qwen2Tokenizer for every qwen2 folder, with Qwen's pre-tokenizer), so which ids the model "
            f"sees depends on who loads it. rlcore uses AutoTokenizer's. If the model learned the file's ids, train the "
            f"tokenizer with the pre-tokenizer AutoTokenizer builds (or save the folder under a model type whose "
            f"tokenizer class keeps tokenizer.json, e.g. llama); if it learned AutoTokenizer's, re-save the tokenizer "
            f"through AutoTokenizer (AutoTokenizer.from_pretrained(path).save_pretrained(path)) so both agree "
            f"(data.tokenizer_check_rows=0 skips this check)")
    return problems


def check_tokenization(path: str, samples: Sequence[PromptSample], apply_chat_template: bool, backend: str = "hf",
                       key: str = "model.path") -> None:
    """Raise `TokenizerMismatchError` listing each disagreement `tokenization_problems` finds."""
    start = time.perf_counter()
    problems = tokenization_problems(path, samples, apply_chat_template, backend, key)
    log.info("tokenizer check: %d prompts, %d problem(s), %.2f s", len(samples), len(problems), time.perf_counter() - start)
    if problems:
        raise TokenizerMismatchError("\n  ".join(problems))


def rl_prompt_files(config: Config) -> list[tuple[str, str]]:
    """(config key, file) of every file whose rows carry a `prompt` the run tokenizes."""
    keyed = [(f"data.train_files[{i}]", f) for i, f in enumerate(config.data.train_files)]
    keyed += [(f"data.val_files[{i}]", f) for i, f in enumerate(config.data.val_files)]
    if config.traits.task_validation:
        keyed += [(f"preference.task_val_files[{i}]", f) for i, f in enumerate(config.preference.task_val_files)]
    return keyed


def check_run_tokenization(config: Config) -> None:
    """The check for a training run (`rlcore.trainer.run.make_trainer` calls it after preflight)."""
    rows = config.data.tokenizer_check_rows
    if rows == 0:
        return
    samples = sample_prompts(rl_prompt_files(config), rows)
    backend = resolve_backend(config.rollout.backend)
    check_tokenization(config.model.path, samples, config.data.apply_chat_template, backend)
    if config.reward_model.path is not None:  # it tokenizes the same conversations with its own tokenizer
        check_tokenization(config.reward_model.path, samples, True, "hf", key="reward_model.path")


__all__ = ["PromptSample", "TokenizerMismatchError", "check_run_tokenization", "check_tokenization", "sample_prompts",
           "tokenization_problems"]
