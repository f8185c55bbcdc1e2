"""`RoleSpec`: what one worker is handed, built once per role from the run's config.

A worker holds its own section, the model section, its layout (and the keys that set it), the
run's device, seed and step count, and the few values of other sections it needs, each named here
(the log-prob temperature the rollout sampled at, the LoRA rank the engine serves, the longest
sequence a step may hold, ...). It never reads another role's section: `role_spec` (an RL
`Config`) and `rlcore.config.sft.sft_actor_spec` (an SFT config) are where those values are
chosen, so both recipes hand the actor the same kind of object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from rlcore.config.algorithm import PreferenceConfig
from rlcore.config.model import ModelConfig
from rlcore.config.roles import LayoutConfig
from rlcore.config.tree import ConfigTree

S = TypeVar("S")

LoraSync = Literal["full", "merged", "adapter"]


@dataclass(frozen=True)
class MicroSpec:
    """A role's micro-batching keys: rows per micro-batch, packing by tokens, the token budget
    (a number or `auto`) and the key that set it (named when `auto` is sized or halved)."""

    size: int
    dynamic: bool
    max_tokens: int | str
    key: str


@dataclass(frozen=True)
class RoleSpec(Generic[S]):
    """One role's settings (module docstring). `section` is the role's own config section (the
    reference's `ref`, whose forwards follow the actor's keys given in `micro` and `logprob_*`)."""

    role: str
    section: S
    model: ModelConfig
    layout: LayoutConfig
    tp_key: str  # the key of its tensor-parallel size (`Config.layout_key`), named in errors
    sp_key: str  # the key of its sequence-parallel size
    device: str  # `trainer.device`
    seed: int  # `trainer.seed`
    total_steps: int  # `trainer.total_steps`: the learning-rate schedule's length
    trains: bool = False  # whether this role's model trains in this run
    model_path: str = ""  # the folder this role loads (`critic.model_path`, `reward_model.path`, else `model.path`)
    mixed_precision: str = "none"  # `actor.mixed_precision` for the actor
    micro: MicroSpec | None = None  # its micro-batching (critic: unset keys the actor's; ref: the actor's)
    mini_batch_size: int = 0  # examples per optimizer step (critic: unset, the actor's; reward model: unset, data.train_batch_size)
    logprob_temperature: float = 1.0  # `rollout.temperature` when the algorithm trains on its own samples, else 1
    logprob_chunk_tokens: int = 0  # `actor.logprob_chunk_tokens`: the log-prob chunk (and every head's in the activation estimate)
    fused_kernels: bool = False  # `actor.fused_kernels`: the log-prob kernel
    longest_sequence: int = 0  # data.max_prompt_length + the longest response (`rollout.max_new_tokens` or the agent's total)
    lora_rank: int = 0  # `actor.lora.rank`: the adapter rank the engine serves (rollout)
    lora_sync: LoraSync = "full"  # how the actor's weights reach the engine (`Config.lora_sync`)
    preference: PreferenceConfig | None = None  # the preference losses' section (actor)


def _micro(section: Any, key: str) -> MicroSpec:
    return MicroSpec(section.micro_batch_size, section.dynamic_batch_size, section.max_tokens_per_micro_batch, key)


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def role_spec(config: ConfigTree, role: str) -> RoleSpec[Any]:
    """`role`'s `RoleSpec` in the RL run `config` ("actor", "ref", "critic", "reward_model",
    "rollout", "reward")."""
    a, t = config.actor, config.trainer
    trains = role in ("actor", "critic") or (role == "reward_model" and "reward_model" in config.traits.trains)
    meshed = role != "reward"  # the rule scorer holds no model: one rank, no layout keys
    layout = config.layout_of(role) if meshed else LayoutConfig()
    tp_key, sp_key = (config.layout_key(role, "tensor_parallel"), config.layout_key(role, "sequence_parallel")) if meshed else ("", "")
    agent = config.rollout.agent
    common: dict[str, Any] = dict(
        role=role, section=getattr(config, role), model=config.model, layout=layout, tp_key=tp_key, sp_key=sp_key,
        device=t.device, seed=t.seed, total_steps=t.total_steps, trains=trains, model_path=config.model.path,
        logprob_chunk_tokens=a.logprob_chunk_tokens,
        longest_sequence=config.data.max_prompt_length + (agent.max_total_tokens if agent.enabled else config.rollout.max_new_tokens),
    )
    actor_micro = _micro(a, "actor.max_tokens_per_micro_batch")
    if role in ("actor", "ref"):
        common.update(micro=actor_micro, mini_batch_size=a.ppo_mini_batch_size, fused_kernels=a.fused_kernels,
                      logprob_temperature=config.rollout.temperature if config.traits.generates else 1.0)
        if role == "actor":
            common.update(mixed_precision=a.mixed_precision, preference=config.preference)
    elif role == "critic":
        c = config.critic
        key = "critic.max_tokens_per_micro_batch" if c.max_tokens_per_micro_batch is not None else actor_micro.key
        common.update(model_path=c.model_path or config.model.path,
                      micro=MicroSpec(_or(c.micro_batch_size, a.micro_batch_size), _or(c.dynamic_batch_size, a.dynamic_batch_size),
                                      _or(c.max_tokens_per_micro_batch, a.max_tokens_per_micro_batch), key),
                      mini_batch_size=_or(c.ppo_mini_batch_size, a.ppo_mini_batch_size))
    elif role == "reward_model":
        rm = config.reward_model
        common.update(model_path=config.model.path if trains else (rm.path or config.model.path),
                      micro=_micro(rm, "reward_model.max_tokens_per_micro_batch"),
                      mini_batch_size=rm.mini_batch_size or config.data.train_batch_size)
    elif role == "rollout":
        common.update(lora_rank=a.lora.rank, lora_sync=config.lora_sync)
    return RoleSpec(**common)


def require_spec(given: object, role: str) -> RoleSpec[Any]:
    """`given`, a worker's `RoleSpec`; anything else (a whole config) is refused with a
    `TypeError` naming what the worker takes and where it comes from (`role_spec`)."""
    if not isinstance(given, RoleSpec):
        raise TypeError(f"the {role} worker takes its RoleSpec (rlcore.config.role_spec(config, {role!r})), "
                        f"not a {type(given).__name__}")
    return given


__all__ = ["LoraSync", "MicroSpec", "RoleSpec", "require_spec", "role_spec"]
