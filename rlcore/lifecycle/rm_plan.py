"""What the reward-model branch of the pipeline (`--reward model`) asks of its two configs, checked
before anything starts: light on imports (no torch, no MLflow), so `rlcore pipeline run` reports a
bad config in a second, as it does for the policy's."""

from __future__ import annotations

from rlcore.config import Config
from rlcore.errors import RLCoreError

CHAMPION_ALIAS = "champion"  # rlcore.lifecycle.mlflow_store.CHAMPION


class RewardModelStageError(RLCoreError):
    """The reward-model branch of the pipeline cannot run as configured; names what to change."""


def check_reward_model_config(rm_config: Config, policy_config: Config) -> None:
    """The reward model's config trains one (`algorithm.name: rm`), has held-out pairs to be gated
    on, and registers under a name of its own."""
    if "reward_model" not in rm_config.traits.trains:
        raise RewardModelStageError(f"--reward-config: algorithm.name is {rm_config.algorithm.name}; the reward "
                                    "model's config must train one (algorithm.name: rm)")
    if not rm_config.data.val_files:
        raise RewardModelStageError("--reward-config: data.val_files is empty; a reward model is gated on its "
                                    "held-out pairwise accuracy and needs held-out pairs")
    if rm_config.registry.model_name == policy_config.registry.model_name:
        raise RewardModelStageError(f"--reward-config: registry.model_name {rm_config.registry.model_name!r} is the "
                                    "policy's; the reward model is registered as a model of its own")


def champion_alias_uri(config: Config) -> str:
    """What a policy config's `reward_model.path` says until the pipeline resolves it: the
    champion of the reward model's registered model."""
    return f"models:/{config.registry.model_name}@{CHAMPION_ALIAS}"


__all__ = ["CHAMPION_ALIAS", "RewardModelStageError", "champion_alias_uri", "check_reward_model_config"]
