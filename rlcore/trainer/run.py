"""Pick the control flow for a config and run it."""

from __future__ import annotations

from typing import Any

from rlcore.config import Config


def make_trainer(config: Config, **kwargs: Any):
    """kwargs go to the trainer (e.g. `step_hooks`)."""
    if config.algorithm.name == "ppo":
        from rlcore.trainer.ppo import PPOTrainer

        return PPOTrainer(config, **kwargs)
    if config.algorithm.name == "dpo":
        from rlcore.trainer.dpo import DPOTrainer

        return DPOTrainer(config, **kwargs)
    if config.algorithm.name == "kto":
        from rlcore.trainer.kto import KTOTrainer

        return KTOTrainer(config, **kwargs)
    from rlcore.trainer.grpo import GRPOTrainer

    return GRPOTrainer(config, **kwargs)


def run_training(config: Config, **kwargs: Any) -> list[dict[str, Any]]:
    return make_trainer(config, **kwargs).fit()
