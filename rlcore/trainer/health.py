"""Run-health guard: stops a run going bad before it wastes compute or produces a broken or
reward-hacked model. Every recipe runs it after every step (`health:` settings).

Checked on the step's metrics: KL to the reference above a limit (the policy drifted), entropy
below a floor (the policy collapsed onto a few tokens), a jump of the mean reward or of the KL
between consecutive steps that is large for this run (a reward exploit being found, the policy
lurching away), and the actor's weights: a non-finite parameter or optimizer state, or a
parameter norm growing by more than a factor in one step (an exploding update, e.g. a huge
learning rate, with a loss that still looks finite). A breach raises `HealthBreach`, a
`TrainingStopped` whose message names the `health.*` setting and its value: the recipe then ends
without checkpointing that step, so the newest complete checkpoint is the last healthy one.

Jumps are judged against the run's own scale (`JumpCheck`), since rewards come on any scale
(0/1, 0/10, -100..100): a step's move of the mean is compared with the spread of the samples of
the last `health.jump_window` steps (the per-sample reward, or per-sequence KL, over those steps
together), and the check is off until that many steps exist and their spread is not zero.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any

from rlcore.trainer.run_state import TrainingStopped

log = logging.getLogger(__name__)

KL_KEY = "actor/kl"
KL_STD_KEY = "actor/kl_std"  # the spread of the per-sequence KL over the step's samples
ENTROPY_KEY = "actor/entropy"
REWARD_KEY = "reward/mean"
REWARD_STD_KEY = "reward/std"
PARAM_NORM_KEY = "actor/param_norm"
GROWTH_KEY = "actor/param_norm_growth"
NONFINITE_STATE_KEY = "actor/nonfinite_state"


class HealthBreach(TrainingStopped):
    """A run-health limit was crossed; names the metric, its value, the limit, the step and the
    `health.*` setting that set the limit (`setting`, e.g. "health.max_kl=1"; None: always checked)."""

    def __init__(self, metric: str, value: float, limit: float, step: int, check: str, setting: str | None = None) -> None:
        self.metric, self.value, self.limit, self.step, self.check = metric, float(value), float(limit), int(step), check
        self.setting = setting
        how = (f"; {setting}: raise it, or set it to null to switch this check off" if setting
               else "; this check is always on")
        super().__init__(f"run health: {check} at step {step}: {metric}={value:.4g} (limit {limit:.4g}{how})")

    def __reduce__(self) -> tuple[Any, ...]:  # keep the fields through pickling (Prefect results, Ray)
        return (HealthBreach, (self.metric, self.value, self.limit, self.step, self.check, self.setting))

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "value": self.value, "limit": self.limit, "step": self.step,
                "check": self.check, "setting": self.setting, "reason": str(self)}


class JumpCheck:
    """A metric's move between consecutive steps against the run's own recent spread: `sigmas`
    times the standard deviation of the samples of the last `window` steps, pooled from each
    step's mean and per-sample std (`spread_key`), i.e. of all those samples together. Off until
    `window` steps have been seen and while their spread is 0 (no baseline yet)."""

    def __init__(self, key: str, spread_key: str, sigmas: float, window: int, setting: str) -> None:
        self.key, self.spread_key, self.sigmas, self.window, self.setting = key, spread_key, sigmas, window, setting
        self.history: deque[tuple[float, float]] = deque(maxlen=window)  # (mean, per-sample std) per step

    def spread(self) -> float:
        """The std of the samples of the steps in the window (equal weight per step)."""
        means = [m for m, _ in self.history]
        centre = sum(means) / len(means)
        return math.sqrt(sum(s * s + (m - centre) ** 2 for m, s in self.history) / len(self.history))

    def __call__(self, step: int, value: float, spread: float) -> None:
        if len(self.history) == self.window and math.isfinite(value):
            baseline = self.spread()
            previous = self.history[-1][0]
            if baseline > 0 and abs(value - previous) > self.sigmas * baseline:
                raise HealthBreach(f"{self.key}_jump", abs(value - previous), self.sigmas * baseline, step,
                                   f"{self.key} jumped from {previous:.4g} to {value:.4g}, {abs(value - previous) / baseline:.3g}x "
                                   f"the spread of the last {self.window} steps ({baseline:.4g})",
                                   f"health.{self.setting}={self.sigmas:g} times that spread")
        if math.isfinite(value) and math.isfinite(spread):
            self.history.append((value, spread))

    def state_dict(self) -> list[list[float]]:
        return [list(h) for h in self.history]

    def load_state_dict(self, state: list[list[float]]) -> None:
        self.history = deque(((float(m), float(s)) for m, s in state), maxlen=self.window)


class HealthGuard:
    """`step_hooks` entry: `HealthGuard(max_kl=..., min_entropy=..., reward_jump_sigmas=...)`.

    A limit of None switches its check off. A metric the run does not produce (e.g. `actor/kl`
    without a reference model) is skipped, with one warning. A non-finite value is a breach.
    `max_reward_jump` is an absolute limit on the reward's move (for a run whose reward scale is
    known); `reward_jump_sigmas` and `kl_jump_sigmas` scale with the run (`JumpCheck`).
    """

    def __init__(self, max_kl: float | None = None, min_entropy: float | None = None,
                 max_reward_jump: float | None = None, max_param_norm_growth: float | None = None,
                 role: str = "actor", *, reward_jump_sigmas: float | None = None, kl_jump_sigmas: float | None = None,
                 jump_window: int = 5) -> None:
        self.max_kl = max_kl
        self.min_entropy = min_entropy
        self.max_reward_jump = max_reward_jump
        self.max_param_norm_growth = max_param_norm_growth
        self.role = role  # whose weights are checked: `<role>/param_norm`, ...
        self.previous_reward: float | None = None
        self.jumps = [JumpCheck(key, spread, sigmas, jump_window, setting) for key, spread, sigmas, setting in (
            (REWARD_KEY, REWARD_STD_KEY, reward_jump_sigmas, "reward_jump_sigmas"),
            (KL_KEY, KL_STD_KEY, kl_jump_sigmas, "kl_jump_sigmas")) if sigmas is not None]
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
                   max_param_norm_growth=health.max_param_norm_growth, reward_jump_sigmas=health.reward_jump_sigmas,
                   kl_jump_sigmas=health.kl_jump_sigmas, jump_window=health.jump_window)

    def state_dict(self) -> dict[str, Any]:
        """The previous step's reward and the jump checks' recent steps, so a resumed run checks
        step k+1 against the steps before it."""
        return {"previous_reward": self.previous_reward, "jumps": {j.key: j.state_dict() for j in self.jumps}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.previous_reward = state.get("previous_reward")
        for jump in self.jumps:  # a checkpoint from before the jump checks: their baseline starts again
            jump.load_state_dict(state.get("jumps", {}).get(jump.key, []))

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
                raise HealthBreach(KL_KEY, kl, self.max_kl, step, "KL to the reference above its limit",
                                   f"health.max_kl={self.max_kl:g}")
        if self.min_entropy is not None and (ent := self._value(metrics, ENTROPY_KEY)) is not None:
            if not math.isfinite(ent) or ent < self.min_entropy:
                raise HealthBreach(ENTROPY_KEY, ent, self.min_entropy, step, "entropy collapse",
                                   f"health.min_entropy={self.min_entropy:g}")
        if self.max_reward_jump is not None and (reward := self._value(metrics, REWARD_KEY)) is not None:
            previous, self.previous_reward = self.previous_reward, reward
            if not math.isfinite(reward):
                raise HealthBreach(REWARD_KEY, reward, self.max_reward_jump, step, "non-finite reward",
                                   f"health.max_reward_jump={self.max_reward_jump:g}")
            if previous is not None and abs(reward - previous) > self.max_reward_jump:
                raise HealthBreach("reward/mean_jump", abs(reward - previous), self.max_reward_jump, step,
                                   f"reward jumped from {previous:.4g} to {reward:.4g}",
                                   f"health.max_reward_jump={self.max_reward_jump:g}")
        for jump in self.jumps:
            if (value := self._value(metrics, jump.key)) is not None and (spread := self._value(metrics, jump.spread_key)) is not None:
                if not math.isfinite(value):
                    raise HealthBreach(jump.key, value, jump.sigmas, step, f"non-finite {jump.key}",
                                       f"health.{jump.setting}={jump.sigmas:g}")
                jump(step, value, spread)
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
                               f"the update grew the {who}'s parameter norm {float(growth):.3g}x (to {float(norm or 0):.4g})",
                               f"health.max_param_norm_growth={limit:g}")
