"""`trainer.off_policy=async`: a rollout thread generates without stopping and hands
finished prompt groups (all n samples of a prompt, as group advantages need them) to a bounded
buffer; each step trains on the next `data.train_batch_size` groups no more than
`trainer.max_staleness` actor updates old, dropping (and counting) older ones. The thread is the
controller's, on either backend: its generate calls run on the rollout group's own thread in
process, or in the rollout workers on their own Ray pool (remote calls; `check_async_on_ray` in
`rlcore/config/rules.py` says which layouts), while the trainer thread drives the other groups.

Three small parts, each with one job:

- `GroupBuffer`: the bounded FIFO of `PromptGroup`s (each with the policy version it was generated
  with); `put` blocks while it is full, `take` while it lacks fresh groups; `close` wakes both.
- `EngineGate`: generation and weight changes take turns on the engine (a weight sync is several
  buckets); a waiting sync goes before the next generation, so the trainer is never starved by the
  producer. By default new weights reach the engine between generate calls; with
  `trainer.async_weight_sync=step` the sync is handed to the generation in flight, which runs it
  between two decode steps (`DecodeSwitch`, the hf engine's `WeightSwitch`) and goes on with the
  new weights, each token recording its version (a group's staleness is its oldest token's). A
  generation also waits until it may start (`ready`): as AReaL's rollout controller, the producer
  runs at most `max_staleness` steps ahead of the updates, so in steady state nothing it makes is
  too old to train on (dropping stays as the bound's guard).
- `AsyncRollout`: the producer thread (prompts from the loader, generate, split, put), the
  trainer's side (`next_batch`, `update_weights`, `exclusive` for validation) and the step's
  metrics (`async/*`: staleness histogram, buffer depth, wait fractions, dropped groups).

Checkpoints stay exact by draining, as the one-step `Prefetcher` does: the producer draws no
prompts for a step after the next checkpoint (or the last step) until that checkpoint is saved
(`checkpoint_saved`), so the saved loader position is exactly the prompts trained on, and a
resumed run draws the same prompts for the same steps as the uninterrupted one (the step after a
checkpoint waits for its generation, on the checkpoint's weights, in both).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch

from rlcore.config import Config
from rlcore.data import PromptLoader
from rlcore.protocol import RIGHT_PAD, Batch
from rlcore.rollout import SamplingParams
from rlcore.rollout.output import TOKEN_VERSIONS
from rlcore.trainer.groups import WorkerGroups, required
from rlcore.trainer.metrics import Timer
from rlcore.trainer.rollout_parts import stamp_policy_version, train_sampling

__all__ = ["AsyncRollout", "BufferClosed", "DecodeSwitch", "EngineGate", "GroupBuffer", "PromptGroup", "WaitClock",
           "chunk_sampling", "interrupted", "join_generations", "oldest_version"]


@dataclass(frozen=True)
class PromptGroup:
    """All samples of one prompt, generated on the weights after `version` actor updates."""

    samples: Batch
    version: int


class WaitClock:
    """Seconds a thread spent waiting, counting a wait still in progress (so a share of wall time
    measured between two readings never exceeds that wall time)."""

    def __init__(self) -> None:
        self._done = 0.0
        self._since: float | None = None
        self._lock = threading.Lock()

    @contextmanager
    def waiting(self) -> Iterator[None]:
        with self._lock:
            self._since = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self._done += time.perf_counter() - (self._since or 0.0)
                self._since = None

    def total(self, now: float) -> float:
        with self._lock:
            return self._done + (now - self._since if self._since is not None else 0.0)


class BufferClosed(RuntimeError):
    """The buffer was closed (the run ends, or the producer failed: then `__cause__`)."""


class GroupBuffer:
    """A bounded FIFO of prompt groups shared by one producer and one consumer thread."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._groups: deque[PromptGroup] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._error: BaseException | None = None
        self.dropped = 0  # groups dropped as too stale, since the start
        self.put_wait = WaitClock()  # the producer blocked on a full buffer

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)

    def put(self, group: PromptGroup) -> bool:
        """Append, waiting while the buffer is full; False (nothing appended) once it is closed."""
        with self._cond:
            with self.put_wait.waiting():
                self._cond.wait_for(lambda: self._closed or len(self._groups) < self.capacity)
            if self._closed:
                return False
            self._groups.append(group)
            self._cond.notify_all()
            return True

    def take(self, k: int, min_version: int) -> list[PromptGroup]:
        """The next `k` groups generated on version `min_version` or later, oldest first, waiting
        for them; older groups met on the way are dropped and counted. Raises `BufferClosed`."""
        taken: list[PromptGroup] = []
        with self._cond:
            while len(taken) < k:
                self._cond.wait_for(lambda: self._closed or bool(self._groups))
                if not self._groups:  # closed and empty
                    raise BufferClosed("the async rollout stopped") from self._error
                group = self._groups.popleft()
                if group.version < min_version:
                    self.dropped += 1
                else:
                    taken.append(group)
                self._cond.notify_all()
        return taken

    def close(self, error: BaseException | None = None) -> None:
        """Wake every waiter: `put` returns False, `take` raises once the groups left run out."""
        with self._cond:
            self._closed = True
            self._error = self._error or error
            if error is not None:
                self._groups.clear()  # the producer failed: the run stops, nothing more is trained
            self._cond.notify_all()


