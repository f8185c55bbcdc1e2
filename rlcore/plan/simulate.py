"""One training step of one role at one layout, simulated on fake tensors in this process.

The role's model is built on the meta device (`rlcore.plan.models`) and laid out over the fake
process group (`torch_api`: rank 0 of `layout.devices` ranks, no data moves) by the function its
worker calls, `rlcore.workers.parallel.apply_layout`: the workers' tensor-parallel plan (DTensor,
the vocabulary-parallel embedding and head), Ulysses sequence parallelism and FSDP2 (per decoder
layer and the root, the worker's mixed precision) on the layout's ("dp", "sp", "tp") mesh. Then,
under `FakeTensorMode` (shapes, no data), its parameters are materialised, AdamW is built as
`build_optimizer` builds it, and the micro-batch runs as the worker runs it: packed into one row (`pack_rows`, the rank's slice of it with sequence
parallelism), the backbone with rlcore's packed attention, the head (`fused_token_logprobs` in
token chunks for log-probs, on this rank's vocabulary rows under tensor parallelism; the value or
score head), a backward, clipping and the AdamW step.
Torch's memory tracker counts every storage alive and keeps the peak, by kind.

A trained role runs two steps: an untracked warm-up (an optimizer step on zero gradients: AdamW
creates its state on the first step) and the tracked step of up to two full micro-batches (the second runs with the first's
gradients alive, as gradient accumulation does). A forward-only role runs one micro-batch under
no_grad (its parameters keep requires_grad, which changes nothing under no_grad; torch's tracker
for an unsharded model cannot hook frozen parameters).

Depth: with identical decoder layers every part of the peak grows linearly with the number of
layers (parameters, gradients and AdamW state per layer, one saved input or all activations per
layer), so `simulate` runs two shallow copies (`DEPTHS`) and extrapolates to the real depth; a
model whose layers differ is simulated at full depth (`exact=True` forces that).
"""

from __future__ import annotations

import gc
import math
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from rlcore.plan import torch_api
from rlcore.plan.models import build_meta, num_layers, with_layers
from rlcore.plan.roles import RolePlan
from rlcore.triton_kernels import fused_token_logprobs
from rlcore.workers.attention import SEQUENCE_PARALLEL_KWARG, use_packed_attention
from rlcore.workers.forward import lm_head_semantics, score_head
from rlcore.workers.fsdp import is_sharded
from rlcore.workers.optim import build_optimizer
from rlcore.workers.packed import PackedRows, pack_rows
from rlcore.workers.parallel.apply import apply_layout as apply_worker_layout
from rlcore.workers.parallel.mesh import device_mesh
from rlcore.workers.parallel.tensors import is_dtensor, vocab_rows
from rlcore.workers.ulysses import SequenceParallel, sequence_parallel_of

DEPTHS = (3, 4)  # the shallow copies a uniform model is simulated at (from 3 on, FSDP's prefetching looks as in a deep stack)
DEVICE = torch.device("cpu")  # fake tensors: the device only picks kernels; CPU SDPA is memory-efficient like flash-attn


@dataclass(frozen=True)
class Layout:
    """How a role's ranks split its work: `dp` data-parallel shards x `sp` sequence-parallel ranks
    each x `tp` tensor-parallel ranks each (TP splits the matrices, FSDP shards the rest over
    dp x sp). A `rlcore.workers.parallel.mesh.Layout`, as the config's `*.layout` is."""

    dp: int
    sp: int = 1
    tp: int = 1

    @property
    def devices(self) -> int:
        return self.dp * self.sp * self.tp

    @property
    def data_parallel(self) -> int:
        return self.dp

    @property
    def sequence_parallel(self) -> int:
        return self.sp

    @property
    def tensor_parallel(self) -> int:
        return self.tp

    def __str__(self) -> str:
        if self.devices == 1:
            return "1 device"
        parts = []
        if self.dp * self.sp > 1:
            parts.append(f"FSDP {self.dp * self.sp}" + (f" (DP {self.dp} x SP {self.sp})" if self.sp > 1 else ""))
        if self.tp > 1:
            parts.append(f"TP {self.tp}")
        return " x ".join(parts)

    def keys(self, role: str) -> str:
        """The config overrides that give `role` this layout."""
        return f"{role}.layout.data_parallel={self.dp} {role}.layout.sequence_parallel={self.sp} {role}.layout.tensor_parallel={self.tp}"


