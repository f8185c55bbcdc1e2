"""Run-health guard: stops a run going bad before it wastes compute or produces a broken or
reward-hacked model. Every recipe runs it after every step (`health:` settings).

Checked on the step's metrics: KL to the reference above a limit (the policy drifted), entropy
below a floor (the policy collapsed onto a few tokens), a jump in mean reward between
consecutive steps above a limit (typical of a reward exploit being found), and the actor's
weights: a non-finite parameter or optimizer state, or a parameter norm growing by more than a
factor in one step (an exploding update, e.g. a huge learning rate, with a loss that still
looks finite). A breach raises `HealthBreach`, a `TrainingStopped`: the recipe then ends without
checkpointing that step, so the newest complete checkpoint is the last healthy one.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from rlcore.trainer.run_state import TrainingStopped

log = logging.getLogger(__name__)

KL_KEY = "actor/kl"
ENTROPY_KEY = "actor/entropy"
REWARD_KEY = "reward/mean"
PARAM_NORM_KEY = "actor/param_norm"
GROWTH_KEY = "actor/param_norm_growth"
NONFINITE_STATE_KEY = "actor/nonfinite_state"


class HealthBreach(TrainingStopped):
    """A run-health limit was crossed; names the metric, its value, the limit and the step."""

    def __init__(self, metric: str, value: float, limit: float, step: int, check: str) -> None:
        self.metric, self.value, self.limit, self.step, self.check = metric, float(value), float(limit), int(step), check
        super().__init__(f"run health: {check} at step {step}: {metric}={value:.4g} (limit {limit:.4g})")

    def __reduce__(self) -> tuple[Any, ...]:  # keep the fields through pickling (Prefect results, Ray)
        return (HealthBreach, (self.metric, self.value, self.limit, self.step, self.check))

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "value": self.value, "limit": self.limit, "step": self.step,
                "check": self.check, "reason": str(self)}


class HealthGuard:
    """`step_hooks` entry: `HealthGuard(max_kl=..., min_entropy=..., max_reward_jump=...)`.

    A limit of None switches its check off. A metric the run does not produce (e.g. `actor/kl`
    without a reference model) is skipped, with one warning. A non-finite value is a breach.
    """

    def __init__(self, max_kl: float | None = None, min_entropy: float | None = None,
                 max_reward_jump: float | None = None, max_param_norm_growth: float | None = None,
                 role: str = "actor") -> None:
        self.max_kl = max_kl
        self.min_entropy = min_entropy
        self.max_reward_jump = max_reward_jump
        self.max_param_norm_growth = max_param_norm_growth
        self.role = role  # whose weights are checked: `<role>/param_norm`, ...
        self.previous_reward: float | None = None
        self._warned: set[str] = set()

    @classmethod
    def from_config(cls, health: Any, role: str = "actor") -> HealthGuard:
        """From a `HealthConfig` section (rlcore.config). `enabled: false` lifts every limit; non-finite
        weights still stop the run (training on them is never what anyone wants). A run that
        trains another role than the policy (`role="reward_model"`) has no KL, entropy or reward to
        watch: only that role's weights are checked."""
        if not health.enabled:
            return cls(role=role)
        if role != "actor":
            return cls(max_param_norm_growth=health.max_param_norm_growth, role=role)
        return cls(max_kl=health.max_kl, min_entropy=health.min_entropy, max_reward_jump=health.max_reward_jump,
                   max_param_norm_growth=health.max_param_norm_growth)

    def state_dict(self) -> dict[str, Any]:
        """The previous step's reward, so a resumed run checks step k+1 against step k."""
        return {"previous_reward": self.previous_reward}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.previous_reward = state.get("previous_reward")

    def _value(self, metrics: dict[str, Any], key: str) -> float | None:
        if key not in metrics:
            if key not in self._warned:
                self._warned.add(key)
                log.warning("health guard: the run reports no %s; that check is skipped%s", key,
                            " (KL needs a reference model: algorithm.use_reference=true)" if key == KL_KEY else "")
            return None
        value = metrics[key]
        return float(value.item() if hasattr(value, "item") else value)

    def __call__(self, step: int, metrics: dict[str, Any]) -> None:
        if self.max_kl is not None and (kl := self._value(metrics, KL_KEY)) is not None:
            if not math.isfinite(kl) or kl > self.max_kl:
                raise HealthBreach(KL_KEY, kl, self.max_kl, step, "KL to the reference above its limit")
        if self.min_entropy is not None and (ent := self._value(metrics, ENTROPY_KEY)) is not None:
            if not math.isfinite(ent) or ent < self.min_entropy:
                raise HealthBreach(ENTROPY_KEY, ent, self.min_entropy, step, "entropy collapse")
        if self.max_reward_jump is not None and (reward := self._value(metrics, REWARD_KEY)) is not None:
            previous, self.previous_reward = self.previous_reward, reward
            if not math.isfinite(reward):
                raise HealthBreach(REWARD_KEY, reward, self.max_reward_jump, step, "non-finite reward")
            if previous is not None and abs(reward - previous) > self.max_reward_jump:
                raise HealthBreach("reward/mean_jump", abs(reward - previous), self.max_reward_jump, step,
                                   f"reward jumped from {previous:.4g} to {reward:.4g}")
        self._check_weights(step, metrics)

    def _check_weights(self, step: int, metrics: dict[str, Any]) -> None:
        """Non-finite weights or optimizer state always stop the run; so does an update that grew
        the parameter norm by more than `max_param_norm_growth`."""
        keys = {k: k.replace("actor/", f"{self.role}/", 1) for k in (NONFINITE_STATE_KEY, PARAM_NORM_KEY, GROWTH_KEY)}
        who = self.role.replace("_", " ")
        bad_state = metrics.get(keys[NONFINITE_STATE_KEY])
        if bad_state is not None and float(bad_state) > 0:
            raise HealthBreach(keys[NONFINITE_STATE_KEY], float(bad_state), 0.0, step,
                               f"non-finite values in the {who}'s weights or optimizer state")
        norm = metrics.get(keys[PARAM_NORM_KEY])
        if norm is not None and not math.isfinite(float(norm)):
            raise HealthBreach(keys[PARAM_NORM_KEY], float(norm), 0.0, step, f"non-finite {who} weights")
        growth, limit = metrics.get(keys[GROWTH_KEY]), self.max_param_norm_growth
        if growth is not None and limit is not None and float(growth) > limit:
            raise HealthBreach(keys[GROWTH_KEY], float(growth), limit, step,
                               f"the update grew the {who}'s parameter norm {float(growth):.3g}x (to {float(norm or 0):.4g})")
