"""Public entry point: fused per-token log-prob / entropy with a custom autograd Function.

The Function returns (logprobs, entropy) and saves only the inputs plus two [N] float32
vectors (lse, entropy); its backward recomputes logits tile by tile. The LM head's own
semantics (bias, logit scale, final soft-cap; see ``logit_map``) are applied inside each tile.

Vocabulary-parallel head (tensor parallelism, ``VocabShard``): each rank of a group holds rows
[start, start + V_r) of the head. A rank runs the same kernels on its rows (targets shifted by
``start``, so a target outside them matches no column), giving its partial log-sum-exp lse_r,
the entropy H_r of its renormalised slice and, where it owns the target, the target's logit.
With w_r = exp(lse_r - lse):

    lse = log sum_r exp(lse_r),   H = sum_r w_r * H_r - sum_r w_r * log w_r,
    log p(y) = z_y - lse          (z_y from the rank that owns y)

one all-gather of three [N] vectors. The backward is each rank's kernel with the global lse and
H (so p = exp(z - lse) is the full softmax on its rows): exact gradients for its rows of the head,
and its share of the hidden state's gradient, summed over the group (every rank computes the same
loss from the same hidden states, so each ends with the full gradient, as one process would).
No rank ever holds more than its own rows of the head or its logits.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch

from rlcore.triton_kernels import torch_chunked
from rlcore.triton_kernels.logit_map import LogitMap
from rlcore.triton_kernels.output import FusedOutput

BACKENDS = ("auto", "torch", "triton")
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def triton_available() -> bool:
    """True when triton imports (it does not say a GPU is present)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def _interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str, device: torch.device) -> str:
    """Pick "torch" or "triton"; "auto" means triton on CUDA tensors when triton imports."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' but triton cannot be imported")
        if device.type != "cuda" and not _interpret_mode():
            raise RuntimeError(
                f"backend='triton' needs CUDA tensors (got {device.type}) or TRITON_INTERPRET=1 "
                "set before rlcore.triton_kernels.triton_impl is first imported"
            )
    return backend


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows [start, start + rows) of a head of `vocab` rows split over `group` (a
    torch.distributed process group: the tensor-parallel ranks)."""

    group: Any
    start: int
    vocab: int


@dataclass(frozen=True)
class _Plan:
    backend: str
    lmap: LogitMap
    compute_entropy: bool
    chunk_tokens: int
    chunk_vocab: int | None
    shard: VocabShard | None = None


def _combine_shards(shard: VocabShard, targets, rows: int, logprobs, entropy, lse):
    """The full-vocabulary (logprobs, entropy, lse) from every rank's partial ones (module docstring)."""
    import torch.distributed as dist

    owned = (targets >= shard.start) & (targets < shard.start + rows)
    mine = torch.stack([lse, entropy, torch.where(owned, logprobs + lse, torch.zeros_like(lse))])
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(shard.group))]
    dist.all_gather(parts, mine, group=shard.group)
    lse_r, ent_r, z_target = torch.stack(parts).unbind(1)  # [ranks, N] each
    total = torch.logsumexp(lse_r, dim=0)
    log_w = lse_r - total
    w = log_w.exp()
    full_entropy = (w * ent_r).sum(0) - (w * log_w).sum(0)
    return z_target.sum(0) - total, full_entropy, total


def _forward(plan: _Plan, hidden, weight, bias, targets):
    if plan.backend == "triton":
        from rlcore.triton_kernels.triton_impl import triton_forward

        return triton_forward(hidden, weight, bias, targets, plan.lmap)
    return torch_chunked.chunked_forward(hidden, weight, bias, targets, plan.lmap, plan.chunk_tokens, plan.chunk_vocab)


def _backward(plan: _Plan, hidden, weight, bias, targets, lse, entropy, g_lp, g_ent, need_h, need_w, need_b):
    if plan.backend == "triton":
        from rlcore.triton_kernels.triton_impl import triton_backward

        return triton_backward(hidden, weight, bias, targets, lse, entropy, g_lp, g_ent, plan.lmap, need_h, need_w, need_b)
    return torch_chunked.chunked_backward(
        hidden, weight, bias, targets, lse, entropy, g_lp, g_ent, plan.lmap,
        need_h, need_w, need_b, plan.chunk_tokens, plan.chunk_vocab,
    )


