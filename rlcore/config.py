"""Run configuration: pydantic models, YAML files and dotted command-line overrides.

Every section forbids unknown keys, so a typo (`actor.optim.lrr=1e-6`) is an error that names
the key instead of a silently ignored setting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A configuration problem; the message names the dotted key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    path: str = Field(description="local Hugging Face model directory (no hub access)")
    dtype: Literal["float32", "bfloat16"] = "float32"
    gradient_checkpointing: bool = False


class DataConfig(_Section):
    train_files: list[str]
    val_files: list[str] = []
    max_prompt_length: int = Field(64, ge=1)
    train_batch_size: int = Field(32, ge=1, description="prompts per training step")
    val_batch_size: int = Field(256, ge=1)
    shuffle: bool = True
    apply_chat_template: bool = True
    on_bad_row: Literal["error", "skip"] = "error"


class OptimConfig(_Section):
    lr: float = Field(1e-6, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    grad_clip: float = Field(1.0, gt=0)


class ActorConfig(_Section):
    optim: OptimConfig = OptimConfig()
    ppo_epochs: int = Field(1, ge=1)
    ppo_mini_batch_size: int = Field(32, ge=1, description="prompts per optimizer step (x rollout.n samples)")
    micro_batch_size: int = Field(64, ge=1, description="samples per forward when dynamic_batch_size is off")
    dynamic_batch_size: bool = True
    max_tokens_per_micro_batch: int = Field(8192, ge=1)
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


class RolloutConfig(_Section):
    backend: Literal["hf"] = "hf"
    n: int = Field(8, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    max_new_tokens: int = Field(32, ge=1)
    val_n: int = Field(1, ge=1, description="samples per validation prompt (pass@k when > 1)")
    val_temperature: float = Field(1.0, gt=0)
    val_greedy: bool = True


class CriticConfig(_Section):
    model_path: str | None = Field(None, description="defaults to the actor model")
    optim: OptimConfig = OptimConfig(lr=1e-5)
    ppo_epochs: int = Field(1, ge=1)
    cliprange_value: float = Field(0.5, gt=0)
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"


class RewardConfig(_Section):
    function: str | None = Field(None, description="'module:function' or 'file.py:function'; default: by data_source")
    num_workers: int = Field(2, ge=0)
    timeout_s: float = Field(10.0, gt=0)
    error_score: float = 0.0


class KLControlConfig(_Section):
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = Field(0.001, ge=0)
    target_kl: float = Field(0.1, gt=0)
    horizon: int = Field(10000, ge=1)


class AlgorithmConfig(_Section):
    name: Literal["grpo", "ppo"] = "grpo"
    adv_estimator: str = "grpo"
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(1.0, ge=0, le=1)
    norm_adv_by_std: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "k1"
    kl_ctrl: KLControlConfig = KLControlConfig()
    use_reference: bool | None = Field(None, description="default: on when any KL term is used")


class TrainerConfig(_Section):
    total_steps: int = Field(20, ge=1)
    seed: int = 0
    output_dir: str = "runs/default"
    save_every: int = Field(10, ge=1)
    keep_last: int = Field(2, ge=1)
    val_every: int = Field(10, ge=1)
    val_before_train: bool = True
    resume: str = Field("auto", description="'auto' (newest complete checkpoint), 'disable', or a checkpoint path")
    loggers: list[Literal["console", "jsonl"]] = ["console", "jsonl"]
    device: Literal["auto", "cpu", "cuda"] = "auto"


class Config(_Section):
    model: ModelConfig
    data: DataConfig
    actor: ActorConfig = ActorConfig()
    rollout: RolloutConfig = RolloutConfig()
    critic: CriticConfig = CriticConfig()
    reward: RewardConfig = RewardConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    trainer: TrainerConfig = TrainerConfig()

    @model_validator(mode="after")
    def _check_consistency(self) -> "Config":
        if self.data.train_batch_size % self.actor.ppo_mini_batch_size:
            raise ValueError(
                f"data.train_batch_size ({self.data.train_batch_size}) must be a multiple of "
                f"actor.ppo_mini_batch_size ({self.actor.ppo_mini_batch_size})"
            )
        if self.algorithm.name == "ppo" and self.algorithm.adv_estimator != "gae":
            raise ValueError("algorithm.adv_estimator must be 'gae' when algorithm.name is 'ppo' (the critic needs it)")
        if self.algorithm.name == "grpo" and self.algorithm.adv_estimator == "gae":
            raise ValueError("algorithm.adv_estimator 'gae' needs a critic: use algorithm.name=ppo")
        return self

    @property
    def needs_reference(self) -> bool:
        if self.algorithm.use_reference is not None:
            return self.algorithm.use_reference
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a","b","c"], value) with the value typed by YAML (1e-6, true, [1,2])."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected dotted.key=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {text!r}: empty key segment")
    value = yaml.safe_load(raw) if raw.strip() else ""
    return parts, value


def _apply_override(tree: dict[str, Any], parts: list[str], value: Any) -> None:
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {'.'.join(parts)}: {'.'.join(parts[: i + 1])} is not a section")
        node = child
    node[parts[-1]] = value


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            lines.append(f"{loc}: unknown key")
        else:
            lines.append(f"{loc}: {e['msg']}")
    return "invalid config: " + "; ".join(lines)


def config_from_dict(tree: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML file (optional), apply dotted overrides, validate."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
        tree = loaded
    for text in overrides:
        parts, value = parse_override(text)
        _apply_override(tree, parts, value)
    return config_from_dict(tree)


def dump_config(config: Config) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
