"""Step pieces that RL recipes share between generation and the update: scoring, the no-grad
log-prob passes of actor and reference, the KL penalty in the reward, and the actor update."""

from __future__ import annotations

import logging

import torch

from rlcore.algos import apply_kl_penalty
from rlcore.algos.kl import AdaptiveKLController, FixedKLController
from rlcore.config import Config, RewardConfig
from rlcore.protocol import Batch
from rlcore.trainer.groups import WorkerGroups, required
from rlcore.trainer.metrics import Timer, mean_over_ranks
from rlcore.trainer.run_state import TrainingStopped

log = logging.getLogger(__name__)


class RewardFailures(TrainingStopped):
    """More of a step's reward calls failed than `reward.max_error_fraction` allows: the run stops
    before training on `reward.error_score` in place of rewards (its checkpoints so far are kept)."""


def score(groups: WorkerGroups, gen: Batch, timer: Timer, reward: RewardConfig) -> tuple[Batch, dict[str, float | str]]:
    """Rewards for generated samples, joined to them; reward metrics and the first error (logged).
    Raises `RewardFailures` when the failed calls exceed `reward.max_error_fraction` of the batch."""
    with timer.phase("reward"):
        scored, metrics = required(groups.reward, "reward").compute_reward(gen)
    first_error = metrics.get("reward/first_error")
    if first_error:
        log.warning("reward function error (counted, score=%s): %s", reward.error_score, first_error)
    errors, timeouts = int(metrics.get("reward/errors", 0)), int(metrics.get("reward/timeouts", 0))
    if errors + timeouts > reward.max_error_fraction * len(gen):
        raise RewardFailures(
            f"reward: {errors + timeouts} of {len(gen)} reward calls failed in one batch ({errors} errors, {timeouts} "
            f"timeouts), more than reward.max_error_fraction={reward.max_error_fraction:g} allows: the run would train "
            f"on reward.error_score={reward.error_score:g} instead of rewards; first: {first_error}")
    return gen.union(scored), metrics


def old_and_ref_log_probs(groups: WorkerGroups, gen: Batch, timer: Timer, *, recompute: bool = True) -> Batch:
    """The actor's log-probs of the samples before the update (and its entropy), and the
    reference model's when the run has one. `recompute=False` (an exactly on-policy step,
    `Config.old_log_probs_from_update`): no old-log-prob pass; `update_actor` supplies them."""
    if recompute:
        with timer.phase("old_log_prob"):
            gen = gen.union(required(groups.actor, "actor").compute_log_prob(gen))
    if groups.ref is not None:
        with timer.phase("ref_log_prob"):
            gen = gen.union(groups.ref.compute_ref_log_prob(gen))
    return gen


def rewards_with_kl(config: Config, gen: Batch, kl_ctrl: FixedKLController | AdaptiveKLController) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level rewards: the scores, minus `kl_ctrl.value` x the KL to the reference when
    `algorithm.use_kl_in_reward` (rlcore.algos.apply_kl_penalty); the controller then sees this
    batch's KL (adaptive: the coefficient moves toward `kl_ctrl.target_kl`)."""
    if not config.algorithm.use_kl_in_reward:
        return gen.tensors["token_level_scores"], {}
    rewards, metrics = apply_kl_penalty(gen.tensors["token_level_scores"], gen.tensors["old_log_probs"], gen.tensors["ref_log_probs"],
                                        gen.tensors["response_mask"], kl_coef=kl_ctrl.value, kind=config.algorithm.kl_penalty)
    kl_ctrl.update(metrics["actor/reward_kl_penalty"], n_steps=len(gen))
    return rewards, metrics


def update_actor(groups: WorkerGroups, gen: Batch, timer: Timer, *, samples_per_prompt: int,
                 on_policy: bool) -> tuple[Batch, dict[str, float]]:
    """The actor's update of `gen` (`samples_per_prompt` consecutive rows per prompt: mini-batches
    hold whole prompts); its metrics. `on_policy`: the batch has no old log-probs, the update's
    forward gives them (and the entropy), joined to the batch as if the pass had run, so the
    step reports the same entropy, KL and rollout/actor gap."""
    actor = required(groups.actor, "actor")
    with timer.phase("update_actor"):
        if not on_policy:
            return gen, mean_over_ranks(actor.update_actor(gen, samples_per_prompt))
        out, per_rank = actor.update_actor_on_policy(gen)
    return gen.union(out), per_rank[0]  # rank 0's, as this step has always reported


__all__ = ["RewardFailures", "old_and_ref_log_probs", "rewards_with_kl", "score", "update_actor"]
