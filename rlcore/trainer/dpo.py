"""DPO and its variants (IPO, robust/cDPO via `preference.loss_type` and `label_smoothing`).

One step, as data flows: take a batch of (prompt, chosen, rejected) pairs, attach the reference
model's sequence log-probs (cached per dataset, or computed now by the reference group), and let
the actor take its update on the DPO loss. No rollout: the data is offline.
"""

from __future__ import annotations

from typing import Any

from rlcore.protocol import Batch
from rlcore.trainer.base import Timer
from rlcore.trainer.grpo import _mean_metrics
from rlcore.trainer.preference import PreferenceTrainer


class DPOTrainer(PreferenceTrainer):
    algorithm = "dpo"
    kind = "pairwise"

    def train_step(self, batch: Batch) -> dict[str, Any]:
        timer = Timer()
        with timer.phase("ref_log_prob"):
            batch = self.with_reference(batch, self.train_loader)  # ref_chosen_logps, ref_rejected_logps
        batch.info.update(algorithm="dpo", temperature=1.0)
        with timer.phase("update_actor"):
            actor_metrics = _mean_metrics(self.groups.actor.update_preference(batch))
        return {**actor_metrics, **self.step_metrics(batch, timer)}
