"""Fused per-token log-prob and entropy from hidden states and the LM head (with its bias,
logit scale and soft-cap).

The full [tokens, vocab] float32 logits never exist: a chunked torch path runs everywhere,
Triton kernels run on CUDA (and on CPU under ``TRITON_INTERPRET=1`` for tests).
"""

from rlcore.triton_kernels.fused import BACKENDS, VocabShard, fused_token_logprobs, resolve_backend, triton_available
from rlcore.triton_kernels.logit_map import LogitMap
from rlcore.triton_kernels.naive import naive_token_logprobs
from rlcore.triton_kernels.output import FusedOutput

__all__ = [
    "BACKENDS",
    "FusedOutput",
    "LogitMap",
    "VocabShard",
    "fused_token_logprobs",
    "naive_token_logprobs",
    "resolve_backend",
    "triton_available",
]