class EngineGate:
    """Generation and weight changes take turns on the engine; a waiting change goes first."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._generating = False
        self._exclusive = False
        self._woken = False
        self._waiting = 0  # exclusive users waiting for the generation in flight
        self._job: Callable[[], None] | None = None  # handed to the generation in flight (`at_step_boundary`)
        self._job_done = False
        self._job_error: BaseException | None = None
        self.wait = WaitClock()  # the generator waiting for exclusive users, or until `ready`

    @contextmanager
    def generation(self, ready: Callable[[], bool] = lambda: True) -> Iterator[bool]:
        """Generate once no exclusive user holds or waits for the engine and `ready()` (read under
        the gate, which `exclusive` users and `wake` re-check); yields `ready()`: False when woken
        by `wake` without it (the caller stops)."""
        with self._cond:
            with self.wait.waiting():
                self._cond.wait_for(lambda: (not self._exclusive and self._waiting == 0 and ready()) or self._woken)
            go = ready() and not self._exclusive and self._waiting == 0
            self._generating = go
        try:
            yield go
        finally:
            with self._cond:
                self._generating = False
                self._cond.notify_all()

    def wake(self) -> None:
        """Let a waiting generation return (yielding False): the run ends."""
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """The engine alone (weight sync, validation, a checkpoint): waits for the generation in flight."""
        with self._cond:
            self._waiting += 1
            self._cond.wait_for(lambda: not self._generating and not self._exclusive)
            self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()

    @property
    def job_waiting(self) -> bool:
        """Whether a job handed over by `at_step_boundary` waits for a decode step boundary."""
        with self._cond:
            return self._job is not None

    def at_step_boundary(self, job: Callable[[], None]) -> None:
        """Run `job` with the engine alone, as soon as possible: handed to the generation in flight,
        which runs it between two decode steps (`step_boundary`, on the generating thread), or here
        once no generation is in flight (it ended before its next step, or none was)."""
        with self._cond:
            self._waiting += 1
            self._job, self._job_done, self._job_error = job, False, None
            self._cond.wait_for(lambda: self._job_done or (not self._generating and not self._exclusive))
            self._waiting -= 1
            mine = not self._job_done
            self._job = None
            self._exclusive = self._exclusive or mine
            error = self._job_error
        if not mine:
            if error is not None:
                raise error
            return
        try:
            job()
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()

    def step_boundary(self) -> bool:
        """Inside a generation, between two decode steps: run the job `at_step_boundary` handed
        over, if any (its error goes to the thread that handed it); True when one ran."""
        with self._cond:
            job, self._job = self._job, None
            if job is None:
                return False
            self._exclusive = True
        error: BaseException | None = None
        try:
            job()
        except BaseException as e:  # raised where the job was handed over
            error = e
        finally:
            with self._cond:
                self._exclusive = False
                self._job_done, self._job_error = True, error
                self._cond.notify_all()
        return True


class DecodeSwitch:
    """The `WeightSwitch` the hf engine asks between decode steps: the gate's `step_boundary`,
    on the weights' policy version."""

    def __init__(self, gate: EngineGate, version: Callable[[], int]) -> None:
        self._gate = gate
        self._version = version

    def version(self) -> int:
        return self._version()

    def between_steps(self) -> bool:
        before = self._version()
        with torch.inference_mode(False):  # the sync runs as it would on the trainer's thread
            self._gate.step_boundary()
        return self._version() != before


