"""The run-health guard lives with the recipes that run it (rlcore.trainer.health); the lifecycle
re-exports it for callers that catch `HealthBreach` around a training run."""

from rlcore.trainer.health import HealthBreach, HealthGuard

__all__ = ["HealthBreach", "HealthGuard"]
