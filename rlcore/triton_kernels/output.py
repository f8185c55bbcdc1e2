"""The result type shared by the fused and the naive per-token log-prob functions."""

from __future__ import annotations

from typing import NamedTuple

import torch


class FusedOutput(NamedTuple):
    """Per-token results, float32, shaped like ``targets``.

    A NamedTuple so callers can unpack it (``logp, ent = fused_token_logprobs(...)``);
    ``entropy`` is None unless asked for. A KL to a reference is not computed here: it is an
    elementwise function of two log-prob vectors (``rlcore.algos.kl``), nothing a kernel saves.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
