"""Chunked torch path: per-token log-prob/entropy without the full [N, V] logits.

Tokens are processed ``chunk_tokens`` at a time and, optionally, the vocabulary
``chunk_vocab`` columns at a time with an online log-sum-exp, so the largest temporary is a
float32 [chunk_tokens, chunk_vocab] tile (two of them at once in the backward, three with a
soft-capped head). The backward recomputes each logits tile instead of keeping it.

Online accumulation per row over vocab tiles, with m the running max:
    s = sum exp(z - m),  t = sum exp(z - m) * (z - m)
    lse = m + log s,     entropy = log s - t / s      (since H = lse - E_p[z])
Keeping t shifted by m avoids cancelling two large numbers in the entropy.

Gradients w.r.t. the logits z of row i (p = softmax(z), H the entropy):
    d logp_y / dz = onehot(y) - p
    d H / dz      = -p * (log p + H)
and z = LogitMap(raw), raw = hidden @ weight.T + bias (see ``logit_map``), so both chain through
dz/draw and then a matmul (hidden, weight) or a column sum (bias).
"""

from __future__ import annotations

import torch

from rlcore.triton_kernels.logit_map import LogitMap


def _vocab_tiles(vocab: int, chunk_vocab: int | None) -> list[tuple[int, int]]:
    step = vocab if chunk_vocab is None else chunk_vocab
    return [(v0, min(v0 + step, vocab)) for v0 in range(0, vocab, step)]


def _weight_tile(weight: torch.Tensor, w32: torch.Tensor | None, v0: int, v1: int) -> torch.Tensor:
    """fp32 rows [v0, v1) of the LM head; a view when the weight is fp32 or pre-cast."""
    if w32 is not None:
        return w32[v0:v1]
    return weight[v0:v1].float()


def _precast_weight(weight: torch.Tensor, chunk_vocab: int | None) -> torch.Tensor | None:
    # Without vocab chunking every token chunk needs the whole head in fp32: cast it once
    # (O(V*H) extra for bf16/fp16 weights) rather than once per token chunk.
    if weight.dtype == torch.float32 or chunk_vocab is None:
        return weight.float()
    return None


def _target_in_tile(targets: torch.Tensor, v0: int, v1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask of rows whose target falls in [v0, v1), column index clamped into the tile)."""
    in_tile = (targets >= v0) & (targets < v1)
    idx = (targets - v0).clamp(0, v1 - v0 - 1)
    return in_tile, idx


def _logits_tile(h: torch.Tensor, w_tile: torch.Tensor, b_tile: torch.Tensor | None, lmap: LogitMap,
                 want_slope: bool) -> tuple[torch.Tensor, torch.Tensor | float | None]:
    """(z, dz/draw) of one tile, z built in place in one fp32 buffer; the slope is a float for a
    linear map, a tile for a soft-capped one, None unless asked for."""
    z = h @ w_tile.T
    if b_tile is not None:
        z.add_(b_tile)
    if not lmap.capped:
        return z.mul_(lmap.pre), lmap.pre if want_slope else None
    t = z.mul_(lmap.pre).tanh_()
    slope = (1.0 - t * t).mul_(lmap.pre * lmap.post) if want_slope else None
    return t.mul_(lmap.post), slope


@torch.no_grad()
def chunked_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    lmap: LogitMap,
    chunk_tokens: int = 1024,
    chunk_vocab: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (logprobs, entropy, lse), each float32 [N]."""
    n, vocab = hidden.shape[0], weight.shape[0]
    logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
    entropy = torch.empty_like(logprobs)
    lse = torch.empty_like(logprobs)
    w32 = _precast_weight(weight, chunk_vocab)
    b32 = bias.float() if bias is not None else None
    tiles = _vocab_tiles(vocab, chunk_vocab)
    for r0 in range(0, n, chunk_tokens):
        r1 = min(r0 + chunk_tokens, n)
        h = hidden[r0:r1].float()
        y = targets[r0:r1]
        m = s = t = None
        z_target = torch.zeros(r1 - r0, dtype=torch.float32, device=hidden.device)
        for v0, v1 in tiles:
            z, _ = _logits_tile(h, _weight_tile(weight, w32, v0, v1), None if b32 is None else b32[v0:v1], lmap, False)
            m_tile = z.amax(dim=1)
            m_new = m_tile if m is None else torch.maximum(m, m_tile)
            z.sub_(m_new[:, None])  # z - m_new, in place: one [c, v] buffer for z
            in_tile, idx = _target_in_tile(y, v0, v1)
            z_target = torch.where(in_tile, z.gather(1, idx[:, None]).squeeze(1) + m_new, z_target)
            e = torch.exp(z)
            s_tile = e.sum(dim=1)
            t_tile = e.mul_(z).sum(dim=1)
            if m is None:
                s, t = s_tile, t_tile
            else:
                delta = m - m_new  # <= 0: rescale the old sums to the new max
                alpha = torch.exp(delta)
                t = alpha * (t + s * delta) + t_tile
                s = alpha * s + s_tile
            m = m_new
            del z, e
        log_s = torch.log(s)
        lse[r0:r1] = m + log_s
        logprobs[r0:r1] = z_target - lse[r0:r1]
        entropy[r0:r1] = log_s - t / s
    return logprobs, entropy, lse


