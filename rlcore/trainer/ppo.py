"""PPO with a critic and GAE.

Differs from GRPO in two places only: the critic supplies values before the advantage, and
it is updated (on the GAE returns) before the actor. `trainer.off_policy=one_step` works as in
GRPO (grpo.py): samples one update old; the old log-probs and the values are recomputed by the
current actor and critic, so the clipped ratio and GAE see this step's models.
"""

from __future__ import annotations

from typing import Any

from rlcore.algos import compute_advantage
from rlcore.protocol import Batch
from rlcore.trainer.base import RLTrainer, Timer
from rlcore.trainer.grpo import _mean_metrics


class PPOTrainer(RLTrainer):
    algorithm = "ppo"
    supports_one_step = True

    def train_step(self, batch: Batch) -> dict[str, Any]:
        algo = self.config.algorithm
        timer = Timer()

        gen, reward_metrics = self.step_samples(batch, timer)
        gen = self.old_and_ref_log_probs(gen, timer)
        with timer.phase("values"):
            gen = gen.union(self.groups.critic.compute_values(gen))
        token_rewards, kl_metrics = self.rewards_with_kl(gen)

        with timer.phase("advantage"):
            advantages, returns = compute_advantage(
                "gae",
                token_level_rewards=token_rewards,
                response_mask=gen["response_mask"].float(),
                values=gen["values"],
                gamma=algo.gamma,
                lam=algo.lam,
            )
        gen = gen.union(Batch(tensors={"token_level_rewards": token_rewards, "advantages": advantages, "returns": returns}))

        with timer.phase("update_critic"):
            critic_metrics = self.groups.critic.update_critic(gen)
        with timer.phase("update_actor"):
            actor_metrics = self.groups.actor.update_actor(gen)
        self.sync_weights(timer)

        return {
            **self.batch_metrics(gen, timer),
            **reward_metrics,
            **kl_metrics,
            **_mean_metrics(critic_metrics),
            **_mean_metrics(actor_metrics),
        }