@dataclass(frozen=True)
class Peak:
    """A simulated per-rank peak: `total` bytes and what they were at that moment, by kind
    (params, grads: the rank's gradient shard, grads in flight: FSDP's unsharded gradients and
    reduce-scatter buffers of the layers being reduced, optimizer, activations, gathered: FSDP's
    unsharded layers in flight, other)."""

    total: int
    kinds: dict[str, int] = field(default_factory=dict)
    depths: tuple[int, ...] = ()  # the depths simulated (one: the full model; two: extrapolated from them)

    @property
    def sharded(self) -> int:
        """The part FSDP divides by the number of ranks: parameters, the gradient shard, optimizer
        state (not the gradients in flight: FSDP gathers those, only TP splits them)."""
        return sum(self.kinds.get(k, 0) for k in ("params", "grads", "optimizer"))

    def extrapolate(self, other: Peak, layers: int) -> Peak:
        """The affine continuation through this peak (at depth a) and `other` (at depth b) to `layers`."""
        (a,), (b,) = self.depths, other.depths
        scale = (layers - a) / (b - a)
        kinds = {k: max(0, round(self.kinds.get(k, 0) + scale * (other.kinds.get(k, 0) - self.kinds.get(k, 0))))
                 for k in set(self.kinds) | set(other.kinds)}
        return Peak(max(0, round(self.total + scale * (other.total - self.total))), kinds, (a, b))


def simulate(role: RolePlan, model_config: Any, layout: Layout, *, uniform: bool, exact: bool = False) -> Peak:
    """The per-rank peak of one step of `role` at `layout` (extrapolated over depth unless `exact`
    or the layers differ)."""
    layers = num_layers(model_config)
    if exact or not uniform or layers <= DEPTHS[-1]:
        return simulate_depth(role, model_config, layout, layers)
    low, high = (simulate_depth(role, with_layers(model_config, d), layout, d) for d in DEPTHS)
    return low.extrapolate(high, layers)


def simulate_depth(role: RolePlan, model_config: Any, layout: Layout, depth: int) -> Peak:
    """One simulation of `model_config` as it is (its own depth, recorded as `depth`)."""
    tools = torch_api.load()
    torch_api.forget_meshes()  # the last simulation's meshes, equal to this one's, must not come back from a cache
    with no_collection_inside(), fake_process_group(tools, layout.devices):
        model = build_meta(model_config, role.head, role.param_dtype, role.model_key)
        use_packed_attention(model)  # as load_causal_lm / load_value_model / load_sequence_classifier
        if role.checkpointing:
            model.gradient_checkpointing_enable()
            model.config.use_cache = False
        fake = tools.FakeTensorMode(allow_non_fake_inputs=True)
        model, optimizer = _materialise(model, role, layout, fake)
        micro = _MicroInputs.of(role, model, layout)
        model.forward = types.MethodType(_FORWARDS[role.head], model)  # the root's call: FSDP gathers its parameters around it
        count = min(2, role.micro_batches(layout.dp))
        with fake:  # untracked: AdamW makes its state, DTensor caches its sharding propagation (see `_track`)
            if layout.tp > 1:  # the step's DTensor ops too: the forward and backward of the same shapes
                with torch.set_grad_enabled(role.trains):
                    out = model(*micro.full)
                if role.trains:
                    out.sum().backward()
                del out
            if role.trains:
                assert optimizer is not None and role.optim is not None
                _warm_up(model, optimizer, role.optim.grad_clip)
        tracker = _track(tools, model, optimizer)
        with fake, tracker:
            if role.trains:
                assert optimizer is not None and role.optim is not None
                _train_step(model, optimizer, [micro.full] * count, role.optim.grad_clip, tracker.reset_mod_stats)
            else:
                with torch.no_grad():
                    model(*micro.full)
        kinds = torch_api.peak_by_kind(tracker)
    total = kinds.pop("total")
    return Peak(total, kinds, (depth,))


