"""FSDP2 for the trained roles: sharding, equal collective counts, full-state gathering.

A worker group with world_size > 1 on Ray has a torch.distributed process group in every rank
(set up by the group before `setup()`); these helpers are what a worker does with it. Without a
process group (one process, the in-process backend) every helper is a no-op or the plain path.
"""

from __future__ import annotations

import types
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn


def distributed_world() -> int:
    """World size of the initialised process group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def shard_model(
    model: nn.Module,
    device: torch.device,
    mixed_precision: str = "none",
    cpu_offload: bool = False,
) -> nn.Module:
    """`fully_shard` every decoder layer, then the root (embeddings, final norm and head).

    Tied embeddings stay one parameter in the root's group. Without a process group the model
    is returned unchanged; with one rank it is sharded only when bf16 mixed precision
    (parameters bf16, gradient reduction fp32) or CPU offload is asked for.
    """
    wants_policy = mixed_precision != "none" or cpu_offload
    has_group = dist.is_available() and dist.is_initialized()
    if not has_group or (distributed_world() == 1 and not wants_policy):
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    kwargs: dict = {"mesh": init_device_mesh(device.type, (dist.get_world_size(),))}
    if mixed_precision == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    backbone = getattr(model, model.base_model_prefix)
    for layer in backbone.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    # response_log_probs runs the backbone and the head outside `model.forward`: register it as
    # a forward method so the root's parameters are gathered (and their gradients reduced).
    model.rlcore_response_log_probs = types.MethodType(_sharded_log_probs, model)
    register_fsdp_forward_method(model, "rlcore_response_log_probs")
    return model


def _sharded_log_probs(model: nn.Module, *args, **kwargs):
    """`response_log_probs` as an FSDP forward method; outputs are copies, not views (FSDP warns
    that an in-place op on a view would skip its backward hook)."""
    from rlcore.workers.modeling import _response_log_probs_impl

    logprobs, entropy = _response_log_probs_impl(model, *args, **kwargs)
    return logprobs.clone(), entropy.clone() if entropy is not None else None


def max_over_ranks(value: int, device: torch.device) -> int:
    if distributed_world() <= 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def equalize_micro_batches(groups: list[list[int]], model: nn.Module, device: torch.device) -> list[list[int]]:
    """Make every rank run the same number of micro-batches: FSDP gathers parameters inside
    each forward, so a rank with one forward fewer would leave the others waiting forever.

    Splits the largest micro-batches first; when only single samples are left, appends empty
    micro-batches, which the caller runs as a zero-weight forward/backward on one real row.
    """
    if not is_sharded(model):
        return groups
    target = max_over_ranks(len(groups), device)
    groups = [list(g) for g in groups]
    while len(groups) < target:
        big = max(range(len(groups)), key=lambda i: len(groups[i])) if groups else None
        if big is None or len(groups[big]) < 2:
            groups.append([])
            continue
        g = groups.pop(big)
        groups[big:big] = [g[: len(g) // 2], g[len(g) // 2 :]]
    return groups


def to_full(value: torch.Tensor) -> torch.Tensor:
    """A DTensor (a sharded parameter, an FSDP grad norm) as a plain full tensor; a collective."""
    full = getattr(value, "full_tensor", None)
    return full() if callable(full) else value


def _sync_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Name -> tensor for a rollout engine; tied weights also under `lm_head.weight`
    (vLLM keeps a stale head otherwise)."""
    state = model.state_dict()
    if "lm_head.weight" not in state and getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        state["lm_head.weight"] = model.get_output_embeddings().weight
    return state


def plan_buckets(model: nn.Module, bucket_bytes: int) -> list[list[str]]:
    """Parameter names grouped into buckets of about `bucket_bytes` of full (unsharded) size.

    Sizes come from global shapes, so every rank computes the same plan."""
    buckets: list[list[str]] = [[]]
    size = 0
    for name, t in _sync_state(model).items():
        if buckets[-1] and size + t.numel() * t.element_size() > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += t.numel() * t.element_size()
    return buckets


def gather_bucket(model: nn.Module, names: list[str], keep: bool) -> list[tuple[str, torch.Tensor]]:
    """Full CPU tensors of `names`. Sharded parameters are gathered with `full_tensor()` (every
    rank must call this with the same names); only a rank with `keep` returns them."""
    state = _sync_state(model)
    out: list[tuple[str, torch.Tensor]] = []
    seen: dict[int, torch.Tensor] = {}
    for name in names:
        t = state[name]  # kept alive by `state`: ids are stable and the same on every rank
        full = seen.get(id(t))
        if full is None:
            full = to_full(t.detach()).cpu()
            seen[id(t)] = full
        if keep:
            out.append((name, full))
    return out


def iter_full_state(model: nn.Module, bucket_bytes: int, keep: bool) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The full weights bucket by bucket: no rank holds more than one gathered bucket at a time
    beyond what the consumer keeps. Unsharded models yield views of their own tensors."""
    for names in plan_buckets(model, bucket_bytes):
        yield gather_bucket(model, names, keep)
