"""GRPO and its relatives (Dr.GRPO, RLOO, REINFORCE++, ReMax-style baselines): no critic.

One step, as data flows (DESIGN.md): generate n samples per prompt, score them, recompute
old log-probs (and reference log-probs when KL is used), compute group-relative advantages,
update the actor, push the new weights to the rollout engine.

`trainer.off_policy=one_step`: step k+1's generation is launched as soon as step k's samples are
in, so it runs (on Ray, in its own pool) while step k scores, recomputes log-probs and updates.
Those samples come from the weights one update old (staleness 1, per sample in meta
`policy_version`, `rollout/staleness_max`); the old log-probs are still the actor's own, so the
clipped ratio corrects for it. The weight sync follows the update, before the next launch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rlcore.algos import compute_advantage, group_ids_from_uids
from rlcore.protocol import Batch
from rlcore.trainer.base import RLTrainer, Timer


class GRPOTrainer(RLTrainer):
    algorithm = "grpo"
    supports_one_step = True

    def train_step(self, batch: Batch) -> dict[str, Any]:
        algo = self.config.algorithm
        timer = Timer()

        gen, reward_metrics = self.step_samples(batch, timer)
        gen = self.old_and_ref_log_probs(gen, timer)
        token_rewards, kl_metrics = self.rewards_with_kl(gen)

        with timer.phase("advantage"):
            advantages, returns = compute_advantage(
                algo.adv_estimator,
                token_level_rewards=token_rewards,
                response_mask=gen["response_mask"].float(),
                group_ids=torch.as_tensor(group_ids_from_uids(gen.meta["uid"]), dtype=torch.long),
                gamma=algo.gamma,
                lam=algo.lam,
                norm_adv_by_std=algo.norm_adv_by_std,
            )
        gen = gen.union(Batch(tensors={"token_level_rewards": token_rewards, "advantages": advantages, "returns": returns}))

        with timer.phase("update_actor"):
            actor_metrics = self.groups.actor.update_actor(gen)
        self.sync_weights(timer)

        return {**self.batch_metrics(gen, timer), **reward_metrics, **kl_metrics, **_mean_metrics(actor_metrics)}


def _mean_metrics(per_rank: dict[str, float] | list[dict[str, float]]) -> dict[str, float]:
    """Worker groups may return one metrics dict per rank: average them."""
    if isinstance(per_rank, dict):
        return per_rank
    keys = per_rank[0].keys()
    return {k: float(np.mean([m[k] for m in per_rank])) for k in keys}
