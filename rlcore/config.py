"""Run configuration: pydantic models, YAML files and dotted command-line overrides.

Every section forbids unknown keys, so a typo (`actor.optim.lrr=1e-6`) is an error that names
the key instead of a silently ignored setting.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, get_args

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.functional_validators import BeforeValidator

from rlcore.algorithms import AlgorithmName, AlgorithmTraits, Role, names_where, traits_of
from rlcore.errors import RLCoreError
from rlcore.redact import redact_tree
from rlcore.rollout_backends import check_backend, support_problem

log = logging.getLogger(__name__)


class ConfigError(RLCoreError, ValueError):
    """A configuration problem; the message names the dotted key."""


class _Section(BaseModel):
    # allow_inf_nan=False: `actor.optim.lr=inf` (or nan) is an error at load, not an all-NaN model
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def registered_names(kind: Literal["advantage estimator", "policy loss", "KL estimator"]) -> list[str]:
    """The names rlcore.algos resolves for `kind` at run time ("advantage estimator", "policy loss",
    "KL estimator"), read when a config is validated, so names registered before loading count.
    Imported here rather than at module level: `import rlcore.config` stays free of torch."""
    from rlcore import algos

    if kind == "advantage estimator":
        return algos.advantage_estimator_names()
    if kind == "policy loss":
        return algos.policy_loss_names()
    if kind == "KL estimator":
        return list(algos.KL_KINDS)
    raise ValueError(f"no registry of {kind!r}")


def estimator_inputs(name: str) -> frozenset[str]:
    """What advantage estimator `name` reads beyond the rewards ("values": a critic's; "reward_baselines":
    ReMax's greedy baseline), as rlcore.algos registered it (imported here: see `registered_names`)."""
    from rlcore import algos

    return algos.advantage_estimator_inputs(name)


def check_registered(kind: Literal["advantage estimator", "policy loss", "KL estimator"], name: str) -> str:
    """`name` if rlcore.algos knows it as a `kind`, else an error listing the names it knows (pydantic
    prefixes the dotted key), so a typo fails at load, before any model is loaded."""
    known = registered_names(kind)
    if name not in known:
        raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(known)}")
    return name


class ModelConfig(_Section):
    path: str = Field(description="local Hugging Face model directory (no hub access)")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="compute dtype of every model: actor, reference, critic and (by default) the rollout "
        "engine. bfloat16: the trained roles (actor, critic) still keep float32 master weights, gradients and AdamW "
        "state and compute in bf16 (FSDP2-style mixed precision), unless model.pure_bf16")
    pure_bf16: bool = Field(
        False, description="with dtype bfloat16: train the bf16 weights themselves (AdamW state in bf16, no float32 "
        "master copy). Half the memory of the trained roles, but updates below bf16's resolution (~0.4% of a "
        "weight) are rounded away")
    gradient_checkpointing: bool = Field(
        False, description="actor and critic keep only each decoder layer's input in the forward and recompute the "
        "layer in the backward: activation memory of one layer instead of all, for about one more forward")
    use_remove_padding: bool = Field(
        True, description="actor, reference and critic run each micro-batch as its sequences packed into one row "
        "without pad tokens (per-sequence positions, packed-sequence attention: flash-attn varlen on CUDA when "
        "installed, causal SDPA per sequence otherwise), so the tokens computed are the real ones. false: the "
        "padded [rows, batch-wide prompt + response] forward. A model whose outputs packing would change is "
        "refused at load")
    share_prompt_prefix: bool | None = Field(
        None, description="null (default): on wherever use_remove_padding packs rows; true/false: asked for. "
        "With packing: rows of a micro-batch whose prompts are the same tokens (the "
        "rollout.n samples of a prompt, DPO's chosen and rejected) hold the prompt once in the packed row, their "
        "responses attending to it, so its forward and backward run once, not once per row; the results are the "
        "unshared ones (float tolerance). Not on the flash-attn path (CUDA bf16/fp16 with flash-attn installed), "
        "which runs every row whole. Token-budget micro-batches keep a prompt's rows together")

    @model_validator(mode="after")
    def _check_pure_bf16(self) -> ModelConfig:
        if self.pure_bf16 and self.dtype != "bfloat16":
            raise ValueError(f"model.pure_bf16=true needs model.dtype=bfloat16 (got {self.dtype})")
        if self.share_prompt_prefix and not self.use_remove_padding:
            raise ValueError("model.share_prompt_prefix=true needs model.use_remove_padding=true (prompts are shared "
                             "within a packed row)")
        return self

    @property
    def shares_prompts(self) -> bool:
        """Whether packed rows hold a prompt once for all its rows (`share_prompt_prefix` on packed rows)."""
        return self.use_remove_padding and self.share_prompt_prefix is not False


class DataConfig(_Section):
    train_files: list[str]
    val_files: list[str] = []
    max_prompt_length: int = Field(64, ge=1)
    train_batch_size: int = Field(32, ge=1, description="prompts per training step")
    val_batch_size: int = Field(256, ge=1)
    shuffle: bool = True
    apply_chat_template: bool = True
    on_bad_row: Literal["error", "skip"] = "error"
    tokenizer_check_rows: int = Field(
        32, ge=0, description="prompts per data file whose ids rlcore, the serving side (vLLM's tokenizer for a vLLM "
        "rollout, else AutoTokenizer) and the folder's tokenizer.json must agree on at start-up; 0: no check")