@contextmanager
def no_collection_inside() -> Iterator[None]:
    """The process's garbage collected now, and not while the step is simulated: a cycle collected
    under the fake mode runs its `__del__` there, and whatever that allocates counts as the step's
    memory (CI saw vLLM's kernel handlers finalised inside a simulation, whose peak came out 1 MiB
    higher than in a fresh process). The step's own cycles are collected after it."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _track(tools: torch_api.TorchTools, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Any:
    """Torch's memory tracker over `model` and `optimizer`, counting what exists now (parameters,
    AdamW state) and everything the step allocates.

    Entered after a warm-up step: under fake tensors DTensor computes each op's output shape on
    global-size fake tensors in the fake mode it finds active, ours, which the tracker would count
    as allocations (the full unsharded gradients, in `clip_grad_norm_`); it does so once per op
    and shapes, then answers from its cache, so the measured step counts only the real work."""
    if is_sharded(model):
        return tools.FSDPMemTracker(model, optimizer)
    tracker = tools.MemTracker()
    tracker.track_external(model, optimizer)
    return tracker


def apply_layout(model: nn.Module, role: RolePlan, layout: Layout, device: torch.device) -> nn.Module:
    """Lay `model` out as `role`'s worker does, with the workers' own `apply_layout` (tensor
    parallelism, then Ulysses, then FSDP2 with its precision) on the layout's mesh over the fake
    process group: the one place the planner applies a layout."""
    mesh = device_mesh(layout, device.type) if dist.is_initialized() else None
    return apply_worker_layout(model, layout, device, tp_key=role.tp_key, sp_key=role.sp_key or f"{role.role} sequence parallelism",
                               mixed_precision=role.precision, mesh=mesh)


def _materialise(model: nn.Module, role: RolePlan, layout: Layout, fake: Any) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Fake parameters laid out, and the role's optimizer. FSDP2 shards the meta model (its device
    mesh needs real tensors) before its shards become fake; one process without a process group
    (one device) gets fake parameters first, then the worker's precision hooks on them."""
    if dist.is_initialized():
        model = apply_layout(model, role, layout, DEVICE)
        with fake:
            model.to_empty(device=DEVICE)
    else:
        with fake:
            model.to_empty(device=DEVICE)
        model = apply_layout(model, role, layout, DEVICE)
    with fake:
        optimizer = build_optimizer(model, role.optim) if role.trains and role.optim is not None else None
    return model, optimizer


