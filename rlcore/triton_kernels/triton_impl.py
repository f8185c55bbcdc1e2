"""Triton kernels for per-token log-prob and entropy straight from hidden states and LM head.

Import this module lazily (``rlcore.triton_kernels.fused`` does): ``triton.jit`` decides at
decoration time whether to build an interpreted function, so ``TRITON_INTERPRET=1`` must be
in the environment before the first import for the kernels to run on CPU tensors.

Three kernels, none of which materialises more than one [BLOCK_N, BLOCK_V] logits tile per
program:

* ``_fwd_kernel`` - grid over token blocks; walks the vocabulary in tiles, computing each
  logits tile as a K-loop of ``tl.dot`` (fp32 accumulation) and folding it into an online
  log-sum-exp (running max m, s = sum exp(z-m), t = sum exp(z-m)(z-m)). Writes logprob,
  entropy and lse (kept for the backward).
* ``_bwd_hidden_kernel`` - grid over token blocks; recomputes each logits tile, turns it into
  grad_logits, and adds grad_logits @ W_tile into its own rows of an fp32 grad_hidden buffer.
* ``_bwd_weight_kernel`` - grid over vocab blocks; the same recompute, adding
  grad_logits^T @ h_tile into its own rows of an fp32 grad_weight buffer, and the column sums
  of grad_logits into its own entries of grad_bias (a head with a bias).

Every logits tile carries the head's own semantics (bias, logit scale, soft-cap: ``logit_map``),
selected by constexpr flags, so a head without them compiles to the plain kernels.

Each program owns the rows it writes, so there are no atomics: results are deterministic and
the kernels run unchanged under the interpreter. The price is one extra logits recompute
(the weight pass) compared with an atomic-add design.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from rlcore.triton_kernels.logit_map import LogitMap

# Tile sizes for the GPU; the interpreter tests pass smaller ones. All >= 16 (tl.dot minimum).
BLOCK_N = 64
BLOCK_V = 64
BLOCK_H = 64


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b with fp32 accumulation.

    "ieee": fp32 inputs stay fp32 (no silent tf32); bf16/fp16 inputs use tensor cores.
    UPCAST works around the interpreter, whose dot multiplies bf16 *bit patterns* (numpy has no
    bf16); products of bf16 values are exact in fp32, so upcasting gives the GPU's numbers.
    """
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _logits_tile(
    h_ptr, w_ptr, b_ptr, rows, cols, row_mask, col_mask, H,
    stride_hn, stride_hh, stride_wv, stride_wh, pre, post,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, UPCAST: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_CAP: tl.constexpr,
):
    """(z, dz/draw) for one [BLOCK_N, BLOCK_V] tile: raw = h[rows] @ w[cols].T (+ b[cols]),
    z = raw * pre, or post * tanh(raw * pre) when soft-capped (see logit_map)."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_H):
        ks = k0 + tl.arange(0, BLOCK_H)
        k_mask = ks < H
        h = tl.load(
            h_ptr + rows[:, None] * stride_hn + ks[None, :] * stride_hh,
            mask=row_mask[:, None] & k_mask[None, :], other=0.0,
        )
        w = tl.load(
            w_ptr + cols[:, None] * stride_wv + ks[None, :] * stride_wh,
            mask=col_mask[:, None] & k_mask[None, :], other=0.0,
        )
        acc = _dot(h, tl.trans(w), acc, UPCAST)
    if HAS_BIAS:
        b = tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        acc = acc + b[None, :]
    if HAS_CAP:
        # tanh(x) = 2 sigmoid(2x) - 1: portable (CUDA and the interpreter), saturates cleanly
        t = 2.0 * tl.sigmoid(2.0 * (acc * pre)) - 1.0
        z = t * post
        slope = (1.0 - t * t) * (pre * post)
    else:
        z = acc * pre
        slope = pre
    return z, slope


@triton.jit
def _grad_logits_tile(z, slope, cols, row_mask, col_mask, y, lse, ent, g_lp, g_ent):
    """d loss / d raw for one tile: (g_lp*(onehot - p) - g_ent*p*(log p + H)) * dz/draw."""
    logp = z - lse[:, None]
    p = tl.exp(logp)
    g = -p * (g_lp[:, None] + g_ent[:, None] * (logp + ent[:, None]))
    g += tl.where(cols[None, :] == y[:, None], g_lp[:, None], 0.0)
    g = tl.where(row_mask[:, None] & col_mask[None, :], g, 0.0)
    return g * slope


@triton.jit
def _fwd_kernel(
    h_ptr, w_ptr, b_ptr, y_ptr, logp_ptr, ent_ptr, lse_ptr,
    N, V, H, stride_hn, stride_hh, stride_wv, stride_wh, pre, post,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, UPCAST: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_CAP: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_mask = rows < N
    y = tl.load(y_ptr + rows, mask=row_mask, other=0)
    m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    t = tl.zeros((BLOCK_N,), dtype=tl.float32)
    z_target = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = (v0 + tl.arange(0, BLOCK_V)).to(tl.int64)
        col_mask = cols < V
        z, _slope = _logits_tile(
            h_ptr, w_ptr, b_ptr, rows, cols, row_mask, col_mask, H,
            stride_hn, stride_hh, stride_wv, stride_wh, pre, post, BLOCK_N, BLOCK_V, BLOCK_H, UPCAST,
            HAS_BIAS, HAS_CAP,
        )
        z = tl.where(col_mask[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        d = tl.where(col_mask[None, :], z - m_new[:, None], 0.0)
        e = tl.where(col_mask[None, :], tl.exp(d), 0.0)
        # Before the first tile s == 0 and m == -inf: use delta 0 so nothing becomes NaN.
        delta = tl.where(s > 0, m - m_new, 0.0)
        alpha = tl.exp(delta)
        t = alpha * (t + s * delta) + tl.sum(e * d, axis=1)
        s = alpha * s + tl.sum(e, axis=1)
        m = m_new
        z_target += tl.sum(tl.where(cols[None, :] == y[:, None], z, 0.0), axis=1)
    log_s = tl.log(s)
    lse = m + log_s
    tl.store(logp_ptr + rows, z_target - lse, mask=row_mask)
    tl.store(ent_ptr + rows, log_s - t / s, mask=row_mask)
    tl.store(lse_ptr + rows, lse, mask=row_mask)


@triton.jit
def _bwd_hidden_kernel(
    h_ptr, w_ptr, b_ptr, y_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, gh_ptr,
    N, V, H, stride_hn, stride_hh, stride_wv, stride_wh, pre, post,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, UPCAST: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_CAP: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_mask = rows < N
    y = tl.load(y_ptr + rows, mask=row_mask, other=0)
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    ent = tl.load(ent_ptr + rows, mask=row_mask, other=0.0)
    g_lp = tl.load(glp_ptr + rows, mask=row_mask, other=0.0)
    g_ent = tl.load(gent_ptr + rows, mask=row_mask, other=0.0)
    for v0 in range(0, V, BLOCK_V):
        cols = (v0 + tl.arange(0, BLOCK_V)).to(tl.int64)
        col_mask = cols < V
        z, slope = _logits_tile(
            h_ptr, w_ptr, b_ptr, rows, cols, row_mask, col_mask, H,
            stride_hn, stride_hh, stride_wv, stride_wh, pre, post, BLOCK_N, BLOCK_V, BLOCK_H, UPCAST,
            HAS_BIAS, HAS_CAP,
        )
        g = _grad_logits_tile(z, slope, cols, row_mask, col_mask, y, lse, ent, g_lp, g_ent)
        for k0 in range(0, H, BLOCK_H):
            ks = k0 + tl.arange(0, BLOCK_H)
            k_mask = ks < H
            w = tl.load(
                w_ptr + cols[:, None] * stride_wv + ks[None, :] * stride_wh,
                mask=col_mask[:, None] & k_mask[None, :], other=0.0,
            )
            out = gh_ptr + rows[:, None] * H + ks[None, :]
            out_mask = row_mask[:, None] & k_mask[None, :]
            acc = tl.load(out, mask=out_mask, other=0.0)
            acc = _dot(g.to(w.dtype), w, acc, UPCAST)
            tl.store(out, acc, mask=out_mask)


@triton.jit
def _bwd_weight_kernel(
    h_ptr, w_ptr, b_ptr, y_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, gw_ptr, gb_ptr,
    N, V, H, stride_hn, stride_hh, stride_wv, stride_wh, pre, post,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, UPCAST: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_CAP: tl.constexpr, NEED_W: tl.constexpr, NEED_B: tl.constexpr,
):
    cols = (tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
    col_mask = cols < V
    gb = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        rows = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
        row_mask = rows < N
        y = tl.load(y_ptr + rows, mask=row_mask, other=0)
        lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
        ent = tl.load(ent_ptr + rows, mask=row_mask, other=0.0)
        g_lp = tl.load(glp_ptr + rows, mask=row_mask, other=0.0)
        g_ent = tl.load(gent_ptr + rows, mask=row_mask, other=0.0)
        z, slope = _logits_tile(
            h_ptr, w_ptr, b_ptr, rows, cols, row_mask, col_mask, H,
            stride_hn, stride_hh, stride_wv, stride_wh, pre, post, BLOCK_N, BLOCK_V, BLOCK_H, UPCAST,
            HAS_BIAS, HAS_CAP,
        )
        g = _grad_logits_tile(z, slope, cols, row_mask, col_mask, y, lse, ent, g_lp, g_ent)
        if NEED_B:
            gb += tl.sum(g, axis=0)
        if NEED_W:
            for k0 in range(0, H, BLOCK_H):
                ks = k0 + tl.arange(0, BLOCK_H)
                k_mask = ks < H
                h = tl.load(
                    h_ptr + rows[:, None] * stride_hn + ks[None, :] * stride_hh,
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0,
                )
                out = gw_ptr + cols[:, None] * H + ks[None, :]
                out_mask = col_mask[:, None] & k_mask[None, :]
                acc = tl.load(out, mask=out_mask, other=0.0)
                acc = _dot(tl.trans(g.to(h.dtype)), h, acc, UPCAST)
                tl.store(out, acc, mask=out_mask)
    if NEED_B:
        tl.store(gb_ptr + cols, gb, mask=col_mask)


def _blocks(block_n: int | None, block_v: int | None, block_h: int | None) -> tuple[int, int, int]:
    # Read the module constants at call time so tests can shrink the tiles.
    return block_n or BLOCK_N, block_v or BLOCK_V, block_h or BLOCK_H


def _upcast(hidden: torch.Tensor) -> bool:
    """Upcast dot operands only where the interpreter would get low-precision dots wrong."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1" and hidden.dtype != torch.float32


