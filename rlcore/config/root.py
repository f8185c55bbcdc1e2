"""`Config`: an RL run's whole config, its sections validated and then the cross-section rules
(`rlcore.config.rules.RULES`) checked in order, by one validator."""

from __future__ import annotations

from pydantic import model_validator

from rlcore.config.rules import RULES
from rlcore.config.tree import ConfigTree


class Config(ConfigTree):
    """An RL run's config (`rlcore train`, the pipeline's stages): `load_config` reads one."""

    @model_validator(mode="after")
    def _check_rules(self) -> Config:
        for rule in RULES:
            rule(self)
        return self
