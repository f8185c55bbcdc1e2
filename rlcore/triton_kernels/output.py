"""The result type shared by the fused and the naive per-token log-prob functions."""

from __future__ import annotations

from typing import NamedTuple

import torch


class FusedOutput(NamedTuple):
    """Per-token results, float32, shaped like ``targets``.

    A NamedTuple so callers can unpack it (``logp, ent, kl = fused_token_logprobs(...)``);
    ``entropy`` is None unless asked for, ``kl`` is None unless ``ref_logprobs`` was given.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    kl: torch.Tensor | None
