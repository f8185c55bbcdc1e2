"""A role's model from its `config.json` alone, built on the meta device (no weights, no memory).

The planner needs only the architecture: a user plans before downloading. A folder with a
`config.json` (or the file itself) is checked (`rlcore.plan.model_json`: a JSON object whose sizes a
real model could have, so nothing absurd is ever built), read with `AutoConfig`, and the model is
built by transformers on the meta device as the worker would build it: a causal LM (actor,
reference), a one-label token classifier (the critic's values), a one-label sequence classifier
(the reward model). Any architecture transformers builds that way is accepted whose decoder layers
are where the workers shard them (`check_supported`).

`with_layers` gives the same model with fewer decoder layers: when every layer is the same
(`uniform_layers`), a step's peak memory is an affine function of the number of layers (each
layer adds its parameters, gradients, optimizer state and saved activations), so the planner
simulates two shallow copies and extrapolates (`rlcore.plan.simulate`).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from rlcore.plan.hardware import PlanInputError
from rlcore.plan.model_json import SIZE_BOUNDS, brief, check_sizes, read_config_json

Head = Literal["lm", "value", "score"]  # log-probs (actor, reference), values (critic), a sequence score (reward model)


def config_file(path: str | Path, key: str) -> Path:
    """The `config.json` of a model folder (or the file itself)."""
    path = Path(path)
    found = path if path.is_file() else path / "config.json"
    if not found.is_file():
        raise PlanInputError(f"{key}: {path} has no config.json (the planner needs only that file, no weights)")
    return found


def read_config(path: str | Path, key: str) -> Any:
    """The transformers config of the model at `path` (`key` names the setting in errors): its
    config.json checked first (`model_json`: shape, types, sizes a real model has), then read by
    transformers, whose own names for the sizes (`attribute_map`) are checked again."""
    found = config_file(path, key)
    raw = read_config_json(found, key)  # before transformers reads it: a bad file never reaches a config class
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if raw["model_type"] not in CONFIG_MAPPING_NAMES:
        raise PlanInputError(f"{key}: {found}: model_type {brief(raw['model_type'])} is not an architecture transformers knows "
                             "(llama, qwen2, mistral, ...)")
    try:
        config = AutoConfig.from_pretrained(found.parent if found.name == "config.json" else found, local_files_only=True)
    except Exception as err:  # noqa: BLE001 - transformers' complaint about the user's file, whatever its class
        raise PlanInputError(f"{key}: transformers cannot read {found}: {one_line(err)}") from err
    check_sizes(*_standard_sizes(config), f"{key}: {found}")
    return config


def one_line(err: BaseException) -> str:
    """An exception's message on one line (transformers' validation errors span several)."""
    return " ".join(f"{type(err).__name__}: {err}".split())[:500]


def _standard_sizes(config: Any) -> tuple[dict[str, Any], Callable[[str], str]]:
    """The size keys of `config`'s text config under transformers' standard names, and how the file
    spells each (GPT-2's `n_layer` for `num_hidden_layers`, under `text_config.` when nested)."""
    text = text_config(config)
    prefix = "text_config." if text is not config else ""
    spelling = dict(getattr(text, "attribute_map", None) or {})
    return {name: getattr(text, name, None) for name in SIZE_BOUNDS}, lambda name: prefix + spelling.get(name, name)


def config_dict(config: Any) -> dict[str, Any]:
    """The config as config.json holds it (what `rlcore.flops` reads)."""
    return json.loads(config.to_json_string(use_diff=False))


def text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def num_layers(config: Any) -> int:
    return int(text_config(config).num_hidden_layers)


def with_layers(config: Any, layers: int) -> Any:
    """A copy of `config` with `layers` decoder layers (per-layer lists cut to match)."""
    out = copy.deepcopy(config)
    text = text_config(out)
    text.num_hidden_layers = layers
    if isinstance(getattr(text, "layer_types", None), list):
        text.layer_types = text.layer_types[:layers]
    return out


def head_config(config: Any, head: Head) -> Any:
    """The config a worker builds `head`'s model from: one label and no dropout before it for the
    value and score heads (`load_value_model`, `load_sequence_classifier`), a pad token to score at."""
    if head == "lm":
        return config
    out = copy.deepcopy(config)
    out.num_labels = 1
    out.classifier_dropout = 0.0
    if head == "score" and getattr(out, "pad_token_id", None) is None:
        out.pad_token_id = 0
    return out


def build_meta(config: Any, head: Head, dtype: torch.dtype, key: str) -> nn.Module:
    """`head`'s transformers model of `config` on the meta device, parameters in `dtype`."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification

    auto = {"lm": AutoModelForCausalLM, "value": AutoModelForTokenClassification, "score": AutoModelForSequenceClassification}[head]
    try:
        with torch.device("meta"):
            return auto.from_config(head_config(config, head), dtype=dtype)
    except Exception as err:  # noqa: BLE001 - transformers' complaint about the user's config, whatever its class
        raise PlanInputError(f"{key}: transformers cannot build the model of {_source(config)} ({auto.__name__} of "
                             f"{type(config).__name__}): {one_line(err)}") from err


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers `rlcore.workers.fsdp.shard_model` shards one by one."""
    return getattr(model, model.base_model_prefix).layers


def check_supported(model: nn.Module, config: Any, key: str) -> None:
    """Refuse (naming `key`, what is unsupported and what is) a model whose decoder layers are not
    where rlcore's workers shard them (`decoder_layers`): the planner simulates them there."""
    backbone = getattr(model, getattr(model, "base_model_prefix", ""), None)
    layers = getattr(backbone, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) > 0:
        return
    where = f"{model.base_model_prefix}.layers" if backbone is not None else "base_model_prefix.layers"
    raise PlanInputError(
        f"{key}: {type(model).__name__} (model_type {getattr(config, 'model_type', None)!r}) is not supported: it has no "
        f"decoder layers at {where}, where rlcore's FSDP workers and the planner shard a model layer by layer; supported "
        f"are decoder-only models built that way, as transformers builds Llama, Qwen2, Qwen3, Mistral and Gemma "
        f"({_source(config)})")


def _source(config: Any) -> str:
    """Where `config` was read from (transformers records the folder)."""
    return str(getattr(config, "_name_or_path", "") or "a config")


def uniform_layers(model: nn.Module) -> bool:
    """Whether every decoder layer is the same (class, parameter shapes, attention type), so that
    memory is affine in their number."""
    layers = list(decoder_layers(model))
    shapes = {(type(layer).__name__, tuple((n, tuple(p.shape)) for n, p in layer.named_parameters())) for layer in layers}
    types = getattr(text_config(model.config), "layer_types", None)
    return len(shapes) == 1 and (not isinstance(types, list) or len(set(types)) <= 1)


@dataclass(frozen=True)
class ModelFacts:
    """What the planner reads off a full-depth meta model once."""

    architecture: str
    parameters: int
    layers: int
    uniform: bool  # every decoder layer the same: simulate two shallow copies and extrapolate
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int

    @classmethod
    def of(cls, config: Any, head: Head, key: str) -> ModelFacts:
        """Refused (PlanInputError naming `key`) for a model the planner cannot simulate: one
        without decoder layers where the workers shard them, or without a size the planner reads."""
        model = build_meta(config, head, torch.float32, key)
        check_supported(model, config, key)
        check_sizes(*_standard_sizes(config), f"{key}: {_source(config)}", required=True)
        text = text_config(config)
        heads = int(text.num_attention_heads)
        return cls(
            architecture=type(model).__name__,
            parameters=sum(p.numel() for p in model.parameters()),
            layers=num_layers(config),
            uniform=uniform_layers(model),
            heads=heads,
            kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
            hidden=int(text.hidden_size),
            vocab=int(text.vocab_size),
        )


__all__ = ["Head", "ModelFacts", "build_meta", "check_supported", "config_dict", "config_file", "decoder_layers", "head_config",
           "num_layers", "one_line", "read_config", "text_config", "uniform_layers", "with_layers"]