def _on_device(t: torch.Tensor):
    """Launch on the tensors' GPU, not whichever one is current."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _common_args(hidden: torch.Tensor, weight: torch.Tensor, lmap: LogitMap) -> tuple:
    n, h = hidden.shape
    return (n, weight.shape[0], h, hidden.stride(0), hidden.stride(1),
            weight.stride(0), weight.stride(1), float(lmap.pre), float(lmap.post or 0.0))


def _flags(hidden: torch.Tensor, bias: torch.Tensor | None, lmap: LogitMap, blocks: tuple[int, int, int]) -> dict:
    block_n, block_v, block_h = blocks
    return dict(BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_H=block_h, UPCAST=_upcast(hidden),
                HAS_BIAS=bias is not None, HAS_CAP=lmap.capped)


def triton_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    lmap: LogitMap,
    block_n: int | None = None,
    block_v: int | None = None,
    block_h: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (logprobs, entropy, lse), each float32 [N]. Block sizes default to the module's."""
    blocks = _blocks(block_n, block_v, block_h)
    if weight.dtype != hidden.dtype:
        raise TypeError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype for tl.dot")
    n = hidden.shape[0]
    logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
    entropy = torch.empty_like(logprobs)
    lse = torch.empty_like(logprobs)
    if n == 0:
        return logprobs, entropy, lse
    b = bias.contiguous() if bias is not None else logprobs  # any pointer when there is no bias
    with _on_device(hidden):
        _fwd_kernel[(triton.cdiv(n, blocks[0]),)](
            hidden, weight, b, targets.contiguous(), logprobs, entropy, lse,
            *_common_args(hidden, weight, lmap), **_flags(hidden, bias, lmap, blocks),
        )
    return logprobs, entropy, lse


