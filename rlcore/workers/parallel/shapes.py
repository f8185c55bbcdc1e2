"""What a model's shape must satisfy for a layout, read from its config.json (a dict) before any
model loads: the preflight's check, and `apply_layout`'s at load time."""

from __future__ import annotations

from typing import Any

# Model families whose decoder layers rlcore splits with its own plan when transformers' config
# carries none (`base_model_tp_plan`): the same shapes as transformers' plans for them.
OWN_PLAN_FAMILIES = ("llama", "mistral", "qwen2")


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("text_config") or config


def ulysses_problem(num_heads: int, num_kv_heads: int, size: int) -> str | None:
    """Why attention with these heads (on one tensor-parallel rank) cannot be split over `size`
    Ulysses ranks (None: it can). Key/value heads fewer than `size` are repeated."""
    if num_heads % size:
        return f"the model's {num_heads} attention heads do not divide by {size}"
    if num_kv_heads % size and size % num_kv_heads:
        return f"the model's {num_kv_heads} key/value heads neither divide by {size} nor divide {size}"
    return None


def tensor_parallel_problems(config: dict[str, Any], tp: int, sp: int = 1) -> list[str]:
    """Why a model with this config.json cannot be split over `tp` tensor-parallel ranks (with `sp`
    Ulysses ranks on top): each dimension tensor parallelism splits must divide by `tp`."""
    text = text_config(config)
    problems = []
    heads = int(text.get("num_attention_heads") or 0)
    kv_heads = int(text.get("num_key_value_heads") or heads)
    dims = [("attention heads", heads), ("key/value heads", kv_heads), ("vocabulary", int(text.get("vocab_size") or 0)),
            ("intermediate size", int(text.get("intermediate_size") or 0))]
    for what, n in dims:
        if tp > 1 and (n == 0 or n % tp):
            problems.append(f"the model's {what} ({n}) is not divisible by tensor_parallel={tp}")
    if sp > 1 and not problems:
        problem = ulysses_problem(heads // tp, kv_heads // tp, sp)
        if problem:
            problems.append(f"{problem} (the heads of one of {tp} tensor-parallel ranks)" if tp > 1 else problem)
    return problems


def plan_source(config: dict[str, Any]) -> str | None:
    """Where a tensor-parallel plan for this model comes from: "transformers" (its config class
    has `base_model_tp_plan`), "rlcore" (a family rlcore owns a plan for), or None (no plan)."""
    model_type = text_config(config).get("model_type") or config.get("model_type")
    try:
        from transformers import AutoConfig

        plan = AutoConfig.for_model(model_type).base_model_tp_plan if model_type else None
    except (ValueError, KeyError):
        plan = None
    if plan:
        return "transformers"
    return "rlcore" if model_type in OWN_PLAN_FAMILIES else None


def architecture_name(config: dict[str, Any]) -> str:
    archs = config.get("architectures") or []
    return f"{archs[0] if archs else 'a model'} (model_type {config.get('model_type')!r})"




def role_model_path(config: Any, role: str) -> str | None:
    """The model folder `role` loads (`rlcore.config.Config`): the policy's for actor, reference and
    rollout, the critic's own when set, the reward model's (or, training one, the backbone's)."""
    if role == "critic":
        return config.critic.model_path or config.model.path
    if role == "reward_model":
        return config.model.path if "reward_model" in config.traits.trains else config.reward_model.path  # training one: the backbone
    return config.model.path


def layout_problems(config: Any) -> list[str]:
    """Every tensor-parallel size in `config` (an `rlcore.config.Config`) the model it splits cannot
    take, read from the model folders' config.json before any model loads: the divisibility of
    heads, key/value heads, vocabulary and intermediate size, heads left for Ulysses, and a plan
    for the architecture; a rollout engine's query heads (vLLM replicates key/value heads itself).
    Unreadable folders are `model_folder_problems`' to report."""
    import json
    from pathlib import Path

    problems = []
    for role in [*config.trained_roles, *(["rollout"] if "rollout" in config.present_roles else [])]:
        layout = config.layout_of(role)
        tp = layout.tensor_parallel
        path = role_model_path(config, role)
        if tp == 1 or path is None:
            continue
        key = config.layout_key(role, "tensor_parallel")
        try:
            model_config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if role == "rollout":
            heads = int(text_config(model_config).get("num_attention_heads") or 0)
            if heads % tp:
                problems.append(f"{key}={tp}: the model's {heads} attention heads do not divide by it ({path}; each "
                                "vLLM rank serves an equal share of them)")
            continue
        problems += model_layout_problems(key, model_config, tp, layout.sequence_parallel, path)
    return problems


def model_layout_problems(key: str, model_config: dict[str, Any], tp: int, sp: int, path: str) -> list[str]:
    """Why one trained role cannot split the model of this config.json over `tp` tensor-parallel
    ranks (with `sp` Ulysses ranks on top), each naming `key` and the model folder `path`."""
    found = tensor_parallel_problems(model_config, tp, sp)
    if plan_source(model_config) is None:
        found.append(f"{architecture_name(model_config)} has no tensor-parallel plan (none in transformers, and "
                     f"rlcore owns plans for the {', '.join(OWN_PLAN_FAMILIES)} families only)")
    return [f"{key}={tp}: {p} ({path})" for p in found]


__all__ = ["OWN_PLAN_FAMILIES", "architecture_name", "layout_problems", "model_layout_problems", "plan_source",
           "role_model_path", "tensor_parallel_problems", "text_config", "ulysses_problem"]
