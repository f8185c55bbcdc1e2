"""What every rollout backend promises: sampling parameters and the `RolloutEngine` protocol.

A rollout engine turns a prompt `Batch` into a response `Batch` (see the shared data contract in
`rlcore.protocol`) and accepts fresh weights from the actor after every update. Backends (HF
transformers, vLLM, ...) differ only in how fast they do it, never in the shape of the output, so
the control flow can swap them by configuration.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

# The backends table lives below the config layer (config checks `rollout.backend` at load); it is
# re-exported here, where engines are built.
from rlcore.rollout_backends import (  # noqa: F401 - re-exported
    BackendTraits,
    load_engine_class,
    register_backend,
    resolve_backend,
    vllm_installed,
)

if TYPE_CHECKING:
    from rlcore.protocol import Batch


@dataclass(frozen=True)
class SamplingParams:
    """How to sample responses; validated on construction so a bad config fails before a rollout.

    `top_k=-1` and `top_p=1.0` switch those filters off. `do_sample=False` is greedy decoding
    (temperature, top-k and top-p are then ignored). `seed` makes sampling reproducible: the
    same prompts, weights and seed give the same responses.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    do_sample: bool = True
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.do_sample and not self.temperature > 0:
            raise ValueError(
                f"SamplingParams.temperature must be > 0 when do_sample=True, got {self.temperature} "
                "(use do_sample=False for greedy decoding)"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1 (off) or >= 1, got {self.top_k}")

    @property
    def logprob_temperature(self) -> float:
        """Temperature the reported log-probs are computed at (1.0 for greedy decoding).

        The actor must recompute its log-probs at this same temperature for the rollout and
        actor log-probs to be comparable.
        """
        return self.temperature if self.do_sample else 1.0


@runtime_checkable
class RolloutEngine(Protocol):
    """A generator of responses whose weights the trainer can replace in place.

    `generate` takes the rollout input batch (left-padded `input_ids`, `attention_mask`, per-sample
    meta) and returns the rollout output batch: each prompt repeated `params.n` times
    consecutively with its meta, plus `prompts`, `responses`, `response_mask`, `input_ids`,
    `attention_mask`, `position_ids` and `rollout_log_probs` (log-probs of the sampled tokens
    under the temperature-scaled distribution *before* top-k/top-p filtering).
    """

    def generate(self, batch: Batch, params: SamplingParams) -> Batch: ...

    def begin_weight_sync(self, names: Iterable[str]) -> None:
        """Announce the names the coming `update_weights` calls of one sync carry, when that is only
        part of the model (LoRA: the adapted layers); an engine that reloads whole syncs can finish
        this one as soon as they arrived."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load (a bucket of) named tensors into the model; may be called many times per sync.

        Names are the HF state-dict names. For models with tied input/output embeddings
        either `lm_head.weight` or `model.embed_tokens.weight` updates the shared tensor.
        """
        ...

    def sleep(self) -> None:
        """Release accelerator memory (weights, caches) so training can use it."""
        ...

    def wake(self) -> None:
        """Bring the engine back onto its device after `sleep`."""
        ...


class WeightSwitch(Protocol):
    """Where a decode loop may take new weights between two steps (`trainer.async_weight_sync=step`:
    the async rollout's gate lets a waiting weight sync in there)."""

    def version(self) -> int:
        """The policy version of the engine's weights now."""
        ...

    def between_steps(self) -> bool:
        """Let a waiting weight sync change the weights now; True when they changed."""
        ...


def reload_group(name: str) -> str:
    """The module group an engine reloads a weight with (its parent module's parent): a weight sync
    sends each group whole. `model.layers.3.self_attn.q_proj.weight` -> `model.layers.3.self_attn`
    (q, k, v, o together, which covers vLLM's fused qkv_proj); `model.layers.3.mlp.up_proj.weight`
    -> `model.layers.3.mlp` (gate_up_proj)."""
    return name.rsplit(".", 2)[0] if name.count(".") >= 2 else name.rsplit(".", 1)[0]


def make_rollout_engine(backend: str, **kwargs: Any) -> RolloutEngine:
    """Build a rollout engine by backend name (`rlcore.rollout_backends`: a registered name, `auto`
    or a "module:Class").

    With a `path` keyword the engine loads a model from disk (`cls.from_pretrained(**kwargs)`);
    otherwise the keywords go to the class constructor (e.g. an in-memory `model`).
    """
    cls = load_engine_class(backend)
    if "path" in kwargs:
        return cls.from_pretrained(**kwargs)  # type: ignore[attr-defined]
    return cls(**kwargs)
