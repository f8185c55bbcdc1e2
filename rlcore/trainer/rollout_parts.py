"""The parts of a step that drive the rollout engine: sampling parameters, generation, sleep/wake
around the update (colocated), one-step prefetch, and the weight sync.

Each is a small object or function with one job; a recipe composes the ones it needs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from rlcore.config import Config
from rlcore.controller import GroupFuture
from rlcore.data import PromptLoader
from rlcore.protocol import Batch
from rlcore.rollout import SamplingParams
from rlcore.trainer.groups import WorkerGroups, required
from rlcore.trainer.metrics import Timer
from rlcore.workers.memory import sleep_decision

log = logging.getLogger(__name__)


def sampling_seed(seed: int, step: int) -> int:
    """A per-step seed that a resumed run reproduces without saving generator state."""
    return (seed * 1_000_003 + step * 7919) % (2**31 - 1)


def train_sampling(config: Config, step: int) -> SamplingParams:
    """Sampling parameters of step `step`'s training generation: `rollout.n` samples per prompt
    (`.n`, which the recipe also hands the updates to split rows by)."""
    r = config.rollout
    return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                          seed=sampling_seed(config.trainer.seed, step))


def val_sampling(config: Config, step: int) -> SamplingParams:
    """Validation: `rollout.val_n` samples per prompt, greedy when `val_n` is 1 (`rollout.val_greedy`)."""
    r = config.rollout
    greedy = r.val_greedy if r.val_greedy is not None else r.val_n == 1
    return SamplingParams(n=r.val_n, temperature=r.val_temperature, do_sample=not greedy, top_p=r.top_p, top_k=r.top_k,
                          max_new_tokens=r.max_new_tokens, seed=sampling_seed(config.trainer.seed + 1, step))


def stamp_policy_version(gen: Batch, version: int) -> Batch:
    """Record, per sample, after how many actor updates the generating weights were taken."""
    gen.meta["policy_version"] = np.full(len(gen), version, dtype=np.int64)
    return gen


def generate(groups: WorkerGroups, prompts: Batch, sampling: SamplingParams, policy_version: int, timer: Timer) -> Batch:
    """Generate now (waiting for the result) with the given sampling parameters."""
    with timer.phase("generate"):
        gen = required(groups.rollout, "rollout").generate_sequences(prompts, sampling)
    return stamp_policy_version(gen, policy_version)


def rollout_shares_gpu(config: Config) -> bool:
    """Whether the rollout engine shares a GPU with the actor while the actor trains: in-process on
    CUDA; on Ray, placed on one GPU pool, which includes colocating them in one process. Never in
    one-step or async mode: the engine generates the next batch while the actor trains."""
    if config.trainer.off_policy != "sync":
        return False
    if config.trainer.backend == "inprocess":
        return config.trainer.device == "cuda" or (config.trainer.device == "auto" and torch.cuda.is_available())
    pool = config.ray.pool_of("actor")
    return pool == config.ray.pool_of("rollout") and config.ray.pools[pool].gpus_per_bundle > 0


SleepMode = Literal["always", "never", "auto"]


def sleep_mode(config: Config) -> tuple[SleepMode, str]:
    """How the engine sleeps through the update (`rollout.sleep`), and why: always / never as set;
    auto: never where it shares no GPU with the actor, else decided by memory (`RolloutSleep`)."""
    mode = config.rollout.sleep
    if mode != "auto":
        return mode, f"rollout.sleep={mode}" + (" (a no-op on a CPU: the engine's memory is host memory)" if rollout_on_cpu(config) else "")
    if not rollout_shares_gpu(config):
        where = (f"trainer.off_policy={config.trainer.off_policy}: it generates while the actor trains"
                 if config.trainer.off_policy != "sync"
                 else "it runs on a CPU, where sleeping is a no-op" if rollout_on_cpu(config) else "it shares no GPU with the actor")
        return "never", f"rollout.sleep=auto: the engine stays awake: {where}"
    return "auto", "rollout.sleep=auto: step 1 sleeps the engine through the update and measures the update's peak"


def rollout_on_cpu(config: Config) -> bool:
    """Whether the rollout engine runs on a CPU (in process: the trainer's device; on Ray: a pool without GPUs)."""
    if config.trainer.backend == "inprocess":
        return config.trainer.device == "cpu" or (config.trainer.device == "auto" and not torch.cuda.is_available())
    return config.ray.pools[config.ray.pool_of("rollout")].gpus_per_bundle == 0


def update_peak_bytes(metrics: dict[str, float]) -> int | None:
    """The largest device-wide update peak the trained roles reported this step (CUDA only), in
    bytes: each role's bound (`memory/<role>_update_device_bound_gib`: its measured peak grown to
    the largest micro-batch a later step may pack), else its measured peak; None when none did."""
    peaks = [v for k, v in metrics.items() if k.startswith("memory/") and k.endswith("_update_device_bound_gib")]
    peaks = peaks or [v for k, v in metrics.items() if k.startswith("memory/") and k.endswith("_update_device_peak_gib")]
    return int(max(peaks) * 2**30) if peaks else None


class RolloutSleep:
    """Colocated hybrid mode: the engine sleeps (weights and KV cache off the GPU) from after a
    training generation until the weight sync, so the actor's update has the memory.

    `rollout.sleep=auto` on a shared GPU (`sleep_mode`): the first step sleeps, the rollout workers
    report the bytes sleeping released and the device's size, the trained roles the update's
    device-wide peak grown to the largest micro-batch a later step may pack, as responses grow
    (`memory/*_update_device_bound_gib`); `after_update` then decides once, with
    `sleep_decision`, whether later steps keep the engine awake, and logs it with the numbers."""

    def __init__(self, groups: WorkerGroups, mode: SleepMode, reason: str = "") -> None:
        self.groups = groups
        self.mode = mode
        self.enabled = mode != "never"
        self.asleep = False
        self.released: dict[str, float] = {}  # the last sleep's numbers (most over the engine's ranks)
        if reason:
            log.info(reason)

    def after_generation(self, timer: Timer) -> None:
        """Sleep (queued behind any generation still running on the engine)."""
        if self.enabled:
            with timer.phase("rollout_sleep"):
                per_rank = required(self.groups.rollout, "rollout").sleep()
            self.released = {k: max(float(r.get(k, 0.0)) for r in per_rank) for k in ("released_bytes", "device_total_bytes")}
            self.asleep = True

    def wake(self, timer: Timer) -> None:
        if self.asleep:
            with timer.phase("rollout_wake"):
                required(self.groups.rollout, "rollout").wake()
            self.asleep = False

    def after_update(self, metrics: dict[str, float]) -> None:
        """`auto`: decide once from this step's numbers whether the engine sleeps from now on."""
        if self.mode != "auto":
            return
        self.mode = "always"  # decided once; without measurements it keeps sleeping, and says so
        peak, total = update_peak_bytes(metrics), int(self.released.get("device_total_bytes", 0))
        if peak is None or total <= 0:
            log.info("rollout.sleep=auto: the engine keeps sleeping through the update (no device measurement of the "
                     "update's peak or the engine's memory this step)")
            return
        grown = any(k.endswith("_update_device_bound_gib") for k in metrics)
        decision = sleep_decision(total=total, engine_bytes=int(self.released.get("released_bytes", 0)), update_peak=peak,
                                  source="measured in step 1" + (", grown to the largest micro-batch a step may pack" if grown else ""))
        log.info(decision.reason)
        if not decision.sleep:
            self.mode, self.enabled = "never", False


def sync_weights(groups: WorkerGroups, sleep: RolloutSleep, timer: Timer) -> None:
    """Actor -> rollout engine (woken first), bucket by bucket: never a second full copy at once."""
    sleep.wake(timer)
    with timer.phase("weight_sync"):
        groups.sync_weights()


@dataclass
class PendingRollout:
    """A generation launched for `step` on an engine holding the weights after `policy_version` updates."""

    step: int
    prompts: Batch
    future: GroupFuture[Batch]
    policy_version: int


class Prefetcher:
    """`trainer.off_policy=one_step`: step k+1's generation runs while step k scores and updates
    (in process the rollout group has a thread of its own for it, see `build_worker_groups`; on
    Ray it is another process). The weight sync after step k's update is queued behind it on
    the rollout workers, so weights never change under a running generation.

    Those samples come from the weights one update old (staleness 1, recorded per sample); the
    actor recomputes old log-probs, so the clipped ratio corrects for it. Nothing is prefetched
    across a checkpoint step or past the last step: a checkpoint holds the data order up to step k
    only, and a resumed run regenerates step k+1 on step k's weights. The uninterrupted run does the
    same (step k+1 after a checkpoint is on-policy), so resume stays exact.
    """

    def __init__(self, config: Config, groups: WorkerGroups, loader: PromptLoader) -> None:
        self.config = config
        self.groups = groups
        self.loader = loader
        self.pending: PendingRollout | None = None

    def prompts_for(self, step: int) -> Batch | None:
        """The prompts already launched for `step`, if any (the loader has moved past them)."""
        return self.pending.prompts if self.pending is not None and self.pending.step == step else None

    def collect(self, prompts: Batch, step: int, policy_version: int, timer: Timer) -> Batch:
        """This step's samples: the prefetched generation, or one launched now (step 1 and the step
        after a checkpoint). The `generate` phase is only the wait the overlap did not hide."""
        pending, self.pending = self.pending, None
        if pending is None or pending.step != step:
            pending = self._launch(prompts, step, policy_version)
        with timer.phase("generate"):
            gen = pending.future.result()
        return stamp_policy_version(gen, pending.policy_version)

    def launch_next(self, step: int, policy_version: int) -> None:
        """Launch step+1's generation now, on the weights before step's update."""
        cfg = self.config.trainer
        if step < cfg.total_steps and step % cfg.save_every != 0:
            self.pending = self._launch(self.loader.next_batch(), step + 1, policy_version)

    def _launch(self, prompts: Batch, step: int, policy_version: int) -> PendingRollout:
        future = required(self.groups.rollout, "rollout").generate_sequences_async(prompts, train_sampling(self.config, step))
        return PendingRollout(step, prompts, future, policy_version)


__all__ = [
    "PendingRollout", "Prefetcher", "RolloutSleep", "SleepMode", "generate", "rollout_shares_gpu", "sampling_seed",
    "rollout_on_cpu", "sleep_mode", "stamp_policy_version", "sync_weights", "train_sampling", "update_peak_bytes", "val_sampling",
]
