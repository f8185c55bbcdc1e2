"""The top-level tree of an RL run's config: its sections, and what they determine together (the
roles present, each role's layout and the key that set it, how weights reach the engine). The rules
between sections are `rlcore.config.rules`; `rlcore.config.root.Config` is this tree with them."""

from __future__ import annotations

from typing import Literal

from rlcore.algorithms import AlgorithmTraits, Role, traits_of
from rlcore.config.algorithm import AlgorithmConfig, PreferenceConfig
from rlcore.config.base import Section
from rlcore.config.model import DataConfig, ModelConfig
from rlcore.config.roles import (
    ActorConfig,
    CriticConfig,
    LayoutConfig,
    RefConfig,
    RewardConfig,
    RewardModelConfig,
    section_layout,
    section_layout_key,
)
from rlcore.config.rollout import RolloutConfig
from rlcore.config.run import HealthConfig, RayConfig, RegistryConfig, TrackingConfig, TrainerConfig


class ConfigTree(Section):
    """Every section of an RL run (the cross-section rules are checked by `Config`)."""

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

    @property
    def trained_roles(self) -> list[str]:
        """The roles of this run that hold a model on a device mesh (the ones with a `layout`)."""
        return [r for r in self.present_roles if r in ("actor", "ref", "critic", "reward_model")]

    def layout_of(self, role: str) -> LayoutConfig:
        """The device-mesh layout of `role` ("actor", "ref", "critic", "reward_model", "rollout"):
        its `layout` key, else what its legacy keys (`world_size`, Ulysses size) say."""
        if role == "ref":
            return self.ref.layout or self.layout_of("actor")
        sp = {"actor": self.actor.ulysses_sequence_parallel_size, "critic": self.critic_sequence_parallel_size}.get(role, 1)
        return section_layout(getattr(self, role), sp)

    def layout_key(self, role: str, part: str) -> str:
        """The key a user set `part` of `role`'s layout with (the legacy key when no layout is given)."""
        if role == "ref" and self.ref.layout is None:
            return self.layout_key("actor", part)
        return section_layout_key(role, getattr(self, role), part)

    @property
    def critic_sequence_parallel_size(self) -> int:
        """`critic.ulysses_sequence_parallel_size`, the actor's when unset."""
        sp = self.critic.ulysses_sequence_parallel_size
        return self.actor.ulysses_sequence_parallel_size if sp is None else sp

    @property
    def lora_sync(self) -> Literal["full", "merged", "adapter"]:
        """How the actor's weights reach the rollout engine: every tensor (no LoRA), the merged weights of
        the adapted modules, or the adapter (`rollout.lora_sync`)."""
        if not self.actor.lora.enabled:
            return "full"
        return "adapter" if self.rollout.lora_sync == "adapter" else "merged"

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
