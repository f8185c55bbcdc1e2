"""Attention over packed sequences, registered with transformers as `rlcore_varlen`.

A model loaded with `model.use_remove_padding` (the default) runs this attention function. On a
packed row (the forward carries `cu_seq_lens_q`, see `rlcore.workers.packed`) each sequence attends
causally to itself only:

- CUDA, bf16/fp16, `flash-attn` installed: `flash_attn_varlen_func` over the whole row;
- anywhere else: causal SDPA once per sequence (grouped-query attention by `enable_gqa`).

Either costs O(sum L_i^2). Transformers' own packed path (sdpa with `attention_mask=None` and
restarting position ids) instead builds a dense block-diagonal [T, T] bool mask (16 MiB at 4K
tokens, 1 GiB at 32K) and attends over all of it, O(T^2): measured by
`benchmarks/bench_lengths.py`, a 4,068-token packed row of 13 sequences (forward + backward of a
4.7M-parameter Llama, 1 CPU thread) took 3.3x the CPU time of this path. The matching mask
function builds no mask for such a row. Every other call (a padded batch, decoding
with a KV cache) goes to transformers' sdpa unchanged, so the model behaves as before there.

`varlen_attention` takes the packed `[1, heads, T, head_dim]` query/key/value of one packed row
and its `cu_seqlens`. A sequence-parallel forward (`rlcore.workers.ulysses`) passes its group as
the keyword `rlcore_sequence_parallel`, which transformers hands through every layer to this
function: the rank then holds a slice of the row, and the group's `attention` trades it for all
tokens of a subset of heads around `varlen_attention`.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VARLEN = "rlcore_varlen"
SEQUENCE_PARALLEL_KWARG = "rlcore_sequence_parallel"  # a `ulysses.SequenceParallel`, passed through the backbone


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    scale: float | None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Causal attention of each packed sequence to itself: query `[1, H, T, D]`, key and value
    `[1, H_kv, T, D]`; returns `[1, T, H, D]` (transformers' attention output layout)."""
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one packed row, got a batch of {query.shape[0]}")
    if _use_flash_attn(query):
        from flash_attn import flash_attn_varlen_func

        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, D]
        cu = cu_seqlens.to(device=query.device, dtype=torch.int32)
        out = flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, dropout_p=dropout, softmax_scale=scale, causal=True)
        return out.unsqueeze(0)
    lens = [int(x) for x in torch.diff(cu_seqlens).tolist()]
    gqa = query.shape[1] != key.shape[1]
    parts = [
        F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scale, enable_gqa=gqa)
        for q, k, v in zip(query.split(lens, 2), key.split(lens, 2), value.split(lens, 2))
        if q.shape[2]
    ]
    return torch.cat(parts, 2).transpose(1, 2)


@cache
def _flash_attn_installed() -> bool:
    from transformers.utils import is_flash_attn_2_available

    return bool(is_flash_attn_2_available())


def _use_flash_attn(query: torch.Tensor) -> bool:
    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and _flash_attn_installed()


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
    """transformers' attention-function signature: packed rows through `varlen_attention`, every
    other call through transformers' sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None and attention_mask is None:
        cu_seqlens = _packed_from_positions(query, key, kwargs.get("position_ids"))
    if cu_seqlens is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    max_seqlen = int(kwargs.get("max_length_q") or torch.diff(cu_seqlens).max())
    window = kwargs.get("sliding_window")
    unsupported = [k for k in ("softcap", "s_aux", "position_bias") if kwargs.get(k) is not None]
    if window is not None and max_seqlen > window:  # within the window, sliding attention is causal attention
        unsupported.append(f"sliding_window={window} (a sequence of {max_seqlen} tokens)")
    is_causal = kwargs.get("is_causal")
    if unsupported or not (getattr(module, "is_causal", True) if is_causal is None else is_causal):
        what = ", ".join(unsupported) or "non-causal attention"
        raise ValueError(f"{type(module).__name__}: rlcore's packed-sequence attention does not support {what}; "
                         "set model.use_remove_padding=false for this model")
    sequence_parallel = kwargs.get(SEQUENCE_PARALLEL_KWARG)
    if sequence_parallel is not None:
        return sequence_parallel.attention(query, key, value, cu_seqlens, max_seqlen, scale=scaling, dropout=dropout), None
    out = varlen_attention(query, key, value, cu_seqlens, max_seqlen, scale=scaling, dropout=dropout)
    return out, None


def _packed_from_positions(query: torch.Tensor, key: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """cu_seqlens of one row packed the way transformers detects it (position ids that restart,
    no mask, no cache), for a caller that packed without passing them; None for anything else."""
    if position_ids is None or query.shape[0] != 1 or query.shape[2] != key.shape[2] or position_ids.shape[-1] != query.shape[2]:
        return None
    pos = position_ids.reshape(-1)
    starts = torch.cat([pos.new_zeros(1), (torch.diff(pos) != 1).nonzero().squeeze(1) + 1])
    if starts.numel() == 1:
        return None  # one sequence: plain causal sdpa is the same
    return torch.cat([starts, starts.new_tensor([pos.numel()])]).to(torch.int32)


def _mask(batch_size: int, q_length: int, kv_length: int, attention_mask: torch.Tensor | None = None, **kwargs: Any):
    """No mask for one row without padding (a packed row; `_attention` separates its sequences),
    else the mask transformers' sdpa would get."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None and batch_size == 1 and q_length == kv_length and not kwargs.get("q_offset") and not kwargs.get("kv_offset"):
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, attention_mask=attention_mask, **kwargs)


@cache
def register() -> str:
    """Register `rlcore_varlen` with transformers (attention and mask functions); its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN, _attention)
    AttentionMaskInterface.register(VARLEN, _mask)
    return VARLEN


def use_packed_attention(model: nn.Module) -> nn.Module:
    """Switch `model` to `rlcore_varlen` attention; refused (ValueError naming the config key) for
    a model whose attention transformers cannot swap."""
    try:
        model.set_attn_implementation(register())
    except (ValueError, NotImplementedError, AttributeError) as err:
        raise ValueError(f"{type(model).__name__} cannot run rlcore's packed-sequence attention ({err}); "
                         "set model.use_remove_padding=false to train it on padded batches") from err
    return model


__all__ = ["SEQUENCE_PARALLEL_KWARG", "VARLEN", "register", "use_packed_attention", "varlen_attention"]