class OptimConfig(_Section):
    lr: float = Field(1e-6, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    grad_clip: float = Field(1.0, gt=0)


class LoraConfig(_Section):
    """LoRA adapters (the `peft` library) on a trained role's model: the base weights stay frozen and
    only the low-rank adapters train (with a value or reward head, the head too). Like verl's
    `lora_rank`, `lora_alpha` and `target_modules`."""

    rank: int = Field(0, ge=0, description="adapter rank r; 0: LoRA off (full fine-tuning)")
    alpha: float = Field(16.0, gt=0, description="the adapter's update is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input while training")
    target_modules: str | list[str] = Field(
        "all-linear", description="'all-linear' (every linear layer except the output head) or the names of the "
        "modules to adapt (e.g. [q_proj, v_proj]); a name the model lacks is an error when it is loaded")

    @field_validator("target_modules")
    @classmethod
    def _check_targets(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, str) and value != "all-linear":
            raise ValueError(f"{value!r}: expected 'all-linear' or a list of module names")
        if isinstance(value, list) and not (value and all(isinstance(v, str) and v for v in value)):
            raise ValueError("expected a non-empty list of module names")
        if isinstance(value, list) and {"lm_head", "embed_tokens"} & set(value):
            raise ValueError("LoRA on the input embeddings or the output head is not supported: the log-prob "
                             "path reads the head's weight directly (and a tied head would come untied)")
        return value

    @property
    def enabled(self) -> bool:
        return self.rank > 0


MAX_RANKS = 2**20  # ranks of one role: more than any cluster holds (the largest have ~10^5 accelerators)


def _number(n: int) -> str:
    """`n` with thousands separators, or its digit count when it would fill the line."""
    return f"{n:,}" if n < 10**15 else f"a {len(str(n))}-digit number of"


def _ranks(value: int) -> int:
    if value > MAX_RANKS:
        raise ValueError(f"{_number(value)} ranks, more than any cluster holds (at most {MAX_RANKS:,} per role)")
    return value


# A rank count: a whole number (strict: no 2.0, "2" or true), at least 1, at most MAX_RANKS.
Ranks = Annotated[int, Field(strict=True, ge=1), AfterValidator(_ranks)]


def _token_budget(value: Any) -> Any:
    """A micro-batch token budget: a whole number of tokens (at least 1) or `auto`; else one line."""
    if value is None or value == "auto":
        return value
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        text = repr(value)
        raise ValueError(f"expected a number of tokens (at least 1) or auto, got {text if len(text) <= 40 else text[:32] + '...'}")
    return value


# `*.max_tokens_per_micro_batch`: tokens, or `auto` (sized to the device by its worker, rlcore.workers.memory)
TokenBudget = Annotated[int | Literal["auto"], BeforeValidator(_token_budget)]
MICRO_BATCH_AUTO = ("auto: from the device's free memory and the model's activations per token (rlcore.workers.memory), "
                    "logged once per role, halved once if the role's first step runs out of device memory; 8,192 on a CPU")


class LayoutConfig(_Section):
    """How a role's ranks share its work: one device mesh named ("dp", "sp", "tp") whose size is the
    role's world size (the product). Tensor-parallel ranks vary fastest, then sequence-parallel ones,
    so the `sequence_parallel * tensor_parallel` consecutive ranks of a data-parallel shard receive
    the same rows. `rlcore.workers.parallel` builds the mesh and applies it (README: "Layouts")."""

    data_parallel: Ranks = Field(1, description="FSDP2 shards: groups of ranks that get different rows; the "
                               "parameters, gradients and optimizer state are sharded over data_parallel x "
                               "sequence_parallel ranks")
    sequence_parallel: Ranks = Field(1, description="Ulysses sequence parallelism: ranks that split each packed "
                                   "row along its tokens (all-to-all over attention heads); needs "
                                   "model.use_remove_padding, and the attention and key/value heads of a "
                                   "tensor-parallel rank divisible by it")
    tensor_parallel: Ranks = Field(1, description="tensor parallelism (DTensor): ranks that split every "
                                 "attention, MLP, embedding and LM-head matrix; the model's attention heads, "
                                 "key/value heads, vocabulary and intermediate size must be divisible by it")

    @model_validator(mode="after")
    def _check_world(self) -> LayoutConfig:
        if self.world_size > MAX_RANKS:
            raise ValueError(f"{self.describe()}: more than any cluster holds (at most {MAX_RANKS:,} ranks per role)")
        return self

    @property
    def world_size(self) -> int:
        return self.data_parallel * self.sequence_parallel * self.tensor_parallel

    @property
    def ranks_per_shard(self) -> int:
        """Consecutive ranks that receive the same rows (a sequence- and tensor-parallel group)."""
        return self.sequence_parallel * self.tensor_parallel

    def describe(self) -> str:
        return (f"data_parallel={self.data_parallel} x sequence_parallel={self.sequence_parallel} x "
                f"tensor_parallel={self.tensor_parallel} = {self.world_size} ranks")


def _layout_fills_legacy_keys(data: Any, section: str, sp_key: str | None, engines: bool = False) -> Any:
    """A role section's `layout` sets its `world_size` (the product; a rollout's: its engines, each
    of `tensor_parallel` ranks of vLLM's own) and Ulysses size; a legacy key given beside it must
    agree (a dumped config.yaml has both), else it is refused naming both."""
    if not isinstance(data, dict) or data.get("layout") is None:
        return data
    try:
        layout = data["layout"] if isinstance(data["layout"], LayoutConfig) else LayoutConfig.model_validate(data["layout"])
    except ValidationError:
        return data  # reported by the field's own validation, under its full key
    filled = {"world_size": layout.data_parallel if engines else layout.world_size}
    if sp_key is not None:
        filled[sp_key] = layout.sequence_parallel
    for key, value in filled.items():
        given = data.get(key)
        if given is not None and given != value:
            raise ValueError(f"{section}.{key}={given} disagrees with {section}.layout ({layout.describe()}); "
                             f"set {section}.layout alone ({section}.{key} follows from it)")
    return {**data, **filled, "layout": layout}


class ActorConfig(_Section):
    optim: OptimConfig = OptimConfig()
    ppo_epochs: int = Field(1, ge=1)
    ppo_mini_batch_size: int = Field(32, ge=1, description="prompts per optimizer step (x rollout.n samples)")
    micro_batch_size: int = Field(64, ge=1, description="samples per forward when dynamic_batch_size is off")
    dynamic_batch_size: bool = True
    max_tokens_per_micro_batch: TokenBudget = Field("auto", description=f"tokens per packed micro-batch; {MICRO_BATCH_AUTO}")
    policy_loss: str = "vanilla"
    clip_ratio_low: float = Field(0.2, ge=0)
    clip_ratio_high: float = Field(0.2, ge=0)
    clip_ratio_c: float = Field(3.0, gt=1)
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(0.001, ge=0)
    kl_loss_type: str = "k3"
    logprob_chunk_tokens: int = Field(1024, ge=1)
    fused_kernels: bool = False
    max_consecutive_bad_steps: int = Field(3, ge=1, description="NaN/inf loss or grad steps in a row before the run stops")
    tis_cap: float | None = Field(None, gt=0, description="truncated importance sampling cap for rollout/actor mismatch")
    world_size: Ranks = Field(1, description="ranks of the actor (and, unless ref.layout, the reference); FSDP2 "
                            "when > 1 (Ray backend). Set by actor.layout when that is given (its product)")
    layout: LayoutConfig | None = Field(
        None, description="data-parallel x sequence-parallel x tensor-parallel ranks of the actor (one device mesh). "
        "Default: world_size / ulysses_sequence_parallel_size data-parallel ranks, no tensor parallelism")
    ulysses_sequence_parallel_size: Ranks = Field(
        1, description="Ulysses sequence parallelism for actor and reference: each group of this many "
        "consecutive ranks gets the same rows and splits every packed micro-batch along its tokens, with an "
        "all-to-all over attention heads around attention, so a rank holds 1/size of a long sequence's "
        "activations. Must divide actor.world_size (data-parallel ranks: world_size / size), the model's "
        "attention heads, and its key/value heads (or be a multiple of them: they are repeated); needs "
        "model.use_remove_padding")
    weight_sync_bucket_mb: float = Field(64.0, gt=0, description="weights go to the rollout engine in buckets of this size")
    mixed_precision: Literal["none", "bf16"] = Field(
        "none", description="bf16: the actor computes in bf16 (parameters cast per forward, fp32 gradient reduction) "
        "over float32 master weights, gradients and AdamW state, at any world size (FSDP2's policy with a process "
        "group, the same casts in one process without); reference and critic follow model.dtype. "
        "model.dtype=bfloat16 implies it")
    recompute_old_log_prob: Literal["auto", "always"] = Field(
        "auto", description="auto: skip the no-grad forward that recomputes old log-probs when a step is exactly "
        "on-policy (trainer.off_policy=sync, actor.ppo_epochs=1, data.train_batch_size == actor.ppo_mini_batch_size, "
        "algorithm.use_kl_in_reward off; GRPO and PPO): the update's own forward, detached, gives them (ratio 1, as "
        "TRL does), and entropy, KL and rollout/logprob_diff_* are still reported from it. always: run the pass "
        "every step (the update is the same)")
    cpu_offload: bool = Field(
        False, description="keep the actor's master weights, gradients and AdamW state in host memory and step "
        "AdamW there; parameters are copied to the GPU for each forward (FSDP2's CPUOffloadPolicy, or the same "
        "per-module copies in one process). Needs a CUDA device: refused with trainer.device=cpu")
    cast_once: Literal["auto"] | bool = Field(
        "auto", description="make the weights' compute copies (bf16 under mixed precision, on the GPU with CPU offload, "
        "FSDP2's gathered parameters) once per optimizer step and keep them across its micro-batches, instead of again "
        "for every micro-batch (with FSDP2, for its forward and again for its backward); gradients are the same. auto: "
        "on where the step's peak holds them all anyway: in one process or on a one-rank FSDP2 group without CPU "
        "offload, and without gradient checkpointing; off on FSDP2 over more ranks, where each rank would hold the "
        "whole model's copies for the step (true asks for that)")
    compile: Literal["auto"] | bool = Field(
        "auto", description="torch.compile each decoder layer (regional compilation, dynamic shapes so packed rows "
        "of any length reuse one graph): auto: on for a CUDA device (falling back to eager, with a warning, if "
        "compiling fails), off on the CPU, with tensor parallelism and with actor.liger_kernel (measured no faster "
        "on CPU: benchmarks/bench_update.py); true: compile anywhere, failures raise")
    liger_kernel: bool = Field(
        False, description="Liger Kernel's fused Triton RMSNorm, SwiGLU MLP and RoPE in the actor's model (the "
        "architecture's RoPE module-wide, so the reference and an in-process hf engine get it too); the log-prob head "
        "stays rlcore's. Needs a CUDA device and the liger-kernel package (pip install 'rlcore[liger]')")
    lora: LoraConfig = Field(LoraConfig(), description="LoRA on the actor; the reference is then the actor's own "
                             "base model with the adapter disabled (no second copy)")

    @model_validator(mode="before")
    @classmethod
    def _from_layout(cls, data: Any) -> Any:
        return _layout_fills_legacy_keys(data, "actor", "ulysses_sequence_parallel_size")

    @field_validator("policy_loss")
    @classmethod
    def _known_policy_loss(cls, name: str) -> str:
        return check_registered("policy loss", name)

    @field_validator("kl_loss_type")
    @classmethod
    def _known_kl_loss_type(cls, name: str) -> str:
        return check_registered("KL estimator", name)


class VLLMEngineConfig(_Section):
    """Engine settings of the `vllm` rollout backend; None picks vLLM's / the backend's default."""

    max_model_len: int | None = Field(None, ge=1, description="default: the model's max_position_embeddings")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="tokens per engine step (prefill chunk size)")
    max_num_seqs: int | None = Field(None, ge=1, description="sequences decoded at once")
    enforce_eager: bool | None = Field(None, description="default: True on CPU, False (CUDA graphs) on GPU")
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="GPU: fraction of the card for weights + KV cache")
    kv_cache_gib: float | None = Field(None, gt=0, description="KV cache size; default 1 GiB on CPU, from gpu_memory_utilization on GPU")
    enable_prefix_caching: bool = True
    enable_sleep_mode: bool | None = Field(None, description="default: on for GPU (sleep/wake free memory), off on CPU (unsupported)")
    block_size: int | None = Field(None, ge=1, description="KV cache block (tokens); default 32 on CPU (short RL contexts), vLLM's own on GPU")
    weight_bucket_mb: float = Field(256.0, gt=0, description="max size of one reload_weights call during a weight sync")
    extra: dict[str, Any] = Field(default_factory=dict, description="passed verbatim to vllm.LLM(...)")