def interrupted(samples: Batch) -> int:
    """Samples whose tokens were drawn under more than one policy version (`TOKEN_VERSIONS`)."""
    versions = samples.tensors.get(TOKEN_VERSIONS)
    if versions is None:
        return 0
    mask = samples.tensors["response_mask"] > 0
    big = torch.iinfo(versions.dtype).max
    first = torch.where(mask, versions, big).min(dim=1).values
    last = torch.where(mask, versions, -1).max(dim=1).values
    return int((last > first).sum())


def oldest_version(samples: Batch, started: int) -> int:
    """The policy version of a group's oldest token (`TOKEN_VERSIONS`), else of its generation's start."""
    versions = samples.tensors.get(TOKEN_VERSIONS)
    if versions is None:
        return started
    mask = samples.tensors["response_mask"] > 0
    return int(versions[mask].min()) if bool(mask.any()) else started


def join_generations(parts: list[Batch]) -> Batch:
    """Rows of several generations in one batch. Their prompts are left-padded to different
    widths (each loader batch to its longest): left-pad the prompt side to the widest first (pad
    tokens, attention 0, position 0, as `collate_prompts` does), then `Batch.concat` right-pads
    the response side."""
    width = max(int(p.tensors["prompts"].shape[1]) for p in parts)
    if all(p.tensors["prompts"].shape[1] == width for p in parts):
        return Batch.concat(parts)
    pad_id = (parts[0].info.get(RIGHT_PAD) or {}).get("responses", 0)
    fills = {"prompts": pad_id, "input_ids": pad_id, "attention_mask": 0, "position_ids": 0}
    padded = []
    for p in parts:
        extra = width - int(p.tensors["prompts"].shape[1])
        tensors = dict(p.tensors)
        for key, fill in fills.items():
            t = tensors[key]
            tensors[key] = torch.cat([t.new_full((t.shape[0], extra), fill), t], dim=1) if extra else t
        padded.append(Batch(tensors=tensors, meta=p.meta, info=p.info))
    return Batch.concat(padded)


def chunk_sampling(sampling: SamplingParams, chunk: int) -> SamplingParams:
    """The sampling parameters of a step's `chunk`-th generate call: the step's own for the first,
    a seed of its own for each further one (one seeded stream per call: chunks sharing a seed
    would draw alike)."""
    if chunk == 0 or sampling.seed is None:
        return sampling
    return replace(sampling, seed=(sampling.seed + chunk * 104_729) % (2**31 - 1))


