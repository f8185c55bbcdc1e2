"""Per-step throughput and utilisation: tokens/s and estimated MFU of each model phase, and the
GPU's memory and utilisation where this process can see one.

Tokens per phase: `generate` counts response tokens (not reported with `trainer.off_policy=one_step`,
where that phase times only the wait the overlap did not hide); the scoring passes (`old_log_prob`,
`ref_log_prob`, `values`) every real token of every sequence; the updates those times their
epochs. FLOPs come from `rlcore.flops` (the one copy of the formulas), MFU from the device peak:
`trainer.device_peak_tflops`, else detected for known NVIDIA GPUs, else none (CPU: no MFU key).

Device numbers (CUDA only, never on CPU): `memory/allocated_gib` and `memory/reserved_gib` from
torch when CUDA is initialised in this process (the in-process backend on a GPU); `gpu/util_pct`
(mean over visible GPUs) and `gpu/memory_used_gib` (largest) from NVML when `pynvml`
(nvidia-ml-py) is importable, sampled at the end of the step (NVML's utilisation is the share of
its last sample period, up to a second, that a kernel ran). Anything that fails is left out: a
metric must never stop a run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlcore.config import Config
from rlcore.flops import ModelFlops, causal_pairs, decode_pairs, mfu, peak_flops_for
from rlcore.protocol import Batch
from rlcore.trainer.metrics import Timer

log = logging.getLogger(__name__)


def detect_peak_flops(config: Config) -> float | None:
    """FLOP/s of one device for MFU: configured, or looked up by the GPU's name (torch where CUDA
    is the in-process device, else NVML, which needs no CUDA context); None on CPU."""
    if config.trainer.device_peak_tflops is not None:
        return config.trainer.device_peak_tflops * 1e12
    if config.trainer.device == "cpu":
        return None
    name = None
    try:
        if config.trainer.backend == "inprocess" and torch.cuda.is_available():
            name = torch.cuda.get_device_name(0)
        elif config.trainer.backend == "ray" and any(p.gpus_per_bundle > 0 for p in config.ray.pools.values()):
            names = _nvml_names()
            name = names[0] if names else None
    except Exception as e:  # noqa: BLE001 - an unknown device means no MFU, not a failed run
        log.warning("MFU: could not read the GPU's name (%s); set trainer.device_peak_tflops", e)
    return peak_flops_for(name) if name else None


@dataclass
class StepThroughput:
    """Built once per run: the FLOPs models of actor and critic, the device peak, ranks per role."""

    actor: ModelFlops | None   # None: a config rlcore.flops cannot read (tokens/s only, no MFU)
    critic: ModelFlops | None
    peak_flops: float | None
    devices: dict[str, int]  # phase -> devices doing it (the role's world size)
    actor_epochs: int
    critic_epochs: int
    generate_timed: bool = True  # False in one-step mode: the `generate` phase is only the wait the overlap left

    @classmethod
    def of(cls, config: Config) -> StepThroughput:
        critic_path = config.critic.model_path or config.model.path
        a, c, r = config.actor.world_size, config.critic.world_size, config.rollout.world_size
        return cls(
            actor=_flops_of(config.model.path, "lm"),
            critic=_flops_of(critic_path, "value") if config.traits.critic else None,
            peak_flops=detect_peak_flops(config),
            devices={"generate": r, "old_log_prob": a, "ref_log_prob": a, "update_actor": a, "values": c, "update_critic": c},
            actor_epochs=config.actor.ppo_epochs,
            critic_epochs=config.critic.ppo_epochs,
            generate_timed=config.trainer.off_policy == "sync",
        )

    def metrics(self, gen: Batch, timer: Timer, samples_per_prompt: int) -> dict[str, float]:
        """`throughput/<phase>_tok_s` and `throughput/<phase>_mfu` for the model phases this step
        timed (`gen`: `samples_per_prompt` consecutive samples per prompt), and the device numbers
        (see the module docstring)."""
        seq = gen.tensors["attention_mask"].sum(-1).double().numpy()
        resp = gen.tensors["response_mask"].sum(-1).double().numpy()
        tokens, head_tokens, pairs = float(seq.sum()), float(resp.sum()), causal_pairs(seq.tolist())
        actor, critic = self.actor, self.critic
        work: dict[str, tuple[float, float | None]] = {}  # phase -> (tokens, FLOPs)
        if self.generate_timed:
            work["generate"] = (head_tokens, self._generation_flops(actor, samples_per_prompt, seq - resp, resp) if actor else None)
        work["old_log_prob"] = work["ref_log_prob"] = (tokens, actor.forward(tokens, head_tokens, pairs) if actor else None)
        work["update_actor"] = (tokens * self.actor_epochs,
                                actor.training(tokens, head_tokens, pairs) * self.actor_epochs if actor else None)
        work["values"] = (tokens, critic.forward(tokens, tokens, pairs) if critic else None)
        work["update_critic"] = (tokens * self.critic_epochs,
                                 critic.training(tokens, tokens, pairs) * self.critic_epochs if critic else None)
        out: dict[str, float] = {}
        for phase, (n, flops) in work.items():
            secs = timer.seconds.get(phase)
            if not secs:
                continue
            out[f"throughput/{phase}_tok_s"] = n / secs
            util = mfu(flops, secs, self.peak_flops, self.devices[phase]) if flops is not None else None
            if util is not None:
                out[f"throughput/{phase}_mfu"] = util
        out.update(device_stats())
        return out

    @staticmethod
    def _generation_flops(model: ModelFlops, n: int, prompt: np.ndarray, resp: np.ndarray) -> float:
        """Prefill once per prompt (the cache is shared by its `n` samples), then one token at a time."""
        unique = prompt[::n]
        prefill = model.forward(float(unique.sum()), 0.0, causal_pairs(unique.tolist()))
        decode = model.forward(float(resp.sum()), float(resp.sum()), decode_pairs(prompt.tolist(), resp.tolist()))
        return prefill + decode


def _flops_of(path: str, head: str) -> ModelFlops | None:
    """The FLOPs model of a model folder, or None (logged) for a config without the usual keys."""
    try:
        return ModelFlops.from_model_dir(path, head)
    except (OSError, KeyError, TypeError, ValueError) as e:
        log.warning("MFU: cannot count the FLOPs of %s (%s: %s); tokens/s only", path, type(e).__name__, e)
        return None


def device_stats() -> dict[str, float]:
    """GPU memory (torch, this process) and utilisation (NVML); {} on CPU or when unavailable."""
    out: dict[str, float] = {}
    try:
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            out["memory/allocated_gib"] = torch.cuda.memory_allocated() / 2**30
            out["memory/reserved_gib"] = torch.cuda.memory_reserved() / 2**30
    except Exception as e:  # noqa: BLE001
        log.debug("no CUDA memory stats: %s", e)
    out.update(_nvml_stats())
    return out


def _nvml() -> Any | None:
    try:
        import pynvml  # nvidia-ml-py: optional, not in the lock
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver: no GPU numbers
        return None
    return pynvml


def _nvml_names() -> list[str]:
    nv = _nvml()
    if nv is None:
        return []
    names = []
    for i in range(nv.nvmlDeviceGetCount()):
        name = nv.nvmlDeviceGetName(nv.nvmlDeviceGetHandleByIndex(i))
        names.append(name.decode() if isinstance(name, bytes) else str(name))
    return names


def _nvml_stats() -> dict[str, float]:
    nv = _nvml()
    if nv is None:
        return {}
    try:
        handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        if not handles:
            return {}
        util = [float(nv.nvmlDeviceGetUtilizationRates(h).gpu) for h in handles]
        used = [float(nv.nvmlDeviceGetMemoryInfo(h).used) / 2**30 for h in handles]
        return {"gpu/util_pct": float(np.mean(util)), "gpu/memory_used_gib": max(used)}
    except Exception as e:  # noqa: BLE001
        log.debug("no NVML stats: %s", e)
        return {}


__all__ = ["StepThroughput", "detect_peak_flops", "device_stats"]
