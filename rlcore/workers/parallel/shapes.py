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
            problems.append(f"the model's {what} ({n}) do not divide by tensor_parallel={tp}")
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


__all__ = ["OWN_PLAN_FAMILIES", "architecture_name", "plan_source", "tensor_parallel_problems", "text_config",
           "ulysses_problem"]
