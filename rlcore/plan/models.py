"""A role's model from its `config.json` alone, built on the meta device (no weights, no memory).

The planner needs only the architecture: a user plans before downloading. A folder with a
`config.json` (or the file itself) is read with `AutoConfig`, and the model is built by
transformers on the meta device as the worker would build it: a causal LM (actor, reference), a
one-label token classifier (the critic's values), a one-label sequence classifier (the reward
model). Any architecture transformers builds that way is accepted.

`with_layers` gives the same model with fewer decoder layers: when every layer is the same
(`uniform_layers`), a step's peak memory is an affine function of the number of layers (each
layer adds its parameters, gradients, optimizer state and saved activations), so the planner
simulates two shallow copies and extrapolates (`rlcore.plan.simulate`).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from rlcore.plan.hardware import PlanInputError

Head = Literal["lm", "value", "score"]  # log-probs (actor, reference), values (critic), a sequence score (reward model)


def config_file(path: str | Path, key: str) -> Path:
    """The `config.json` of a model folder (or the file itself)."""
    path = Path(path)
    found = path if path.is_file() else path / "config.json"
    if not found.is_file():
        raise PlanInputError(f"{key}: {path} has no config.json (the planner needs only that file, no weights)")
    return found


def read_config(path: str | Path, key: str) -> Any:
    """The transformers config of the model at `path` (`key` names the setting in errors)."""
    from transformers import AutoConfig

    found = config_file(path, key)
    try:
        return AutoConfig.from_pretrained(found.parent if found.name == "config.json" else found, local_files_only=True)
    except (ValueError, OSError, KeyError) as err:
        raise PlanInputError(f"{key}: transformers cannot read {found}: {err}") from None


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
    except (ValueError, KeyError, TypeError) as err:
        raise PlanInputError(f"{key}: transformers cannot build a {auto.__name__} of {type(config).__name__}: {err}") from None


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers `rlcore.workers.fsdp.shard_model` shards one by one."""
    return getattr(model, model.base_model_prefix).layers


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
        model = build_meta(config, head, torch.float32, key)
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


__all__ = ["Head", "ModelFacts", "build_meta", "config_dict", "config_file", "decoder_layers", "head_config", "num_layers",
           "read_config", "text_config", "uniform_layers", "with_layers"]
