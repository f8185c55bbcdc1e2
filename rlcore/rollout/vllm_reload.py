"""Weight syncs into an in-process vLLM engine by vLLM's layerwise reload, reaching into vLLM's
reload internals (`vllm.model_executor.model_loader.reload`): the part of the vLLM backend that
moves with vLLM's internals, apart from the engine adapter (`rlcore.rollout.vllm`).

Weights: `update_weights` may receive a model's tensors in any split (the actor streams buckets
sized by bytes). vLLM reloads layer by layer and a fused layer (q/k/v, gate/up) that gets only
some of its tensors in one reload would be rebuilt from partial data, so tensors are held back
until every tensor of their module group has arrived, then sent in buckets of at most
`weight_bucket_mb`. For tied embeddings both `model.embed_tokens.weight` and `lm_head.weight`
are always sent: vLLM keeps a separate (repacked) head on CPU that otherwise stays stale.

One weight sync is one vLLM layerwise reload, however many buckets it takes: the first bucket
opens it, each bucket's layers are loaded (and repacked) as they complete, and it is finalised
once every checkpoint tensor has arrived, or every tensor the caller declared for this sync
(`begin_weight_sync`: a LoRA sync of the adapted layers only), or else before the engine is next
used, or when a tensor this sync already received arrives again (which begins the next). vLLM's own `reload_weights` finalises at every call and warns
"<Layer>: Failed to load weights" for each layer that call did not carry -- every other layer of
a multi-bucket sync, and at every sync the rotary embedding, whose only tensor is a cos/sin
cache computed from the config that no checkpoint holds. Layers without parameters are marked
as having nothing to load, so the warning is left for what it means: a layer with weights that a
sync did not update. A bf16 engine beside a float32 actor (`rollout.dtype`) casts every tensor
on load, as a fresh engine casts the checkpoint; vLLM warns about each such narrowing, and that
one expected message (float32 into the engine's own dtype) is dropped during syncs and at start.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from rlcore.rollout.base import reload_group

TIED_NAMES = ("model.embed_tokens.weight", "lm_head.weight")


# --------------------------------------------------------------- worker side of a weight sync
# Run inside vLLM's worker (`collective_rpc` passes it as the first argument), as vLLM's own
# `Worker.reload_weights` -> `reload.inplace.reload_weights` does, but split into open / load /
# finish so that one sync spans several calls.


def reload_open(worker: Any) -> None:
    """Put every layer into layerwise-reload mode; parameter-less layers expect nothing."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    model = worker.model_runner.get_model()
    with set_current_vllm_config(worker.vllm_config), torch.no_grad():
        initialize_layerwise_reload(model)
    for module in model.modules():
        info = get_layerwise_info(module)
        params, buffers = info.kernel_tensors or ({}, {})
        if not params and set(buffers) <= info.kernel_non_persistent_buffers:
            info.load_numel_total = 0  # e.g. RotaryEmbedding's cos_sin_cache: computed, never loaded


