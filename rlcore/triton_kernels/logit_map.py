"""The LM head's own logit semantics, as the kernels apply them to each logits tile.

A causal LM's logits are not always ``hidden @ W.T``: heads may carry a bias (Phi, GPT-J), scale
the logits (Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``) or soft-cap them (Gemma 2/3's
``final_logit_softcapping``). With ``raw = hidden @ W.T + bias``, the sampled logits are

    linear:    z = raw * scale / T
    softcap:   z = cap * tanh(raw * scale / cap) / T

so every variant is ``z = raw * pre`` or ``z = post * tanh(raw * pre)``: two scalars that the torch
and Triton paths share, and dz/draw = ``pre`` or ``pre * post * (1 - tanh^2)`` for the backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LogitMap:
    """z = pre * raw (``post`` None) or post * tanh(pre * raw) (soft-capped)."""

    pre: float
    post: float | None = None

    @classmethod
    def of(cls, temperature: float, logit_scale: float = 1.0, softcap: float | None = None) -> LogitMap:
        if not (temperature > 0 and math.isfinite(temperature)):
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if not (math.isfinite(logit_scale) and logit_scale != 0):
            raise ValueError(f"logit_scale must be finite and non-zero, got {logit_scale}")
        if softcap is None:
            return cls(pre=float(logit_scale) / float(temperature))
        if not (softcap > 0 and math.isfinite(softcap)):
            raise ValueError(f"softcap must be > 0 or None, got {softcap}")
        return cls(pre=float(logit_scale) / float(softcap), post=float(softcap) / float(temperature))

    @property
    def capped(self) -> bool:
        return self.post is not None
