"""Rollout worker: wraps a `RolloutEngine` (any backend of `rlcore.rollout_backends`) behind the worker interface; with
`rollout.agent` it generates multi-turn trajectories (`rlcore.rollout.agent.AgentLoop`) on that
engine, its tools running in this worker's sandboxed tool pool."""

from __future__ import annotations

import time
from collections.abc import Iterable

import numpy as np
import torch

from rlcore.config import RoleSpec, RolloutConfig, require_spec
from rlcore.controller import Dispatch, Worker, register
from rlcore.protocol import RIGHT_PAD, Batch
from rlcore.rewards.registry import load_function
from rlcore.rewards.tools import ToolPool
from rlcore.rollout import SamplingParams, make_rollout_engine, resolve_backend
from rlcore.rollout.agent import AgentLoop, AgentSettings
from rlcore.rollout.base import WeightSwitch
from rlcore.rollout.output import response_right_pad
from rlcore.rollout_backends import load_engine_class, support_problem
from rlcore.workers.loading import resolve_device
from rlcore.workers.memory import device_memory
from rlcore.workers.tokenizer import end_token_ids, load_tokenizer, pad_token_id


class RolloutWorker(Worker):
    def __init__(self, spec: RoleSpec[RolloutConfig], rank: int = 0, world_size: int = 1) -> None:
        super().__init__(rank=rank, world_size=world_size, role="rollout")
        self.spec: RoleSpec[RolloutConfig] = require_spec(spec, "rollout")
        self.device = resolve_device(self.spec.device)

        self.engine = None
        self.agent: AgentLoop | None = None
        self.tools: ToolPool | None = None
        self.busy_s = 0.0  # in generate_sequences, since the worker started

    def setup(self, model_path: str | None = None) -> None:
        spec, rollout = self.spec, self.spec.section
        backend = resolve_backend(rollout.backend)
        problem = support_problem(backend, rollout.tensor_parallel_size, spec.lora_sync)
        if problem is not None:  # `auto` resolved here (config checks a named backend at load)
            raise ValueError(f"{problem} (rollout.backend={rollout.backend} resolved to {backend})")
        engine_kwargs = getattr(load_engine_class(backend), "engine_kwargs", None)
        extra = {} if engine_kwargs is None else engine_kwargs(rollout, seed=spec.seed, lora_sync=spec.lora_sync,
                                                               lora_rank=spec.lora_rank)
        self._close_engine()  # vLLM allows one engine per process: close the old one first
        self.pad_id = pad_token_id(spec.model.path)
        self.engine = make_rollout_engine(
            backend,
            path=model_path or spec.model_path,
            dtype=rollout.dtype or spec.model.dtype,
            device=str(self.device),
            pad_token_id=self.pad_id,
            # every end token the model declares (tokenizer and generation_config), as vLLM and
            # transformers' generate stop on them; the run's model.path is the tokenizer's folder
            eos_token_ids=end_token_ids(spec.model.path),
            **extra,
        )
        self.backend = backend
        agent = rollout.agent
        if agent.enabled:
            if agent.tools and self.tools is None:  # one pool for the worker's life (engine restarts keep it)
                self.tools = ToolPool(agent.tools, num_workers=agent.tool_workers, timeout_s=agent.tool_timeout_s,
                                      memory_mb=agent.tool_memory_mb, max_chars=agent.tool_max_chars)
            interaction = load_function(agent.interaction, "interaction") if agent.interaction else None
            self.agent = AgentLoop(self.engine, load_tokenizer(spec.model.path), end_token_ids(spec.model.path),
                                   AgentSettings(agent.max_turns, agent.max_total_tokens), self.tools, interaction)

    def shutdown(self) -> None:
        self._close_engine()
        if self.tools is not None:
            self.tools.close()
            self.tools = None

    def _close_engine(self) -> None:
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()
        self.engine = None
        self.agent = None

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_model(self, model_path: str) -> None:
        """Restart the engine on another model folder (resume from a checkpoint)."""
        self.setup(model_path=model_path)

    @register(dispatch=Dispatch.DP_COMPUTE)
    def generate_sequences(self, batch: Batch, sampling: SamplingParams) -> Batch:
        """`sampling.n` responses per prompt, each prompt's consecutively (`rlcore.rollout.base.RolloutEngine`)."""
        generator = self.agent if self.agent is not None else self.engine
        started = time.perf_counter()
        try:
            out = generator.generate(batch, sampling)
        finally:
            self.busy_s += time.perf_counter() - started
        # every rank's responses are as wide as its own longest: the group's results concatenate
        # right-padded to the widest (what one rank generating the whole batch would return)
        out.info[RIGHT_PAD] = response_right_pad(self.pad_id)
        # which rank made each sample, for trace.jsonl: an async step joins groups of several calls
        out.meta["rollout_rank"] = np.full(len(out), self.rank, dtype=np.int64)
        return out

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def generate_seconds(self) -> float:
        """Seconds this rank has spent generating since it started: the async rollout's measure of
        how long each rollout worker waited (a rank that finishes its share of a call early waits
        for the slowest)."""
        return self.busy_s

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def set_weight_switch(self, switch: WeightSwitch | None) -> None:
        """Take new weights between decode steps through `switch` (`trainer.async_weight_sync=step`,
        in process: the switch is the async rollout's gate); None: between generate calls only."""
        if not hasattr(self.engine, "weight_switch"):
            raise ValueError(f"trainer.async_weight_sync=step: the {self.backend} rollout engine takes new weights "
                             "between generate calls only; use rollout.backend=hf or vllm, or trainer.async_weight_sync=generation")
        self.engine.weight_switch = switch

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def begin_weight_sync(self, names: list[str]) -> None:
        self.engine.begin_weight_sync(names)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.engine.update_weights(named_tensors)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_adapter(self, adapter: tuple[dict[str, torch.Tensor], dict]) -> None:
        """Generate with this LoRA adapter (tensors under peft's file names, its config) from now on."""
        tensors, config = adapter
        self.engine.load_adapter(tensors, config)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def sleep(self) -> dict[str, float]:
        """Sleep the engine; the device bytes that freed (`released_bytes`, device-wide) and the
        device's size (`device_total_bytes`): what `rollout.sleep=auto` weighs. Zeros on a CPU."""
        before = device_memory(self.device)
        self.engine.sleep()
        after = device_memory(self.device)
        if before is None or after is None:
            return {"released_bytes": 0.0, "device_total_bytes": 0.0}
        return {"released_bytes": float(max(0, after.free - before.free)), "device_total_bytes": float(after.total)}

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def wake(self) -> None:
        self.engine.wake()