def reload_load(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Load checkpoint-named tensors; each layer is processed once all of its tensors are in."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config), torch.no_grad():
        worker.model_runner.get_model().load_weights(weights)


def reload_finish(worker: Any, partial: bool = False) -> None:
    """Finalise the reload (layers that got nothing keep their tensors) and drop derived state.
    `partial`: the caller declared that it sends only some layers (LoRA's adapted layers), so the
    others are not reported as "Failed to load weights"."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    runner = worker.model_runner
    if partial:
        for module in runner.get_model().modules():
            info = get_layerwise_info(module)
            if info.can_load() and not info.load_numel:
                info.load_numel_total = 0  # kept as it is, by design
    with set_current_vllm_config(worker.vllm_config), torch.no_grad():
        finalize_layerwise_reload(runner.get_model(), worker.vllm_config.model_config)
    for name in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
        reset = getattr(runner, name, None)
        if reset is not None:
            reset()


class _ExpectedCastFilter(logging.Filter):
    """Drops vLLM's "Attempted to load weight X with dtype A into parameter with dtype B" when B is
    the engine's dtype and A a wider float: the cast `rollout.dtype` asks for, once per tensor per
    sync. Other dtype mismatches still warn."""

    def __init__(self, engine_dtype: torch.dtype) -> None:
        super().__init__()
        self.engine_dtype = engine_dtype

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Attempted to load weight %s with dtype %s into parameter"):
            return True
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) != 3 or not all(isinstance(a, torch.dtype) for a in args[1:]):
            return True
        sent, param = args[1], args[2]
        narrowing = sent.is_floating_point and sent.itemsize > param.itemsize
        return not (param == self.engine_dtype and narrowing)


@contextlib.contextmanager
def quiet_expected_casts(engine_dtype: torch.dtype) -> Iterator[None]:
    target = logging.getLogger("vllm.model_executor.models.utils")
    quiet = _ExpectedCastFilter(engine_dtype)
    target.addFilter(quiet)
    try:
        yield
    finally:
        target.removeFilter(quiet)


class LayerwiseSync:
    """The engine side of weight syncs into `llm`: which tensors arrived, which module groups are
    whole, the open reload (module docstring)."""

    def __init__(self, llm: Any, param_names: Iterable[str], tied_embeddings: bool, bucket_bytes: int) -> None:
        self.llm = llm
        self.tied_embeddings = tied_embeddings
        self.bucket_bytes = bucket_bytes
        names = set(param_names)
        if tied_embeddings:
            names.update(TIED_NAMES)
        self._groups: dict[str, set[str]] = {}
        for name in names:
            self._groups.setdefault(reload_group(name), set()).add(name)
        self._all_names = frozenset(names)
        self._sync_names: frozenset[str] | None = None  # what the current sync carries (`begin`)
        self._pending: dict[str, dict[str, torch.Tensor]] = {}
        self._loaded: set[str] | None = None  # names loaded by the open reload; None: none open
        self._received: set[str] = set()  # names sent since the last finished sync (engine-made tied aliases not counted)
        self.syncs_finished = 0

    def add(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take (a bucket of) HF-named tensors: each module group is loaded once it is whole, and the
        sync finalised once every tensor (or every declared one) was sent once."""
        for name, tensor in named_tensors:
            group = reload_group(name)
            if name not in self._groups.get(group, ()):
                raise ValueError(f"update_weights: unknown parameter {name!r} (not in the checkpoint the engine was started on)")
            if name in self._received:  # each tensor once per sync: after a partial one, a repeat begins the next
                self.finish()
                self._received.clear()
            self._received.add(name)
            pending = self._pending.setdefault(group, {})
            pending[name] = tensor.detach()
            if self.tied_embeddings and name in TIED_NAMES:
                # One shared tensor, two names: whichever arrives stands for both.
                for alias in TIED_NAMES:
                    self._pending.setdefault(reload_group(alias), {}).setdefault(alias, pending[name])
        ready = [g for g, got in self._pending.items() if set(got) == self._groups[g]]
        if not ready:
            return
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for group in ready:
            items = list(self._pending.pop(group).items())
            group_size = sum(t.numel() * t.element_size() for _, t in items)
            if bucket and size + group_size > self.bucket_bytes:
                self._reload(bucket)
                bucket, size = [], 0
            bucket.extend(items)
            size += group_size
        if bucket:
            self._reload(bucket)
        if self._loaded is not None and self._loaded >= (self._sync_names or self._all_names):
            self.finish()

    def begin(self, names: Iterable[str]) -> None:
        """The names the coming `update_weights` calls carry: part of the model on purpose (LoRA's
        adapted layers). The sync then completes once they are in, and the layers it leaves out keep
        their weights without vLLM's "Failed to load weights" (which still names a layer a sync
        without this declaration did not update)."""
        self.finish()
        wanted = set(names)
        unknown = wanted - self._all_names
        if unknown:
            raise ValueError(f"begin_weight_sync: unknown parameters {sorted(unknown)[:3]} (not in the engine's checkpoint)")
        if self.tied_embeddings and wanted & set(TIED_NAMES):
            wanted.update(TIED_NAMES)
        self._received.clear()
        self._sync_names = frozenset(wanted)

    def _reload(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        if self._loaded is None:
            self.llm.collective_rpc(reload_open)
            self._loaded = set()
        with quiet_expected_casts(self.llm.llm_engine.vllm_config.model_config.dtype):
            self.llm.collective_rpc(reload_load, args=(bucket,))
        self._loaded.update(name for name, _ in bucket)

    def finish(self) -> None:
        """Finalise the open reload, if any, and drop KV blocks computed with the old weights (those
        of requests in flight too)."""
        if self._loaded is None:
            return
        declared = self._sync_names is not None and self._loaded >= self._sync_names
        self.llm.collective_rpc(reload_finish, args=(declared and not self._loaded >= self._all_names,))
        self._loaded = None
        self._sync_names = None
        self._received.clear()
        self.syncs_finished += 1
        # Requests in flight (a sync between decode steps, `trainer.async_weight_sync=step`) are
        # preempted: vLLM resumes each by recomputing its prefix on the new weights.
        self.llm.reset_prefix_cache(reset_running_requests=True)

    @property
    def pending(self) -> list[str]:
        """Names received but not yet loaded (their module group is incomplete)."""
        return sorted(n for got in self._pending.values() for n in got)


__all__ = ["TIED_NAMES", "LayerwiseSync", "quiet_expected_casts", "reload_finish", "reload_load", "reload_open"]
