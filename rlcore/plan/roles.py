"""What each role of a run does to memory, read from its config as its worker reads it.

A trained role (actor, critic; the reward model under `algorithm.name: rm`) holds master weights
in `trained_dtype`, computes in `compute_precision`, keeps gradients and AdamW state, and runs
micro-batches of at most `max_tokens_per_micro_batch` tokens (or `micro_batch_size` rows) packed
into one row, split over its sequence-parallel group. The reference and a scoring reward model run
forward passes only, in `model.dtype`. Every sequence is planned at its configured maximum
length (prompt + response), so a micro-batch is as full as its budget allows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from rlcore.config import Config, LayoutConfig, OptimConfig, role_spec
from rlcore.flops import ModelFlops, causal_pairs
from rlcore.plan.hardware import PlanInputError
from rlcore.plan.models import Head, config_dict
from rlcore.workers.critic import critic_settings
from rlcore.workers.loading import compute_precision, trained_dtype
from rlcore.workers.loops import MicroBatching, budget_tokens
from rlcore.workers.memory import CPU_MICRO_BATCH_TOKENS, MicroBudget, role_budget

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MAX_MICRO_BATCH_TOKENS = 2**24  # 16M tokens: a sequence or a micro-batch beyond any model's context


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as the planner simulates it: `rows` sequences of `prompt + response` tokens."""

    rows: int
    prompt: int
    response: int

    @property
    def length(self) -> int:
        return self.prompt + self.response

    @property
    def tokens(self) -> int:
        return self.rows * self.length

    @classmethod
    def of(cls, micro: MicroBatching, prompt: int, response: int) -> MicroBatch:
        """The fullest micro-batch `micro` packs of such sequences: as many as the token budget
        holds (one, when one is longer: it goes alone), or `micro_batch_size` rows."""
        rows = max(1, micro.max_tokens // (prompt + response)) if micro.dynamic else micro.size
        return cls(rows, prompt, response)

    def describe(self) -> str:
        return f"up to {self.tokens:,} tokens ({self.rows} x {self.prompt:,} + {self.response:,})"


@dataclass(frozen=True)
class RolePlan:
    """One role of the run, as the planner simulates it."""

    role: str                    # actor, ref, critic, reward_model
    model_path: str
    model_key: str               # the config key naming its model (errors, report)
    head: Head
    trains: bool
    param_dtype: torch.dtype     # parameters (and, trained, gradients and AdamW state)
    precision: str               # `shard_model`'s mixed_precision: "bf16" computes in bf16
    checkpointing: bool          # `model.gradient_checkpointing` (trained roles)
    layout: LayoutConfig         # the configured layout (`Config.layout_of`: data x sequence x tensor parallel)
    sp_key: str | None           # the config key of its sequence-parallel size; None: the role has no sequence parallelism
    tp_key: str                  # the config key of its tensor-parallel size
    micro: MicroBatch
    mini_batch_rows: int         # rows one pass covers over all data-parallel ranks: a mini-batch (trained), the step's (forward)
    optim: OptimConfig | None
    compute_entropy: bool
    chunk_tokens: int
    temperature: float
    step_sequences: int          # sequences this role sees per training step (all ranks)
    passes: tuple[tuple[str, int], ...]  # ("train" | "forward", times per step): for FLOPs
    length_keys: str = ""           # the config keys a sequence's length comes from (errors)
    micro_key: str = ""             # the config key that sizes its micro-batches (errors)
    not_planned: str | None = None  # why the planner cannot simulate this role as configured
    lora: bool = False              # LoRA on this role: the workers refuse tensor parallelism with it
    caveat: str | None = None       # what the simulation leaves out (its peak is then an upper bound)
    micro_auto: bool = False        # its token budget is `auto`: sized for the hardware (`planner.size_auto_micro_batch`)
    micro_note: str | None = None   # how an `auto` budget was sized

    @property
    def sequence_parallel(self) -> int:
        """The configured Ulysses size."""
        return self.layout.sequence_parallel

    def micro_at(self, data_parallel: int) -> MicroBatch:
        """The micro-batch at `data_parallel` shards: no more rows than a rank has."""
        return replace(self.micro, rows=min(self.micro.rows, max(1, math.ceil(self.mini_batch_rows / data_parallel))))

    def micro_batches(self, data_parallel: int) -> int:
        """Micro-batches one rank runs per optimizer step (or pass) at `data_parallel` shards."""
        rows = math.ceil(self.mini_batch_rows / data_parallel)
        return max(1, math.ceil(rows / self.micro_at(data_parallel).rows))

    def step_flops(self, config_json: dict[str, Any]) -> float:
        """Model FLOPs of this role's work in one training step, over all its ranks (`rlcore.flops`):
        every sequence at its full length, the head on response tokens (a value or score head: ~0)."""
        model = ModelFlops.from_hf_config(config_json, head="lm" if self.head == "lm" else "value")
        m = self.micro
        tokens = self.step_sequences * m.length
        head_tokens = self.step_sequences * (m.response if self.head != "score" else 1)
        pairs = self.step_sequences * causal_pairs([m.length])
        total = 0.0
        for kind, times in self.passes:
            fn = model.training if kind == "train" else model.forward
            total += times * fn(tokens, head_tokens, pairs)
        return total


def _lengths(config: Config) -> tuple[int, int, int, str]:
    """(prompt tokens, response tokens, rows per example) of the run's sequences at their maximum,
    and the config keys their length comes from."""
    prompt = config.data.max_prompt_length
    traits = config.traits
    if traits.trains_policy and not traits.generates:  # offline preference rows: pairs or single rows
        return prompt, config.preference.max_response_length, 2 if traits.data == "pairwise" else 1, \
            "data.max_prompt_length + preference.max_response_length"
    if "reward_model" in traits.trains:
        return prompt, max(1, config.reward_model.max_length - prompt), 2, "reward_model.max_length"
    agent = config.rollout.agent
    if agent.enabled:
        return prompt, agent.max_total_tokens, config.rollout.n, "data.max_prompt_length + rollout.agent.max_total_tokens"
    return prompt, config.rollout.max_new_tokens, config.rollout.n, "data.max_prompt_length + rollout.max_new_tokens"


def _micro_key(section: str, micro: MicroBatching, own: Any = None) -> str:
    """The key that sizes `micro` (`own`: the section whose batch fields are unset fall back to the actor's)."""
    field = "max_tokens_per_micro_batch" if micro.dynamic else "micro_batch_size"
    if own is not None and getattr(own, field) is None:
        section = "actor"
    return f"{section}.{field}"


def _placeholder_budget(config: Config, role: Literal["actor", "ref", "critic", "reward_model"]) -> MicroBudget | None:
    """`role`'s `auto` token budget, standing at the CPU default until the planner sizes it for the
    hardware (`rlcore.plan.planner.size_auto_micro_batch`, once the model's shape is read)."""
    budget = role_budget(role_spec(config, role))
    if budget is not None:
        budget.tokens = CPU_MICRO_BATCH_TOKENS
    return budget


def role_plans(config: Config) -> list[RolePlan]:
    """The roles of `config` that hold a model on a device, in `Config.present_roles` order (the
    rollout is planned apart: `rlcore.plan.rollout`)."""
    prompt, response, rows_per_example, length_keys = _lengths(config)
    traits = config.traits
    step_sequences = config.data.train_batch_size * rows_per_example
    common = dict(temperature=config.rollout.temperature, chunk_tokens=config.actor.logprob_chunk_tokens,
                  step_sequences=step_sequences, length_keys=length_keys)
    lora = {"actor": config.actor.lora, "critic": config.critic.lora, "reward_model": config.reward_model.lora}
    plans: list[RolePlan] = []
    for role in config.present_roles:
        if role in ("rollout", "reward"):
            continue
        if role in ("actor", "ref"):
            a = config.actor
            trains = role == "actor"
            budget = _placeholder_budget(config, role)
            micro = MicroBatching.of(a, budget=budget)
            passes: tuple[tuple[str, int], ...] = (("train", a.ppo_epochs),)
            if traits.generates and not config.old_log_probs_from_update:
                passes += (("forward", 1),)  # the old log-probs' no-grad pass
            if not trains:
                cached = "ref_cache" in traits.preference_keys and config.preference.ref_cache
                passes = () if cached else (("forward", 1),)
            plans.append(RolePlan(
                role=role, model_path=config.model.path, model_key="model.path", head="lm", trains=trains,
                param_dtype=_DTYPES[trained_dtype(config.model) if trains else config.model.dtype],
                precision=compute_precision(config.model, a.mixed_precision) if trains else "none",
                checkpointing=trains and config.model.gradient_checkpointing,
                layout=config.layout_of(role), sp_key=config.layout_key(role, "sequence_parallel"),
                tp_key=config.layout_key(role, "tensor_parallel"), micro=MicroBatch.of(micro, prompt, response),
                mini_batch_rows=a.ppo_mini_batch_size * rows_per_example if trains else step_sequences,
                optim=a.optim if trains else None,
                compute_entropy=trains and (a.entropy_coeff != 0 or config.old_log_probs_from_update),
                passes=passes, micro_key=_micro_key("actor", micro), micro_auto=budget is not None,
                **_limits(config, role, lora.get(role)), **common))
        elif role == "critic":
            c = config.critic
            budget = _placeholder_budget(config, role)
            settings = critic_settings(role_spec(config, role), budget)
            plans.append(RolePlan(
                role=role, model_path=c.model_path or config.model.path,
                model_key="critic.model_path" if c.model_path else "model.path", head="value", trains=True,
                param_dtype=_DTYPES[trained_dtype(config.model)], precision=compute_precision(config.model),
                checkpointing=config.model.gradient_checkpointing, layout=config.layout_of(role),
                sp_key=config.layout_key(role, "sequence_parallel"), tp_key=config.layout_key(role, "tensor_parallel"),
                micro=MicroBatch.of(settings.micro, prompt, response), mini_batch_rows=settings.mini_batch_size * rows_per_example,
                optim=c.optim, compute_entropy=False, passes=(("forward", 1), ("train", c.ppo_epochs)),
                micro_key=_micro_key("critic", settings.micro, c), micro_auto=budget is not None,
                **_limits(config, role, c.lora), **common))
        elif role == "reward_model":
            r = config.reward_model
            trains = "reward_model" in traits.trains
            budget = _placeholder_budget(config, role)
            micro = MicroBatching(r.micro_batch_size, r.dynamic_batch_size, budget_tokens(r.max_tokens_per_micro_batch, budget))
            length = min(r.max_length, prompt + response)
            mini = (r.mini_batch_size or config.data.train_batch_size) * 2 if trains else step_sequences
            plans.append(RolePlan(
                role=role, model_path=config.model.path if trains else str(r.path),
                model_key="model.path" if trains else "reward_model.path", head="score", trains=trains,
                param_dtype=_DTYPES[trained_dtype(config.model) if trains else config.model.dtype],
                precision=compute_precision(config.model) if trains else "none",
                checkpointing=trains and config.model.gradient_checkpointing, layout=config.layout_of(role), sp_key=None,
                tp_key=config.layout_key(role, "tensor_parallel"),
                micro=MicroBatch.of(micro, min(prompt, length - 1), length - min(prompt, length - 1)),
                mini_batch_rows=mini, optim=r.optim if trains else None, compute_entropy=False,
                passes=(("train", 1),) if trains else (("forward", 1),), micro_key=_micro_key("reward_model", micro),
                micro_auto=budget is not None,
                **_limits(config, role, r.lora if trains else None), **common))
    return plans


def check_micro_batch(role: RolePlan) -> None:
    """Refuse (PlanInputError naming the keys) a micro-batch beyond what any device trains on at
    once, before any model is built: the planner builds each simulated micro-batch's token ids."""
    m = role.micro_at(1)  # the largest: one data-parallel shard
    if m.length > MAX_MICRO_BATCH_TOKENS:
        raise PlanInputError(f"{role.role}: {role.length_keys} = {m.length:,} tokens per sequence, more than "
                             f"{MAX_MICRO_BATCH_TOKENS:,}: longer than any model's context")
    if m.tokens > MAX_MICRO_BATCH_TOKENS:
        raise PlanInputError(f"{role.role}: {role.micro_key} makes micro-batches of {m.describe()}, more than "
                             f"{MAX_MICRO_BATCH_TOKENS:,} tokens: beyond what any device trains on at once")


def _limits(config: Config, role: str, lora: Any) -> dict[str, Any]:
    """`not_planned`: why the planner cannot simulate `role` as configured; `caveat`: a setting it
    leaves out, which only lowers the real peak (the plan is then an upper bound); `lora`."""
    if not config.model.use_remove_padding:
        return {"not_planned": "model.use_remove_padding=false: the planner simulates packed micro-batches only (a padded "
                               "one holds more tokens)"}
    if lora is not None and lora.enabled:
        return {"lora": True, "caveat": f"{role}.lora is planned as full fine-tuning (LoRA's adapter state is not simulated yet): "
                                        "an upper bound; no tensor parallelism (refused with LoRA)"}
    if role == "actor" and config.actor.cpu_offload:
        return {"caveat": "actor.cpu_offload is planned as without it (offloaded weights, gradients and AdamW state are not "
                          "subtracted yet): an upper bound on the device"}
    if role in ("actor", "ref") and config.actor.fused_kernels:
        return {"caveat": "actor.fused_kernels: the Triton log-prob kernel is planned as the chunked torch path it replaces "
                          "(which casts the head to float32 per micro-batch): an upper bound"}
    return {}


__all__ = ["MAX_MICRO_BATCH_TOKENS", "MicroBatch", "RolePlan", "check_micro_batch", "config_dict", "role_plans"]
