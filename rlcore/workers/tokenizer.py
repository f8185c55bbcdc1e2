"""The run's tokenizer and end tokens, loaded exactly as transformers, vLLM and users' code load them.

Tokenizer: `AutoTokenizer.from_pretrained`, the loader vLLM uses and a user's own code uses, so
the ids rlcore trains and scores on are the ids the model is served with. (transformers 5 may
build the architecture's own class from a folder's `tokenizer.json`: for `model_type: qwen2`
always `Qwen2Tokenizer`, with Qwen's pre-tokenizer. A folder whose tokenizer.json was trained with
another pre-tokenizer therefore tokenizes one way as the file and another through AutoTokenizer;
`rlcore.trainer.tokenizer_check` stops such a run at start-up instead of picking one silently.)

End tokens: every token the model declares as one, the tokenizer's `eos_token` and the
`eos_token_id` list of `generation_config.json` (Qwen2.5-Instruct: `<|im_end|>` and
`<|endoftext|>`), as `transformers.generate` and vLLM stop on them; rollout, reward and
evaluation all take them from here.

Model folders rlcore writes (checkpoints, merged adapters, SFT outputs) carry the tokenizer and
generation files of the folder they were trained from (`copy_tokenizer`).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

# What a model folder needs beside its weights to tokenize, template and stop as its source did.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "generation_config.json")


@lru_cache(maxsize=8)
def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The folder's tokenizer as `AutoTokenizer` builds it, left-padded, with a pad token (the
    EOS token when the folder names none: pad positions are masked, so any valid id does)."""
    tok = AutoTokenizer.from_pretrained(Path(path), local_files_only=True)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def declared_end_token_ids(folder: str | Path, tokenizer_eos: int | None) -> list[int]:
    """The tokenizer's EOS first, then `generation_config.json`'s `eos_token_id` (an id or a
    list), or config.json's when there is no generation config (what `generate` falls back to);
    each id once, in that order."""
    root = Path(folder)
    gen = _read_json(root / "generation_config.json")
    if "eos_token_id" in gen:
        declared = _ids(gen["eos_token_id"])
    else:
        config = _read_json(root / "config.json")
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        declared = _ids(text.get("eos_token_id", config.get("eos_token_id")))
    return list(dict.fromkeys([*_ids(tokenizer_eos), *declared]))


@lru_cache(maxsize=8)
def _end_token_ids(path: str) -> tuple[int, ...]:
    return tuple(declared_end_token_ids(path, load_tokenizer(path).eos_token_id))


def end_token_ids(path: str) -> list[int]:
    """Every end token of the model in `path` (see the module docstring); never empty for a
    folder whose tokenizer or configs name one."""
    return list(_end_token_ids(str(path)))


def pad_token_id(path: str) -> int:
    """The pad id of the run's tokenizer (its EOS when it names no pad token)."""
    tok = load_tokenizer(str(path))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if pad is None:
        raise ValueError(f"{path}: the tokenizer has neither a pad token nor an EOS token")
    return int(pad)


def cut_at_end(ids: Sequence[int], end_ids: Iterable[int]) -> list[int]:
    """`ids` up to (without) the first end token: what a response says, however it was generated."""
    ends = set(end_ids)
    for i, tok in enumerate(ids):
        if tok in ends:
            return list(ids[:i])
    return list(ids)


__all__ = ["cut_at_end", "declared_end_token_ids", "end_token_ids", "load_tokenizer", "pad_token_id"]


def copy_tokenizer(src: Path, dst: Path) -> None:
    """The tokenizer files of `src` into the model folder `dst` (existing files are kept)."""
    for file in TOKENIZER_FILES:
        if (src / file).is_file() and not (dst / file).exists():
            shutil.copy2(src / file, dst / file)
