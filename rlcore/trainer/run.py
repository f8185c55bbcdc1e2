"""Pick the control flow (recipe) for a config and run it."""

from __future__ import annotations

import importlib
from typing import Any

from rlcore.config import Config


def make_trainer(config: Config, **kwargs: Any) -> Any:
    """The recipe that runs `algorithm.name` (`rlcore.algorithms`: its traits' `recipe`); kwargs go
    to it (`groups`, `step_hooks`). Everything the config names is checked first
    (`rlcore.trainer.preflight`), then that rlcore tokenizes the data's prompts as the serving side
    does (`rlcore.trainer.tokenizer_check`), before any model loads."""
    from rlcore.trainer.preflight import preflight
    from rlcore.trainer.tokenizer_check import check_run_tokenization

    preflight(config)
    check_run_tokenization(config)
    module, _, name = config.traits.recipe.partition(":")
    recipe = getattr(importlib.import_module(module), name)
    return recipe(config, **kwargs)


def run_training(config: Config, **kwargs: Any) -> list[dict[str, Any]]:
    """Train to `trainer.total_steps` (resuming per `trainer.resume`); returns each step's metrics."""
    history: list[dict[str, Any]] = make_trainer(config, **kwargs).fit()
    return history
