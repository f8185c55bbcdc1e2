"""Device memory of a training step: how many tokens a micro-batch may hold
(`*.max_tokens_per_micro_batch: auto`) and whether a rollout engine that shares the actor's GPU
may stay awake through the update (`rollout.sleep: auto`).

Both decisions are pure functions of byte counts (`size_micro_batch`, `sleep_decision`), so they
are tested on the CPU with given numbers; the workers call them with what they measure on the
device (`device_memory`, `PeakMeter`, `bytes_to_come`), `rlcore plan` with what it plans.

The per-token activation estimate (`ActivationCost`) is the one copy of that formula. Its
coefficients count the tensors a Hugging Face decoder layer (Llama, Qwen2, Mistral: RMSNorm,
rotary attention, gated MLP) keeps for its backward under rlcore's packed attention. They match the
planner's fake-tensor simulation of a training step (`rlcore.plan.simulate`) per layer and token:
to within 0.1% on a Qwen2.5-0.5B-shaped model (the growth of the peak between 4,096- and
8,192-token micro-batches, float32 and bf16 compute), and within 2% on the tiny model
`tests/test_memory_budget.py` simulates. Not yet measured against a real GPU's allocator.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from rlcore.config.spec import RoleSpec
from rlcore.workers.ranks import distributed_world, max_over_ranks

log = logging.getLogger(__name__)

GIB = 2**30
SAFETY_MARGIN = 0.10  # of the device's memory, never planned on: the CUDA context, NCCL buffers, fragmentation
CPU_MICRO_BATCH_TOKENS = 8192  # `auto` on a CPU: the fixed default (see `size_micro_batch`)
MIN_AUTO_TOKENS = 256  # below this a device is too small for the model; sequences still go alone when longer
MAX_AUTO_TOKENS = 2**20  # far beyond any mini-batch a rank gets: a larger budget changes nothing
GRANULE = 256  # an auto budget is a multiple of this many tokens (readable, and stable across small memory changes)

Head = Literal["lm", "value", "score"]


def gib(size: float) -> str:
    """Bytes as GiB with one decimal ("72.0 GiB"), MiB below one GiB."""
    return f"{size / GIB:,.1f} GiB" if abs(size) >= GIB else f"{size / 2**20:,.1f} MiB"


@dataclass(frozen=True)
class ActivationCost:
    """Bytes a micro-batch's activations take per token, and what its head adds at any size.

    Per decoder layer and token a training forward keeps for the backward, in the compute dtype
    (`compute_bytes`: 2 under bf16 compute, else 4): 7 hidden-sized tensors (the two norms'
    outputs, the queries, the attention output and its projections' inputs), 2 key/value-sized
    (keys and values), 4 intermediate-sized (gate, its SiLU, up, their product); in float32: 2
    hidden-sized (each RMSNorm's float32 input) and 4 bytes per attention head (the attention's
    log-sum-exp). With gradient checkpointing a layer keeps only its input (hidden x compute bytes)
    and one layer is recomputed at a time. On top: one layer's worth in flight during the backward
    and 32 bytes per hidden unit (embedding output, final norm, the head's input, gradients in
    flight). A forward without gradients holds one layer's worth at a time.

    Tensor parallelism splits the key/value, intermediate and head dimensions over its ranks;
    Ulysses sequence parallelism gives each rank 1/size of a micro-batch's tokens. The LM head
    (log-probs in `chunk_tokens`-token chunks, `fused_token_logprobs`) holds float32 logits and
    their gradient for one chunk: a fixed cost, not a per-token one."""

    layers: int
    hidden: int
    kv_width: int       # key/value heads x head dim
    intermediate: int
    heads: int
    vocab: int
    compute_bytes: int
    checkpointing: bool
    head: Head = "lm"
    chunk_tokens: int = 1024
    tensor_parallel: int = 1
    sequence_parallel: int = 1

    @classmethod
    def of(cls, config_json: dict[str, Any], *, compute_bytes: int, checkpointing: bool, head: Head = "lm",
           chunk_tokens: int = 1024, tensor_parallel: int = 1, sequence_parallel: int = 1) -> ActivationCost:
        """From a Hugging Face config.json (its `text_config` where it has one)."""
        cfg = config_json.get("text_config", config_json)
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        return cls(layers=int(cfg["num_hidden_layers"]), hidden=hidden, kv_width=kv_heads * head_dim,
                   intermediate=int(cfg["intermediate_size"]), heads=heads, vocab=int(cfg["vocab_size"]),
                   compute_bytes=compute_bytes, checkpointing=checkpointing, head=head, chunk_tokens=chunk_tokens,
                   tensor_parallel=tensor_parallel, sequence_parallel=sequence_parallel)

    @classmethod
    def of_model_dir(cls, path: str | Path, **kwargs: Any) -> ActivationCost:
        return cls.of(json.loads((Path(path) / "config.json").read_text()), **kwargs)

    def layer(self) -> int:
        """Bytes per token one decoder layer keeps for its backward (see the class docstring)."""
        tp = self.tensor_parallel
        split = 2 * self.kv_width // tp + 4 * self.intermediate // tp
        return self.compute_bytes * (7 * self.hidden + split) + 4 * (2 * self.hidden + max(1, self.heads // tp))

    def per_token(self, trains: bool = True) -> float:
        """Bytes per token of a micro-batch on one rank: every layer's saved tensors and what is in
        flight (training), or one layer at a time (`trains=False`)."""
        in_flight = self.layer() + 32 * self.hidden
        if not trains:
            return in_flight / self.sequence_parallel
        kept = self.compute_bytes * self.hidden if self.checkpointing else self.layer()
        return (self.layers * kept + in_flight) / self.sequence_parallel

    def fixed(self) -> int:
        """Bytes independent of the micro-batch's size: the LM head's float32 logits and their
        gradient for one chunk of tokens (none for a value or score head)."""
        if self.head != "lm":
            return 0
        return 2 * self.chunk_tokens * math.ceil(self.vocab / self.tensor_parallel) * 4


@dataclass(frozen=True)
class MicroBatchChoice:
    """An `auto` micro-batch budget and the line that says how it was chosen."""

    tokens: int
    reason: str


def per_token_text(size: float) -> str:
    """Bytes per token as the log lines show them: 1.50 MiB, 12.3 KiB, 640 bytes."""
    if size >= 2**20:
        return f"{size / 2**20:,.2f} MiB"
    return f"{size / 2**10:,.1f} KiB" if size >= 2**10 else f"{size:,.0f} bytes"


def size_micro_batch(key: str, *, device: str, total: int = 0, available: int = 0, to_come: int = 0,
                     per_token: float = 1.0, fixed: int = 0, margin: float = SAFETY_MARGIN,
                     free: str = "free") -> MicroBatchChoice:
    """Tokens per micro-batch for `key: auto`: what the device's `available` bytes hold after the
    bytes still `to_come` (gradients, optimizer state not made yet), the head's `fixed` bytes and a
    `margin` of its `total`, at `per_token` bytes each; a multiple of `GRANULE` between
    `MIN_AUTO_TOKENS` and `MAX_AUTO_TOKENS`.

    On a CPU (`device` "cpu") it is `CPU_MICRO_BATCH_TOKENS`, the fixed default: host memory is
    shared with the rollout engine, Ray's object store and other processes, none of which a
    free-memory reading at start-up accounts for, and a CPU computes a token no faster in a larger
    micro-batch (a GPU does: fewer, larger kernels), so there is nothing to gain from sizing it up
    and a run's numbers stay the ones a fixed 8,192 gives. `free` names `available` in the line."""
    if device == "cpu":
        return MicroBatchChoice(CPU_MICRO_BATCH_TOKENS, f"{key}=auto: {CPU_MICRO_BATCH_TOKENS:,} tokens on the CPU (the fixed "
                                "default: host memory is shared with the rollout engine and other processes, and a CPU "
                                "is no faster per token in larger micro-batches)")
    reserve = int(margin * total)
    budget = available - to_come - fixed - reserve
    fit = int(budget // per_token) if per_token > 0 else MAX_AUTO_TOKENS
    tokens = min(MAX_AUTO_TOKENS, max(MIN_AUTO_TOKENS, fit // GRANULE * GRANULE))
    terms = [f"{gib(available)} {free}"] + ([f"{gib(to_come)} gradients and optimizer state to come"] if to_come else [])
    terms += [f"{gib(fixed)} head chunk"] if fixed else []
    terms += [f"{gib(reserve)} margin ({margin:.0%} of {gib(total)})"]
    sums = f"({' - '.join(terms)}) / {per_token_text(per_token)} of activations per token"
    short = " (the device is short of memory for this model: at the minimum)" if fit < MIN_AUTO_TOKENS else ""
    capped = f" (capped at {MAX_AUTO_TOKENS:,})" if fit >= MAX_AUTO_TOKENS + GRANULE else ""
    return MicroBatchChoice(tokens, f"{key}=auto: {tokens:,} tokens on {device}{short}{capped}: {sums}")


@dataclass(frozen=True)
class SleepDecision:
    """Whether the rollout engine sleeps through the update, and the line that says why."""

    sleep: bool
    reason: str


def sleep_decision(*, total: int, engine_bytes: int, update_peak: int, margin: float = SAFETY_MARGIN,
                   source: str = "measured") -> SleepDecision:
    """`rollout.sleep: auto` on a shared GPU: the engine stays awake when the update's peak with the
    engine asleep (`update_peak`, device-wide), the engine's resident bytes and a `margin` of the
    device's `total` fit the device; else it sleeps. `source` says where the peak comes from."""
    reserve = int(margin * total)
    need = update_peak + engine_bytes + reserve
    fits = need <= total
    sums = (f"the update's peak {gib(update_peak)} ({source}) + the engine's {gib(engine_bytes)} + a {margin:.0%} margin "
            f"{gib(reserve)} = {gib(need)} {'fits in' if fits else 'exceeds'} the device's {gib(total)}")
    if fits:
        return SleepDecision(False, f"rollout.sleep=auto: the engine stays awake through the update: {sums}")
    return SleepDecision(True, f"rollout.sleep=auto: the engine sleeps through the update: {sums}")


# ------------------------------------------------------------------ measured on a CUDA device


@dataclass(frozen=True)
class DeviceMemory:
    """A CUDA device's memory as this process sees it: `free` counts what its caching allocator
    holds unused (it reuses that before asking the driver)."""

    total: int
    free: int


def device_memory(device: torch.device) -> DeviceMemory | None:
    """`device`'s total and free bytes; None off CUDA."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return DeviceMemory(int(total), int(free + cached))


class PeakMeter:
    """The device-wide peak of a block on CUDA: what was in use on the device when it began (every
    process's, less this process's unused cache) plus the most this process allocated beyond its
    allocation then (`torch.cuda.max_memory_allocated`, reset at the start). `peak` is None off CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak: int | None = None
        self._start: tuple[int, int] | None = None

    def __enter__(self) -> PeakMeter:
        memory = device_memory(self.device)
        if memory is not None:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = (memory.total - memory.free, torch.cuda.memory_allocated(self.device))
        return self

    def __exit__(self, *exc: object) -> None:
        if self._start is not None and exc[0] is None:
            torch.cuda.synchronize(self.device)
            in_use, allocated = self._start
            self.peak = in_use + torch.cuda.max_memory_allocated(self.device) - allocated


def bytes_to_come(model: nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device) -> int:
    """Device bytes a first optimizer step still allocates: the gradient of every trainable
    parameter that has none yet and AdamW's two moments where the optimizer (None: not built yet)
    holds no state for it (this rank's shard of a sharded parameter; nothing for parameters kept
    in host memory)."""
    from rlcore.workers.parallel.tensors import local

    total = 0
    for p in model.parameters():
        if not p.requires_grad:
            continue
        shard = local(p)
        if shard.device.type != device.type:
            continue
        moments = 2 if optimizer is None or not optimizer.state.get(p) else 0
        total += shard.numel() * shard.element_size() * ((p.grad is None) + moments)
    return total


# The trained models of this process (weakly held): a role sizing its micro-batches leaves room for
# what every one of them still allocates, so roles sharing a process and its device (the in-process
# backend, colocated Ray roles) do not each count on the same free memory. Roles in other
# processes on the same device are not seen; their memory counts once it is allocated.
_TRAINED: list[tuple[weakref.ref[nn.Module], Callable[[], torch.optim.Optimizer | None]]] = []


def track_trained(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Register a trained role's model and optimizer (its worker's `setup`): see `pending_bytes`."""
    _TRAINED[:] = [(m, o) for m, o in _TRAINED if m() is not None and m() is not model]
    _TRAINED.append((weakref.ref(model), weakref.ref(optimizer) if optimizer is not None else lambda: None))


def pending_bytes(device: torch.device, also: tuple[nn.Module, torch.optim.Optimizer | None] | None = None) -> int:
    """What the first optimizer steps of this process's trained models (`track_trained`, and
    `also`) still allocate on `device` (`bytes_to_come`)."""
    models: dict[int, tuple[nn.Module, torch.optim.Optimizer | None]] = {}
    for model_ref, optimizer_ref in _TRAINED:
        model = model_ref()
        if model is not None:
            models[id(model)] = (model, optimizer_ref())
    if also is not None:
        models.setdefault(id(also[0]), also)
    return sum(bytes_to_come(model, optimizer, device) for model, optimizer in models.values())


def choose_micro_batch(key: str, device: torch.device, cost: Callable[[], ActivationCost], *, trains: bool, model: nn.Module,
                       optimizer: torch.optim.Optimizer | None = None) -> MicroBatchChoice:
    """`size_micro_batch` for a loaded role on `device`: its free memory now, what the first steps
    of this process's trained models (this one's too when `trains`) still allocate
    (`pending_bytes`), the per-token and fixed bytes of `cost()` (read only on a device). The ranks
    of a group take the smallest of their choices, so every rank packs alike."""
    memory = device_memory(device)
    if memory is None:
        return size_micro_batch(key, device=device.type)
    activations = cost()
    choice = size_micro_batch(key, device=str(device), total=memory.total, available=memory.free,
                              to_come=pending_bytes(device, (model, optimizer) if trains else None),
                              per_token=activations.per_token(trains), fixed=activations.fixed())
    smallest = -max_over_ranks(-choice.tokens, device)
    if smallest != choice.tokens:
        return MicroBatchChoice(smallest, f"{choice.reason}; the group's smallest: {smallest:,} tokens")
    return choice


class MicroBudget:
    """A role's micro-batch token budget under `key: auto`, held by its worker: chosen on first use
    (`resolve`, logged once), halved once by an out-of-memory error in the role's first step
    (`may_halve`, `halve`), fixed from the end of that step on (`first_step_done`): a later OOM is a real
    error. `forward_only`: a role whose first step is a forward without gradients (the reference)."""

    def __init__(self, key: str, forward_only: bool = False) -> None:
        self.key = key
        self.forward_only = forward_only
        self.tokens: int | None = None
        self.halved = False
        self.settled = False

    def resolve(self, choose: Callable[[], MicroBatchChoice]) -> int:
        if self.tokens is None:
            choice = choose()
            log.info(choice.reason)
            self.tokens = choice.tokens
        return self.tokens

    def may_halve(self) -> bool:
        """Whether an out-of-memory error may halve the budget: in the role's first step, once, with
        one rank (with several, the others wait in a collective the failed rank left: a real error)."""
        return (self.tokens is not None and not self.settled and not self.halved and self.tokens > MIN_AUTO_TOKENS
                and distributed_world() == 1)

    def halve(self) -> int:
        """The halved budget (after `may_halve`), with the device's unused cache given back; says so."""
        assert self.tokens is not None
        before, self.tokens, self.halved = self.tokens, max(MIN_AUTO_TOKENS, self.tokens // 2), True
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        log.warning("%s=auto: out of device memory in the first step at %s tokens per micro-batch; halved to %s and "
                    "running this pass's micro-batches again (a number fixes it)", self.key, f"{before:,}", f"{self.tokens:,}")
        return self.tokens

    def first_step_done(self) -> None:
        self.settled = True


def role_budget(spec: RoleSpec[Any]) -> MicroBudget | None:
    """The `MicroBudget` of `spec`'s role when its micro-batches are packed by tokens (`dynamic_batch_size`)
    under an `auto` budget (`RoleSpec.micro`: the reference reads the actor's key, the critic its own or, unset, the actor's)."""
    micro = spec.micro
    if micro is None or micro.max_tokens != "auto" or not micro.dynamic:
        return None
    label = micro.key if micro.key.startswith(spec.role) else f"{micro.key} ({spec.role})"
    return MicroBudget(label, forward_only=not spec.trains)


def role_cost(spec: RoleSpec[Any]) -> ActivationCost:
    """`spec`'s role's `ActivationCost` as its worker runs it: its model's config.json, compute dtype,
    gradient checkpointing (trained roles), head, log-prob chunk and layout."""
    from rlcore.workers.loading import compute_precision

    model = spec.model
    if spec.trains:
        bf16 = compute_precision(model, spec.mixed_precision) == "bf16" or model.pure_bf16
    else:
        bf16 = model.dtype == "bfloat16"
    head: Head = {"critic": "value", "reward_model": "score"}.get(spec.role, "lm")  # type: ignore[assignment]
    return ActivationCost.of_model_dir(spec.model_path, compute_bytes=2 if bf16 else 4,
                                       checkpointing=spec.trains and model.gradient_checkpointing,
                                       head=head, chunk_tokens=spec.logprob_chunk_tokens,
                                       tensor_parallel=spec.layout.tensor_parallel, sequence_parallel=spec.layout.sequence_parallel)


def largest_micro_batch(longest: int, *, dynamic: bool, max_tokens: int, rows_per_micro: int, mini_rows: int) -> int:
    """The most tokens one micro-batch of an RL update may hold in any step: its token budget, or
    its rows, of sequences at the `longest` the config allows (`RoleSpec.longest_sequence`: prompt
    and response limits), and no more than a mini-batch's `mini_rows` rows on this rank."""
    if dynamic:
        return min(max_tokens, mini_rows * longest)
    return min(rows_per_micro, mini_rows) * longest


def resolve_budget(budget: MicroBudget | None, spec: RoleSpec[Any], device: torch.device, model: nn.Module,
                   optimizer: torch.optim.Optimizer | None = None) -> MicroBudget | None:
    """`budget` chosen for `spec`'s role's loaded `model` on `device` (once; see `choose_micro_batch`)."""
    if budget is not None:
        budget.resolve(lambda: choose_micro_batch(budget.key, device, lambda: role_cost(spec),
                                                  trains=spec.trains, model=model, optimizer=optimizer))
    return budget


__all__ = [
    "CPU_MICRO_BATCH_TOKENS", "GRANULE", "MAX_AUTO_TOKENS", "MIN_AUTO_TOKENS", "SAFETY_MARGIN", "ActivationCost",
    "DeviceMemory", "MicroBatchChoice", "MicroBudget", "PeakMeter", "SleepDecision", "bytes_to_come", "choose_micro_batch",
    "device_memory", "largest_micro_batch", "pending_bytes", "per_token_text", "resolve_budget", "role_budget", "role_cost",
    "size_micro_batch", "sleep_decision", "track_trained",
]