def triton_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logprobs: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    lmap: LogitMap,
    need_hidden: bool = True,
    need_weight: bool = True,
    need_bias: bool = False,
    block_n: int | None = None,
    block_v: int | None = None,
    block_h: int | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients w.r.t. (hidden, weight, bias), accumulated in fp32, returned in the input dtypes."""
    blocks = _blocks(block_n, block_v, block_h)
    targets = targets.contiguous()
    g_lp = grad_logprobs.float().contiguous()
    g_ent = grad_entropy.float().contiguous() if grad_entropy is not None else torch.zeros_like(g_lp)
    args = _common_args(hidden, weight, lmap)
    flags = _flags(hidden, bias, lmap, blocks)
    need_bias = need_bias and bias is not None
    b = bias.contiguous() if bias is not None else g_lp  # any pointer when there is no bias
    grad_hidden = grad_weight = grad_bias = None
    empty = hidden.shape[0] == 0
    with _on_device(hidden):
        if need_hidden:
            buf = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
            if not empty:
                _bwd_hidden_kernel[(triton.cdiv(hidden.shape[0], blocks[0]),)](
                    hidden, weight, b, targets, lse, entropy, g_lp, g_ent, buf, *args, **flags,
                )
            grad_hidden = buf.to(hidden.dtype)
        if need_weight or need_bias:
            gw = torch.zeros(weight.shape if need_weight else (1,), dtype=torch.float32, device=weight.device)
            gb = torch.zeros(weight.shape[0] if need_bias else 1, dtype=torch.float32, device=weight.device)
            if not empty:
                _bwd_weight_kernel[(triton.cdiv(weight.shape[0], blocks[1]),)](
                    hidden, weight, b, targets, lse, entropy, g_lp, g_ent, gw, gb, *args, **flags,
                    NEED_W=need_weight, NEED_B=need_bias,
                )
            grad_weight = gw.to(weight.dtype) if need_weight else None
            grad_bias = gb.to(bias.dtype) if need_bias else None
    return grad_hidden, grad_weight, grad_bias
