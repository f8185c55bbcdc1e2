"""Rollout engines: prompts in, sampled responses with their log-probs out.

`make_rollout_engine("hf", ...)` builds a backend by name; every backend follows the
`RolloutEngine` protocol in `base.py`, and is a row of `rlcore.rollout_backends` (its traits).
"""

from rlcore.rollout.base import (
    BackendTraits,
    RolloutEngine,
    SamplingParams,
    make_rollout_engine,
    register_backend,
    resolve_backend,
    vllm_installed,
)
from rlcore.rollout.hf import HFRolloutEngine

__all__ = [
    "BackendTraits",
    "HFRolloutEngine",
    "RolloutEngine",
    "SamplingParams",
    "make_rollout_engine",
    "register_backend",
    "resolve_backend",
    "vllm_installed",
]