class AsyncRollout:
    """The producer thread and the trainer's side of the buffer (see the module's docstring)."""

    def __init__(self, config: Config, groups: WorkerGroups, loader: PromptLoader) -> None:
        self.config = config
        self.groups = groups
        self.loader = loader
        self.n = config.rollout.n
        self.batch_groups = config.data.train_batch_size
        self.max_staleness = config.trainer.max_staleness
        self.chunk = config.trainer.async_chunk_prompts or self.batch_groups  # prompts per generate call
        # room for the steps the producer may run ahead (`_may_start` bounds it); one more call is in flight
        self.buffer = GroupBuffer(capacity=self.batch_groups * max(1, self.max_staleness))
        self.gate = EngineGate()
        self.at_step = config.trainer.async_weight_sync == "step"  # new weights between decode steps
        self.version = 0  # actor updates behind the engine's weights (changed under the gate)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._calls = 0  # generate calls started, one step's prompts each
        self._open_until = 0  # the last step whose prompts may be drawn before the next checkpoint is saved
        self._engine_waited = 0.0  # the trainer's waits for the engine outside a step (validation)
        # (time, producer wait, dropped, trainer's engine wait) at the last step's metrics
        self._mark = (time.perf_counter(), 0.0, 0, 0.0)
        self._busy: list[float] = []  # each rollout rank's generating seconds after the producer's last call
        self._busy_mark: list[float] = []  # the same at the last step's metrics

    def start(self, version: int) -> None:
        """Start generating on the engine's weights (after `version` updates: a resumed run's step)."""
        self.version = self._calls = version
        self._open_until = self._next_checkpoint(version)
        self._mark = (time.perf_counter(), 0.0, 0, self._engine_waited)
        self._busy = self._busy_mark = required(self.groups.rollout, "rollout").generate_seconds()  # validation's, before
        if self.at_step:
            required(self.groups.rollout, "rollout").set_weight_switch(DecodeSwitch(self.gate, lambda: self.version))
        self._thread = threading.Thread(target=self._produce, name="rlcore-async-rollout", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        try:
            while self._produce_step():
                pass
        except BaseException as e:  # the trainer raises it from `next_batch`
            self.buffer.close(e)

    def _produce_step(self) -> bool:
        """One step's prompts, drawn once `_may_start`, generated chunk by chunk (`trainer.async_chunk_prompts`),
        each chunk on the engine's weights when it starts; False once the run ends."""
        rollout = required(self.groups.rollout, "rollout")
        with self.gate.generation(self._may_start) as go:
            if not go:
                return False
            prompts = self.loader.next_batch()
            self._calls += 1
        sampling = train_sampling(self.config, self._calls)
        for i, chunk in enumerate(prompts.split(self.chunk)):
            with self.gate.generation(lambda: not self._stop.is_set()) as go:
                if not go:
                    return False
                version = self.version
                gen = rollout.generate_sequences(chunk, chunk_sampling(sampling, i))
                self._busy = rollout.generate_seconds()
            for samples in stamp_policy_version(gen, version).split(self.n):
                if not self.buffer.put(PromptGroup(samples, oldest_version(samples, version))):
                    return False
        return True

    def _may_start(self) -> bool:
        """Whether the next generation, trained after the ones before it, would be at most
        `max_staleness` updates old: call c (one step's groups each, less those dropped) trains
        at step c, on the weights after c - 1 updates, and starts on `self.version`'s."""
        due = self._calls + 1 - self.buffer.dropped // self.batch_groups
        return not self._stop.is_set() and due - 1 - self.version <= self.max_staleness and due <= self._open_until

    def _next_checkpoint(self, step: int) -> int:
        """The first step after `step` that saves a checkpoint (`trainer.save_every`, and the last step)."""
        cfg = self.config.trainer
        return min((step // cfg.save_every + 1) * cfg.save_every, cfg.total_steps)

    def checkpoint_saved(self, step: int) -> None:
        """Step `step`'s checkpoint holds the loader's position: draw prompts up to the next one."""
        with self.gate.exclusive():  # leaving it wakes the producer to re-check `_may_start`
            self._open_until = self._next_checkpoint(step)

    def next_batch(self, version: int, timer: Timer) -> tuple[Batch, dict[str, float]]:
        """This step's samples: the next groups at most `max_staleness` updates behind `version`
        (the weights the actor trains from); the wait is the step's `generate` phase."""
        with timer.phase("generate"):
            try:
                taken = self.buffer.take(self.batch_groups, min_version=version - self.max_staleness)
            except BufferClosed as closed:  # the producer's own error, as a sync run would raise it
                if closed.__cause__ is not None:
                    raise closed.__cause__ from None
                raise
        lags = [version - g.version for g in taken]
        metrics = {f"async/staleness_{lag}": float(sum(self.n for x in lags if x == lag)) for lag in range(self.max_staleness + 1)}
        metrics["async/buffer_depth"] = float(len(self.buffer))
        if self.at_step:
            metrics["async/interrupted_generations"] = float(sum(interrupted(g.samples) for g in taken))
        return join_generations([g.samples for g in taken]), metrics

    def step_metrics(self, timer: Timer) -> dict[str, float]:
        """Since the last call: the share of wall time the trainer waited (for samples, for the
        generation in flight before a weight sync, and before a validation between steps) and the
        producer waited (buffer full, or the engine taken by a weight sync or validation), the
        share each rollout rank was not generating (`async/rollout_wait_frac_rank_<r>`: the
        producer's waits, plus a rank's wait for the slowest rank of each call; a call's seconds
        count when it returns, so a step's value is clipped to [0, 1]), and the groups dropped as
        too stale."""
        now = time.perf_counter()
        waited, dropped = self.buffer.put_wait.total(now) + self.gate.wait.total(now), self.buffer.dropped
        then, waited_then, dropped_then, engine_waited_then = self._mark
        self._mark = (now, waited, dropped, self._engine_waited)
        busy, busy_then = list(self._busy), self._busy_mark
        self._busy_mark = busy
        wall = max(now - then, 1e-9)
        trainer_waited = (timer.seconds.get("generate", 0.0) + timer.seconds.get("weight_sync_wait", 0.0)
                          + self._engine_waited - engine_waited_then)
        ranks = {f"async/rollout_wait_frac_rank_{rank}": min(max(1.0 - (seconds - seconds_then) / wall, 0.0), 1.0)
                 for rank, (seconds, seconds_then) in enumerate(zip(busy, busy_then))}
        return {"async/trainer_wait_frac": min(trainer_waited / wall, 1.0),
                "async/rollout_wait_frac": min((waited - waited_then) / wall, 1.0), **ranks,
                "async/dropped_groups": float(dropped - dropped_then)}

    def update_weights(self, sync: Callable[[], Any], version: int, timer: Timer) -> None:
        """Push the actor's weights between two generate calls (the wait for the one in flight is
        the step's `weight_sync_wait` phase); later groups carry `version`. With
        `trainer.async_weight_sync=step` the generation in flight takes them at its next decode
        step: the sync runs there, on the generating thread, while this one waits (the phase is
        the wait until the sync starts; the sync times its own `weight_sync` phase)."""
        if self.at_step:
            handed = time.perf_counter()
            started = [handed]

            def job() -> None:
                started[0] = time.perf_counter()
                sync()
                self.version = version

            self.gate.at_step_boundary(job)
            timer.add("weight_sync_wait", started[0] - handed)
            return
        with ExitStack() as engine:
            with timer.phase("weight_sync_wait"):
                engine.enter_context(self.gate.exclusive())
            sync()
            self.version = version

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """The engine alone (validation), between two generations: the wait for the one in flight
        is the trainer's, counted in the next step's `async/trainer_wait_frac`."""
        asked = time.perf_counter()
        with self.gate.exclusive():
            self._engine_waited += time.perf_counter() - asked
            yield

    def close(self) -> None:
        """Stop the producer (after the generation in flight) without hanging on a full buffer."""
        self._stop.set()
        self.buffer.close()
        self.gate.wake()
        if self._thread is not None:
            self._thread.join()
        if self.at_step and self._thread is not None:
            required(self.groups.rollout, "rollout").set_weight_switch(None)
