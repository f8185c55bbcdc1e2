"""A model's `config.json` as the planner reads it, checked before transformers or torch see it.

A user plans from a config.json alone, so it is input like any other: the file must be a JSON
object of UTF-8 text of config.json's size and nesting, naming a `model_type`, and every size the
planner builds a model from (layers, hidden size, heads, vocabulary, experts) must be a whole
number a real model could have. A size beyond any real model is refused here, before any model
is built: transformers would build a billion layers (or list their attention types) for
`num_hidden_layers: 1000000000` and never return. Each refusal is one line naming the setting
that named the file, the file and the key in it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcore.plan.hardware import PlanInputError

MAX_CONFIG_BYTES = 16 * 2**20  # a model's config.json is a few KB; the largest (label maps) well under a MB
MAX_DEPTH = 32                 # config.json nests a few levels (text_config.rope_scaling.x)
_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "true or false", type(None): "null"}


@dataclass(frozen=True)
class Bound:
    """The range of a size key's values a real model has, with why it ends there."""

    high: int
    why: str
    low: int = 1


# What the planner builds a model from (transformers' standard names: `attribute_map` gives a
# model type's own spelling, GPT-2's `n_layer`), each bounded far above any released model.
SIZE_BOUNDS: dict[str, Bound] = {
    "num_hidden_layers": Bound(1024, "released decoder models have fewer than 200 layers"),
    "hidden_size": Bound(2**17, "released models' hidden sizes are below 32,768"),
    "intermediate_size": Bound(2**20, "released models' MLP widths are below 131,072"),
    "num_attention_heads": Bound(4096, "released models have at most a few hundred attention heads"),
    "num_key_value_heads": Bound(4096, "released models have at most a few hundred key/value heads"),
    "head_dim": Bound(4096, "released models' heads have at most 512 dimensions"),
    "vocab_size": Bound(2**22, "released vocabularies hold at most ~262,144 tokens"),
    "max_position_embeddings": Bound(2**30, "released models' contexts are below 16M tokens"),
    "num_local_experts": Bound(4096, "mixture-of-experts models have at most a few hundred experts per layer", low=0),
    "num_experts": Bound(4096, "mixture-of-experts models have at most a few hundred experts per layer", low=0),
    "n_routed_experts": Bound(4096, "mixture-of-experts models have at most a few hundred experts per layer", low=0),
}
REQUIRED_SIZES = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")


def brief(value: Any) -> str:
    """A JSON value as an error message quotes it, cut short when long."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else f"{text[:24]}... ({len(text):,} characters)"


def read_config_json(found: Path, key: str) -> dict[str, Any]:
    """The JSON object in `found` (a model's config.json, named by the setting `key`), refused
    (PlanInputError naming `key`, the file and the key in it) unless it is UTF-8 JSON of a
    config.json's size and nesting with a `model_type`, and every size key present is in bounds."""
    where = f"{key}: {found}"
    with found.open("rb") as handle:
        data = handle.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise PlanInputError(f"{where} is larger than {MAX_CONFIG_BYTES // 2**20} MiB: not a model's config.json (a few KB)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise PlanInputError(f"{where} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start:,})") from None
    try:
        raw = json.loads(text)
    except RecursionError:
        raise PlanInputError(f"{where} nests more than {MAX_DEPTH} levels deep (a config.json nests a few)") from None
    except ValueError as err:  # JSONDecodeError; an integer of more digits than Python converts
        raise PlanInputError(f"{where} is not JSON: {' '.join(str(err).split())}") from None
    if not isinstance(raw, dict):
        raise PlanInputError(f"{where} holds {_JSON_KINDS.get(type(raw), 'a value')}, not a JSON object of settings")
    deep = too_deep(raw, MAX_DEPTH)
    if deep is not None:
        raise PlanInputError(f"{where}: {deep} nests more than {MAX_DEPTH} levels deep (a config.json nests a few)")
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or not model_type.strip():
        raise PlanInputError(f"{where}: model_type is {brief(model_type) if 'model_type' in raw else 'missing'}; it must name "
                             "the architecture transformers builds (llama, qwen2, mistral, ...)")
    archs = raw.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise PlanInputError(f"{where}: architectures is {brief(archs)}, not a list of class names")
    inner = raw.get("text_config")
    if inner is not None and not isinstance(inner, dict):
        raise PlanInputError(f"{where}: text_config is {brief(inner)}, not an object")
    prefix = "text_config." if inner is not None else ""
    check_sizes(inner if inner is not None else raw, lambda name: prefix + name, where)
    return raw


def too_deep(value: Any, limit: int) -> str | None:
    """The dotted path of the first value nested more than `limit` levels deep in `value`, or None."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        if depth > limit:
            return path or "<top level>"
        children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for name, child in children:
            stack.append((child, f"{path}.{name}" if path else str(name), depth + 1))
    return None


def check_sizes(values: Mapping[str, Any], spelled: Callable[[str], str], where: str, *, required: bool = False) -> None:
    """Refuse the first size key of `values` (`SIZE_BOUNDS`' names) that is not a whole number in
    its bounds, and key/value heads that do not group the attention heads; `spelled(name)`:
    the key as the file spells it (`where`: the setting and file); `required`: `REQUIRED_SIZES` must be there (the planner's
    model FLOPs read them)."""
    for name, bound in SIZE_BOUNDS.items():
        value = values.get(name)
        if value is None:
            if required and name in REQUIRED_SIZES:
                raise PlanInputError(f"{where}: {spelled(name)} is missing (the planner reads a decoder's "
                                     f"{', '.join(REQUIRED_SIZES)})")
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise PlanInputError(f"{where}: {spelled(name)} is {brief(value)}, not a whole number")
        if value < bound.low:
            raise PlanInputError(f"{where}: {spelled(name)}={brief(value)} must be at least {bound.low}")
        if value > bound.high:
            raise PlanInputError(f"{where}: {spelled(name)}={brief(value)} is more than {bound.high:,}, beyond any real "
                                 f"model ({bound.why}); refused before any model is built")
    heads, kv_heads, head_dim, hidden = (values.get(n) for n in ("num_attention_heads", "num_key_value_heads", "head_dim",
                                                                  "hidden_size"))
    if isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads:
        raise PlanInputError(f"{where}: {spelled('num_attention_heads')}={heads} is not a multiple of "
                             f"{spelled('num_key_value_heads')}={kv_heads} (each key/value head serves a whole group of "
                             "attention heads)")
    if isinstance(heads, int) and isinstance(hidden, int) and head_dim is None and hidden < heads:
        raise PlanInputError(f"{where}: {spelled('hidden_size')}={hidden} is less than {spelled('num_attention_heads')}="
                             f"{heads}: a head would have no dimensions (head_dim = hidden_size // num_attention_heads)")


__all__ = ["MAX_CONFIG_BYTES", "MAX_DEPTH", "REQUIRED_SIZES", "SIZE_BOUNDS", "Bound", "brief", "check_sizes", "read_config_json",
           "too_deep"]