@torch.no_grad()
def chunked_backward(
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
    chunk_tokens: int = 1024,
    chunk_vocab: int | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients w.r.t. (hidden, weight, bias) given upstream grads of logprobs and entropy.

    Accumulates in fp32 and returns tensors in the dtypes of ``hidden``, ``weight`` and ``bias``.
    """
    n, vocab = hidden.shape[0], weight.shape[0]
    w32 = _precast_weight(weight, chunk_vocab)
    b32 = bias.float() if bias is not None else None
    tiles = _vocab_tiles(vocab, chunk_vocab)
    grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_hidden else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
    need_bias = need_bias and bias is not None
    grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_bias else None
    g_lp_all = grad_logprobs.float()
    g_ent_all = grad_entropy.float() if grad_entropy is not None else None
    for r0 in range(0, n, chunk_tokens):
        r1 = min(r0 + chunk_tokens, n)
        h = hidden[r0:r1].float()
        y = targets[r0:r1]
        lse_c = lse[r0:r1, None]
        g_lp = g_lp_all[r0:r1, None]
        for v0, v1 in tiles:
            w_tile = _weight_tile(weight, w32, v0, v1)
            z, slope = _logits_tile(h, w_tile, None if b32 is None else b32[v0:v1], lmap, True)
            z.sub_(lse_c)  # log p
            p = torch.exp(z)
            # grad_z = -p * (g_lp + g_ent * (log p + H)), built in place in z's buffer
            if g_ent_all is not None:
                z.add_(entropy[r0:r1, None]).mul_(g_ent_all[r0:r1, None]).add_(g_lp)
            else:
                z.copy_(g_lp.expand_as(z))
            grad_z = z.mul_(p).neg_()
            del p
            in_tile, idx = _target_in_tile(y, v0, v1)
            grad_z.scatter_add_(1, idx[:, None], (g_lp.squeeze(1) * in_tile)[:, None])
            grad_raw = grad_z.mul_(slope)  # chain through z = LogitMap(raw)
            del slope
            if grad_hidden is not None:
                grad_hidden[r0:r1].addmm_(grad_raw, w_tile)
            if grad_weight is not None:
                grad_weight[v0:v1].addmm_(grad_raw.T, h)
            if grad_bias is not None:
                grad_bias[v0:v1] += grad_raw.sum(dim=0)
            del grad_z, grad_raw, z
    if grad_hidden is not None:
        grad_hidden = grad_hidden.to(hidden.dtype)
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    if grad_bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    return grad_hidden, grad_weight, grad_bias
