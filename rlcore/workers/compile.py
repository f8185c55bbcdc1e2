"""Regional `torch.compile`: each decoder layer's forward compiled on its own (`actor.compile`).

Compiling the layer rather than the model (torchtune's and torchtitan's "regional compilation")
keeps compile time to one layer's graphs, reused by every layer (parameters are graph inputs), and
leaves everything around the layers eager: the packed-row bookkeeping, the log-prob head, the
precision hooks. Only `forward` is compiled, not the module's call: the hooks that swap in compute
copies (`LocalPolicy`, FSDP2's) run before and after it, eagerly, so the graph sees one set of
parameters and no Python that builds `nn.Parameter`s. Shapes are dynamic from the first call:
packed rows have a different length every micro-batch. Attention is not compiled
(`rlcore.workers.attention._attention` is `torch.compiler.disable`d: the per-length SDPA path reads
lengths from a tensor, and the fused kernels are single calls already), so each layer runs as two
graphs, before and after it, in which the norms, RoPE, the projections and the gated MLP's
element-wise work fuse.

Measured on CPU (`benchmarks/bench_update.py`): no faster than eager, and compiling costs tens of
CPU seconds, so "auto" compiles on CUDA only, where it has not been measured yet (the GPU check's
actor phase does). Under "auto" a layer whose forward fails to compile runs eagerly from then on,
with one warning, so that a default does not stop a run over a compiler problem (the backward graph
is compiled at the first backward, outside that net).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from rlcore.workers.fsdp import decoder_layers

log = logging.getLogger(__name__)


def compile_wanted(setting: bool | str, device: torch.device, *, tensor_parallel: int = 1, liger: bool = False) -> bool:
    """`actor.compile`: True, False, or "auto": CUDA, without tensor parallelism (DTensor layers
    stay eager) and without Liger's kernels (which fuse the same element-wise work)."""
    if setting != "auto":
        return bool(setting)
    return device.type == "cuda" and tensor_parallel == 1 and not liger


def compile_decoder_layers(model: nn.Module, *, fall_back: bool = False) -> int:
    """Replace each decoder layer's `forward` by its `torch.compile`d self (dynamic shapes); the
    number of layers compiled (0 for a model without `<base_model_prefix>.layers`, logged).
    `fall_back`: a layer whose compilation fails runs its eager forward instead (warned once)."""
    layers = decoder_layers(model)
    if not layers:
        log.warning("actor.compile: %s has no decoder layers where transformers keeps them; left eager", type(model).__name__)
        return 0
    for layer in layers:
        compiled = torch.compile(layer.forward, dynamic=True)
        layer.forward = _with_fallback(layer, compiled) if fall_back else compiled  # type: ignore[method-assign]
    log.info("actor.compile: %d decoder layers compiled (torch.compile, dynamic shapes)", len(layers))
    return len(layers)


def _compile_errors() -> tuple[type[BaseException], ...]:
    from torch._dynamo.exc import TorchDynamoException

    errors: list[type[BaseException]] = [TorchDynamoException]
    inductor = getattr(getattr(torch, "_inductor", None), "exc", None)
    if inductor is not None and hasattr(inductor, "InductorError"):
        errors.append(inductor.InductorError)
    return tuple(errors)


def _with_fallback(layer: nn.Module, compiled: Callable[..., Any]) -> Callable[..., Any]:
    own = vars(layer).get("forward")  # an instance's own forward (else the class's) to put back
    eager = layer.forward

    @functools.wraps(eager)
    def forward(*args: Any, **kwargs: Any) -> Any:
        try:
            return compiled(*args, **kwargs)
        except _compile_errors() as err:
            log.warning("actor.compile=auto: compiling %s failed, it runs eagerly from now on (%s: %s)",
                        type(layer).__name__, type(err).__name__, str(err).splitlines()[0] if str(err) else "")
            if own is None:
                del layer.forward
            else:
                layer.forward = own  # type: ignore[method-assign]
            return eager(*args, **kwargs)

    return forward


__all__ = ["compile_decoder_layers", "compile_wanted"]
