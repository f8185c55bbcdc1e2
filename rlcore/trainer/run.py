"""Pick the control flow (recipe) for a config and run it."""

from __future__ import annotations

from typing import Any

from rlcore.config import Config


def make_trainer(config: Config, **kwargs: Any) -> Any:
    """The recipe of `algorithm.name`; kwargs go to it (`groups`, `step_hooks`). Everything the
    config names is checked first (`rlcore.trainer.preflight`), then that rlcore tokenizes the
    data's prompts as the serving side does (`rlcore.trainer.tokenizer_check`), before any model
    loads."""
    from rlcore.trainer.preflight import preflight
    from rlcore.trainer.tokenizer_check import check_run_tokenization

    preflight(config)
    check_run_tokenization(config)
    name = config.algorithm.name
    if name == "ppo":
        from rlcore.trainer.ppo import PPOTrainer

        return PPOTrainer(config, **kwargs)
    if name == "dpo":
        from rlcore.trainer.dpo import DPOTrainer

        return DPOTrainer(config, **kwargs)
    if name == "rm":
        from rlcore.trainer.reward_model import RewardModelTrainer

        return RewardModelTrainer(config, **kwargs)
    if name == "kto":
        from rlcore.trainer.kto import KTOTrainer

        return KTOTrainer(config, **kwargs)
    from rlcore.trainer.grpo import GRPOTrainer

    return GRPOTrainer(config, **kwargs)


def run_training(config: Config, **kwargs: Any) -> list[dict[str, Any]]:
    """Train to `trainer.total_steps` (resuming per `trainer.resume`); returns each step's metrics."""
    return make_trainer(config, **kwargs).fit()
