"""Tensor-parallel plans: which module is split how, applied with DTensor's `parallelize_module`.

The decoder layers follow the model's own plan, transformers' `config.base_model_tp_plan`
(q/k/v and gate/up column-wise, o and down row-wise for Llama, Qwen2, Mistral and most others);
a config without one gets rlcore's plan for the Llama/Qwen2/Mistral families (the same shapes);
any other architecture asked for tensor parallelism is refused naming it. rlcore adds the ends:
the input embedding split over the vocabulary (row-wise with replicated ids; each rank looks up
its rows, the partial sums all-reduced) and a causal LM's head split over the vocabulary (column-
wise; its logits gathered when the model's own forward runs it: rlcore's log-prob path reads the
head's rows itself, `rlcore.triton_kernels.VocabShard`). Heads of classifiers (a value or score
head, one output) stay whole on every rank. Tied embeddings stay one parameter.

Attention then runs on each rank's own heads: transformers' attention modules reshape with -1
heads, so the attention function (rlcore's packed one included) sees `H / tp` query and
`H_kv / tp` key/value heads, and Ulysses splits those further over its ranks.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from rlcore.workers.parallel.shapes import OWN_PLAN_FAMILIES, tensor_parallel_problems

OWN_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}


class NoTensorParallelPlan(ValueError):
    """An architecture asked for tensor parallelism that neither transformers nor rlcore has a plan for."""


def _style(name: str) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),  # vocabulary-parallel lookup
    }
    return styles[name]() if name in styles else None


def decoder_plan(model: nn.Module, key: str = "tensor_parallel") -> tuple[dict[str, str], str]:
    """(the decoder layers' plan as style names relative to the backbone, its source)."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    plan = getattr(text, "base_model_tp_plan", None)
    if plan:
        return dict(plan), "transformers"
    if getattr(text, "model_type", None) in OWN_PLAN_FAMILIES:
        return dict(OWN_PLAN), "rlcore"
    raise NoTensorParallelPlan(
        f"{key}: {type(model).__name__} (model_type {getattr(text, 'model_type', None)!r}) has no tensor-parallel plan (transformers' config has no "
        f"base_model_tp_plan, and rlcore owns plans for the {', '.join(OWN_PLAN_FAMILIES)} families only); "
        "use data and sequence parallelism for it")


def _module_name(model: nn.Module, module: nn.Module | None) -> str | None:
    for name, m in model.named_modules():
        if m is module:
            return name
    return None


def tensor_parallel_styles(model: nn.Module, key: str) -> dict[str, Any]:
    """Module path (with `*` for any layer) -> DTensor ParallelStyle for `model`."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    layers, _ = decoder_plan(model, key)
    prefix = model.base_model_prefix
    plan: dict[str, Any] = {}
    for path, name in layers.items():
        style = _style(name)
        if style is None:
            raise NoTensorParallelPlan(f"{key}: the tensor-parallel plan of {type(model).__name__} splits {path} as "
                                       f"{name!r}, a style rlcore does not apply (it applies colwise, rowwise, "
                                       "colwise_gather_output and embedding_rowwise)")
        plan[f"{prefix}.{path}"] = style
    embed = _module_name(model, model.get_input_embeddings())
    if embed is not None:
        plan[embed] = RowwiseParallel(input_layouts=Replicate())
    head = model.get_output_embeddings()
    if isinstance(head, nn.Linear) and head.out_features > 1:
        plan[_module_name(model, head)] = ColwiseParallel(output_layouts=Replicate())
    return plan


def parallelize(model: nn.Module, tp_mesh: Any, key: str) -> nn.Module:
    """Split `model` over the tensor-parallel mesh `tp_mesh` in place; refused (ValueError naming
    `key`, the config key of its size) when its shape does not divide or it has no plan. Tied
    embeddings are re-tied (DTensor makes each module's parameter anew)."""
    from torch.distributed.tensor.parallel import parallelize_module

    tp = tp_mesh.size()
    problems = tensor_parallel_problems(model.config.to_dict(), tp)
    if problems:
        raise ValueError(f"{key}={tp}: {'; '.join(problems)}")
    tied = _tied(model)
    plan = tensor_parallel_styles(model, f"{key}={tp}")
    parallelize_module(model, tp_mesh, plan)
    if tied:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    model.rlcore_tensor_parallel = tp_mesh  # what the forward paths and the weight sync read
    return model


def _tied(model: nn.Module) -> bool:
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and embed is not None and getattr(head, "weight", None) is embed.weight


def tensor_parallel_mesh(model: nn.Module) -> Any:
    """The tensor-parallel mesh `model` was split over (None: it was not)."""
    return getattr(model, "rlcore_tensor_parallel", None)


__all__ = ["NoTensorParallelPlan", "OWN_PLAN", "decoder_plan", "parallelize", "tensor_parallel_mesh",
           "tensor_parallel_styles"]