class AgentConfig(_Section):
    """Multi-turn agent rollouts (`rlcore.rollout.agent`): on when `tools` or `interaction` is set.
    The model calls tools in the hermes format (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`)
    and reads their results as `tool` messages rendered by the chat template; tool outputs and
    template tokens are attended to but masked out of the loss. `rollout.max_new_tokens` caps each
    assistant turn."""

    tools: list[str] = Field([], description="tool functions, 'module:function' or 'path/to/file.py:function', each "
                             "with an OpenAI-style JSON schema (its tool_schema attribute, or read from its type hints "
                             "and docstring); run in sandboxed worker processes")
    interaction: str | None = Field(None, description="'module:Factory' or 'file.py:Factory': called per sample with "
                                    "data_source, ground_truth, extra_info; its respond(messages) answers each assistant "
                                    "turn without a tool call (InteractionReply: content, done, reward)")
    max_turns: int = Field(4, ge=1, description="assistant turns per sample")
    max_total_tokens: int = Field(256, ge=2, description="a sample's whole response: every assistant turn, tool output "
                                  "and template token after the prompt")
    tool_timeout_s: float = Field(10.0, gt=0, description="longest a tool call may run; then it is killed and the model "
                                  "reads a timeout error")
    tool_memory_mb: float | None = Field(1024.0, gt=0, description="memory a tool call may allocate (RLIMIT_AS over what "
                                         "the loaded tools use); beyond it the call fails with MemoryError. None: no limit")
    tool_workers: int = Field(2, ge=1, description="tool worker processes per rollout rank (calls run in parallel)")
    tool_max_chars: int = Field(2000, ge=1, description="a longer tool result is cut to this many characters")

    @property
    def enabled(self) -> bool:
        return bool(self.tools) or self.interaction is not None

    @model_validator(mode="after")
    def _check_used(self) -> AgentConfig:
        """A setting that would change nothing is refused (compared with the defaults, so a dumped
        config.yaml of a run without agent loads again)."""
        changed = sorted(k for k, f in type(self).model_fields.items() if getattr(self, k) != f.get_default(call_default_factory=True))
        if not self.enabled:
            if changed:
                raise ValueError(f"{changed[0]} is set, but the agent loop is off: set rollout.agent.tools or "
                                 "rollout.agent.interaction")
        elif not self.tools:
            tool_keys = [k for k in changed if k.startswith("tool_")]
            if tool_keys:
                raise ValueError(f"{tool_keys[0]} is set, but rollout.agent.tools is empty")
        return self


class RolloutConfig(_Section):
    backend: str = Field("auto", description="a rollout backend (rlcore.rollout_backends): hf, vllm, one registered with "
                         "rlcore.rollout.register_backend, or 'module:Class' of an engine class. auto: vllm where "
                         "installed, else hf")
    dtype: Literal["float32", "bfloat16"] | None = Field(
        None, description="rollout engine dtype; default model.dtype. bfloat16 is what GPU rollouts run (and is ~1.7x "
        "faster on AMX CPUs); the actor still recomputes log-probs in model.dtype, rollout/logprob_diff_* shows the gap "
        "and actor.tis_cap corrects for it")
    world_size: Ranks = Field(1, description="rollout engines (data parallel; Ray backend); set by rollout.layout "
                            "when that is given (its data_parallel)")
    layout: LayoutConfig | None = Field(
        None, description="data_parallel: rollout engines (Ray workers), each serving a share of the prompts; "
        "tensor_parallel: ranks of each vLLM engine (vLLM's tensor_parallel_size; on CPU each engine rank gets its "
        "worker's cores as VLLM_CPU_OMP_THREADS_BIND). sequence_parallel must be 1. Default: world_size engines, "
        "tensor_parallel 1")
    n: int = Field(8, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    max_new_tokens: int = Field(32, ge=1)
    val_n: int = Field(1, ge=1, description="samples per validation prompt; > 1 reports mean@n, pass@n and maj@n per data_source")
    val_temperature: float = Field(1.0, gt=0)
    val_greedy: bool | None = Field(None, description="default: greedy when val_n is 1, sampled when val_n > 1")
    vllm: VLLMEngineConfig = VLLMEngineConfig()
    agent: AgentConfig = AgentConfig()
    lora_sync: Literal["auto", "merged", "adapter"] = Field(
        "auto", description="with actor.lora: how the trained weights reach the engine. merged: the merged weights "
        "of the adapted modules only (the rest never changes); adapter: the adapter itself, which vLLM applies per "
        "request (vllm backend only). auto: merged")
    sleep: Literal["auto", "always", "never"] = Field(
        "auto", description="the engine sleeps (its weights and KV cache off the GPU) from after generation until the "
        "weight sync. auto: only where it shares a GPU with the actor (in-process on CUDA, or one GPU pool on Ray) and "
        "the update would not fit beside it: the first step sleeps and measures the update's peak, later steps keep "
        "the engine awake when that peak, the engine and a 10% margin fit the device (logged once, with the numbers). "
        "always / never force it (on a CPU sleeping is a no-op). Older spelling: free_memory_when_idle (true: always, "
        "false: never)")

    @model_validator(mode="before")
    @classmethod
    def _older_sleep_spelling(cls, data: Any) -> Any:
        """`rollout.free_memory_when_idle`, the older spelling of `rollout.sleep`, read as it (true:
        always, false: never) with a note; null (a dumped config of an older run) as the default."""
        if not isinstance(data, dict) or "free_memory_when_idle" not in data:
            return data
        data = dict(data)
        old = data.pop("free_memory_when_idle")
        if old is None:
            return data
        if "sleep" in data:
            raise ValueError("free_memory_when_idle and sleep are the same setting (the first its older spelling); give "
                             "sleep alone")
        if not isinstance(old, bool):
            raise ValueError(f"free_memory_when_idle (the older spelling of rollout.sleep): expected true or false, got "
                             f"{str(old)[:40]!r}; use rollout.sleep: auto, always or never")
        data["sleep"] = "always" if old else "never"
        log.warning("rollout.free_memory_when_idle=%s is the older spelling of rollout.sleep: read as rollout.sleep=%s",
                    str(old).lower(), data["sleep"])
        return data

    @model_validator(mode="before")
    @classmethod
    def _from_layout(cls, data: Any) -> Any:
        return _layout_fills_legacy_keys(data, "rollout", None, engines=True)

    @model_validator(mode="after")
    def _check_layout(self) -> RolloutConfig:
        if self.layout is not None and self.layout.sequence_parallel != 1:
            raise ValueError(f"rollout.layout.sequence_parallel={self.layout.sequence_parallel}: rollout engines split "
                             "a model by tensor parallelism only (rollout.layout.tensor_parallel)")
        problem = None if self.backend == "auto" else support_problem(self.backend, self.tensor_parallel_size, "full")
        if problem is not None:  # auto: the rollout worker checks what it resolves to
            raise ValueError(problem)
        return self

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, name: str) -> str:
        return check_backend(name)

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks of each rollout engine (vLLM's tensor_parallel_size)."""
        return 1 if self.layout is None else self.layout.tensor_parallel


class CriticConfig(_Section):
    model_path: str | None = Field(None, description="defaults to the actor model")
    optim: OptimConfig = OptimConfig(lr=1e-5)
    ppo_epochs: int = Field(1, ge=1)
    ppo_mini_batch_size: int | None = Field(None, ge=1, description="prompts per critic optimizer step; default: actor's")
    micro_batch_size: int | None = Field(None, ge=1, description="samples per forward without dynamic batching; default: actor's")
    dynamic_batch_size: bool | None = Field(None, description="pack micro-batches by token budget; default: actor's")
    max_tokens_per_micro_batch: TokenBudget | None = Field(None, description="tokens per packed micro-batch (or auto, "
                                                           "sized on the critic's device); default: actor's")
    cliprange_value: float = Field(0.5, gt=0)
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    world_size: Ranks = Field(1, description="ranks of the critic; FSDP2 when > 1 (Ray backend); set by "
                            "critic.layout when that is given")
    layout: LayoutConfig | None = Field(
        None, description="data-parallel x sequence-parallel x tensor-parallel ranks of the critic (see actor.layout). "
        "Default: world_size / its Ulysses size data-parallel ranks, no tensor parallelism")
    ulysses_sequence_parallel_size: Ranks | None = Field(
        None, description="the critic's Ulysses sequence-parallel size (see actor.ulysses_sequence_parallel_size); "
        "default: the actor's. Must divide critic.world_size")
    lora: LoraConfig = Field(LoraConfig(), description="LoRA on the critic (its value head trains in full)")

    @model_validator(mode="before")
    @classmethod
    def _from_layout(cls, data: Any) -> Any:
        return _layout_fills_legacy_keys(data, "critic", "ulysses_sequence_parallel_size")


class RewardConfig(_Section):
    function: str | None = Field(None, description="'module:function' or 'file.py:function'; default: by data_source")
    num_workers: int = Field(2, ge=0)
    timeout_s: float = Field(10.0, gt=0)
    error_score: float = Field(0.0, description="the score of a call that raised, returned no number or timed out")
    max_error_fraction: float = Field(
        0.1, ge=0, le=1, description="a batch (a training step's samples, or a validation batch) in which more than "
        "this share of reward calls failed stops the run, the errors counted, instead of training on error_score; "
        "1: never stop")
    clip: float | None = Field(
        1e4, gt=0, description="a score beyond ±clip is clipped to it and counted (reward/clipped), so one huge "
        "reward cannot overflow float32 or swamp its group's advantages; None: clip only at float32's range")

    @model_validator(mode="after")
    def _check_error_score(self) -> RewardConfig:
        if self.clip is not None and abs(self.error_score) > self.clip:
            raise ValueError(f"reward.error_score={self.error_score:g} lies beyond reward.clip={self.clip:g}")
        return self


class RewardModelConfig(_Section):
    """The reward model: a sequence classifier (transformers `AutoModelForSequenceClassification`,
    one label) scoring each whole conversation, on its own worker group (role `reward_model`).

    RL runs (GRPO, PPO) score their samples with the model at `path` when it is set: each sample's
    prompt messages and decoded response are rendered with the reward model's own tokenizer and
    chat template, never by re-using the policy's token ids. `algorithm.name: rm` trains one from
    `model.path` on pairwise preference rows (the Bradley-Terry loss) and saves it as an HF folder."""

    path: str | None = Field(None, description="a trained reward model folder (sequence classifier, 1 label) that RL "
                             "runs score with; none: rewards are the rule scorer's alone")
    weight: float = Field(1.0, ge=0, description="weight of the (normalised, clipped) reward-model score in the reward")
    rule_weight: float = Field(0.0, ge=0, description="weight of the rule scorer's score in the reward (0: the reward is "
                               "the reward model's alone; the rule scorer still gives acc and reward_model/rule_agreement)")
    normalize: bool = Field(True, description="standardise scores by the running mean/std of every training score seen "
                            "(kept in checkpoints)")
    clip: float | None = Field(5.0, gt=0, description="the normalised score is clipped to ±clip (counted as "
                               "reward_model/clipped); none: no clip")
    max_length: int = Field(1024, ge=2, description="tokens of a rendered conversation; a longer one keeps its end (where "
                            "the score is read) and is counted as reward_model/truncated")
    on_nonfinite: Literal["error", "skip"] = Field(
        "error", description="a NaN/inf score: stop with an error naming the sample, or skip: the sample is counted "
        "(reward_model/nonfinite), left out of the update (its response mask zeroed) and its reward set to the "
        "batch's mean reward, so it moves no group baseline")
    overlap: bool = Field(True, description="launch scoring before the old log-probs and the critic's values and wait "
                          "for it after them (on Ray with its own pool they run at once); false: score first")
    micro_batch_size: int = Field(64, ge=1, description="sequences per forward without dynamic batching")
    dynamic_batch_size: bool = True
    max_tokens_per_micro_batch: TokenBudget = Field("auto", description=f"tokens per packed micro-batch; {MICRO_BATCH_AUTO}")
    world_size: Ranks = Field(1, description="ranks of the reward model (Ray backend); FSDP2 when training with "
                            "> 1; set by reward_model.layout when that is given")
    layout: LayoutConfig | None = Field(
        None, description="data-parallel x tensor-parallel ranks of the reward model (scoring and training; see "
        "actor.layout; sequence_parallel must be 1). Default: world_size data-parallel ranks")
    # training (algorithm.name: rm)
    optim: OptimConfig = OptimConfig(lr=1e-5)
    margin: float = Field(0.0, ge=0, description="training: chosen must outscore rejected by this; a row's own "
                          "`margin` field takes precedence")
    mini_batch_size: int | None = Field(None, ge=1, description="training: pairs per optimizer step; default "
                                        "data.train_batch_size (one step per batch)")
    max_consecutive_bad_steps: int = Field(3, ge=1, description="training: NaN/inf loss or grad steps in a row before "
                                           "the run stops")
    lora: LoraConfig = Field(LoraConfig(), description="training: LoRA on the reward model's backbone (its score head "
                             "trains in full); checkpoints hold the adapter, the pipeline registers base + adapter merged")

    # the settings that only mean something when RL runs score with a reward model
    SCORING_KEYS: ClassVar[tuple[str, ...]] = ("weight", "rule_weight", "normalize", "clip", "on_nonfinite", "overlap")
    TRAINING_KEYS: ClassVar[tuple[str, ...]] = ("optim", "margin", "mini_batch_size", "max_consecutive_bad_steps", "lora")

    @model_validator(mode="before")
    @classmethod
    def _from_layout(cls, data: Any) -> Any:
        return _layout_fills_legacy_keys(data, "reward_model", None)

    @model_validator(mode="after")
    def _check_layout(self) -> RewardModelConfig:
        if self.layout is not None and self.layout.sequence_parallel != 1:
            raise ValueError(f"reward_model.layout.sequence_parallel={self.layout.sequence_parallel}: the reward model "
                             "scores whole sequences without sequence parallelism; use data_parallel or tensor_parallel")
        return self


class RefConfig(_Section):
    """The reference model's worker group (KL and the preference losses)."""

    layout: LayoutConfig | None = Field(
        None, description="data-parallel x sequence-parallel x tensor-parallel ranks of the reference (see "
        "actor.layout); default: the actor's. Its own world size makes it a group of its own on Ray (it cannot then "
        "be colocated with the actor)")


class KLControlConfig(_Section):
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = Field(0.001, ge=0)
    target_kl: float = Field(0.1, gt=0)
    horizon: int = Field(10000, ge=1)


class AlgorithmConfig(_Section):
    name: AlgorithmName = Field(
        "grpo", description="the control flow: grpo (and its critic-free relatives), ppo, dpo, kto, or rm (train a "
        "reward model on pairwise preference rows)")
    adv_estimator: str = "grpo"
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(1.0, ge=0, le=1)
    norm_adv_by_std: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "k1"
    kl_ctrl: KLControlConfig = KLControlConfig()
    use_reference: bool | None = Field(None, description="default: on when any KL term is used")

    @field_validator("adv_estimator")
    @classmethod
    def _known_adv_estimator(cls, name: str) -> str:
        return check_registered("advantage estimator", name)

    @field_validator("kl_penalty")
    @classmethod
    def _known_kl_penalty(cls, name: str) -> str:
        return check_registered("KL estimator", name)


def _differs_from_default(section: BaseModel, key: str) -> bool:
    """`section.key` is not its field's default: a setting the user made. By value, not by
    `model_fields_set`, so a config dumped and loaded again (as the flows pass it) reads the same."""
    field = type(section).model_fields[key]
    default = field.get_default(call_default_factory=True)
    return bool(getattr(section, key) != default)


class PreferenceConfig(_Section):
    """Offline preference optimisation (algorithm.name dpo or kto). data.train_files / val_files then
    hold preference rows (rlcore.data.preference: pairwise for DPO, unpaired for KTO; validation
    files may be pairwise for both, which gives held-out preference accuracy)."""

    loss_type: Literal["sigmoid", "ipo", "robust"] = Field("sigmoid", description="DPO loss (sigmoid + label_smoothing = cDPO)")
    beta: float = Field(0.1, gt=0)
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="DPO sigmoid/robust: assumed label-flip rate")
    desirable_weight: float = Field(1.0, gt=0, description="KTO")
    undesirable_weight: float = Field(1.0, gt=0, description="KTO")
    max_response_length: int = Field(64, ge=1, description="completions longer than this (tokens, EOS included) are dropped")
    ref_cache: bool = Field(True, description="reference log-probs computed once per dataset, cached by fingerprint")
    ref_cache_dir: str | None = Field(None, description="default: <trainer.output_dir>/ref_cache")
    task_val_files: list[str] = Field([], description="RL-schema prompts whose greedy accuracy (val/acc) is measured at validation")


