"""`rlcore_decode`: transformers' SDPA attention, except for one decoding step of a grouped-query
attention model on the CPU.

With a padding mask transformers' SDPA path repeats every key/value head for its query heads
(`repeat_kv`: a copy of the whole KV cache, per layer, per generated token). For one new token
that is not needed: the query heads of one key/value head can be that head's queries (a
`[rows, kv heads, group, head dim]` view), all at the same position, so one SDPA over the cache as
it is computes the same output (long-tail benchmark, 6 layers, 2 KV heads: the decode loop spent
~45% of its CPU time in those copies; one such attention is ~17x faster than repeat + SDPA).
Everything else (prefill, GPU, multi-head attention) is transformers' own `sdpa` path.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

DECODE = "rlcore_decode"


def _attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    rows, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    if q_len != 1 or heads == kv_heads or query.device.type != "cpu" or kwargs.get("position_bias") is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    grouped = query.reshape(rows, kv_heads, heads // kv_heads, dim)  # a KV head's query heads as its queries
    mask = attention_mask[:, :, :, : key.shape[2]] if attention_mask is not None else None  # [rows, 1, 1, keys]
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.reshape(rows, 1, heads, dim), None  # transformers' output layout [rows, tokens, heads, dim]


@cache
def register() -> str:
    """Register `rlcore_decode` with transformers (its attention; the mask is SDPA's); its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(DECODE, _attention)
    AttentionMaskInterface.register(DECODE, sdpa_mask)
    return DECODE


def use_decode_attention(model: nn.Module) -> nn.Module:
    """Switch a model on transformers' SDPA attention to `rlcore_decode` (any other is left as it is)."""
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(register())
    return model


__all__ = ["DECODE", "register", "use_decode_attention"]
