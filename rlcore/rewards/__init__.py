"""Rewards: rule-based scorers, user reward functions by spec, and a fault-tolerant scoring pool.

Scorers follow verl's conventions so existing reward functions and datasets work unchanged:
`compute_score(data_source, solution_str, ground_truth, extra_info)` returning a float or a
dict with a "score" key. Importing this package does not import torch (workers start fast).
"""

from . import gsm8k, math_boxed
from .format import format_reward
from .manager import (
    RewardScorer,
    RewardWorkerError,
    ScoreItem,
    ScoreResult,
    scores_to_token_rewards,
)
from .registry import (
    RewardFunctionError,
    builtin_data_sources,
    default_compute_score,
    load_reward_fn,
    normalize_result,
)

__all__ = [
    "RewardFunctionError",
    "RewardScorer",
    "RewardWorkerError",
    "ScoreItem",
    "ScoreResult",
    "builtin_data_sources",
    "default_compute_score",
    "format_reward",
    "gsm8k",
    "load_reward_fn",
    "math_boxed",
    "normalize_result",
    "scores_to_token_rewards",
]
