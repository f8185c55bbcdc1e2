"""The rollout engine's memory per device at a tensor-parallel size: weights plus vLLM's KV cache.

Arithmetic, not simulation: vLLM's tensor parallelism slices every attention and MLP matrix and
the vocabulary evenly over `tp` ranks (key/value heads fewer than `tp` are repeated, one per rank),
and keeps norms whole. Its KV cache is blocks of `block_size` tokens, each token holding a key and
a value vector per layer and key/value head of the rank, in the engine's dtype. On a GPU vLLM takes
`gpu_memory_utilization` of the device for weights and cache (or `kv_cache_gib` of cache when set);
a layout fits when one sequence of the run's maximum length fits in the cache beside the weights,
and runs the step's samples without queueing when all of a replica's share of them fit at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from rlcore.config import Config
from rlcore.flops import ModelFlops, causal_pairs, decode_pairs
from rlcore.plan.hardware import GIB, Hardware, gib
from rlcore.plan.models import ModelFacts, build_meta

DEFAULT_BLOCK_SIZE = 16   # vLLM's KV block on GPUs
DEFAULT_MAX_NUM_SEQS = 256  # vLLM's default cap on sequences decoded at once
_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class RolloutNeeds:
    """What the rollout needs at the run's settings, independent of the layout."""

    sharded_params: int     # matrix and embedding parameters (sliced over tp)
    kv_params: int          # of which the key/value projections (repeated when kv_heads < tp)
    whole_params: int       # norms and other vectors (whole on every rank)
    dtype_bytes: int
    layers: int
    kv_heads: int
    heads: int
    head_dim: int
    sequence_tokens: int    # prompt + response at their maximum
    step_sequences: int     # samples generated per training step
    block_size: int
    max_num_seqs: int
    utilization: float
    kv_cache_bytes: int | None  # rollout.vllm.kv_cache_gib, when set
    max_model_len: int

    @classmethod
    def of(cls, config: Config, model_config: Any, facts: ModelFacts) -> RolloutNeeds:
        model = build_meta(model_config, "lm", torch.float32, "model.path")
        sharded = kv = whole = 0
        for name, param in model.named_parameters(remove_duplicate=True):
            if param.dim() < 2:
                whole += param.numel()
            else:
                sharded += param.numel()
                if name.rsplit(".", 2)[-2] in ("k_proj", "v_proj"):
                    kv += param.numel()
        v = config.rollout.vllm
        agent = config.rollout.agent
        response = agent.max_total_tokens if agent.enabled else config.rollout.max_new_tokens
        dtype = config.rollout.dtype or config.model.dtype
        max_len = v.max_model_len or int(getattr(model.config, "max_position_embeddings", 0) or 0) or 10**9
        return cls(sharded_params=sharded, kv_params=kv, whole_params=whole, dtype_bytes=_BYTES[dtype], layers=facts.layers,
                   kv_heads=facts.kv_heads, heads=facts.heads, head_dim=facts.head_dim,
                   sequence_tokens=config.data.max_prompt_length + response,
                   step_sequences=config.data.train_batch_size * config.rollout.n,
                   block_size=v.block_size or DEFAULT_BLOCK_SIZE, max_num_seqs=v.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
                   utilization=v.gpu_memory_utilization,
                   kv_cache_bytes=int(v.kv_cache_gib * GIB) if v.kv_cache_gib else None, max_model_len=max_len)

    def tp_sizes(self, hardware: Hardware) -> list[int]:
        """Tensor-parallel sizes vLLM accepts for this model within a node: they divide the attention
        heads, and the key/value heads divide them or are divided by them."""
        return [t for t in range(1, hardware.devices_per_node + 1)
                if hardware.devices % t == 0 and self.heads % t == 0 and (self.kv_heads % t == 0 or t % self.kv_heads == 0)]


@dataclass(frozen=True)
class RolloutPlan:
    """The rollout at tensor-parallel size `tp` on `devices` devices."""

    tp: int
    replicas: int
    weights: int             # bytes per device
    kv_cache: int            # bytes of KV cache per device (what vLLM would take)
    kv_per_sequence: int     # bytes of one full-length sequence's blocks on one device
    concurrent: int          # full-length sequences the cache holds at once
    wanted: int              # sequences a replica generates at once: its share of the step, up to max_num_seqs
    fits: bool
    why: str

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache


def plan_rollout(needs: RolloutNeeds, tp: int, hardware: Hardware) -> RolloutPlan:
    """Weights and KV cache per device at `tp` on every device of `hardware`."""
    kv_heads = math.ceil(needs.kv_heads / tp)  # fewer kv heads than ranks: each rank holds one
    kv_params = needs.kv_params // needs.kv_heads * kv_heads if needs.kv_params else 0
    weights = ((needs.sharded_params - needs.kv_params) // tp + kv_params + needs.whole_params) * needs.dtype_bytes
    per_token = 2 * needs.layers * kv_heads * needs.head_dim * needs.dtype_bytes
    per_sequence = math.ceil(needs.sequence_tokens / needs.block_size) * needs.block_size * per_token
    replicas = hardware.devices // tp
    wanted = min(needs.max_num_seqs, math.ceil(needs.step_sequences / replicas))
    budget = int(needs.utilization * hardware.device_memory)
    if needs.kv_cache_bytes is not None:
        cache = needs.kv_cache_bytes
        room = hardware.usable - weights - cache
        fits, why = room >= 0, f"weights + rollout.vllm.kv_cache_gib {'fit' if room >= 0 else 'exceed'} {gib(hardware.usable)}"
    else:
        cache = max(0, budget - weights)
        fits = cache >= per_sequence
        why = (f"weights + KV cache take gpu_memory_utilization={needs.utilization:g} of the device" if fits else
               f"weights leave {gib(cache)} of gpu_memory_utilization={needs.utilization:g} x device, less than one "
               f"{needs.sequence_tokens:,}-token sequence's KV ({gib(per_sequence)})")
    if fits and needs.sequence_tokens > needs.max_model_len:
        fits, why = False, f"sequences of {needs.sequence_tokens:,} tokens exceed max_model_len {needs.max_model_len:,}"
    concurrent = cache // per_sequence if per_sequence else 0
    if fits and concurrent < 1:
        fits, why = False, "the KV cache holds no full-length sequence"
    return RolloutPlan(tp, replicas, weights, cache, per_sequence, int(concurrent), wanted, fits, why)


def rollout_flops(config: Config, config_json: dict[str, Any], needs: RolloutNeeds) -> float:
    """Model FLOPs of one step's generation (all devices): each prompt prefilled once, every response
    token decoded against its prompt and predecessors (`rlcore.flops`), at the maximum lengths."""
    model = ModelFlops.from_hf_config(config_json)
    prompts, n = config.data.train_batch_size, config.rollout.n
    prompt, response = config.data.max_prompt_length, needs.sequence_tokens - config.data.max_prompt_length
    prefill = model.forward(prompts * prompt, prompts, prompts * causal_pairs([prompt]))
    samples = prompts * n
    decode = model.forward(samples * response, samples * response, samples * decode_pairs([prompt], [response]))  # all alike
    return prefill + decode


__all__ = ["RolloutNeeds", "RolloutPlan", "plan_rollout", "rollout_flops"]
