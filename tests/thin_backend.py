"""A rollout backend from outside rlcore: a thin wrapper around the hf engine that counts what it
generates. `tests/test_rollout_backend_traits.py` trains with it by name (`rollout.backend:
thin_backend:ThinEngine`, the "module:Class" way a user plugs in a backend of their own)."""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

from rlcore.protocol import Batch
from rlcore.rollout import BackendTraits, HFRolloutEngine, SamplingParams


class ThinEngine(HFRolloutEngine):
    """The hf engine, counting its `generate` calls and the responses they returned."""

    traits: ClassVar[BackendTraits] = replace(HFRolloutEngine.traits, label="thin")
    calls: ClassVar[int] = 0
    responses: ClassVar[int] = 0

    def generate(self, batch: Batch, params: SamplingParams) -> Batch:
        out = super().generate(batch, params)
        type(self).calls += 1
        type(self).responses += len(out)
        return out
