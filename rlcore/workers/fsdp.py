"""FSDP2 for the trained roles: sharding, equal collective counts, full-state gathering.

A worker group with world_size > 1 on Ray has a torch.distributed process group in every rank
(set up by the group before `setup()`); these helpers are what a worker does with it. Without a
process group (one process, the in-process backend) every helper is a no-op or the plain path,
except the precision policy: bf16 mixed precision and CPU offload are applied by `LocalPolicy`,
the same per-module casts and copies FSDP2 makes, so a setting means the same at every world size.
(A one-rank process group is not an option here: an in-process vLLM engine adopts the default
group and destroys it when it shuts down.)
"""

from __future__ import annotations

import types
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlcore.workers.attention import COMPUTE_DTYPE
from rlcore.workers.ranks import distributed_world, max_over_ranks


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


MIXED_PRECISION = ("none", "bf16")

# set on a model that keeps compute copies across micro-batches: what forgets them (`drop_compute_copies`)
DROP_COMPUTE_COPIES = "rlcore_drop_compute_copies"


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a transformers model (`<base_model_prefix>.layers`), or none."""
    layers = getattr(getattr(model, getattr(model, "base_model_prefix", ""), None), "layers", None)
    return list(layers) if isinstance(layers, nn.ModuleList) else []


def shard_model(
    model: nn.Module,
    device: torch.device,
    mixed_precision: str = "none",
    cpu_offload: bool = False,
    forward_methods: Mapping[str, Callable[..., Any]] | None = None,
    mesh: Any = None,
    cast_once: bool | str = False,
) -> nn.Module:
    """`fully_shard` every decoder layer, then the root (embeddings, final norm and head).

    `forward_methods`: the caller's computations that run parts of the model outside
    `model.forward` (`rlcore.workers.forward.POLICY_FORWARD_METHODS`, say), registered on a
    sharded model (`register_forward_methods`); this module knows no model code.

    Tied embeddings stay one parameter in the root's group. With one rank it is sharded only
    when bf16 mixed precision (parameters cast to bf16 for compute, gradients reduced in fp32 into
    the full-precision parameters) or CPU offload is asked for. Without a process group those two
    are applied by `LocalPolicy` instead, else the model is returned unchanged. CPU offload on a
    CPU device is refused (ValueError): there is no device memory to relieve. `mesh`: the 1-D mesh
    to shard over (a layout's data x sequence-parallel ranks, `rlcore.workers.parallel`); default
    every rank of the process group.

    `cast_once` (`actor.cast_once`: True, False or "auto"; `cast_once_wanted`): the compute copies
    are made once per optimizer step and kept across its micro-batches (`drop_compute_copies` lets
    them go): `LocalPolicy(cast_once=True)`, or FSDP2 neither resharding after forward nor after
    backward, so a micro-batch's forward finds the parameters its predecessor gathered.
    """
    if mixed_precision not in MIXED_PRECISION:
        raise ValueError(f"mixed_precision={mixed_precision!r} is not one of {MIXED_PRECISION}")
    if cpu_offload and device.type != "cuda":
        raise ValueError(f"actor.cpu_offload=true needs a CUDA device (the device is {device}): on the CPU the "
                         "weights, gradients and optimizer state already live in host memory")
    wants_policy = mixed_precision != "none" or cpu_offload
    if mixed_precision == "bf16":  # what packed attention computes in (its kernel choice, `prompt_sharing`)
        setattr(model, COMPUTE_DTYPE, torch.bfloat16)
    has_group = dist.is_available() and dist.is_initialized()
    if not has_group:
        if not wants_policy:
            return model
        param_dtype = torch.bfloat16 if mixed_precision == "bf16" else None
        keep = cast_once_wanted(cast_once, model, ranks=1, cpu_offload=cpu_offload, local=True)
        return LocalPolicy(device, param_dtype, offload=cpu_offload, cast_once=keep).apply(model)
    if distributed_world() == 1 and not wants_policy:
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs: dict = {"mesh": mesh if mesh is not None else init_device_mesh(device.type, (dist.get_world_size(),))}
    keep = cast_once_wanted(cast_once, model, ranks=kwargs["mesh"].size(), cpu_offload=cpu_offload, local=False)
    if mixed_precision == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    backbone = getattr(model, model.base_model_prefix)
    for layer in backbone.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    register_forward_methods(model, forward_methods or {})
    if keep:
        model.set_reshard_after_forward(False)
        model.set_reshard_after_backward(False)
        setattr(model, DROP_COMPUTE_COPIES, partial(_reshard_all, model))
    return model


def cast_once_wanted(setting: bool | str, model: nn.Module, *, ranks: int, cpu_offload: bool, local: bool) -> bool:
    """Whether compute copies are kept for a whole step (`actor.cast_once`). "auto": where the step's
    peak already holds them all, i.e. without gradient checkpointing (which frees a layer's copies
    after its forward) and either in one process (`LocalPolicy`: a forward's copies live until its
    backward) or on a one-rank FSDP2 group without CPU offload (2 bytes a parameter beside the 16
    of float32 weights, gradients and AdamW state); never on more ranks, where each would hold the
    whole model's copies instead of its shard."""
    if setting != "auto":
        return bool(setting)
    if getattr(model, "is_gradient_checkpointing", False):
        return False
    return local or (ranks == 1 and not cpu_offload)


def drop_compute_copies(model: nn.Module) -> None:
    """Let go of the compute copies kept across micro-batches (`shard_model(cast_once=...)`): after
    the last backward of an optimizer step, before the step changes the masters, and after a
    no-grad pass. A no-op for a model that keeps none."""
    drop = getattr(model, DROP_COMPUTE_COPIES, None)
    if drop is not None:
        drop()


def keeps_compute_copies(model: nn.Module) -> bool:
    """Whether `model` keeps its compute copies across micro-batches (`shard_model(cast_once=...)` resolved)."""
    return getattr(model, DROP_COMPUTE_COPIES, None) is not None


def _reshard_all(model: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


class LocalPolicy:
    """FSDP2's MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32) and CPUOffloadPolicy for a model
    in one process without a process group.

    The model's own parameters are the master copy (what the optimizer steps, checkpoints save and
    the rollout receives): float32 for mixed precision, in host memory with offload. Before a
    group's forward its parameters are replaced by compute copies (`param_dtype`, on `device`);
    after it, the masters are put back. The groups are FSDP2's: each decoder layer with everything
    in it (so the layer's own forward, which `compile_decoder_layers` compiles, runs on compute
    copies with no hook inside), and every other module with parameters of its own. A compute
    copy's gradient is added to its master's `.grad` (in the master's dtype and device) as soon as
    autograd has accumulated it, so micro-batches accumulate in float32, as FSDP2 reduces them.
    Buffers (RoPE's inv_freq) are never cast. The hooks run again when gradient checkpointing
    recomputes a layer.

    `cast_once`: a compute copy, once made, is kept and reused by the following forwards until
    `drop_compute_copies` (after the last micro-batch of an optimizer step, and after a no-grad
    pass) or until its master changes (a new version or storage: an optimizer step, a checkpoint
    load); the values are the same, so are the gradients.

    Differences from FSDP2: the compute copies of a forward stay alive until its backward (FSDP2
    frees and re-gathers them); heads used outside a module's forward (`forward_response_log_probs`)
    cast their weights themselves, to the hidden state's dtype and device.
    """

    def __init__(self, device: torch.device, param_dtype: torch.dtype | None, offload: bool = False,
                 cast_once: bool = False) -> None:
        self.device = device
        self.param_dtype = param_dtype
        self.offload = offload
        self.cast_once = cast_once
        # (module, name) -> (the master's version, storage and requires_grad at the cast, the copy)
        self._copies: dict[tuple[nn.Module, str], tuple[tuple[int, int, bool], nn.Parameter]] = {}

    def apply(self, model: nn.Module) -> nn.Module:
        if self.offload:
            _params_to_host(model)
        for group, params in self._groups(model).items():
            group.register_forward_pre_hook(partial(self._to_compute, params))
            group.register_forward_hook(partial(self._to_master, params), always_call=True)
        if self.cast_once:
            setattr(model, DROP_COMPUTE_COPIES, self.drop)
        return model

    def _groups(self, model: nn.Module) -> dict[nn.Module, list[tuple[nn.Module, str, nn.Parameter]]]:
        """Hooked module -> the (owner, name, master) it swaps: decoder layers whole, other modules their own."""
        layers = list(decoder_layers(model))
        inside = {id(m) for layer in layers for m in layer.modules()}
        groups: dict[nn.Module, list[tuple[nn.Module, str, nn.Parameter]]] = defaultdict(list)
        for module in model.modules():
            owners = list(module.modules()) if module in layers else [] if id(module) in inside else [module]
            for owner in owners:
                for name, param in owner.named_parameters(recurse=False):
                    if self._compute_dtype(param) != param.dtype or param.device != self.device:
                        groups[module].append((owner, name, param))
        return groups

    def _compute_dtype(self, param: torch.Tensor) -> torch.dtype:
        return self.param_dtype or param.dtype

    def _to_compute(self, params: list[tuple[nn.Module, str, nn.Parameter]], module: nn.Module, args) -> None:
        for owner, name, master in params:
            setattr(owner, name, self._copy_of(owner, name, master))

    def _copy_of(self, owner: nn.Module, name: str, master: nn.Parameter) -> nn.Parameter:
        stamp = (master._version, master.data_ptr(), master.requires_grad)
        kept = self._copies.get((owner, name))
        if kept is not None and kept[0] == stamp:
            return kept[1]
        compute = nn.Parameter(
            master.detach().to(device=self.device, dtype=self._compute_dtype(master)),
            requires_grad=master.requires_grad,
        )
        if master.requires_grad:
            compute.register_post_accumulate_grad_hook(partial(_grad_to_master, master))
        if self.cast_once:
            self._copies[(owner, name)] = (stamp, compute)
        return compute

    @staticmethod
    def _to_master(params: list[tuple[nn.Module, str, nn.Parameter]], module: nn.Module, args, output) -> None:
        for owner, name, master in params:
            setattr(owner, name, master)

    def drop(self) -> None:
        """Forget the kept compute copies (their memory goes with the last autograd graph using them)."""
        self._copies.clear()


def _grad_to_master(master: nn.Parameter, compute: torch.Tensor) -> None:
    grad = compute.grad.to(device=master.device, dtype=master.dtype)
    if master.grad is None:
        master.grad = grad
    else:
        master.grad.add_(grad)
    compute.grad = None


@torch.no_grad()
def _params_to_host(model: nn.Module) -> None:
    """Every parameter into host memory (pinned when a GPU is there, for faster copies), tied
    parameters staying one; buffers stay where they are."""
    moved: dict[int, nn.Parameter] = {}
    for module in list(model.modules()):
        for name, param in list(module.named_parameters(recurse=False)):
            host = moved.get(id(param))
            if host is None:
                data = param.detach().to("cpu")
                host = nn.Parameter(data.pin_memory() if torch.cuda.is_available() else data, requires_grad=param.requires_grad)
                moved[id(param)] = host
            setattr(module, name, host)


def register_forward_methods(model: nn.Module, methods: Mapping[str, Callable[..., Any]]) -> None:
    """Each `methods` entry (attribute name -> a function of the model and its inputs) set on the
    sharded `model` as a method and registered with FSDP2, so the root's parameters are gathered
    around it (and their gradients reduced): for computations that run parts of the model outside
    `model.forward`. Outputs are copies, not views (FSDP warns that an in-place op on a view would
    skip its backward hook)."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    for name, fn in methods.items():
        setattr(model, name, types.MethodType(partial(_copied_outputs, fn), model))
        register_fsdp_forward_method(model, name)


def _copied_outputs(fn: Callable[..., Any], model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    out = fn(model, *args, **kwargs)
    if isinstance(out, tuple):
        return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in out)
    return out.clone() if isinstance(out, torch.Tensor) else out


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


def sync_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Name -> tensor for a rollout engine; tied weights also under `lm_head.weight`
    (vLLM keeps a stale head otherwise)."""
    state = model.state_dict()
    if "lm_head.weight" not in state and getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        state["lm_head.weight"] = model.get_output_embeddings().weight
    return state


def plan_buckets(model: nn.Module, bucket_bytes: int) -> list[list[str]]:
    """Parameter names grouped into buckets of about `bucket_bytes` of full (unsharded) size.

    Sizes come from global shapes, so every rank computes the same plan."""
    return bucket_by_bytes([(name, t.numel() * t.element_size()) for name, t in sync_state(model).items()], bucket_bytes)


def bucket_by_bytes(sizes: list[tuple[str, int]], bucket_bytes: int) -> list[list[str]]:
    """Names in order, cut into buckets of at most `bucket_bytes` (a larger tensor alone)."""
    buckets: list[list[str]] = [[]]
    size = 0
    for name, nbytes in sizes:
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += nbytes
    return buckets


def gather_bucket(model: nn.Module, names: list[str], keep: bool) -> list[tuple[str, torch.Tensor]]:
    """Full CPU tensors of `names`. Sharded parameters are gathered with `full_tensor()` (every
    rank must call this with the same names); only a rank with `keep` returns them."""
    state = sync_state(model)
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
