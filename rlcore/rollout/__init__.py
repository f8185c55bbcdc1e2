"""Rollout engines: prompts in, sampled responses with their log-probs out.

`make_rollout_engine("hf", ...)` builds a backend by name; every backend follows the
`RolloutEngine` protocol in `base.py`.
"""

from rlcore.rollout.base import (
    RolloutEngine,
    SamplingParams,
    make_rollout_engine,
    register_backend,
    resolve_backend,
    vllm_installed,
)
from rlcore.rollout.hf import HFRolloutEngine

__all__ = [
    "HFRolloutEngine",
    "RolloutEngine",
    "SamplingParams",
    "make_rollout_engine",
    "register_backend",
    "resolve_backend",
    "vllm_installed",
]
