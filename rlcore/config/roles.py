"""The sections of the trained roles (actor, critic, reference, reward, reward model) and what they
share: the optimizer, LoRA, rank counts, micro-batch token budgets and the device-mesh layout."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, Field, ValidationError, field_validator, model_validator
from pydantic.functional_validators import BeforeValidator

from rlcore.config.base import Section, check_registered


class OptimConfig(Section):
    lr: float = Field(1e-6, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    grad_clip: float = Field(1.0, gt=0)


class LoraConfig(Section):
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


class LayoutConfig(Section):
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


def section_layout(section: Any, sequence_parallel: int = 1) -> LayoutConfig:
    """A role section's device-mesh layout: its `layout` key, else what its legacy keys say
    (`world_size` ranks, `sequence_parallel` of them per Ulysses group when that divides it)."""
    if section.layout is not None:
        layout: LayoutConfig = section.layout
        return layout
    sp = sequence_parallel if section.world_size % sequence_parallel == 0 else 1
    return LayoutConfig(data_parallel=section.world_size // sp, sequence_parallel=sp)


def section_layout_key(role: str, section: Any, part: str) -> str:
    """The key a user set `part` of `role`'s layout with in `section` (the legacy key when no layout is given)."""
    if section.layout is None:
        if part == "sequence_parallel" and role in ("actor", "critic"):
            return f"{role}.ulysses_sequence_parallel_size"
        if part == "data_parallel":
            return f"{role}.world_size"
    return f"{role}.layout.{part}"


def layout_fills_rank_keys(data: Any, section: str, sp_key: str | None, engines: bool = False) -> Any:
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


class ActorConfig(Section):
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
    tis_cap: float | None = Field(None, gt=0, description="importance weight cap for rollout/actor mismatch "
                                  "(actor.behaviour_correction: truncate bounds the weights to it, decoupled drops "
                                  "tokens above it)")
    behaviour_correction: Literal["truncate", "decoupled"] = Field(
        "truncate", description="how the loss corrects for samples generated by another policy than the one the ratio "
        "is taken against (rollout engine mismatch, one_step/async staleness); w = pi_old / pi_rollout per token "
        "(rlcore.algos.policy_loss.behaviour_weights). truncate: min(w, tis_cap), nothing without tis_cap. "
        "decoupled: AReaL's decoupled PPO, w itself (0 above tis_cap): the clipped ratio is to the current "
        "weights (proximal policy), w corrects for the behaviour policy")
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
        return layout_fills_rank_keys(data, "actor", "ulysses_sequence_parallel_size")

    @field_validator("policy_loss")
    @classmethod
    def _known_policy_loss(cls, name: str) -> str:
        return check_registered("policy loss", name)

    @field_validator("kl_loss_type")
    @classmethod
    def _known_kl_loss_type(cls, name: str) -> str:
        return check_registered("KL estimator", name)



class CriticConfig(Section):
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
        return layout_fills_rank_keys(data, "critic", "ulysses_sequence_parallel_size")


class RewardConfig(Section):
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


class RewardModelConfig(Section):
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
        return layout_fills_rank_keys(data, "reward_model", None)

    @model_validator(mode="after")
    def _check_layout(self) -> RewardModelConfig:
        if self.layout is not None and self.layout.sequence_parallel != 1:
            raise ValueError(f"reward_model.layout.sequence_parallel={self.layout.sequence_parallel}: the reward model "
                             "scores whole sequences without sequence parallelism; use data_parallel or tensor_parallel")
        return self


class RefConfig(Section):
    """The reference model's worker group (KL and the preference losses)."""

    layout: LayoutConfig | None = Field(
        None, description="data-parallel x sequence-parallel x tensor-parallel ranks of the reference (see "
        "actor.layout); default: the actor's. Its own world size makes it a group of its own on Ray (it cannot then "
        "be colocated with the actor)")

