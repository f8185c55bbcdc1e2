"""Attention over packed sequences, registered with transformers as `rlcore_varlen`.

A model loaded with `model.use_remove_padding` (the default) runs this attention function. On a
packed row (the forward carries `cu_seq_lens_q`, see `rlcore.workers.packed`) each sequence attends
causally to itself only:

- CUDA, bf16/fp16, `flash-attn` installed: `flash_attn_varlen_func` over the whole row;
- CUDA, bf16/fp16, an Ampere or newer GPU, no flash-attn: torch's own fused kernel for packed
  sequences, `torch.nn.attention.varlen.varlen_attn` (Flash kernels shipped inside torch), over
  the whole row, grouped-query attention without repeating key/value heads where the installed
  torch takes `enable_gqa`; measured on an H200 (14/2 heads x 64, 128 sequences x 276 tokens,
  forward + backward per layer): 1.8 ms against 35.2 ms for the per-sequence loop;
- anywhere else (CPU, float32): causal SDPA once per run of equal-length sequences (grouped-query
  attention by `enable_gqa`): the loop `pack_rows`' length order keeps short.

`packed_attention_path` makes that choice from the device, dtype and what is installed, and logs
it once per process. On the two fused paths rows do not share prompts (`prompt_sharing`): those
kernels take each sequence whole, prompt and response together.

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

import inspect
import itertools
import logging
from functools import cache
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from rlcore.workers.packed import SHARED_PROMPTS_KWARG, SharedPrompts

log = logging.getLogger(__name__)

VARLEN = "rlcore_varlen"
COMPUTE_DTYPE = "rlcore_compute_dtype"  # set on a model whose forward computes in another dtype than its weights
PackedPath = Literal["flash_attn", "torch_varlen", "sdpa_per_length"]
FUSED_DTYPES = (torch.float16, torch.bfloat16)  # what the Flash kernels take
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
    shared: SharedPrompts | None = None,
) -> torch.Tensor:
    """Causal attention of each packed sequence to itself: query `[1, H, T, D]`, key and value
    `[1, H_kv, T, D]`; returns `[1, T, H, D]` (transformers' attention output layout). With
    `shared`, the tokens before `cu_seqlens[0]` are responses that attend to a prompt elsewhere in
    the row (`rlcore.workers.packed.SharedPrompts`)."""
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one packed row, got a batch of {query.shape[0]}")
    path = path_for(query)
    if (path == "torch_varlen" and dropout) or shared is not None:
        path = "sdpa_per_length"  # torch's varlen_attn has no attention dropout; the fused kernels take no shared prompts
    if path != "sdpa_per_length":
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, D]
        cu = cu_seqlens.to(device=query.device, dtype=torch.int32)
        if path == "flash_attn":
            from flash_attn import flash_attn_varlen_func

            out = flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, dropout_p=dropout, softmax_scale=scale,
                                         causal=True)
        else:
            out = torch_varlen_causal(q, k, v, cu, max_seqlen, scale=scale)
        return out.unsqueeze(0)
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if bounds[0] != (shared.tokens if shared is not None else 0) or bounds[-1] != query.shape[2]:
        raise ValueError(f"cu_seqlens {bounds[0]}..{bounds[-1]} do not cover the {query.shape[2]} packed tokens after the "
                         f"{shared.tokens if shared is not None else 0} shared-prompt responses")
    # One SDPA per run of equal-length sequences (pack_rows orders them by length), [count, heads, length, D] views.
    runs = [(len(list(group)), length) for length, group in itertools.groupby(b - a for a, b in zip(bounds, bounds[1:]))]
    sizes = [count * length for count, length in runs]
    gqa = query.shape[1] != key.shape[1]
    # squeeze, not [0]: a view whose backward is a view too (select's writes its gradient into a zeroed copy of the row)
    query, key, value = (t.squeeze(0) for t in (query, key, value))  # [heads, tokens, D]
    q_parts, k_parts, v_parts = (t.split([bounds[0], *sizes], 1) for t in (query, key, value))
    outs = []
    if shared is not None and shared.buckets:
        outs += _shared_prompt_attention(q_parts[0], key, value, shared, scale=scale, dropout=dropout, gqa=gqa)
    for (count, length), q, k, v in zip(runs, q_parts[1:], k_parts[1:], v_parts[1:]):
        if length:
            out = F.scaled_dot_product_attention(_batched(q, count), _batched(k, count), _batched(v, count), dropout_p=dropout,
                                                 is_causal=True, scale=scale, enable_gqa=gqa)
            outs.append(out.transpose(1, 2).reshape(count * length, *out.shape[1:2], out.shape[-1]))
    return torch.cat(outs).unsqueeze(0)


def _shared_prompt_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, shared: SharedPrompts, *, scale: float | None,
    dropout: float, gqa: bool,
) -> list[torch.Tensor]:
    """Outputs `[count * response, H, D]` per bucket of the responses whose prompt another row holds:
    query `[H, shared.tokens, D]` (theirs), key/value `[H_kv, T, D]` (the whole row), gathered per
    response as its prompt then itself."""
    keys, values = (t.index_select(1, shared.key_index) for t in (key, value))
    key_sizes = [count * (prompt + response) for count, prompt, response in shared.buckets]
    q_parts = query.split([count * response for count, _, response in shared.buckets], 1)
    outs = []
    for (count, prompt, response), q, k, v in zip(shared.buckets, q_parts, keys.split(key_sizes, 1), values.split(key_sizes, 1)):
        visible = torch.arange(prompt + response, device=q.device)[None, :] <= torch.arange(response, device=q.device)[:, None] + prompt
        out = F.scaled_dot_product_attention(_batched(q, count), _batched(k, count), _batched(v, count), attn_mask=visible,
                                             dropout_p=dropout, scale=scale, enable_gqa=gqa)
        outs.append(out.transpose(1, 2).reshape(count * response, *out.shape[1:2], out.shape[-1]))
    return outs


def _batched(x: torch.Tensor, count: int) -> torch.Tensor:
    """`[heads, count * length, D]` as `[count, heads, length, D]` (a view)."""
    return x.unflatten(1, (count, x.shape[1] // count)).transpose(0, 1)


def torch_varlen_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, *,
                        scale: float | None) -> torch.Tensor:
    """Causal attention of each packed sequence by `torch.nn.attention.varlen.varlen_attn`: q
    `[T, H, D]`, k and v `[T, H_kv, D]`, returns `[T, H, D]`. Spelled for the torch at hand (its
    keywords moved between releases: `is_causal`, or `window_size=(-1, 0)`; `enable_gqa` where it
    takes key/value heads that query heads share, else they are repeated)."""
    from torch.nn.attention.varlen import varlen_attn

    takes = _varlen_keywords()
    kwargs: dict[str, Any] = {"is_causal": True} if "is_causal" in takes else {"window_size": (-1, 0)}
    if scale is not None:
        kwargs["scale"] = scale
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in takes:
            kwargs["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs)  # type: ignore[no-any-return]


@cache
def _varlen_keywords() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def packed_attention_path(device_type: str, dtype: torch.dtype, *, flash_attn: bool, torch_varlen: bool,
                          capability: tuple[int, int] | None) -> PackedPath:
    """Which kernel runs a packed row (module doc): flash-attn's where installed, else torch's
    `varlen_attn` (its Flash kernels need an Ampere or newer GPU, `capability` >= (8, 0)), both
    on CUDA in bf16/fp16 only; else SDPA per run of equal-length sequences."""
    if device_type != "cuda" or dtype not in FUSED_DTYPES:
        return "sdpa_per_length"
    if flash_attn:
        return "flash_attn"
    if torch_varlen and capability is not None and capability >= (8, 0):
        return "torch_varlen"
    return "sdpa_per_length"


def path_for(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> PackedPath:
    """`packed_attention_path` for a tensor's device and its dtype (or `dtype`, the one attention
    computes in) on this machine; logged once per device and dtype."""
    dtype = dtype or tensor.dtype
    if not tensor.is_cuda:
        return _logged("sdpa_per_length", tensor.device.type, dtype)
    capability = torch.cuda.get_device_capability(tensor.device)
    path = packed_attention_path("cuda", dtype, flash_attn=_flash_attn_installed(),
                                 torch_varlen=_torch_varlen_available(), capability=capability)
    return _logged(path, f"cuda (sm_{capability[0]}{capability[1]})", dtype)


@cache
def _logged(path: PackedPath, device: str, dtype: torch.dtype) -> PackedPath:
    why = {"flash_attn": "flash-attn's flash_attn_varlen_func",
           "torch_varlen": "torch's fused varlen_attn (flash-attn not installed)",
           "sdpa_per_length": "causal SDPA per run of equal-length sequences (no fused varlen kernel for this device "
                              "and dtype)"}[path]
    log.info("packed attention on %s %s: %s%s", device, str(dtype).removeprefix("torch."), why,
             "; rows do not share prompts on this path" if path != "sdpa_per_length" else "")
    return path


def prompt_sharing(model: nn.Module) -> bool:
    """Whether `model`'s packed attention takes shared prompts: rlcore's (`use_packed_attention`; any
    other attention would drop the keyword and let followers see no prompt) on the per-length SDPA
    path only (the fused kernels take each sequence whole). Judged at the dtype attention computes
    in: float32 masters under bf16 mixed precision compute in bf16 (`COMPUTE_DTYPE`)."""
    if getattr(model.config, "_attn_implementation", None) != VARLEN:
        return False
    weight = model.get_input_embeddings().weight
    return path_for(weight, getattr(model, COMPUTE_DTYPE, None)) == "sdpa_per_length"


@cache
def _flash_attn_installed() -> bool:
    from transformers.utils import is_flash_attn_2_available

    return bool(is_flash_attn_2_available())


@cache
def _torch_varlen_available() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


@torch.compiler.disable  # left eager inside a compiled layer (`rlcore.workers.compile`): the per-length path reads lengths
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
    sequence_parallel, shared = kwargs.get(SEQUENCE_PARALLEL_KWARG), kwargs.get(SHARED_PROMPTS_KWARG)
    if sequence_parallel is not None:
        return sequence_parallel.attention(query, key, value, cu_seqlens, max_seqlen, scale=scaling, dropout=dropout,
                                           shared=shared), None
    out = varlen_attention(query, key, value, cu_seqlens, max_seqlen, scale=scaling, dropout=dropout, shared=shared)
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


__all__ = ["COMPUTE_DTYPE", "SEQUENCE_PARALLEL_KWARG", "VARLEN", "PackedPath", "packed_attention_path", "path_for", "prompt_sharing", "register",
           "torch_varlen_causal", "use_packed_attention", "varlen_attention"]