@contextmanager
def fake_process_group(tools: torch_api.TorchTools, world: int) -> Iterator[None]:
    """Rank 0 of `world` fake ranks as the default process group (none for one device: a worker
    of one rank has no process group either)."""
    if world == 1:
        yield
        return
    if dist.is_initialized():
        raise RuntimeError("rlcore plan simulates in a process without a torch.distributed process group")
    dist.init_process_group("fake", store=tools.FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class _MicroInputs:
    """A micro-batch's packed row, built on real tensors before the fake step (the packing reads
    lengths on the host)."""

    full: tuple[Any, ...]

    @classmethod
    def of(cls, role: RolePlan, model: nn.Module, layout: Layout) -> _MicroInputs:
        m = role.micro_at(layout.dp)
        sp = sequence_parallel_of(model)
        vocab = int(model.get_input_embeddings().num_embeddings)
        return cls(cls._inputs(role, m.rows, m.prompt, m.response, vocab, sp))

    @staticmethod
    def _inputs(role: RolePlan, rows: int, prompt: int, response: int, vocab: int, sp: SequenceParallel | None) -> tuple[Any, ...]:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(1, vocab, (rows, prompt + response), generator=g)
        mask = torch.ones_like(ids)
        packed = pack_rows(mask, response if role.head != "score" else 0)
        if sp is not None:
            packed = packed.shard(sp.rank, sp.size)
        targets = packed.targets(ids[:, prompt:]) if role.head == "lm" else None
        return ids, packed, targets, role


def _backbone_kwargs(model: nn.Module, packed: PackedRows) -> dict[str, Any]:
    kwargs = packed.backbone_kwargs()
    sp = sequence_parallel_of(model)
    if sp is not None:
        kwargs[SEQUENCE_PARALLEL_KWARG] = sp
    return kwargs


def _lm_forward(model: nn.Module, ids: torch.Tensor, packed: PackedRows, targets: torch.Tensor, role: RolePlan) -> torch.Tensor:
    """`forward_response_log_probs` on a packed micro-batch: the backbone, then per-token log-probs
    from the hidden states that predict response tokens, in token chunks (the torch path, as
    `actor.fused_kernels=false` runs on any device)."""
    backbone = getattr(model, model.base_model_prefix)
    hidden = packed.predictors(backbone(input_ids=packed.pack(ids), use_cache=False, **_backbone_kwargs(model, packed)).last_hidden_state)
    spec = lm_head_semantics(model)
    head = model.get_output_embeddings()
    with torch_api.outside_fake():  # tensor parallel: this rank's rows of the head, as the worker reads them
        weight, vocab_shard = vocab_rows(head.weight)
        bias = vocab_rows(head.bias)[0] if spec.has_bias else None
    weight = weight.to(device=hidden.device, dtype=hidden.dtype)
    bias = bias.to(device=hidden.device, dtype=hidden.dtype) if bias is not None else None
    out = fused_token_logprobs(hidden, weight, targets, bias=bias, logit_scale=spec.logit_scale, softcap=spec.softcap,
                               temperature=role.temperature, compute_entropy=role.compute_entropy,
                               chunk_tokens=role.chunk_tokens, backend="torch", vocab_shard=vocab_shard, check_targets=False)
    result = packed.scatter(out.logprobs)
    if out.entropy is not None:
        result = result + packed.scatter(out.entropy)
    sp = sequence_parallel_of(model)
    return (result if sp is None else sp.gather(result)).clone()  # a copy, not a view: as `sharded_log_probs` returns


def _value_forward(model: nn.Module, ids: torch.Tensor, packed: PackedRows, targets: None, role: RolePlan) -> torch.Tensor:
    """`response_values` on a packed micro-batch: the whole token classifier, values at the predictors."""
    out = type(model).forward(model, input_ids=packed.pack(ids), use_cache=False, **_backbone_kwargs(model, packed))
    values = packed.scatter(packed.predictors(out.logits).squeeze(-1).float())
    sp = sequence_parallel_of(model)
    return (values if sp is None else sp.gather(values)).clone()


def _score_forward(model: nn.Module, ids: torch.Tensor, packed: PackedRows, targets: None, role: RolePlan) -> torch.Tensor:
    """`forward_sequence_scores` on a packed micro-batch: the backbone, the score head on each
    sequence's last token."""
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(input_ids=packed.pack(ids), use_cache=False, **packed.backbone_kwargs()).last_hidden_state[0]
    picked = hidden.index_select(0, packed.cu_seqlens[1:].long() - 1)
    head = score_head(model)
    bias = head.bias.to(picked.dtype) if head.bias is not None else None  # a classifier head stays whole under TP
    return F.linear(picked, head.weight.to(device=picked.device, dtype=picked.dtype), bias).squeeze(-1).float()


_FORWARDS: dict[str, Callable[..., torch.Tensor]] = {"lm": _lm_forward, "value": _value_forward, "score": _score_forward}


def _warm_up(model: nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float) -> None:
    """A first optimizer step on zero gradients: AdamW makes its state (as on a run's first step),
    and the clipping and the step's DTensor ops run once, without the cost of a forward."""
    for param in model.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    _clip(model, grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list[tuple[Any, ...]], grad_clip: float,
                next_pass: Callable[[], None] = lambda: None) -> None:
    """`rlcore.workers.loops._step_on`'s memory: gradients dropped, each micro-batch's forward and
    backward accumulating into them, clipping, the AdamW step. `next_pass` after each backward:
    the tracker keeps one forward/backward of the root per iteration (its overall peak stays)."""
    optimizer.zero_grad(set_to_none=True)
    for inputs in micro_batches:
        model(*inputs).sum().backward()
        next_pass()
    _clip(model, grad_clip)
    optimizer.step()


def _clip(model: nn.Module, grad_clip: float) -> None:
    """Gradient clipping's memory as `rlcore.workers.parallel.tensors.clip_grad_norm` spends it: a
    norm per device mesh (FSDP2 x TP puts the split matrices and the rest on two), the gradients
    scaled in place. Each mesh's gradients are scaled by their own norm here: the worker's
    combination of the norms reads them on the host, which fake tensors cannot."""
    meshes: dict[Any, list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.grad is not None:
            meshes.setdefault(p.grad.device_mesh if is_dtensor(p.grad) else None, []).append(p)
    for params in meshes.values():
        torch.nn.utils.clip_grad_norm_(params, grad_clip)


def static_bytes(role: RolePlan, parameters: int, devices: int) -> int:
    """Per-rank bytes of what FSDP shards evenly: parameters (and, trained, gradients and AdamW's
    two moments, all in the parameter dtype). A lower bound of the peak, the analytic pre-filter."""
    size = torch.finfo(role.param_dtype).bits // 8
    per_param = size * (4 if role.trains else 1)
    return math.ceil(parameters / devices) * per_param


__all__ = ["DEPTHS", "Layout", "Peak", "apply_layout", "fake_process_group", "simulate", "simulate_depth", "static_bytes"]
