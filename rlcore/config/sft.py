"""`rlcore sft`'s config: SFT's data and trainer sections, the RL actor's section with SFT's
defaults, and the actor worker's `RoleSpec` built from them (`sft_actor_spec`). No RL `Config` is
made of it: the run parts (worker placement, checkpoints, step log) take the spec and small typed
values, and the RL rules that concern the actor run on its sections alone."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from rlcore.config.base import Section, differs_from_default
from rlcore.config.model import ModelConfig
from rlcore.config.roles import MICRO_BATCH_AUTO, ActorConfig, OptimConfig, TokenBudget, section_layout, section_layout_key
from rlcore.config.rules import (
    check_actor_kernels,
    check_actor_offload,
    check_default_pool,
    check_mesh,
    check_packed_sequence_parallel,
    check_ranks_on_backend,
    check_sequence_parallel_size,
)
from rlcore.config.run import HealthConfig, RayConfig, TrackingConfig
from rlcore.config.spec import MicroSpec, RoleSpec


class SFTDataConfig(Section):
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
        "loss_agg_mode", "entropy_coeff", "use_kl_loss", "kl_loss_coef", "kl_loss_type", "tis_cap", "behaviour_correction",
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


class SFTTrainerConfig(Section):
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



class SFTConfig(Section):
    """`rlcore sft CONFIG`: supervised fine-tuning on the actor worker, whose output folder
    (`trainer.output_dir/model`) is a Hugging Face model that an RL config's `model.path` can start
    from. It reads the sections an RL run's actor reads (`model`, `actor`, `ray`, `health`,
    `tracking`; the actor worker is handed `sft_actor_spec`), so what configures the actor's layout
    (world size, LoRA, precision, sequence parallelism) configures SFT alike."""

    HEALTH_RL_ONLY: ClassVar[tuple[str, ...]] = ("max_kl", "min_entropy", "max_reward_jump", "reward_jump_sigmas",
                                                 "kl_jump_sigmas", "jump_window")

    model: ModelConfig
    data: SFTDataConfig
    actor: SFTActorConfig = SFTActorConfig()
    trainer: SFTTrainerConfig = SFTTrainerConfig()
    health: SFTHealthConfig = SFTHealthConfig()
    tracking: TrackingConfig = TrackingConfig()
    ray: RayConfig = RayConfig()

    @model_validator(mode="after")
    def _check_sft(self) -> SFTConfig:
        rl_only = [k for k in self.actor.RL_ONLY if differs_from_default(self.actor, k)]
        if rl_only:
            raise ValueError(f"actor.{rl_only[0]} is an RL setting; rlcore sft takes one optimizer step per "
                             "trainer.batch_size sequences on their mean response-token loss")
        health = [k for k in self.HEALTH_RL_ONLY if getattr(self.health, k) is not None
                  and (k != "jump_window" or differs_from_default(self.health, k))]
        if health:
            raise ValueError(f"health.{health[0]} reads a metric of RL runs (KL, entropy, reward); an SFT run has none")
        others = [r for r in self.ray.roles if r != "actor"]
        if others or self.ray.colocate:
            raise ValueError(f"ray.{f'roles.{others[0]}' if others else 'colocate'}: rlcore sft runs the actor alone")
        if self.model.share_prompt_prefix:
            raise ValueError("model.share_prompt_prefix=true: SFT rows are whole sequences, with no prompt shared "
                             "between rows")
        self._check_actor_run()
        shards = section_layout(self.actor, self.actor.ulysses_sequence_parallel_size).data_parallel
        if self.trainer.batch_size % shards:  # else the dispatch would pad the batch with repeated rows
            raise ValueError(f"trainer.batch_size={self.trainer.batch_size} is not a multiple of the actor's {shards} "
                             f"data-parallel ranks ({section_layout_key('actor', self.actor, 'data_parallel')})")
        return self

    def _check_actor_run(self) -> None:
        """What an RL config's rules refuse of the actor (`rlcore.config.rules`, in their order):
        several ranks without Ray, its pool, sequence-parallel sizes, LoRA with tensor parallelism,
        CPU offload and Liger's kernels without CUDA."""
        actor, backend = self.actor, self.trainer.backend
        layout = section_layout(actor, actor.ulysses_sequence_parallel_size)
        check_ranks_on_backend("actor", actor, backend)
        check_default_pool(["actor"], self.ray, backend)
        check_sequence_parallel_size("actor", actor, actor.ulysses_sequence_parallel_size)
        check_packed_sequence_parallel(section_layout_key("actor", actor, "sequence_parallel"), layout.sequence_parallel,
                                       self.model)
        check_mesh("actor", layout, section_layout_key("actor", actor, "tensor_parallel"), actor.lora, backend)
        check_actor_offload(actor, self.trainer.device)
        check_actor_kernels(actor, self.trainer.device)


def sft_actor_spec(config: SFTConfig, total_steps: int) -> RoleSpec[ActorConfig]:
    """The actor worker's `RoleSpec` in an SFT run, from `config`'s own sections: its actor section
    and layout, the model (rows share no prompt: each is packed alone), the trainer's device and
    seed, `total_steps` optimizer steps; log-probs at temperature 1 (it scores data, not its own
    samples), the longest sequence `data.max_length`."""
    actor, t = config.actor, config.trainer
    return RoleSpec(
        role="actor", section=actor, model=config.model.model_copy(update={"share_prompt_prefix": False}),
        layout=section_layout(actor, actor.ulysses_sequence_parallel_size),
        tp_key=section_layout_key("actor", actor, "tensor_parallel"), sp_key=section_layout_key("actor", actor, "sequence_parallel"),
        device=t.device, seed=t.seed, total_steps=total_steps, trains=True, model_path=config.model.path,
        mixed_precision=actor.mixed_precision,
        micro=MicroSpec(actor.micro_batch_size, actor.dynamic_batch_size, actor.max_tokens_per_micro_batch,
                        "actor.max_tokens_per_micro_batch"),
        mini_batch_size=actor.ppo_mini_batch_size, logprob_temperature=1.0, logprob_chunk_tokens=actor.logprob_chunk_tokens,
        fused_kernels=actor.fused_kernels, longest_sequence=config.data.max_length,
    )
