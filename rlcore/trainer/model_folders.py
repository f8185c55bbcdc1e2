"""Model folders checked before any model loads: their config as transformers reads it, and their
weight files read as far as is cheap.

Without this, a broken folder failed only while loading, with the library's words: a truncated
`model.safetensors` as `SafetensorError: incomplete metadata` naming no file, a reward model
whose score head is NaN as "this architecture is not supported as a reward model", a classifier
config without `num_labels` (transformers then builds two labels) after loading, with a
traceback. Each check here gives one line naming the config key and the file.

Checked per folder: `config.json` loads with transformers' `AutoConfig` (so `num_labels` and
`architectures` are what transformers will use); every `*.safetensors` file's header (its size
field, JSON, each tensor's dtype, shape and byte range inside the file, the data region covered
exactly: a truncated or padded copy fails); every shard an `*.safetensors.index.json` names
exists and holds the tensors the index puts there; and every floating-point tensor of at most
`FINITE_CHECK_ELEMENTS` values (norms, biases, score and value heads: reading them costs little
next to loading the model) is finite and small enough to compute with (a score head at 1e38 gives
infinite scores from finite weights). A reward model's folder must also hold the score head its
config promises (a causal LM whose config.json was relabelled as a classifier holds an LM head).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

# Bytes per element of the safetensors dtypes (the format's own list).
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
FLOAT_DTYPES = {"F8_E5M2", "F8_E4M3", "F16", "BF16", "F32", "F64"}
HEADER_LIMIT = 100 * 2**20  # the safetensors library's own limit on a header
FINITE_CHECK_ELEMENTS = 1 << 16  # tensors up to this many values are read and checked for NaN/inf
# A finite weight above this is damage, not training: its square, and so a dot product through it,
# overflows float32 (3.4e38); trained weights sit many orders of magnitude below.
OVERFLOW_LIMIT = 2.0**64


class WeightFileError(ValueError):
    """A weight file that cannot be what it claims; the message says what is wrong (not where)."""


def safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """The tensors a safetensors file declares (name -> dtype, shape, data_offsets), after checking
    that the header is whole and every tensor's bytes lie in the file, covering its data exactly."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise WeightFileError(f"{size} bytes, shorter than a safetensors header (truncated or empty)")
        n = int.from_bytes(head, "little")
        if n > size - 8 or n > HEADER_LIMIT:
            raise WeightFileError(f"its header length field says {n} bytes, the file has {size - 8} after it "
                                  "(truncated, or not a safetensors file)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as err:
        raise WeightFileError(f"its header is not JSON ({type(err).__name__}: {err})") from None
    if not isinstance(header, dict):
        raise WeightFileError("its header is not a JSON object")
    data = size - 8 - n
    tensors: dict[str, dict[str, Any]] = {}
    covered = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            if not all(isinstance(v, int) and v >= 0 for v in (*shape, begin, end)) or not isinstance(dtype, str):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise WeightFileError(f"tensor {name!r} has no valid dtype, shape and data_offsets in the header") from None
        if not begin <= end <= data:
            raise WeightFileError(f"tensor {name!r} lies at bytes {begin}..{end} of a data region of {data} bytes "
                                  "(the file is truncated)")
        if dtype in DTYPE_BYTES and end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise WeightFileError(f"tensor {name!r} ({dtype} {shape}) spans {end - begin} bytes, not "
                                  f"{math.prod(shape) * DTYPE_BYTES[dtype]}")
        covered = max(covered, end)
        tensors[name] = info
    if covered != data:
        raise WeightFileError(f"its tensors end at byte {covered} of a data region of {data} bytes "
                              "(an incomplete or padded copy)")
    return tensors


def unusable_small_tensor(path: Path, tensors: dict[str, dict[str, Any]]) -> str | None:
    """What is wrong with the first small floating-point tensor (at most `FINITE_CHECK_ELEMENTS`
    values) that holds NaN or inf, or finite values so large (above `OVERFLOW_LIMIT`) that a
    forward pass through them overflows to inf; None when every one is usable."""
    import torch
    from safetensors import safe_open

    small = [name for name, info in tensors.items()
             if info["dtype"] in FLOAT_DTYPES and math.prod(info["shape"]) <= FINITE_CHECK_ELEMENTS]
    if not small:
        return None
    with safe_open(str(path), framework="pt") as f:
        for name in small:
            t = f.get_tensor(name).float()
            bad = int((~torch.isfinite(t)).sum())
            if bad:
                return f"non-finite weights in {path}: {name} ({bad} of {t.numel()} values NaN or inf)"
            largest = float(t.abs().max()) if t.numel() else 0.0
            if largest > OVERFLOW_LIMIT:
                return (f"weights too large to compute with in {path}: {name} holds values up to {largest:.3g} (above "
                        f"2^64: a dot product of them overflows float32, so the model's outputs would be inf)")
    return None


def weight_problems(key: str, folder: Path) -> list[str]:
    """One line per broken weight file of `folder` (see the module's doc)."""
    problems = []
    headers: dict[str, dict[str, dict[str, Any]]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        try:
            headers[path.name] = safetensors_header(path)
        except WeightFileError as err:
            problems.append(f"{key}: unreadable weights in {path}: {err}")
            continue
        except OSError as err:
            problems.append(f"{key}: cannot read {path}: {err}")
            continue
        try:
            found = unusable_small_tensor(path, headers[path.name])
        except Exception as err:  # noqa: BLE001 - the reader's own refusal of a file whose header passed
            problems.append(f"{key}: unreadable weights in {path}: {type(err).__name__}: {err}")
            continue
        if found is not None:
            problems.append(f"{key}: {found}")
    for index in sorted(folder.glob("*.safetensors.index.json")):
        problems += _index_problems(key, index, headers)
    return problems


def _index_problems(key: str, index: Path, headers: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """A sharded checkpoint's index: readable, every shard it names present and holding its tensors."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, ValueError, KeyError, TypeError) as err:
        return [f"{key}: unreadable shard index {index} ({type(err).__name__}: {err})"]
    problems = []
    for shard in sorted({str(s) for s in weight_map.values()}):
        if not (index.parent / shard).is_file():
            problems.append(f"{key}: {index} names the shard {shard}, which is missing")
        elif shard in headers:
            missing = [name for name, s in weight_map.items() if s == shard and name not in headers[shard]]
            if missing:
                problems.append(f"{key}: {index.parent / shard} lacks {len(missing)} tensor(s) its index puts there, "
                                f"first {missing[0]!r}")
    return problems


def read_model_config(key: str, folder: Path) -> tuple[Any | None, list[str]]:
    """(the folder's config as transformers' `AutoConfig` reads it, problems): None and one line
    naming the file when transformers cannot read it."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True), []
    except Exception as err:  # noqa: BLE001 - transformers raises ValueError, OSError, KeyError... for a bad config
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return None, [f"{key}: transformers cannot read {folder / 'config.json'}: {first[:300]}"]


def reward_model_config_problems(key: str, folder: Path, config: Any) -> list[str]:
    """A reward model is a one-label *ForSequenceClassification model, as transformers reads its
    config (a config without `num_labels` or `id2label` reads as two labels)."""
    architectures = list(getattr(config, "architectures", None) or [])
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        return [f"{key}: {folder} is not a reward model: its config.json names {architectures or 'no architectures'}, "
                "not a one-label *ForSequenceClassification model; train one with algorithm.name=rm"]
    if config.num_labels != 1:
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        why = (" (it has neither num_labels nor id2label, and transformers then builds 2)"
               if "num_labels" not in raw and "id2label" not in raw else "")
        return [f"{key}: {folder} is not a one-label reward model: transformers reads num_labels={config.num_labels} "
                f"from its config.json{why}; a reward model has num_labels: 1"]
    return missing_score_head(key, folder, architectures, bool(getattr(config, "tie_word_embeddings", False)))


def missing_score_head(key: str, folder: Path, architectures: list[str], tied: bool) -> list[str]:
    """A one-label classifier's weights must hold its `score` head: a causal LM whose config.json
    names a *ForSequenceClassification architecture holds an LM head instead, and transformers
    would load it with a random score head."""
    names: set[str] = set()
    for path in sorted(folder.glob("*.safetensors")):
        try:
            names |= set(safetensors_header(path))
        except (WeightFileError, OSError):
            return []  # named by weight_problems
    if not names or any(n.split(".")[-2:-1] == ["score"] for n in names):
        return []  # no safetensors to read (a .bin folder), or the head is there
    lm_head = sorted(n for n in names if n.split(".")[-2:-1] == ["lm_head"])
    if lm_head:
        what = f"it holds an LM head ({lm_head[0]}): a causal LM whose config.json was labelled as a classifier"
    elif tied:
        what = "its LM head is tied to its embeddings: a causal LM whose config.json was labelled as a classifier"
    else:
        what = "it is not a trained reward model"
    return [f"{key}: {folder}'s config.json names {architectures[0]} with one label, but its weights hold no score "
            f"head (score.weight); {what}. Train a reward model with algorithm.name=rm"]


__all__ = ["missing_score_head", "OVERFLOW_LIMIT", "WeightFileError", "unusable_small_tensor", "read_model_config", "reward_model_config_problems",
           "safetensors_header", "weight_problems"]
