"""What every RL control flow shares: worker groups, the step loop, validation, checkpoints.

The algorithm itself lives in a subclass's `train_step` (grpo.py, ppo.py): a readable sequence
of worker-group calls. This module only runs steps, validates, saves, resumes and logs.
"""

from __future__ import annotations

import json
import logging
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from rlcore.algos import kl_penalty, make_kl_controller, masked_mean
from rlcore.checkpoint import (
    CheckpointManager,
    load_trainer_state,
    rng_state,
    save_trainer_state,
    set_rng_state,
    step_of,
)
from rlcore.config import Config, dump_config
from rlcore.controller import GroupFuture
from rlcore.data import PromptLoader, RLDataset
from rlcore.protocol import Batch
from rlcore.tracking import ConsoleSink, JsonlSink, Tracker, truncate_jsonl
from rlcore.trainer.roles import WorkerGroups, build_worker_groups
from rlcore.trainer.tracing import sample_records, step_record, worker_identities
from rlcore.workers.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (e.g. too many non-finite updates in a row); work so far is saved."""


class Timer:
    """Seconds per phase and, where this process drives a GPU, its peak allocated memory.

    Peak memory (`torch.cuda.max_memory_allocated`, reset at each phase start) is measured only
    when CUDA is already initialised here: the in-process backend on a GPU. A Ray controller
    never touches CUDA, so it neither measures nor creates a context by asking.
    """

    def __init__(self, device_memory: bool | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self.peak_gib: dict[str, float] = {}
        if device_memory is None:
            device_memory = torch.cuda.is_available() and torch.cuda.is_initialized()
        self.device_memory = device_memory

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.device_memory:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        yield
        if self.device_memory:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() / 2**30
            self.peak_gib[name] = max(self.peak_gib.get(name, 0.0), peak)
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def rollout_shares_gpu(config: Config) -> bool:
    """Whether the rollout engine should sleep while the actor trains: `rollout.free_memory_when_idle`,
    or by default when actor and rollout share GPUs (in-process on CUDA; on Ray, placed on one
    GPU pool, which includes colocating them in one process)."""
    if config.rollout.free_memory_when_idle is not None:
        return config.rollout.free_memory_when_idle
    if config.trainer.backend == "inprocess":
        return config.trainer.device == "cuda" or (config.trainer.device == "auto" and torch.cuda.is_available())
    pool = config.ray.pool_of("actor")
    return pool == config.ray.pool_of("rollout") and config.ray.pools[pool].gpus_per_bundle > 0


def sampling_seed(seed: int, step: int) -> int:
    """A per-step seed that a resumed run reproduces without saving generator state."""
    return (seed * 1_000_003 + step * 7919) % (2**31 - 1)


@dataclass
class PendingRollout:
    """A generation launched for `step` (one-step off-policy: during the step before), on a
    rollout engine holding the weights after `policy_version` actor updates."""

    step: int
    prompts: Batch
    future: GroupFuture
    policy_version: int




class RLTrainer:
    """Runs `train_step` for `trainer.total_steps` steps with validation, checkpoints and resume."""

    algorithm = "base"
    supports_one_step = False  # control flows that implement trainer.off_policy=one_step

    def __init__(
        self,
        config: Config,
        groups: WorkerGroups | None = None,
        step_hooks: Sequence[Callable[[int, dict[str, Any]], None]] = (),
    ) -> None:
        """`step_hooks` see every step's metrics before they are logged and saved; a hook that
        raises `TrainingStopped` ends the run without checkpointing that step (health guards)."""
        self.config = config
        if config.trainer.off_policy != "sync" and not self.supports_one_step:
            raise ValueError(
                f"trainer.off_policy={config.trainer.off_policy!r} is not supported by the {self.algorithm!r} "
                "control flow; use trainer.off_policy=sync"
            )
        self.step_hooks = list(step_hooks)
        self.run_dir = Path(config.trainer.output_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(dump_config(config))
        torch.manual_seed(config.trainer.seed)
        np.random.seed(config.trainer.seed)
        self.tokenizer = load_tokenizer(config.model.path)
        self.train_loader = self._make_loader(config.data.train_files, config.data.train_batch_size, shuffle=config.data.shuffle, drop_last=True)
        self.val_loader = (
            self._make_loader(config.data.val_files, config.data.val_batch_size, shuffle=False, drop_last=False)
            if config.data.val_files
            else None
        )
        self.groups = groups or build_worker_groups(config)
        self.kl_ctrl = make_kl_controller(
            config.algorithm.kl_ctrl.type,
            kl_coef=config.algorithm.kl_ctrl.kl_coef,
            target_kl=config.algorithm.kl_ctrl.target_kl,
            horizon=config.algorithm.kl_ctrl.horizon,
        )
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", keep_last=config.trainer.keep_last)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.trace_path = self.run_dir / "trace.jsonl"
        # Off-policy bookkeeping: the rollout engine holds the weights after this many actor
        # updates; a one-step run keeps the next step's generation in flight here.
        self.rollout_version = 0
        self._prefetch: PendingRollout | None = None
        self._step_trace: dict[str, Any] | None = None
        self.step = 0
        self.bad_steps_in_a_row = 0
        self.bad_steps_total = 0
        self.history: list[dict[str, Any]] = []
        # Colocated hybrid mode: the engine sleeps (weights and KV cache off the GPU) from after
        # generation until the weight sync, so the actor's update has the memory.
        self.rollout_sleeps = rollout_shares_gpu(config)
        self._rollout_asleep = False

    # ------------------------------------------------------------------ setup
    def _make_loader(self, files: list[str], batch_size: int, shuffle: bool, drop_last: bool) -> PromptLoader:
        cfg = self.config.data
        dataset = RLDataset(
            files,
            self.tokenizer,
            max_prompt_length=cfg.max_prompt_length,
            apply_chat_template=cfg.apply_chat_template,
            on_bad_row=cfg.on_bad_row,
        )
        return PromptLoader(dataset, batch_size=batch_size, seed=self.config.trainer.seed, shuffle=shuffle, drop_last=drop_last)

    def _open_tracker(self) -> Tracker:
        sinks = []
        if "jsonl" in self.config.trainer.loggers:
            sinks.append(JsonlSink(self.metrics_path))
        if "console" in self.config.trainer.loggers:
            sinks.append(ConsoleSink(self.config.trainer.total_steps))
        if "mlflow" in self.config.trainer.loggers:
            sinks.append(self._mlflow_sink())
        return Tracker(sinks)

    def _mlflow_sink(self):
        """One MLflow run per run directory: a resumed run keeps logging into the same one."""
        from rlcore.lifecycle.mlflow_store import MlflowStore, flatten
        from rlcore.tracking import MlflowSink

        store = MlflowStore(self.config.tracking.mlflow_uri, self.config.tracking.experiment)
        id_file = self.run_dir / "mlflow_run_id"
        if id_file.is_file():
            run_id = id_file.read_text().strip()
        else:
            run_id = store.start_run(self.run_dir.name, tags={"rlcore.algorithm": self.algorithm})
            store.log_params(run_id, flatten(self.config.model_dump(mode="json")))
            id_file.write_text(run_id)
        sink = MlflowSink(run_id, client=store.client)
        sink.close = lambda: store.end_run(run_id)  # type: ignore[method-assign]
        return sink

    # ------------------------------------------------------------------ resume / save
    def _resume_point(self) -> Path | None:
        mode = self.config.trainer.resume
        if mode == "disable":
            return None
        if mode == "auto":
            return self.checkpoints.latest()
        path = Path(mode)
        self.checkpoints.verify(path)
        return path

    def resume(self) -> None:
        path = self._resume_point()
        if path is None:
            truncate_jsonl(self.metrics_path, 0)
            truncate_jsonl(self.trace_path, 0)
            return
        state = load_trainer_state(path)
        self.groups.load_checkpoint(str(path))
        self.train_loader.load_state_dict(state["train_loader"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.bad_steps_in_a_row = state["bad_steps_in_a_row"]
        self.bad_steps_total = state["bad_steps_total"]
        self.step = step_of(path)
        set_rng_state(state["rng"])
        truncate_jsonl(self.metrics_path, self.step)
        truncate_jsonl(self.trace_path, self.step)
        self.rollout_version = self.step  # the engine restarts on the checkpoint's actor
        log.info("resumed from %s (step %d)", path, self.step)

    def save_checkpoint(self) -> Path:
        def write(folder: Path) -> None:
            self.groups.save_checkpoint(str(folder), tokenizer_dir=self.config.model.path)
            save_trainer_state(
                folder,
                {
                    "step": self.step,
                    "train_loader": self.train_loader.state_dict(),
                    "kl_ctrl": self.kl_ctrl.state_dict(),
                    "bad_steps_in_a_row": self.bad_steps_in_a_row,
                    "bad_steps_total": self.bad_steps_total,
                    "rng": rng_state(),
                },
            )

        return self.checkpoints.save(self.step, write, extra={"algorithm": self.algorithm})

    # ------------------------------------------------------------------ the loop
    def fit(self) -> list[dict[str, Any]]:
        cfg = self.config.trainer
        self.resume()
        tracker = self._open_tracker()
        workers = worker_identities(self.groups) if cfg.trace else {}
        try:
            if self.step == 0 and cfg.val_before_train and self.val_loader is not None:
                tracker.log(0, self.validate())
            while self.step < cfg.total_steps:
                self.step += 1
                start = time.perf_counter()
                pending = self._prefetch
                batch = pending.prompts if pending is not None and pending.step == self.step else self.train_loader.next_batch()
                self._step_trace = None
                metrics = self.train_step(batch)
                metrics["time/step_s"] = time.perf_counter() - start
                self._check_health(metrics)
                last = self.step == cfg.total_steps
                if self.val_loader is not None and (self.step % cfg.val_every == 0 or last):
                    metrics.update(self.validate())
                try:
                    for hook in self.step_hooks:
                        hook(self.step, metrics)
                finally:
                    tracker.log(self.step, metrics)
                    if cfg.trace:
                        self.write_trace(metrics, workers)
                self.history.append(metrics)
                if self.step % cfg.save_every == 0 or last:
                    self.save_checkpoint()
        finally:
            tracker.close()
            self.groups.close()
        return self.history

    def train_step(self, batch: Batch) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _check_health(self, metrics: dict[str, Any]) -> None:
        bad = metrics.get("actor/bad_updates", 0.0) > 0 or not math.isfinite(metrics.get("actor/pg_loss", 0.0))
        if bad:
            self.bad_steps_in_a_row += 1
            self.bad_steps_total += 1
        else:
            self.bad_steps_in_a_row = 0
        metrics["train/bad_steps_total"] = float(self.bad_steps_total)
        limit = self.config.actor.max_consecutive_bad_steps
        if self.bad_steps_in_a_row >= limit:
            raise TrainingStopped(
                f"{self.bad_steps_in_a_row} steps in a row had a non-finite loss or gradient (limit "
                f"actor.max_consecutive_bad_steps={limit}); the last good checkpoint is kept in {self.checkpoints.root}"
            )

    # ------------------------------------------------------------------ shared step pieces
    def sampling(self, *, validation: bool = False, step: int | None = None) -> dict[str, Any]:
        """Sampling parameters for the generation of `step` (default: the current step)."""
        r = self.config.rollout
        step = self.step if step is None else step
        if validation:
            return dict(
                n=r.val_n,
                temperature=r.val_temperature,
                do_sample=not r.val_greedy,
                top_p=r.top_p,
                top_k=r.top_k,
                max_new_tokens=r.max_new_tokens,
                seed=sampling_seed(self.config.trainer.seed + 1, step),
            )
        return dict(
            n=r.n,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            seed=sampling_seed(self.config.trainer.seed, step),
        )

    def step_samples(self, batch: Batch, timer: Timer) -> tuple[Batch, dict[str, float]]:
        """This step's scored samples. `trainer.off_policy=one_step`: the generation prefetched
        during the previous step, with the next step's launched before scoring so that it runs
        while this step scores and updates; `sync`: generated now."""
        if self.config.trainer.off_policy == "one_step":
            gen = self.collect_generation(batch, timer)
            self.prefetch_next(timer)
            return self.score(gen, timer)
        return self.generate_and_score(batch, timer)

    def generate_and_score(self, batch: Batch, timer: Timer, *, validation: bool = False) -> tuple[Batch, dict[str, float]]:
        batch.info["sampling"] = self.sampling(validation=validation)
        with timer.phase("generate"):
            gen = self.groups.rollout.generate_sequences(batch)
        self._stamp_version(gen, self.rollout_version)
        if self.rollout_sleeps and not validation:  # validation runs right after a sync: stay awake
            with timer.phase("rollout_sleep"):
                self.groups.rollout.sleep()
            self._rollout_asleep = True
        return self.score(gen, timer)

    def score(self, gen: Batch, timer: Timer) -> tuple[Batch, dict[str, float]]:
        """Rewards for generated samples, joined to them; reward metrics and the first error."""
        with timer.phase("reward"):
            scored = self.groups.reward.compute_reward(gen)
        metrics = dict(scored.info.pop("reward_metrics", {}))
        first_error = scored.info.pop("reward_first_error", None)
        if first_error:
            metrics["reward/first_error"] = first_error
            log.warning("reward function error (counted, score=%s): %s", self.config.reward.error_score, first_error)
        return gen.union(scored), metrics

    def old_and_ref_log_probs(self, gen: Batch, timer: Timer) -> Batch:
        with timer.phase("old_log_prob"):
            gen = gen.union(self.groups.actor.compute_log_prob(gen))
        if self.groups.ref is not None:
            with timer.phase("ref_log_prob"):
                gen = gen.union(self.groups.ref.compute_ref_log_prob(gen))
        return gen

    def rewards_with_kl(self, gen: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """Token-level rewards: the scores, minus a KL penalty when it is in the reward."""
        scores = gen["token_level_scores"]
        if not self.config.algorithm.use_kl_in_reward:
            return scores, {}
        mask = gen["response_mask"].float()
        kl = kl_penalty(gen["old_log_probs"], gen["ref_log_probs"], self.config.algorithm.kl_penalty) * mask
        beta = self.kl_ctrl.value
        current_kl = float(masked_mean(kl, mask, dim=-1).mean())
        self.kl_ctrl.update(current_kl, n_steps=len(gen))
        return scores - beta * kl, {"critic/kl_in_reward": current_kl, "critic/kl_coef": beta}

    def sync_weights(self, timer: Timer) -> None:
        if self._rollout_asleep:
            with timer.phase("rollout_wake"):
                self.groups.rollout.wake()
            self._rollout_asleep = False
        with timer.phase("weight_sync"):
            self.groups.sync_weights()  # bucket by bucket, never a second full copy at once
        self.rollout_version = self.step

    # ------------------------------------------------------------------ one-step off-policy
    def launch_generation(self, batch: Batch, step: int) -> PendingRollout:
        """Start generating `step`'s samples without waiting (in-process: done on return)."""
        batch.info["sampling"] = self.sampling(step=step)
        future = self.groups.rollout.call_async("generate_sequences", batch)
        return PendingRollout(step, batch, future, self.rollout_version)

    def collect_generation(self, batch: Batch, timer: Timer) -> Batch:
        """This step's samples: the generation prefetched during the previous step, or one
        launched now (step 1, and the step after a checkpoint: see `prefetch_next`)."""
        pending = self._prefetch
        self._prefetch = None
        if pending is None or pending.step != self.step:
            pending = self.launch_generation(batch, self.step)
        with timer.phase("generate"):  # one-step mode: only the wait that the overlap did not hide
            gen = pending.future.result()
        self._stamp_version(gen, pending.policy_version)
        return gen

    def prefetch_next(self, timer: Timer) -> None:
        """Launch step k+1's generation now, on the weights before step k's update (staleness 1).

        Not at a checkpoint step nor the last: a checkpoint holds the data order up to step k
        only, and a resumed run regenerates step k+1 on step k's weights. The uninterrupted run
        does the same (step k+1 after a checkpoint is on-policy), so resume stays exact.
        """
        cfg = self.config.trainer
        if self.step < cfg.total_steps and self.step % cfg.save_every != 0:
            self._prefetch = self.launch_generation(self.train_loader.next_batch(), self.step + 1)
        if self.rollout_sleeps:  # colocated: the update needs the memory, so no overlap here
            with timer.phase("rollout_sleep"):
                self.groups.rollout.sleep()  # runs after the generation it queues behind
            self._rollout_asleep = True

    @staticmethod
    def _stamp_version(gen: Batch, version: int) -> None:
        gen.meta["policy_version"] = np.full(len(gen), version, dtype=np.int64)

    # ------------------------------------------------------------------ tracing
    def _note_trace(self, gen: Batch, timer: Timer) -> None:
        """Remember this step's per-sample records for trace.jsonl (see rlcore.trainer.tracing)."""
        if self.config.trainer.trace:
            n = int(gen.info.get("n", self.config.rollout.n))
            self._step_trace = {"phases": dict(timer.seconds), "samples": sample_records(gen, self.groups, n)}

    def write_trace(self, metrics: dict[str, Any], workers: dict[str, Any]) -> None:
        record = step_record(self.step, self.config.trainer.off_policy, self._step_trace, metrics, workers)
        with open(self.trace_path, "a") as f:
            f.write(json.dumps(record, default=str) + "\n")

    def batch_metrics(self, gen: Batch, timer: Timer) -> dict[str, float]:
        self._note_trace(gen, timer)
        mask = gen["response_mask"].float()
        lengths = mask.sum(-1)
        scores = gen["scores"]
        m: dict[str, float] = {
            "reward/mean": float(scores.mean()),
            "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
            "acc/mean": float(gen["acc"].mean()),
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "response_length/clip_frac": float((lengths >= self.config.rollout.max_new_tokens).float().mean()),
        }
        if "advantages" in gen:
            adv = gen["advantages"]
            m["advantages/mean"] = float(masked_mean(adv, mask))
            m["advantages/max"] = float(adv[mask.bool()].max()) if mask.any() else 0.0
            m["advantages/min"] = float(adv[mask.bool()].min()) if mask.any() else 0.0
        if "entropy" in gen:
            m["actor/entropy"] = float(masked_mean(gen["entropy"], mask))
        if "ref_log_probs" in gen:
            m["actor/kl"] = float(masked_mean(kl_penalty(gen["old_log_probs"], gen["ref_log_probs"], "k3"), mask))
        if "rollout_log_probs" in gen and "old_log_probs" in gen:
            diff = (gen["rollout_log_probs"] - gen["old_log_probs"]).abs()[mask.bool()]
            m["rollout/logprob_diff_mean"] = float(diff.mean()) if diff.numel() else 0.0
            m["rollout/logprob_diff_max"] = float(diff.max()) if diff.numel() else 0.0
        if "policy_version" in gen.meta:  # the actor trains on the weights after step-1 updates
            staleness = (self.step - 1) - gen.meta["policy_version"].astype(np.int64)
            m["rollout/staleness_max"] = float(staleness.max())
            m["rollout/staleness_mean"] = float(staleness.mean())
        n_tokens = float(mask.sum())
        for name, secs in timer.seconds.items():
            m[f"time/{name}_s"] = secs
        for name, peak in timer.peak_gib.items():
            m[f"memory/{name}_peak_gib"] = peak
        if timer.seconds.get("generate"):
            m["throughput/generate_tok_s"] = n_tokens / timer.seconds["generate"]
        if timer.seconds.get("update_actor"):
            total_tokens = float(gen["attention_mask"].sum())
            m["throughput/update_tok_s"] = total_tokens * self.config.actor.ppo_epochs / timer.seconds["update_actor"]
        return m

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        assert self.val_loader is not None
        timer = Timer()
        scores, accs, uids = [], [], []
        for batch in self.val_loader.epoch_batches():
            gen, _ = self.generate_and_score(batch, timer, validation=True)
            scores.append(gen["scores"])
            accs.append(gen["acc"])
            uids.extend(gen.meta["uid"].tolist())
        score = torch.cat(scores)
        acc = torch.cat(accs)
        out = {"val/reward": float(score.mean()), "val/acc": float(acc.mean()), "time/validate_s": timer.seconds.get("generate", 0.0) + timer.seconds.get("reward", 0.0)}
        if self.config.rollout.val_n > 1:
            by_uid: dict[str, float] = {}
            for uid, a in zip(uids, acc.tolist()):
                by_uid[uid] = max(by_uid.get(uid, 0.0), a)
            out[f"val/pass@{self.config.rollout.val_n}"] = sum(by_uid.values()) / len(by_uid)
        return out


__all__ = ["PendingRollout", "RLTrainer", "Timer", "TrainingStopped", "rollout_shares_gpu", "sampling_seed"]