class _FusedLogprobFunction(torch.autograd.Function):
    """(hidden [N,H], weight [V,H], bias [V] or None, targets [N]) -> (logprobs [N], entropy [N]), fp32."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, plan: _Plan):
        if plan.shard is not None:  # this rank's rows: targets elsewhere match no column
            local = targets - plan.shard.start
            logprobs, entropy, lse = _combine_shards(plan.shard, targets, weight.shape[0], *_forward(plan, hidden, weight, bias, local))
            targets = local
        else:
            logprobs, entropy, lse = _forward(plan, hidden, weight, bias, targets)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.plan = plan
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        plan: _Plan = ctx.plan
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        if not (need_h or need_w or need_b):
            return None, None, None, None, None
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(lse)
        if not plan.compute_entropy:
            grad_entropy = None
        grad_hidden, grad_weight, grad_bias = _backward(
            plan, hidden, weight, bias, targets, lse, entropy, grad_logprobs, grad_entropy, need_h, need_w, need_b
        )
        if plan.shard is not None and grad_hidden is not None:  # each rank's rows' share of it
            import torch.distributed as dist

            dist.all_reduce(grad_hidden, group=plan.shard.group)
        return grad_hidden, grad_weight, grad_bias, None, None


def _check_inputs(hidden, weight, bias, targets, chunk_tokens, chunk_vocab, vocab: int | None = None, check_targets=True):
    if hidden.dim() < 2:
        raise ValueError(f"hidden must be [N, H] (or [..., H]), got shape {tuple(hidden.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [V, H], got shape {tuple(weight.shape)}")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden size mismatch: hidden has H={hidden.shape[-1]}, weight [V, H] has H={weight.shape[1]}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [V] = [{weight.shape[0]}], got shape {tuple(bias.shape)}")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal hidden's leading shape {tuple(hidden.shape[:-1])}"
        )
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise TypeError(f"targets must be an integer tensor, got {targets.dtype}")
    if check_targets and targets.numel():
        lo, hi = (int(x) for x in torch.aminmax(targets))  # one host sync; bad ids would be silent
        vocab = weight.shape[0] if vocab is None else vocab
        if lo < 0 or hi >= vocab:
            raise ValueError(f"targets must lie in [0, {vocab}) (vocab size), got range [{lo}, {hi}]")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if chunk_vocab is not None and chunk_vocab < 1:
        raise ValueError(f"chunk_vocab must be >= 1 or None, got {chunk_vocab}")
    devices = {hidden.device, weight.device, targets.device} | ({bias.device} if bias is not None else set())
    if len(devices) > 1:
        raise ValueError(
            f"hidden ({hidden.device}), weight ({weight.device}), bias and targets ({targets.device}) "
            "must be on one device"
        )


def fused_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    chunk_tokens: int = 1024,
    chunk_vocab: int | None = None,
    backend: str = "auto",
    vocab_shard: VocabShard | None = None,
    check_targets: bool = True,
) -> FusedOutput:
    """Per-token log p(target) and softmax entropy from the last hidden state and the LM head.

    logits = LM head(hidden) / temperature with the head's own semantics: ``raw = hidden @
    weight.T + bias``, times ``logit_scale``, then ``softcap * tanh(. / softcap)`` when ``softcap``
    is given (see ``logit_map``); accumulated in fp32 for any input dtype, and the full [N, V]
    logits are never allocated. Gradients flow to ``hidden``, ``weight`` and ``bias``.

    ``chunk_tokens``/``chunk_vocab`` bound the torch path's temporaries to a float32
    [chunk_tokens, chunk_vocab or V] tile (two in the backward, three when soft-capped). The
    triton backend tiles on its own and ignores them. ``hidden`` may carry leading dims
    ([B, T, H] with targets [B, T]); outputs take the shape of ``targets``.

    ``vocab_shard``: ``weight`` (and ``bias``) are this rank's rows of a head split over a
    tensor-parallel group, every rank of which calls this with the same hidden states and targets
    (module docstring); the results are the full head's.

    ``check_targets=False`` skips the one host sync that checks the target ids lie in the
    vocabulary: for a caller that checked them itself, or tensors without data (the memory
    planner's fake tensors).
    """
    _check_inputs(hidden, weight, bias, targets, chunk_tokens, chunk_vocab,
                  None if vocab_shard is None else vocab_shard.vocab, check_targets)
    lmap = LogitMap.of(float(temperature), float(logit_scale), None if softcap is None else float(softcap))
    chosen = resolve_backend(backend, hidden.device)
    out_shape = targets.shape
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1).long()
    if chosen == "triton":
        for name, t in (("hidden", hidden2d), ("weight", weight)):
            if t.dtype not in _TRITON_DTYPES:
                raise TypeError(f"{name} dtype {t.dtype} is not supported by the triton backend")
        if hidden2d.dtype != weight.dtype:
            # tl.dot wants one dtype; cast the (usually smaller) activations, differentiably.
            hidden2d = hidden2d.to(weight.dtype)
    plan = _Plan(chosen, lmap, compute_entropy, int(chunk_tokens), None if chunk_vocab is None else int(chunk_vocab), vocab_shard)
    logprobs, entropy = _FusedLogprobFunction.apply(hidden2d, weight, bias, flat_targets, plan)
    logprobs = logprobs.reshape(out_shape)
    entropy = entropy.reshape(out_shape) if compute_entropy else None
    return FusedOutput(logprobs, entropy)
