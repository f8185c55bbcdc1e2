"""The promotion gate: does a candidate replace the champion?

A candidate is promoted only when (1) its score (accuracy or mean reward, on the same held-out
data as the champion) beats the champion's by at least `margin`, and (2) it stays within the
reward-hacking budget: mean per-token KL to the reference model at most `max_kl`, and mean
response length at most `max_length_ratio` times the champion's. Budgets are checked first: a
candidate that games the reward by drifting far or padding its answers is rejected however well
it scores. Without a champion, the baseline is the reference (base) model itself.

A reward model goes through the same gate on its held-out pairwise accuracy (`pairwise_accuracy`,
metrics without KL or length: those budgets do not apply); without a champion its baseline is
chance (0.5).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class GatePolicy:
    metric: str = "accuracy"
    margin: float = 0.01
    max_kl: float = 0.5
    max_length_ratio: float = 1.5

    @classmethod
    def from_config(cls, registry: Any) -> GatePolicy:
        """From a `RegistryConfig` section (rlcore.config)."""
        return cls(metric=registry.metric, margin=registry.promotion_margin, max_kl=registry.max_kl,
                   max_length_ratio=registry.max_length_ratio)


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str
    candidate_score: float
    baseline_score: float
    check: str  # "promoted", "kl_budget", "length_budget", "margin"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def decide(candidate: dict[str, float], baseline: dict[str, float], policy: GatePolicy,
           baseline_name: str = "champion") -> Decision:
    """`candidate` / `baseline`: evaluation metrics (`EvalResult.metrics()`) on the same data."""
    metric = policy.metric
    cand, base = float(candidate[metric]), float(baseline[metric])
    kl = float(candidate.get("kl_to_reference", 0.0))  # a reward model generates nothing: no KL or length budget
    if kl > policy.max_kl:
        return Decision(False, f"KL to the reference {kl:.4g} exceeds the budget {policy.max_kl:.4g}", cand, base, "kl_budget")
    base_len = float(baseline.get("response_length", 0.0))
    cand_len = float(candidate.get("response_length", 0.0))
    if base_len > 0 and cand_len > policy.max_length_ratio * base_len:
        return Decision(False, f"mean response length {cand_len:.4g} exceeds {policy.max_length_ratio:.4g} x the "
                               f"{baseline_name}'s {base_len:.4g}", cand, base, "length_budget")
    if cand < base + policy.margin:
        return Decision(False, f"{metric} {cand:.4f} does not beat the {baseline_name}'s {base:.4f} by the margin "
                               f"{policy.margin:.4g}", cand, base, "margin")
    budget = f"; KL {kl:.4g} <= {policy.max_kl:.4g}" if "kl_to_reference" in candidate else ""
    return Decision(True, f"{metric} {cand:.4f} beats the {baseline_name}'s {base:.4f} by {cand - base:.4f} "
                          f"(margin {policy.margin:.4g}){budget}", cand, base, "promoted")
