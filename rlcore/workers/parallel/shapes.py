"""What a model's shape must satisfy for a layout, read from its config.json (a dict) before any
model loads: the preflight's check, and `apply_layout`'s at load time."""

from __future__ import annotations

from typing import Any

# Model families whose decoder layers rlcore splits with its own plan when transformers' config
# carries none (`base_model_tp_plan`): the same shapes as transformers' plans for them.
OWN_PLAN_FAMILIES = ("llama", "mistral", "qwen2")


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config


def _size(text: dict[str, Any], key: str) -> int:
    """A size of the config (0 when missing or not a whole number: a config.json that cannot be
    read as one is `model_folder_problems`' to report)."""
    value = text.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def attention_heads(config: dict[str, Any]) -> tuple[int, int]:
    """(attention heads, key/value heads) of a config.json (its text config)."""
    text = text_config(config)
    heads = _size(text, "num_attention_heads")
    return heads, _size(text, "num_key_value_heads") or heads


def ulysses_problem(num_heads: int, num_kv_heads: int, size: int, tp: int = 1) -> str | None:
    """Why the model's attention heads cannot be split over `size` Ulysses ranks after `tp`
    tensor-parallel ranks took equal shares of them (None: they can). Key/value heads fewer than
    `size` are repeated."""
    heads, kv_heads = num_heads // tp, num_kv_heads // tp

    def held(n: int, total: int, what: str) -> str:
        return f"the model's {n} {what}" if tp == 1 else \
            f"each of the {tp} tensor-parallel ranks holds {n} of the model's {total} {what}, and {n}"

    if heads % size:
        return f"{held(heads, num_heads, 'attention heads')} do not divide by {size}"
    if kv_heads % size and size % kv_heads:
        return f"{held(kv_heads, num_kv_heads, 'key/value heads')} neither divide by {size} nor divide {size}"
    return None


def tensor_parallel_problems(config: dict[str, Any], tp: int) -> list[str]:
    """Why a model with this config.json cannot be split over `tp` tensor-parallel ranks: each
    dimension tensor parallelism splits must divide by `tp`."""
    if tp == 1:
        return []
    text = text_config(config)
    heads, kv_heads = attention_heads(config)
    dims = [("attention heads", heads), ("key/value heads", kv_heads), ("vocabulary", _size(text, "vocab_size")),
            ("intermediate size", _size(text, "intermediate_size"))]
    return [f"the model's {what} ({n}) is not divisible by tensor_parallel={tp}" for what, n in dims if n == 0 or n % tp]


def sequence_parallel_problem(config: dict[str, Any], sp: int, tp: int = 1) -> str | None:
    """Why a model with this config.json cannot split each tensor-parallel rank's attention heads
    over `sp` Ulysses ranks (None: it can, or `tp` itself does not split the heads evenly, which
    `tensor_parallel_problems` says)."""
    heads, kv_heads = attention_heads(config)
    if sp == 1 or heads % tp or kv_heads % tp:
        return None
    return ulysses_problem(heads, kv_heads, sp, tp)


def role_layout_problems(model_config: dict[str, Any], layout: Any, tp_key: str, sp_key: str, path: str) -> list[str]:
    """Why one trained role cannot take `layout` (its `tensor_parallel` and `sequence_parallel`) on
    the model of this config.json, each problem under the key at fault (`tp_key`, `sp_key`: the
    keys the user set them with) and naming the model folder `path`."""
    tp, sp = layout.tensor_parallel, layout.sequence_parallel
    found = [f"{tp_key}={tp}: {p} ({path})" for p in tensor_parallel_problems(model_config, tp)]
    if tp > 1 and plan_source(model_config) is None:
        found.append(f"{tp_key}={tp}: {architecture_name(model_config)} has no tensor-parallel plan (none in transformers, "
                     f"and rlcore owns plans for the {', '.join(OWN_PLAN_FAMILIES)} families only) ({path})")
    problem = sequence_parallel_problem(model_config, sp, tp)
    if problem:
        found.append(f"{sp_key}={sp}: {problem}{f', with {tp_key}={tp}' if tp > 1 else ''} ({path}; Ulysses splits a "
                     "rank's attention heads over its sequence-parallel group)")
    return found


def plan_source(config: dict[str, Any]) -> str | None:
    """Where a tensor-parallel plan for this model comes from: "transformers" (its config class
    has `base_model_tp_plan`), "rlcore" (a family rlcore owns a plan for), or None (no plan)."""
    model_type = text_config(config).get("model_type") or config.get("model_type")
    if not isinstance(model_type, str):
        return None
    try:
        from transformers import AutoConfig

        plan = AutoConfig.for_model(model_type).base_model_tp_plan if model_type else None
    except (ValueError, KeyError):
        plan = None
    if plan:
        return "transformers"
    return "rlcore" if model_type in OWN_PLAN_FAMILIES else None


def architecture_name(config: dict[str, Any]) -> str:
    archs = config.get("architectures")
    name = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else "a model"
    return f"{name} (model_type {config.get('model_type')!r})"


def role_model_path(config: Any, role: str) -> str | None:
    """The model folder `role` loads (`rlcore.config.Config`): the policy's for actor, reference and
    rollout, the critic's own when set, the reward model's (or, training one, the backbone's)."""
    if role == "critic":
        return config.critic.model_path or config.model.path
    if role == "reward_model":
        return config.model.path if "reward_model" in config.traits.trains else config.reward_model.path  # training one: the backbone
    return config.model.path


def layout_problems(config: Any) -> list[str]:
    """Every tensor- and sequence-parallel size in `config` (an `rlcore.config.Config`) the model
    it splits cannot take, read from the model folders' config.json before any model loads: the
    divisibility of heads, key/value heads, vocabulary and intermediate size, each tensor-parallel
    rank's heads for Ulysses, and a plan for the architecture; a rollout engine's query heads
    (vLLM replicates key/value heads itself). Each problem once (the reference shares the actor's
    layout unless it has its own), under the key that set the size. Unreadable folders are
    `model_folder_problems`' to report."""
    import json
    from pathlib import Path

    problems: list[str] = []
    for role in [*config.trained_roles, *(["rollout"] if "rollout" in config.present_roles else [])]:
        layout = config.layout_of(role)
        tp, sp = layout.tensor_parallel, layout.sequence_parallel
        path = role_model_path(config, role)
        if (tp == 1 and sp == 1) or path is None:
            continue
        try:
            model_config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            continue
        if not isinstance(model_config, dict):
            continue
        key = config.layout_key(role, "tensor_parallel")
        if role == "rollout":
            heads, _ = attention_heads(model_config)
            found = [f"{key}={tp}: the model's {heads} attention heads do not divide by it ({path}; each vLLM rank serves "
                     "an equal share of them)"] if heads % tp else []
        else:
            found = role_layout_problems(model_config, layout, key, config.layout_key(role, "sequence_parallel"), path)
        problems += [p for p in found if p not in problems]
    return problems


__all__ = ["OWN_PLAN_FAMILIES", "architecture_name", "attention_heads", "layout_problems", "plan_source", "role_layout_problems",
           "role_model_path", "sequence_parallel_problem", "tensor_parallel_problems", "text_config", "ulysses_problem"]
