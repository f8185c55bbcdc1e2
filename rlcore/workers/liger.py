"""Liger Kernel's fused RMSNorm, SwiGLU MLP and RoPE in the actor's model (`actor.liger_kernel`).

Liger Kernel (PyPI `liger-kernel`, `pip install 'rlcore[liger]'`) is Triton: CUDA only (its
RMSNorm and SwiGLU kernels do not even run under TRITON_INTERPRET=1). What is taken from it is
what its `apply_liger_kernel_to_<model type>(model=...)` patches: each RMSNorm and gated MLP of
the model, and the architecture's `apply_rotary_pos_emb`. That last one is module-wide in
transformers (Liger swaps the function, and the norm and MLP classes, in the architecture's
modeling module), so models of that architecture built later in the process (the reference, an
in-process hf rollout engine) run the same kernels.

Never taken: its cross-entropy and fused linear cross-entropy. rlcore's log-prob head
(`rlcore.triton_kernels`) returns per-token log-probs and entropy at a temperature, with the head's
bias, logit scale and soft-cap, on a vocabulary-parallel head too, for any policy loss; Liger's
fused linear cross-entropy returns -log p per token only (no entropy, no temperature), and its
GRPO loss is one loss with the head fused in. Both recompute logits chunk by chunk and never hold
the [tokens, vocab] matrix, so they are alike in memory.
"""

from __future__ import annotations

import inspect
import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

PATCHES = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False, "fused_linear_cross_entropy": False}


def apply_liger_kernels(model: nn.Module, device: torch.device, key: str = "actor.liger_kernel") -> None:
    """Liger's RMSNorm, SwiGLU and RoPE in `model` (module doc). ValueError naming `key` on a device
    other than CUDA, without the package, or for an architecture it has no kernels for."""
    if device.type != "cuda":
        raise ValueError(f"{key}=true needs a CUDA device (the device is {device}): Liger's kernels are Triton GPU kernels")
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as err:
        raise ValueError(f"{key}=true needs the liger-kernel package (pip install 'rlcore[liger]'): {err}") from err
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply is None:
        raise ValueError(f"{key}=true: Liger Kernel has no kernels for model type {model_type!r}; set {key}=false")
    takes = inspect.signature(apply).parameters
    apply(model=model, **{name: value for name, value in PATCHES.items() if name in takes})
    log.info("%s: Liger's %s kernels in the %s model", key, ", ".join(n for n, v in PATCHES.items() if v and n in takes), model_type)


__all__ = ["apply_liger_kernels"]
