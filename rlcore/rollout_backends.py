"""What each rollout backend is, in one table: the only place outside `rlcore/rollout/` that knows
a backend by its name.

A backend is a row: where its engine class lives ("module:Class", imported only when an engine is
built, so that e.g. the hf backend works on machines without vLLM) and its `BackendTraits`, what
the rest of rlcore asks about it (config validation, preflight, the tokenizer check, the planner's
report, the rollout worker). `tests/test_rollout_backend_traits.py` fails on a comparison with a
backend's name anywhere outside `rlcore/rollout/` and this file.

`rollout.backend` is a registered name, `auto` (vLLM where it is installed, else hf) or a
"module:Class" of an engine class (its `traits` class attribute, if any, says what it can do):
how a user plugs a backend of their own into a CLI run, as `reward.function` plugs in a scorer.
`register_backend` adds a name from Python (a test, a library); `rlcore.rollout` re-exports it.

Imports nothing of rlcore: config (below the rollout layer) reads it at load.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class BackendTraits:
    """One rollout backend as the rest of rlcore needs to know it."""

    label: str = "a custom engine"  # how messages and the planner's report name it
    tensor_parallel: bool = False  # one engine spans several ranks (rollout.layout.tensor_parallel > 1)
    adapter_sync: bool = False  # serves a LoRA adapter per request (rollout.lora_sync=adapter, `load_adapter`)
    # takes new weights between two decode steps of a generation in flight (`set_weight_switch`:
    # trainer.async_weight_sync=step)
    decode_step_weights: bool = False
    # "module:function" (folder path -> tokenizer) of the tokenizer it serves the model with, what the
    # start-up tokenizer check compares rlcore's ids against; None: transformers' AutoTokenizer
    serving_tokenizer: str | None = None
    # dotted config key of an engine context limit (tokens) that preflight checks an agent's
    # trajectories against, besides the model's positions; None: none
    context_limit_key: str | None = None
    # what the memory planner (which plans every rollout as a vLLM engine) misses for it; "": nothing
    plan_note: str = "not planned itself: planned as vLLM"


HF = BackendTraits(label="hf (rlcore's decode loop)", decode_step_weights=True, plan_note="rlcore's own decode loop, is planned as vLLM")
VLLM = BackendTraits(label="vLLM", tensor_parallel=True, adapter_sync=True, decode_step_weights=True,
                     serving_tokenizer="rlcore.rollout.vllm:vllm_tokenizer",
                     context_limit_key="rollout.vllm.max_model_len", plan_note="")


@dataclass(frozen=True)
class Backend:
    engine: str  # "module:Class" of its engine class
    traits: BackendTraits | None = None  # None: the engine class's `traits` attribute (read on first use)


# Name -> row. A backend class is built either from a model path (`path=...` ->
# `cls.from_pretrained(**kwargs)`) or from its constructor arguments (`rlcore.rollout.make_rollout_engine`).
_BACKENDS: dict[str, Backend] = {
    "hf": Backend("rlcore.rollout.hf:HFRolloutEngine", HF),
    "vllm": Backend("rlcore.rollout.vllm:VLLMRolloutEngine", VLLM),
}


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_backend(name: str) -> str:
    """`auto` is vLLM where it is installed and hf elsewhere (models vLLM lacks: set `hf`)."""
    if name == "auto":
        return "vllm" if vllm_installed() else "hf"
    return name


def register_backend(name: str, target: str, traits: BackendTraits | None = None) -> None:
    """Register a backend as "module:ClassName" (lets new backends plug in without editing here);
    without `traits`, the class's `traits` attribute says what it can do (none of the extras if unset)."""
    _BACKENDS[name] = Backend(target, traits)


def backend_names() -> list[str]:
    """The registered names, for `rollout.backend` (besides `auto` and a "module:Class")."""
    return sorted(_BACKENDS)


def _is_target(name: str) -> bool:
    module, sep, attr = name.partition(":")
    return bool(sep and module and attr)


def backend_target(name: str) -> str:
    """The "module:Class" of backend `name` (a registered name, or a "module:Class" itself); `auto` resolved."""
    name = resolve_backend(name)
    if name in _BACKENDS:
        return _BACKENDS[name].engine
    if _is_target(name):
        return name
    raise ValueError(f"unknown rollout backend {name!r}; known: auto, {', '.join(backend_names())} "
                     "(or 'module:Class' of an engine class)")


def load_engine_class(name: str) -> type:
    """The engine class of backend `name`, imported."""
    target = backend_target(name)
    module_name, _, attr = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"rollout backend {name!r}: cannot import {target!r}: {err}") from err
    if not isinstance(cls, type):
        raise ValueError(f"rollout backend {name!r}: {target!r} is a {type(cls).__name__}, not an engine class")
    return cls


def check_backend(name: str) -> str:
    """`name` if it is `auto`, a registered backend or an importable "module:Class" (imported
    here, so a typo fails at load, naming what exists), else an error."""
    if name != "auto" and name not in _BACKENDS:
        if not _is_target(name):
            backend_target(name)  # raises, naming the known backends
        traits_of(name)
    return name


def traits_of(name: str) -> BackendTraits:
    """What backend `name` can do (`auto` resolved as `resolve_backend` does)."""
    name = resolve_backend(name)
    row = _BACKENDS.get(name)
    if row is not None and row.traits is not None:
        return row.traits
    traits = getattr(load_engine_class(name), "traits", BackendTraits())
    if not isinstance(traits, BackendTraits):
        raise ValueError(f"rollout backend {name!r}: its traits attribute is a {type(traits).__name__}, not a "
                         "rlcore.rollout_backends.BackendTraits")
    return traits


def names_where(**traits: Any) -> list[str]:
    """Registered backends whose declared traits have these values, e.g. `names_where(tensor_parallel=True)`
    -> ["vllm"]: for messages."""
    known = {f.name for f in fields(BackendTraits)}
    if not set(traits) <= known:
        raise ValueError(f"no backend traits {sorted(set(traits) - known)}")
    return [name for name, row in sorted(_BACKENDS.items())
            if row.traits is not None and all(getattr(row.traits, k) == v for k, v in traits.items())]


def support_problem(name: str, tensor_parallel: int, lora_sync: str) -> str | None:
    """Why backend `name` cannot run this rollout (an engine of `tensor_parallel` ranks; the
    weight sync `lora_sync`: full, merged or adapter), naming the settings; None when it can."""
    traits = traits_of(name)
    if tensor_parallel > 1 and not traits.tensor_parallel:
        return (f"rollout.layout.tensor_parallel={tensor_parallel} needs rollout.backend="
                f"{' or '.join(names_where(tensor_parallel=True))}: the {name} backend generates with one whole model "
                "per rank (scale it with rollout.layout.data_parallel)")
    if lora_sync == "adapter" and not traits.adapter_sync:
        return (f"rollout.lora_sync=adapter needs rollout.backend={' or '.join(names_where(adapter_sync=True))} "
                f"(it applies the adapter per request); the {name} backend takes the merged weights "
                "(rollout.lora_sync=merged)")
    return None


__all__ = ["Backend", "BackendTraits", "backend_names", "backend_target", "check_backend", "load_engine_class",
           "names_where", "register_backend", "resolve_backend", "support_problem", "traits_of", "vllm_installed"]
