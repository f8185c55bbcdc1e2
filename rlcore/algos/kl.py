"""KL between the policy and the reference: per-token estimators, KL-in-reward, KL-as-loss,
and the KL coefficient controllers (fixed, and adaptive as in Ziegler et al. 2019).

Estimators (Schulman, "Approximating KL divergence"; log-ratio d = logp - ref_logp):

- ``"k1"`` / ``"kl"``: d. Unbiased value, but its gradient is not the KL gradient.
- ``"abs"``: |d|.
- ``"k2"`` / ``"mse"``: d**2 / 2. Its gradient is the right one.
- ``"k3"`` / ``"low_var_kl"``: exp(-d) + d - 1, non-negative and low variance; as verl, -d is
  clamped to [-20, 20] before the exp and the result to [-10, 10].
- ``"<kind>+"`` (``"k1+"``, ``"k3+"``, ...): straight-through, the forward value of ``kind``
  with the gradient of k2 (arXiv:2505.17508): k1/k3 have the right expected value but the
  wrong expected gradient; k2 has the right gradient.
  ``"k2+"`` is k2.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rlcore.algos.aggregation import agg_loss
from rlcore.algos.masked import masked_mean

__all__ = [
    "KL_KINDS",
    "kl_penalty",
    "apply_kl_penalty",
    "kl_loss",
    "FixedKLController",
    "AdaptiveKLController",
    "make_kl_controller",
]

_BASE = {"k1": "k1", "kl": "k1", "abs": "abs", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3"}
KL_KINDS = tuple(_BASE) + tuple(f"{k}+" for k in _BASE)


def _forward(logprob: torch.Tensor, ref_logprob: torch.Tensor, base: str) -> torch.Tensor:
    d = logprob - ref_logprob
    if base == "k1":
        return d
    if base == "abs":
        return d.abs()
    if base == "k2":
        return 0.5 * d.square()
    neg = torch.clamp(-d, min=-20.0, max=20.0)  # k3: log(ref/p), clamped as verl
    return torch.clamp(torch.exp(neg) - neg - 1, min=-10.0, max=10.0)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of the kind named (see the module docstring), same shape as inputs."""
    straight_through = kind.endswith("+")
    base = _BASE.get(kind[:-1] if straight_through else kind)
    if base is None:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {list(KL_KINDS)}")
    value = _forward(logprob, ref_logprob, base)
    if not straight_through or base == "k2":
        return value
    k2 = 0.5 * (logprob - ref_logprob).square()
    return k2 - k2.detach() + value.detach()


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kind: str = "k1",
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL in the reward (PPO-style): rewards = scores - kl_coef * kl * mask.

    The metric ``actor/reward_kl_penalty`` is, as verl, the batch mean of each sequence's mean
    token KL; it is what an :class:`AdaptiveKLController` should be updated with (the caller
    does that, with ``n_steps`` = batch size). Sequences without valid tokens are left out of
    that mean (verl would get NaN).
    """
    m = response_mask.to(dtype=token_level_scores.dtype)
    with torch.no_grad():
        kld = kl_penalty(old_log_prob, ref_log_prob, kind).to(m.dtype) * m
        rewards = token_level_scores - kl_coef * kld
        has_tokens = m.sum(dim=-1) > 0
        current_kl = masked_mean(masked_mean(kld, m, dim=-1), has_tokens)
    return rewards, {
        "actor/reward_kl_penalty": float(current_kl),
        "actor/reward_kl_penalty_coeff": float(kl_coef),
    }


def kl_loss(
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    kind: str = "low_var_kl",
    agg_mode: str = "token-mean",
    **norm: Any,
) -> torch.Tensor:
    """KL as a loss term (GRPO-style), aggregated like the policy loss.

    ``norm`` goes to :func:`agg_loss` (``global_token_count``, ``global_seq_count``,
    ``norm_length``), so the KL term shares the micro-batch weighting of the policy loss.
    """
    return agg_loss(kl_penalty(logprob, ref_logprob, kind), response_mask, agg_mode, **norm)


class FixedKLController:
    """A constant KL coefficient."""

    kind = "fixed"

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_kind(state, self.kind)
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 (https://arxiv.org/abs/1909.08593).

    After each batch: err = clip(current_kl / target_kl - 1, -0.2, 0.2);
    value *= 1 + err * n_steps / horizon. The coefficient grows while the KL is above target
    and shrinks below it, by at most 20% per ``horizon`` samples.
    """

    kind = "adaptive"

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if target_kl <= 0:
            raise ValueError(f"target_kl must be positive, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"horizon must be positive, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        err = float(np.clip(current_kl / self.target - 1.0, -0.2, 0.2))
        self.value *= 1.0 + err * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "value": self.value, "target_kl": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_kind(state, self.kind)
        self.value = float(state["value"])
        self.target = float(state.get("target_kl", self.target))
        self.horizon = float(state.get("horizon", self.horizon))


def _check_kind(state: dict[str, Any], kind: str) -> None:
    if state.get("kind", kind) != kind:
        raise ValueError(f"state of a {state['kind']!r} KL controller loaded into a {kind!r} one")


KLController = FixedKLController | AdaptiveKLController


def make_kl_controller(
    kind: str = "fixed",
    *,
    kl_coef: float,
    target_kl: float | None = None,
    horizon: float | None = None,
) -> KLController:
    """``"fixed"`` -> FixedKLController(kl_coef); ``"adaptive"`` needs target_kl and horizon."""
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            missing = [n for n, v in (("target_kl", target_kl), ("horizon", horizon)) if v is None]
            raise ValueError(f"adaptive KL controller needs {', '.join(missing)}")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller kind {kind!r}; choose one of ['fixed', 'adaptive']")
