"""On-policy RL: GRPO and its critic-free relatives (Dr.GRPO, RLOO, REINFORCE++, GSPO, ReMax) and
PPO with its critic (GAE): the whole loop (`algorithm.name: grpo | ppo`).

One step, as data flows: generate n samples per prompt, score them, recompute old log-probs (and
reference log-probs when KL is used), let the critic value the states (PPO), compute advantages
with `algorithm.adv_estimator` (group-relative from the scores, or GAE from the critic's values),
update the critic (PPO), then the actor, and push the new weights to the rollout engine.
Validation and checkpoints happen between steps. What an algorithm adds to the step is read from
its traits (`Config.traits`: the critic) and its estimator's inputs (ReMax's greedy baseline).

On an exactly on-policy step (`Config.old_log_probs_from_update`) the old-log-prob pass is
skipped: the update's own forward gives them. `trainer.off_policy=one_step`: step k+1's
generation is launched as soon as step k's samples are in, so it runs while step k scores,
recomputes log-probs and values and updates (see `Prefetcher`): in process on the rollout
group's own thread, on Ray in the rollout worker's own process; the weight sync waits for it.
Those samples are one update old; old log-probs and values come from the current actor and
critic, so the clipped ratio and GAE see this step's models. `trainer.off_policy=async`: a
rollout thread generates without stopping into a bounded buffer of prompt groups and each step
takes the next ones at most `trainer.max_staleness` updates old (see `AsyncRollout`; on Ray the
thread's generate calls go to the rollout workers on their own pool).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from rlcore.algos import advantage_estimator_inputs, compute_advantage, group_ids_from_uids, make_kl_controller
from rlcore.config import Config
from rlcore.protocol import Batch
from rlcore.trainer.async_rollout import AsyncRollout
from rlcore.trainer.baselines import greedy_reward_baselines
from rlcore.trainer.groups import WorkerGroups, required
from rlcore.trainer.health import HealthGuard
from rlcore.trainer.loaders import prompt_loader
from rlcore.trainer.metrics import Timer, mean_over_ranks, rl_batch_metrics
from rlcore.trainer.rl_steps import old_and_ref_log_probs, rewards_with_kl, score, update_actor
from rlcore.trainer.rm_scoring import RewardModelScoring
from rlcore.trainer.roles import build_worker_groups, placement
from rlcore.trainer.rollout_parts import (
    Prefetcher,
    RolloutSleep,
    generate,
    sleep_mode,
    sync_weights,
    train_sampling,
)
from rlcore.trainer.run_state import BadStepGuard, RunCheckpoints, checkpoint_policy, prepare_run_dir
from rlcore.trainer.step_log import StepHook, StepLog, log_settings
from rlcore.trainer.throughput import StepThroughput
from rlcore.trainer.tracing import sample_records
from rlcore.trainer.validation import RLValidator
from rlcore.workers.tokenizer import load_tokenizer


class OnPolicyTrainer:
    def __init__(self, config: Config, groups: WorkerGroups | None = None, step_hooks: Sequence[StepHook] = ()) -> None:
        self.config = config
        self.algorithm = config.algorithm.name
        self.run_dir = prepare_run_dir(config)
        self.tokenizer = load_tokenizer(config.model.path)
        self.train_loader = prompt_loader(config, self.tokenizer, config.data.train_files, train=True)
        val_loader = prompt_loader(config, self.tokenizer, config.data.val_files, train=False) if config.data.val_files else None
        self.validator = RLValidator(config, val_loader) if val_loader is not None else None
        self.groups = groups or build_worker_groups(placement(config))
        self.critic = required(self.groups.critic, "critic") if config.traits.critic else None  # PPO's value model
        self.greedy_baseline = "reward_baselines" in advantage_estimator_inputs(config.algorithm.adv_estimator)  # ReMax
        kl = config.algorithm.kl_ctrl
        self.kl_ctrl = make_kl_controller(kl.type, kl_coef=kl.kl_coef, target_kl=kl.target_kl, horizon=kl.horizon)
        self.guard = BadStepGuard(config.actor.max_consecutive_bad_steps, self.run_dir / "checkpoints")
        self.health = HealthGuard.from_config(config.health)
        self.reward_model = RewardModelScoring(config, self.groups)
        self.checkpoints = RunCheckpoints(checkpoint_policy(config), self.run_dir, self.groups, self.algorithm, {
            "train_loader": self.train_loader, "kl_ctrl": self.kl_ctrl, "guard": self.guard, "health": self.health,
            **({"reward_model": self.reward_model} if self.reward_model.enabled else {})})  # its running statistics
        self.rollout_sleep = RolloutSleep(self.groups, *sleep_mode(config))
        self.prefetcher = Prefetcher(config, self.groups, self.train_loader) if config.trainer.off_policy == "one_step" else None
        self.async_rollout = AsyncRollout(config, self.groups, self.train_loader) if config.trainer.off_policy == "async" else None
        self.throughput = StepThroughput.of(config)
        self.log = StepLog(log_settings(config), self.run_dir, self.algorithm, self.groups, [self.health, *step_hooks])
        self.step = 0
        self.rollout_version = 0  # the rollout engine holds the weights after this many actor updates

    def fit(self) -> list[dict[str, Any]]:
        cfg = self.config.trainer
        try:
            self.step = self.rollout_version = self.checkpoints.resume()
            with self.log:  # asks every worker where it runs: before a Ray rollout worker is kept busy generating
                if self.async_rollout is not None:
                    self.async_rollout.start(self.rollout_version)
                if self.step == 0 and cfg.val_before_train and self.validator is not None:
                    with self.engine_alone():
                        self.log.validation(0, self.validator.run(self.groups, 0, self.rollout_version), self.validator.samples)
                while self.step < cfg.total_steps:
                    self.step += 1
                    last = self.step == cfg.total_steps
                    start = time.perf_counter()
                    metrics, trace = self.train_step(self.next_prompts())
                    metrics["time/step_s"] = time.perf_counter() - start
                    self.guard.check(metrics)
                    validation = None  # its per-sample records, for val_trace.jsonl
                    if self.validator is not None and (self.step % cfg.val_every == 0 or last):
                        with self.engine_alone():
                            metrics.update(self.validator.run(self.groups, self.step, self.rollout_version))
                        validation = self.validator.samples
                    self.log.step(self.step, metrics, trace, validation)
                    if self.step % cfg.save_every == 0 or last:
                        self.checkpoints.save(self.step)
                        if self.async_rollout is not None:
                            self.async_rollout.checkpoint_saved(self.step)
        finally:
            try:
                if self.async_rollout is not None:
                    self.async_rollout.close()
            finally:
                self.groups.close()
        return self.log.history

    def engine_alone(self) -> AbstractContextManager[Any]:
        """The rollout engine to this thread alone (async: between two of the producer's generations)."""
        return self.async_rollout.exclusive() if self.async_rollout is not None else nullcontext()

    def train_step(self, prompts: Batch | None) -> tuple[dict[str, Any], dict[str, Any]]:
        """One step; returns its metrics and its trace (phase times, per-sample records)."""
        algo = self.config.algorithm
        timer = Timer()
        sampling = train_sampling(self.config, self.step)  # n: samples per prompt, for the generation and the updates
        # ReMax: each prompt's greedy-response score is its samples' baseline (engine still awake here)
        baselines = greedy_reward_baselines(self.groups, prompts, sampling, timer) if self.greedy_baseline and prompts is not None else None

        async_metrics: dict[str, float] = {}
        if self.async_rollout is not None:  # its own prompts, from the buffer
            gen, async_metrics = self.async_rollout.next_batch(self.rollout_version, timer)
        elif prompts is None:
            raise RuntimeError("train_step needs prompts outside trainer.off_policy=async")
        elif self.prefetcher is not None:  # launched with this step's `train_sampling` too
            gen = self.prefetcher.collect(prompts, self.step, self.rollout_version, timer)
            self.prefetcher.launch_next(self.step, self.rollout_version)
        else:
            gen = generate(self.groups, prompts, sampling, self.rollout_version, timer)
        self.rollout_sleep.after_generation(timer)
        rm_pending = self.reward_model.launch(gen, timer)  # runs beside the steps below (its own pool on Ray)
        gen, reward_metrics = score(self.groups, gen, timer, self.config.reward)
        on_policy = self.config.old_log_probs_from_update  # then update_actor supplies the old log-probs
        gen = old_and_ref_log_probs(self.groups, gen, timer, recompute=not on_policy)
        if self.critic is not None:
            with timer.phase("values"):
                gen = gen.union(self.critic.compute_values(gen))
        gen, rm_metrics = self.reward_model.collect(rm_pending, gen, timer)
        token_rewards, kl_metrics = rewards_with_kl(self.config, gen, self.kl_ctrl)

        with timer.phase("advantage"):
            advantages, returns = compute_advantage(
                algo.adv_estimator,
                token_level_rewards=token_rewards,
                response_mask=gen.tensors["response_mask"].float(),
                values=gen.tensors["values"] if self.critic is not None else None,
                group_ids=torch.as_tensor(group_ids_from_uids(gen.meta["uid"]), dtype=torch.long),
                gamma=algo.gamma,
                lam=algo.lam,
                norm_adv_by_std=algo.norm_adv_by_std,
                reward_baselines=baselines.for_samples(gen.meta["uid"]) if baselines is not None else None,
            )
        gen = gen.union(Batch(tensors={"token_level_rewards": token_rewards, "advantages": advantages, "returns": returns}))

        critic_metrics: dict[str, float] = {}
        if self.critic is not None:
            with timer.phase("update_critic"):
                critic_metrics = mean_over_ranks(self.critic.update_critic(gen, sampling.n))
        gen, actor_metrics = update_actor(self.groups, gen, timer, samples_per_prompt=sampling.n, on_policy=on_policy)
        if self.async_rollout is not None:
            self.async_rollout.update_weights(lambda: sync_weights(self.groups, self.rollout_sleep, timer), self.step, timer)
        else:
            sync_weights(self.groups, self.rollout_sleep, timer)
        self.rollout_sleep.after_update({**critic_metrics, **actor_metrics})  # rollout.sleep=auto decides after step 1
        self.rollout_version = self.step

        metrics = {**rl_batch_metrics(gen, timer, step=self.step, max_new_tokens=self.config.rollout.max_new_tokens),
                   **self.throughput.metrics(gen, timer, sampling.n),
                   **reward_metrics, **rm_metrics, **kl_metrics, **critic_metrics, **actor_metrics,
                   **(baselines.metrics() if baselines is not None else {}), **async_metrics}
        if self.async_rollout is not None:
            metrics.update(self.async_rollout.step_metrics(timer))
        return metrics, self.trace(gen, timer, sampling.n)

    def next_prompts(self) -> Batch | None:
        """This step's prompts: those a one-step prefetch already launched, else the loader's next
        batch; None with `trainer.off_policy=async` (the rollout thread draws them)."""
        if self.async_rollout is not None:
            return None
        prefetched = self.prefetcher.prompts_for(self.step) if self.prefetcher is not None else None
        return prefetched if prefetched is not None else self.train_loader.next_batch()

    def trace(self, gen: Batch, timer: Timer, n: int) -> dict[str, Any]:
        """This step's phases and per-sample records (`n` per prompt) for trace.jsonl (see rlcore.trainer.tracing)."""
        if not self.config.trainer.trace:
            return {}
        return {"phases": dict(timer.seconds), "samples": sample_records(gen, self.groups, n)}


__all__ = ["OnPolicyTrainer"]
