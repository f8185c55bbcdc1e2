"""Pick the control flow for a config and run it."""

from __future__ import annotations

from typing import Any

from rlcore.config import Config


def make_trainer(config: Config):
    if config.algorithm.name == "ppo":
        from rlcore.trainer.ppo import PPOTrainer

        return PPOTrainer(config)
    from rlcore.trainer.grpo import GRPOTrainer

    return GRPOTrainer(config)


def run_training(config: Config) -> list[dict[str, Any]]:
    return make_trainer(config).fit()