class TrainerConfig(_Section):
    total_steps: int = Field(20, ge=1)
    seed: int = 0
    output_dir: str = "runs/default"
    save_every: int = Field(10, ge=1)
    keep_last: int = Field(2, ge=1)
    val_every: int = Field(10, ge=1)
    val_before_train: bool = True
    resume: str = Field("auto", description="'auto' (newest complete checkpoint), 'disable', or a checkpoint path")
    loggers: list[Literal["console", "jsonl", "mlflow"]] = Field(
        ["console", "jsonl"], description="mlflow: one MLflow run per training run (tracking.mlflow_uri), kept across resumes"
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    backend: Literal["inprocess", "ray"] = Field("inprocess", description="where workers run: this process, or Ray actors")
    off_policy: Literal["sync", "one_step"] = Field(
        "sync",
        description="one_step: generate step k+1's samples (with the weights before step k's update, staleness 1) "
        "while step k's update runs; GRPO and PPO (not DPO/KTO: nothing to overlap)",
    )
    device_peak_tflops: float | None = Field(
        None, gt=0, description="dense peak TFLOP/s of one device at the compute dtype, for throughput/<phase>_mfu; "
        "default: detected for known NVIDIA GPUs (bf16 tensor-core peak, rlcore.flops), none on CPU (no MFU reported)")
    overlap_with: Literal["thread", "process"] = Field(
        "thread", description="trainer.backend=inprocess with trainer.off_policy=one_step: where the rollout worker runs "
        "while the actor trains. thread: a thread of this process (torch ops release the GIL; no start-up, no copies, a "
        "breakpoint in the rollout stops here); process: a child process (no GIL shared with the trainer; ~4 s to start, "
        "batches and weights pickled across). The cores are split between it and the training thread either way")
    trace: bool = Field(True, description="write trace.jsonl in the run dir: per step, phase timings, workers, and every "
                        "sample; and val_trace.jsonl: per validation, every validation sample")
    trace_samples: int = Field(4, ge=0, description="trajectories per step, and per validation, (evenly spread over the "
                               "batch) whose conversation trace.jsonl (val_trace.jsonl) records: the prompt, the model's text of every turn, "
                               "each tool call's arguments and result (the response, without an agent); `rlcore trace "
                               "RUN_DIR [--validation]` prints one. 0: none")
    trace_max_chars: int = Field(2000, ge=16, description="each text of a recorded conversation is cut to this many "
                                 "characters, after the secrets in it are redacted (rlcore.redact)")

    @model_validator(mode="after")
    def _check_trace(self) -> TrainerConfig:
        """A trace setting is refused when trace.jsonl is off (it would change nothing); compared with
        the defaults, so a dumped config.yaml loads again."""
        if not self.trace:
            for key in ("trace_samples", "trace_max_chars"):
                if _differs_from_default(self, key):
                    raise ValueError(f"{key} is set, but trainer.trace is off (no trace.jsonl is written)")
        return self


ROLES: tuple[Role, ...] = get_args(Role)


RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


class RayPoolConfig(_Section):
    """A placement group: one bundle per rank of the largest group placed on it. `strategy` spreads
    the bundles over nodes (STRICT_SPREAD: one node each); `resources` and `label_selector` say
    which nodes may hold them (every bundle alike)."""

    cpus_per_bundle: float = Field(1.0, ge=0)
    gpus_per_bundle: float = Field(0.0, ge=0)
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    resources: dict[str, float] = Field(
        {}, description="custom resources each bundle reserves, e.g. {node_a: 1}: only nodes started with them "
        "(`ray start --resources '{\"node_a\": 2}'`) hold the pool")
    label_selector: dict[str, str] = Field(
        {}, description="node labels each bundle's node must match (Ray's label selectors: 'v', '!v', 'in(a,b)', "
        "'!in(a,b)'), e.g. {pool: train} for nodes started with `ray start --labels pool=train`")

    @field_validator("resources")
    @classmethod
    def _custom_resources_only(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in RAY_BUILTIN_RESOURCES:
                raise ValueError(f"{name!r} is set by cpus_per_bundle/gpus_per_bundle (or not per bundle), not here")
            if not amount > 0:
                raise ValueError(f"{name!r}: the amount must be > 0, got {amount}")
        return value

    @field_validator("label_selector")
    @classmethod
    def _valid_label_selector(cls, value: dict[str, str]) -> dict[str, str]:
        """Checked with Ray's own validator (imported only when a selector is given)."""
        if value:
            try:
                from ray._private.label_utils import validate_label_selector
            except ImportError:  # no Ray (or another layout): Ray checks it when the pool is made
                return value
            error = validate_label_selector(value)
            if error:
                raise ValueError(error)
        return value


class RayConfig(_Section):
    """Where the Ray backend runs workers (trainer.backend=ray)."""

    address: str | None = Field(None, description="existing cluster ('auto', 'host:port' of its head's GCS); none: "
                                "$RAY_ADDRESS when set (as inside a Ray job), else start a local one")
    num_cpus: float | None = Field(None, gt=0, description="local cluster only; default: this machine's cores (Ray's "
                                   "count); more lets more ranks than cores run, sharing them")
    temp_dir: str | None = Field(None, description="local cluster's temp/session folder (keep it short: socket paths)")
    pools: dict[str, RayPoolConfig] = {"default": RayPoolConfig()}
    roles: dict[str, str] = Field({}, description="role -> pool name; roles not listed use the pool 'default'")
    colocate: list[list[str]] = Field([], description="roles sharing one process per rank, e.g. [[actor, ref]]")
    call_timeout_s: float | None = Field(3600.0, gt=0, description="longest a worker call may run before it is an error")
    init_timeout_s: float = Field(600.0, gt=0, description="longest worker start-up (import, model load, rendezvous)")

    @model_validator(mode="after")
    def _check_names(self) -> RayConfig:
        for role, pool in self.roles.items():
            if role not in ROLES:
                raise ValueError(f"ray.roles: unknown role {role!r} (roles: {list(ROLES)})")
            if pool not in self.pools:
                raise ValueError(f"ray.roles.{role}: unknown pool {pool!r} (pools: {list(self.pools)})")
        seen: set[str] = set()
        for group in self.colocate:
            for role in group:
                if role not in ROLES:
                    raise ValueError(f"ray.colocate: unknown role {role!r} (roles: {list(ROLES)})")
                if role in seen:
                    raise ValueError(f"ray.colocate: role {role!r} is in two colocated sets")
                seen.add(role)
            if len({self.pool_of(r) for r in group}) > 1:
                raise ValueError(f"ray.colocate: {group} must map to one pool in ray.roles")
        return self

    def pool_of(self, role: str) -> str:
        return self.roles.get(role, "default")


class HealthConfig(_Section):
    """Run-health limits checked after every training step of every run, `rlcore train` and the
    pipeline alike (None switches a check off; `enabled: false` all of them).

    `max_kl` reads `actor/kl` (present only when a reference model is used; nats per token, the
    same unit whatever the reward's scale), `min_entropy` reads `actor/entropy`. The jump checks
    scale with the run: `reward_jump_sigmas` stops a step whose `reward/mean` moved by more than
    that many times the spread of the last `jump_window` steps' rewards (every sample's reward in
    those steps together), `kl_jump_sigmas` the same for `actor/kl` (per-sequence KL); both are off
    for the first `jump_window` steps and while that spread is 0. `max_reward_jump` is an absolute
    limit on the reward's move, off by default (set it when the reward's scale is known).
    `max_param_norm_growth` compares the actor's parameter norm `actor/param_norm` of consecutive
    steps (and a non-finite weight or optimizer state always stops the run)."""

    enabled: bool = True
    max_kl: float | None = Field(1.0, gt=0, description="KL to the reference above this stops the run")
    min_entropy: float | None = Field(0.01, ge=0, description="policy entropy below this (collapse) stops the run")
    max_reward_jump: float | None = Field(None, gt=0, description="|reward/mean change| between consecutive steps above "
                                          "this stops the run (absolute, in the reward's units; off by default: "
                                          "reward_jump_sigmas scales with the run)")
    reward_jump_sigmas: float | None = Field(
        3.0, gt=0, description="reward/mean moving by more than this many times the spread of the last jump_window "
        "steps' rewards in one step stops the run (a reward exploit found, a collapse)")
    kl_jump_sigmas: float | None = Field(
        6.0, gt=0, description="actor/kl moving by more than this many times the spread of the last jump_window "
        "steps' per-sequence KL in one step stops the run (the policy lurching away)")
    jump_window: int = Field(5, ge=1, description="steps whose spread is the jump checks' baseline; the checks start "
                             "after this many steps")
    max_param_norm_growth: float | None = Field(
        2.0, gt=1, description="the actor's parameter norm growing by more than this factor in one step stops the run")


class TrackingConfig(_Section):
    """Where runs are recorded (MLflow)."""

    mlflow_uri: str | None = Field(None, description="tracking URI; default: sqlite:///<working dir>/mlflow.db")
    experiment: str = "rlcore"
    log_model: bool = Field(True, description="log the final model folder as a run artifact")
    run_id: str | None = Field(None, description="with the mlflow logger: log each step into this existing MLflow "
                               "run, which its owner ends (the pipeline's train stage); default: a run per run folder")


class RegistryConfig(_Section):
    """The MLflow registered model and the promotion gate (see rlcore.lifecycle.gate)."""

    model_name: str = "rlcore-tiny"
    metric: Literal["accuracy", "mean_reward", "pairwise_accuracy"] = Field(
        "accuracy", description="what the gate compares; pairwise_accuracy: a reward model's held-out preference accuracy")
    promotion_margin: float = Field(0.01, description="candidate must beat the champion by at least this (negative: may be slightly worse)")
    max_kl: float = Field(0.5, gt=0, description="KL budget: mean per-token KL of the candidate to the reference model")
    max_length_ratio: float = Field(1.5, gt=0, description="length budget: candidate mean response length / champion's")
    warm_start: bool = Field(True, description="train from the current champion when there is one")
    webhook_url: str | None = Field(None, description="POSTed a JSON summary on promotion, rejection, health stop and "
                                    "failure (pipeline and `rlcore train`), and when `rlcore train` finishes")


class Config(_Section):
    model: ModelConfig
    data: DataConfig
    actor: ActorConfig = ActorConfig()
    rollout: RolloutConfig = RolloutConfig()
    critic: CriticConfig = CriticConfig()
    reward: RewardConfig = RewardConfig()
    reward_model: RewardModelConfig = RewardModelConfig()
    ref: RefConfig = RefConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    trainer: TrainerConfig = TrainerConfig()
    health: HealthConfig = HealthConfig()
    tracking: TrackingConfig = TrackingConfig()
    registry: RegistryConfig = RegistryConfig()
    ray: RayConfig = RayConfig()
    preference: PreferenceConfig = PreferenceConfig()

    @model_validator(mode="after")
    def _check_preference(self) -> Config:
        if self.traits.reference == "always" and self.algorithm.use_reference is False:
            raise ValueError(f"algorithm.use_reference=false: {self.algorithm.name} needs the reference model")
        kl_terms = [k for k, on in (("actor.use_kl_loss", self.actor.use_kl_loss),
                                    ("algorithm.use_kl_in_reward", self.algorithm.use_kl_in_reward)) if on]
        if self.algorithm.use_reference is False and kl_terms:
            raise ValueError(f"algorithm.use_reference=false, but {' and '.join(kl_terms)} need the reference model")
        unread = [k for k in type(self.preference).model_fields
                  if k not in self.traits.preference_keys and _differs_from_default(self.preference, k)]
        if unread:
            readers = [n for n in names_where() if unread[0] in traits_of(n).preference_keys]
            raise ValueError(f"preference.{unread[0]}: algorithm.name={self.traits.name} does not read it"
                             + (f" (a setting of {' and '.join(readers)})" if readers else ""))
        if self.preference.loss_type == "ipo" and self.preference.label_smoothing:
            raise ValueError("preference.label_smoothing applies to loss_type sigmoid or robust, not ipo")
        return self

    @model_validator(mode="after")
    def _check_consistency(self) -> Config:
        traits, rm_batch = self.traits, self.reward_model.mini_batch_size
        if "reward_model" in traits.trains and rm_batch is not None and self.data.train_batch_size % rm_batch:
            raise ValueError(f"data.train_batch_size ({self.data.train_batch_size}) must be a multiple of "
                             f"reward_model.mini_batch_size ({rm_batch})")
        if traits.trains_policy and self.data.train_batch_size % self.actor.ppo_mini_batch_size:
            raise ValueError(
                f"data.train_batch_size ({self.data.train_batch_size}) must be a multiple of "
                f"actor.ppo_mini_batch_size ({self.actor.ppo_mini_batch_size})"
            )
        estimator = self.algorithm.adv_estimator
        reads_values = "values" in estimator_inputs(estimator)
        if traits.generates and traits.critic and not reads_values:
            raise ValueError(f"algorithm.adv_estimator={estimator!r} reads no values: algorithm.name={traits.name} trains "
                             f"a critic for an estimator that does (gae)")
        if traits.generates and not traits.critic and reads_values:
            raise ValueError(f"algorithm.adv_estimator {estimator!r} needs a critic: use algorithm.name="
                             f"{' or '.join(names_where(generates=True, critic=True))}")
        if self.trainer.backend == "inprocess":
            for key, ws in (("actor", self.actor.world_size), ("critic", self.critic.world_size), ("rollout", self.rollout.world_size),
                            ("reward_model", self.reward_model.world_size)):
                if ws > 1:
                    what = f"{key}.layout ({getattr(self, key).layout.describe()})" if getattr(self, key).layout else f"{key}.world_size={ws}"
                    raise ValueError(f"{what} needs trainer.backend=ray (the in-process backend runs one rank)")
        if self.trainer.backend == "ray" and "default" not in self.ray.pools:
            unmapped = [r for r in self.present_roles if r not in self.ray.roles]
            if unmapped:
                raise ValueError(f"ray.pools: roles {unmapped} use pool 'default', which is not defined")
        return self

    @model_validator(mode="after")
    def _check_agent(self) -> Config:
        if self.rollout.agent.enabled and not self.traits.generates:
            raise ValueError(f"rollout.agent: the {self.algorithm.name!r} control flow generates nothing (agent rollouts "
                             f"need algorithm.name {' or '.join(names_where(generates=True))})")
        return self

    @model_validator(mode="after")
    def _check_off_policy(self) -> Config:
        if self.trainer.off_policy != "sync" and not self.traits.generates:
            raise ValueError(f"trainer.off_policy={self.trainer.off_policy!r} is not supported by the "
                             f"{self.algorithm.name!r} control flow (no generation to overlap); use trainer.off_policy=sync")
        if self.trainer.off_policy == "one_step" and self.rollout.sleep == "always":
            raise ValueError("rollout.sleep=always with trainer.off_policy=one_step: the engine generates the "
                             "next batch while the actor trains, so it cannot sleep then (each sleep would wait for that "
                             "generation and undo the overlap); unset one of them")
        return self

    @model_validator(mode="after")
    def _check_validation_sampling(self) -> Config:
        if self.rollout.val_greedy and self.rollout.val_n > 1:
            raise ValueError(f"rollout.val_greedy=true with rollout.val_n={self.rollout.val_n}: every sample would be the "
                             "same greedy answer (pass@n = accuracy); set rollout.val_greedy=false or val_n=1")
        return self

    @model_validator(mode="after")
    def _check_sequence_parallel(self) -> Config:
        roles = [("actor", self.actor.ulysses_sequence_parallel_size, self.actor.world_size)]
        if self.traits.critic:
            roles.append(("critic", self.critic_sequence_parallel_size, self.critic.world_size))
        for role, sp, ws in roles:
            key = f"{role}.layout.sequence_parallel" if getattr(self, role).layout is not None else f"{role}.ulysses_sequence_parallel_size"
            if ws % sp:
                default = " (default: the actor's)" if role == "critic" and self.critic.ulysses_sequence_parallel_size is None else ""
                raise ValueError(f"{key}={sp}{default} does not divide {role}.world_size={ws}: each sequence-parallel "
                                 f"group is {sp} of the {role}'s ranks")
        for role in self.trained_roles:
            sp = self.layout_of(role).sequence_parallel
            if sp > 1 and not self.model.use_remove_padding:
                raise ValueError(f"{self.layout_key(role, 'sequence_parallel')}={sp} needs model.use_remove_padding=true: "
                                 "sequence parallelism splits the packed row of a micro-batch along its tokens")
        return self

    @model_validator(mode="after")
    def _check_layouts(self) -> Config:
        """Layouts of roles this run does not have are refused (they would be ignored); tensor
        parallelism with LoRA is refused; several ranks need the Ray backend."""
        roles = set(self.present_roles)
        for role in ("critic", "reward_model", "ref"):
            if getattr(self, role).layout is not None and role not in roles:
                raise ValueError(f"{role}.layout is set, but this run has no {role} worker group")
        if self.ref.layout is not None and self.actor.lora.enabled:
            raise ValueError("ref.layout is set, but with actor.lora the reference is the actor's own base (its adapter "
                             "disabled), on the actor's ranks and layout")
        for role in self.trained_roles:
            tp = self.layout_of(role).tensor_parallel
            lora = {"actor": self.actor.lora, "critic": self.critic.lora, "reward_model": self.reward_model.lora}.get(role)
            if tp > 1 and lora is not None and lora.enabled:
                raise ValueError(f"{self.layout_key(role, 'tensor_parallel')}={tp} with {role}.lora: peft's adapter "
                                 "layers wrap the very linear layers tensor parallelism splits, so rlcore does not "
                                 "combine them; train a LoRA adapter data-parallel (FSDP2 shards the frozen base)")
            if self.trainer.backend == "inprocess" and self.layout_of(role).world_size > 1:
                raise ValueError(f"{role}.layout: {self.layout_of(role).describe()} needs trainer.backend=ray (the "
                                 "in-process backend runs one rank)")
        return self

    @property
    def trained_roles(self) -> list[str]:
        """The roles of this run that hold a model on a device mesh (the ones with a `layout`)."""
        return [r for r in self.present_roles if r in ("actor", "ref", "critic", "reward_model")]

    def layout_of(self, role: str) -> LayoutConfig:
        """The device-mesh layout of `role` ("actor", "ref", "critic", "reward_model", "rollout"):
        its `layout` key, else what its legacy keys (`world_size`, Ulysses size) say."""
        if role == "ref":
            return self.ref.layout or self.layout_of("actor")
        section = getattr(self, role)
        if section.layout is not None:
            layout: LayoutConfig = section.layout
            return layout
        sp = {"actor": self.actor.ulysses_sequence_parallel_size, "critic": self.critic_sequence_parallel_size}.get(role, 1)
        sp = sp if section.world_size % sp == 0 else 1
        return LayoutConfig(data_parallel=section.world_size // sp, sequence_parallel=sp)

    def layout_key(self, role: str, part: str) -> str:
        """The key a user set `part` of `role`'s layout with (the legacy key when no layout is given)."""
        if role == "ref" and self.ref.layout is None:
            return self.layout_key("actor", part)
        if role != "ref" and getattr(self, role).layout is None:
            if part == "sequence_parallel" and role in ("actor", "critic"):
                return f"{role}.ulysses_sequence_parallel_size"
            if part == "data_parallel":
                return f"{role}.world_size"
        return f"{role}.layout.{part}"

    @property
    def critic_sequence_parallel_size(self) -> int:
        """`critic.ulysses_sequence_parallel_size`, the actor's when unset."""
        sp = self.critic.ulysses_sequence_parallel_size
        return self.actor.ulysses_sequence_parallel_size if sp is None else sp

    @model_validator(mode="after")
    def _check_cpu_offload(self) -> Config:
        if self.actor.cpu_offload and self.trainer.device == "cpu":
            raise ValueError("actor.cpu_offload=true needs a CUDA device: with trainer.device=cpu the weights, gradients "
                             "and optimizer state already live in host memory, so there is nothing to offload")
        return self

    @model_validator(mode="after")
    def _check_liger_kernel(self) -> Config:
        if self.actor.liger_kernel and self.trainer.device == "cpu":
            raise ValueError("actor.liger_kernel=true needs a CUDA device: Liger's kernels are Triton GPU kernels "
                             "(trainer.device=cpu)")
        return self

    @model_validator(mode="after")
    def _check_lora_sync(self) -> Config:
        sync = self.rollout.lora_sync
        if sync != "auto" and not self.actor.lora.enabled:
            raise ValueError(f"rollout.lora_sync={sync} needs LoRA on the actor (actor.lora.rank > 0)")
        problem = None if self.rollout.backend == "auto" else support_problem(self.rollout.backend, 1, sync)
        if problem is not None:  # auto: the rollout worker checks what it resolves to
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _check_lora_roles(self) -> Config:
        """LoRA set on a role this run does not train is refused: it would be ignored."""
        name, traits = self.algorithm.name, self.traits
        if not traits.trains_policy and self.actor.lora != LoraConfig():
            raise ValueError(f"actor.lora: algorithm.name={name} trains a reward model, not the policy; LoRA on it is "
                             "reward_model.lora")
        if not traits.critic and self.critic.lora != LoraConfig():
            raise ValueError(f"critic.lora: algorithm.name={name} has no critic "
                             f"({' and '.join(names_where(critic=True))} has one)")
        return self

    @property
    def lora_sync(self) -> Literal["full", "merged", "adapter"]:
        """How the actor's weights reach the rollout engine: every tensor (no LoRA), the merged weights of
        the adapted modules, or the adapter (`rollout.lora_sync`)."""
        if not self.actor.lora.enabled:
            return "full"
        return "adapter" if self.rollout.lora_sync == "adapter" else "merged"

    @model_validator(mode="after")
    def _check_reward_model(self) -> Config:
        rm, name, traits = self.reward_model, self.algorithm.name, self.traits
        defaults = RewardModelConfig()
        set_keys = {k for k in (*rm.SCORING_KEYS, *rm.TRAINING_KEYS) if getattr(rm, k) != getattr(defaults, k)}
        trains_rm = "reward_model" in traits.trains
        if not trains_rm and self.registry.metric == "pairwise_accuracy":
            raise ValueError("registry.metric=pairwise_accuracy gates reward models (algorithm.name=rm); a policy is "
                             "gated on accuracy or mean_reward")
        if trains_rm:
            if rm.path is not None:
                raise ValueError("reward_model.path is the reward model an RL run scores with; algorithm.name=rm trains "
                                 "a new one from model.path (unset reward_model.path)")
            ignored = [k for k in rm.SCORING_KEYS if k in set_keys]
            if ignored:
                raise ValueError(f"reward_model.{ignored[0]} applies to RL runs scoring with a reward model, not to "
                                 "algorithm.name=rm (training one)")
            if self.registry.metric == "mean_reward":
                raise ValueError("registry.metric=mean_reward: a reward model is gated on its held-out pairwise accuracy "
                                 "(registry.metric=pairwise_accuracy; accuracy means the same for algorithm.name=rm)")
            return self
        ignored = [k for k in rm.TRAINING_KEYS if k in set_keys]
        if ignored:
            raise ValueError(f"reward_model.{ignored[0]} applies to training a reward model (algorithm.name=rm), "
                             f"not to algorithm.name={name}")
        if rm.path is None:
            ignored = [k for k in rm.SCORING_KEYS if k in set_keys]
            if ignored:
                raise ValueError(f"reward_model.{ignored[0]} is set but reward_model.path is not: no reward model "
                                 "scores this run")
            return self
        if not traits.reward:
            raise ValueError(f"reward_model.path: algorithm.name={name} learns from offline preference rows and "
                             f"generates nothing to score; a reward model scores {' and '.join(names_where(reward=True))} runs")
        if rm.weight == 0 and rm.rule_weight == 0:
            raise ValueError("reward_model.weight and reward_model.rule_weight are both 0: every reward would be 0")
        if "reward_baselines" in estimator_inputs(self.algorithm.adv_estimator):
            raise ValueError(f"reward_model.path with algorithm.adv_estimator={self.algorithm.adv_estimator}: ReMax's "
                             "greedy baseline is scored by the rule scorer alone, not by the reward model")
        return self

    @property
    def traits(self) -> AlgorithmTraits:
        """What `algorithm.name` is (`rlcore.algorithms`): generates? critic? which role trains? ..."""
        return traits_of(self.algorithm.name)

    @property
    def present_roles(self) -> list[Role]:
        """The worker roles this run has: a reward model's training run has that model alone; a policy's
        has actor, rollout and reward (the rollout and rule scorer validate even an offline run), and
        as its algorithm and config need, the reference, the critic and a reward model to score with."""
        traits = self.traits
        if not traits.trains_policy:
            return list(traits.trains)
        roles: list[Role] = ["actor", "rollout", "reward"]
        if self.needs_reference:
            roles.append("ref")
        if traits.critic:
            roles.append("critic")
        if self.reward_model.path is not None:
            roles.append("reward_model")
        return roles

    @property
    def old_log_probs_from_update(self) -> bool:
        """Whether each step's old log-probs come from the actor update's own forward (detached)
        instead of a separate no-grad pass (`actor.recompute_old_log_prob`). Only on an exactly
        on-policy step: one epoch of one mini-batch (one optimizer step, so the weights the update
        starts from are the ones the pass would use), synchronous generation, and nothing before
        the update that reads them (a KL penalty in the reward does)."""
        a = self.actor
        return (a.recompute_old_log_prob == "auto" and self.traits.generates
                and self.trainer.off_policy == "sync" and a.ppo_epochs == 1
                and self.data.train_batch_size == a.ppo_mini_batch_size and not self.algorithm.use_kl_in_reward)

    @property
    def needs_reference(self) -> bool:
        """`algorithm.use_reference`; by default on when the algorithm always needs one (DPO, KTO) or a KL term is used."""
        if self.algorithm.use_reference is not None:
            return self.algorithm.use_reference
        reference = self.traits.reference
        return reference == "always" or (reference == "with_kl" and (self.actor.use_kl_loss or self.algorithm.use_kl_in_reward))


class SFTDataConfig(_Section):
    """Supervised data in verl's SFT schema: a prompt column and a response column, or a column of
    chat messages (multi-turn: every assistant turn is trained on)."""

    train_files: list[str]
    val_files: list[str] = []
    prompt_key: str = Field("prompt", description="chat messages or a string; a string is used as is (as RL prompts are)")
    response_key: str = Field("response", description="the text to learn; followed by the tokenizer's EOS unless it ends "
                              "with one of the model's end tokens")
    messages_key: str = Field("messages", description="a file with this column is multi-turn (verl's schema): "
                              "[{role, content}, ...]; an assistant turn may carry OpenAI-style tool_calls")
    tools: list[str] = Field([], description="tools whose schemas the chat template renders with every prompt, as "
                             "rollout.agent.tools gives them to RL: 'module:function', 'path/to/file.py:function', or a "
                             ".json file of OpenAI-style schemas")
    tools_key: str = Field("tools", description="a row's own tool schemas (verl's column: a list or its JSON text), "
                           "rendered instead of data.tools for that row")
    max_length: int = Field(512, ge=2, description="tokens per sequence (prompt + response)")
    truncation: Literal["error", "drop", "right"] = Field(
        "error", description="a longer sequence: error (naming the row), drop it (counted), or cut it from the right "
        "(its end token is lost: the model does not learn to stop there)")
    apply_chat_template: bool = True
    on_bad_row: Literal["error", "skip"] = "error"
    tokenizer_check_rows: int = Field(32, ge=0, description="prompts per file whose ids rlcore, AutoTokenizer and the "
                                      "folder's tokenizer.json must agree on at start-up (rlcore.trainer.tokenizer_check); 0: off")


class SFTOptimConfig(OptimConfig):
    """The actor's optimizer, with a supervised run's defaults (a higher rate, warmup and cosine decay)."""

    lr: float = Field(1e-5, gt=0)
    warmup_steps: int = Field(10, ge=0)
    schedule: Literal["constant", "cosine"] = "cosine"
    min_lr_ratio: float = Field(0.1, ge=0, le=1)


class SFTActorConfig(ActorConfig):
    """The actor section of an SFT run: the RL actor's own settings (world size, LoRA, precision,
    sequence parallelism, offload, kernels, micro-batching, the bad-step limit, optimizer), with SFT's
    defaults. The RL-only keys (`RL_ONLY`) are refused when set."""

    RL_ONLY: ClassVar[tuple[str, ...]] = (
        "ppo_epochs", "ppo_mini_batch_size", "policy_loss", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c",
        "loss_agg_mode", "entropy_coeff", "use_kl_loss", "kl_loss_coef", "kl_loss_type", "tis_cap",
        "weight_sync_bucket_mb", "recompute_old_log_prob")

    optim: SFTOptimConfig = SFTOptimConfig()
    max_tokens_per_micro_batch: TokenBudget = Field(
        4096, description="micro-batches are packed to this many real tokens (a longer sequence goes alone); or "
        f"{MICRO_BATCH_AUTO}")


class SFTHealthConfig(HealthConfig):
    """Run health of an SFT run: the actor's weights (parameter-norm growth, non-finite state); the
    limits on RL's KL, entropy and reward are off (and refused when set: an SFT run has none)."""

    max_kl: float | None = None
    min_entropy: float | None = None
    max_reward_jump: float | None = None
    reward_jump_sigmas: float | None = None
    kl_jump_sigmas: float | None = None


class SFTTrainerConfig(_Section):
    epochs: int = Field(1, ge=1)
    total_steps: int | None = Field(None, ge=1, description="optimizer steps; default: epochs x full batches per epoch")
    batch_size: int = Field(32, ge=1, description="sequences per optimizer step, over all ranks")
    seed: int = 0
    output_dir: str = "runs/sft"
    save_every: int = Field(100, ge=1)
    keep_last: int = Field(2, ge=1)
    val_every: int = Field(100, ge=1)
    val_before_train: bool = True
    resume: str = Field("auto", description="'auto' (newest complete checkpoint), 'disable', or a checkpoint path")
    loggers: list[Literal["console", "jsonl", "mlflow"]] = ["console", "jsonl"]
    device: Literal["auto", "cpu", "cuda"] = "auto"
    backend: Literal["inprocess", "ray"] = Field("inprocess", description="where the actor runs: this process, or Ray "
                                                 "actors (actor.world_size FSDP2 ranks)")


# Older spellings of SFT keys, still read (in files and overrides): the optimizer and the micro-batch
# budget were SFT's own sections before SFT trained on the actor worker.
SFT_KEY_SPELLINGS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("optim",): ("actor", "optim"),
    ("trainer", "max_tokens_per_micro_batch"): ("actor", "max_tokens_per_micro_batch"),
}


class SFTConfig(_Section):
    """`rlcore sft CONFIG`: supervised fine-tuning on the actor worker, whose output folder
    (`trainer.output_dir/model`) is a Hugging Face model that an RL config's `model.path` can start
    from. It reads the sections an RL run's actor reads (`model`, `actor`, `ray`, `health`,
    `tracking`; `worker_config` is the RL `Config` the actor worker and the shared run parts get), so
    what configures the actor's layout (world size, LoRA, precision, sequence parallelism) configures
    SFT alike."""

    HEALTH_RL_ONLY: ClassVar[tuple[str, ...]] = ("max_kl", "min_entropy", "max_reward_jump", "reward_jump_sigmas",
                                                 "kl_jump_sigmas", "jump_window")

    model: ModelConfig
    data: SFTDataConfig
    actor: SFTActorConfig = SFTActorConfig()
    trainer: SFTTrainerConfig = SFTTrainerConfig()
    health: SFTHealthConfig = SFTHealthConfig()
    tracking: TrackingConfig = TrackingConfig()
    ray: RayConfig = RayConfig()

    @model_validator(mode="before")
    @classmethod
    def _older_spellings(cls, tree: Any) -> Any:
        return sft_key_spellings(tree) if isinstance(tree, dict) else tree

    @model_validator(mode="after")
    def _check_sft(self) -> SFTConfig:
        rl_only = [k for k in self.actor.RL_ONLY if _differs_from_default(self.actor, k)]
        if rl_only:
            raise ValueError(f"actor.{rl_only[0]} is an RL setting; rlcore sft takes one optimizer step per "
                             "trainer.batch_size sequences on their mean response-token loss")
        health = [k for k in self.HEALTH_RL_ONLY if getattr(self.health, k) is not None
                  and (k != "jump_window" or _differs_from_default(self.health, k))]
        if health:
            raise ValueError(f"health.{health[0]} reads a metric of RL runs (KL, entropy, reward); an SFT run has none")
        others = [r for r in self.ray.roles if r != "actor"]
        if others or self.ray.colocate:
            raise ValueError(f"ray.{f'roles.{others[0]}' if others else 'colocate'}: rlcore sft runs the actor alone")
        if self.model.share_prompt_prefix:
            raise ValueError("model.share_prompt_prefix=true: SFT rows are whole sequences, with no prompt shared "
                             "between rows")
        try:  # what the actor and the run parts would refuse (world size without Ray, sequence parallel sizes, ...)
            worker = self.worker_config(self.trainer.total_steps or 1)
        except ValidationError as err:
            raise ValueError(_format_validation_error(err).removeprefix("invalid config: ").removeprefix("<root>: ")) from None
        shards = worker.layout_of("actor").data_parallel
        if self.trainer.batch_size % shards:  # else the dispatch would pad the batch with repeated rows
            raise ValueError(f"trainer.batch_size={self.trainer.batch_size} is not a multiple of the actor's {shards} "
                             f"data-parallel ranks ({worker.layout_key('actor', 'data_parallel')})")
        return self

    def worker_config(self, total_steps: int) -> Config:
        """The RL `Config` the actor worker, the worker groups and the run parts (checkpoints, step
        log) read: this config's model, actor, ray, health and tracking sections as they are, its
        trainer's run settings with `total_steps` resolved. Rows share no prompt (packed alone)."""
        t = self.trainer
        return Config(
            model=self.model.model_copy(update={"share_prompt_prefix": False}),
            data=DataConfig(train_files=self.data.train_files, val_files=self.data.val_files,
                            apply_chat_template=self.data.apply_chat_template, tokenizer_check_rows=0),
            actor=self.actor,
            trainer=TrainerConfig(total_steps=total_steps, seed=t.seed, output_dir=t.output_dir, save_every=t.save_every,
                                  keep_last=t.keep_last, val_every=t.val_every, val_before_train=t.val_before_train,
                                  resume=t.resume, loggers=t.loggers, device=t.device, backend=t.backend, trace=False),
            health=self.health,
            tracking=self.tracking,
            # the actor is the only role that runs; the RL roles the Config knows of go to its pool
            ray=self.ray.model_copy(update={"roles": {role: self.ray.pool_of("actor") for role in ROLES}}),
        )


def sft_key_spellings(tree: dict[str, Any]) -> dict[str, Any]:
    """`tree` with the older spellings of SFT keys (`SFT_KEY_SPELLINGS`) moved to the current ones;
    both spellings in one tree is an error naming them."""
    tree = {k: dict(v) if isinstance(v, dict) else v for k, v in tree.items()}
    for old, new in SFT_KEY_SPELLINGS.items():
        parent = tree.get(old[0]) if len(old) == 2 else tree
        if not isinstance(parent, dict) or old[-1] not in parent:
            continue
        value = parent.pop(old[-1])
        target = tree.setdefault(new[0], {})
        if not isinstance(target, dict):
            raise ValueError(f"{new[0]}: expected a section")
        if new[1] in target:
            raise ValueError(f"{'.'.join(old)} and {'.'.join(new)} are the same setting (the first its older "
                             "spelling); give one")
        target[new[1]] = value
        if len(old) == 2 and not parent:
            tree.pop(old[0])
    return tree


def sft_key_path(parts: list[str]) -> list[str]:
    """A dotted key's parts with an older SFT spelling (`SFT_KEY_SPELLINGS`) replaced by the current one."""
    for old, new in SFT_KEY_SPELLINGS.items():
        if tuple(parts[:len(old)]) == old:
            return [*new, *parts[len(old):]]
    return parts


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a","b","c"], value) with the value typed by YAML (1e-6, true, [1,2])."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected dotted.key=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {text!r}: empty key segment")
    value = _safe_yaml(raw, f"override {key.strip()!r}") if raw.strip() else ""
    return parts, value


def _safe_yaml(text: str, where: str) -> Any:
    """`yaml.safe_load(text)`, or a `ConfigError` naming `where` and the line and column of what is
    not YAML (a YAML typo is one line, not a parser traceback)."""
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = err.problem or err.context or "not YAML"
        raise ConfigError(f"{where}: not valid YAML{at}: {problem}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{where}: not valid YAML: {str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply to be a config") from None
    except ValueError as err:  # a constructor's refusal: an integer of more than 4,300 digits, say
        raise ConfigError(f"{where}: not a usable YAML value ({str(err).split(';')[0][:200]})") from None


def _apply_override(tree: dict[str, Any], parts: list[str], value: Any) -> None:
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {'.'.join(parts)}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


MAX_PROBLEMS_SHOWN = 12  # a hostile file can hold thousands; the first few say what to fix


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    errors = err.errors()
    for e in errors[:MAX_PROBLEMS_SHOWN]:
        loc = ".".join(str(p) if str(p).isprintable() else repr(p) for p in e["loc"])[:200] or "<root>"
        if e["type"] == "extra_forbidden":
            lines.append(f"{loc}: unknown key")
        elif e["type"] == "value_error":  # our validators' own messages, without pydantic's "Value error, "
            lines.append(f"{loc}: {e.get('ctx', {}).get('error', e['msg'])}")
        else:
            lines.append(f"{loc}: {e['msg']}")
    more = f"; and {len(errors) - MAX_PROBLEMS_SHOWN} more" if len(errors) > MAX_PROBLEMS_SHOWN else ""
    return "invalid config: " + "; ".join(lines) + more


def config_from_dict(tree: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


def sft_config_from_dict(tree: dict[str, Any]) -> SFTConfig:
    try:
        return SFTConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


def _config_tree(path: str | Path | None, overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """A YAML file's mapping (optional) with dotted overrides applied, not yet validated."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ConfigError(f"{path}: not UTF-8 text (byte {err.start})") from None
        except OSError as err:
            raise ConfigError(f"{path}: cannot read the config file ({err.strerror or err})") from None
        loaded = _safe_yaml(text, str(path)) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
        tree = loaded
    for text in overrides:
        parts, value = parse_override(text)
        _apply_override(tree, parts, value)
    return tree


# The webhook URL when the config leaves `registry.webhook_url` unset: a secret kept out of config
# files, command lines and Prefect parameters (a served pipeline's runs inherit it from `pipeline serve`).
WEBHOOK_ENV = "RLCORE_WEBHOOK_URL"


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML file (optional), apply dotted overrides, validate; `registry.webhook_url` unset
    there is $RLCORE_WEBHOOK_URL."""
    tree = _config_tree(path, overrides)
    registry = tree.setdefault("registry", {})
    if isinstance(registry, dict) and registry.get("webhook_url") is None and os.environ.get(WEBHOOK_ENV):
        registry["webhook_url"] = os.environ[WEBHOOK_ENV]
    return config_from_dict(tree)


def load_sft_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> SFTConfig:
    """`load_config` for an SFT run (`rlcore sft`). An older spelling of a key (`optim.lr` for
    `actor.optim.lr`) addresses the same setting, in the file and in an override alike."""
    tree = _config_tree(path, ())
    try:
        tree = sft_key_spellings(tree)
    except ValueError as err:
        raise ConfigError(f"invalid config: {err}") from None
    for text in overrides:
        parts, value = parse_override(text)
        _apply_override(tree, sft_key_path(parts), value)
    return sft_config_from_dict(tree)


def dump_config(config: Config | SFTConfig) -> str:
    """The resolved config as YAML, secrets redacted (`rlcore.redact`): the run folder's
    `config.yaml` is read, shared and logged as an MLflow artifact, so it must not carry the
    webhook's credentials. A run reloaded from it gets its secrets from its overrides again."""
    text: str = yaml.safe_dump(redact_tree(config.model_dump(mode="json")), sort_keys=False)
    return text
