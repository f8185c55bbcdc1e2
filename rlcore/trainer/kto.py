"""KTO: unpaired (prompt, completion, desirable?) examples, Kahneman-Tversky value function.

One step, as data flows: take a batch of labelled completions; each row also carries a
mismatched pair (its prompt with the previous row's completion), whose policy/reference
log-ratio, averaged over the batch and clamped at 0, is the reference point z0 of the KTO paper.
Attach the reference log-probs of both (the matched ones may come from the per-dataset cache;
the mismatched ones depend on the batch and are computed now), then the actor's update.
"""

from __future__ import annotations

from typing import Any

from rlcore.protocol import Batch
from rlcore.trainer.base import Timer
from rlcore.trainer.grpo import _mean_metrics
from rlcore.trainer.preference import PreferenceTrainer


class KTOTrainer(PreferenceTrainer):
    algorithm = "kto"
    kind = "unpaired"

    def train_step(self, batch: Batch) -> dict[str, Any]:
        timer = Timer()
        with timer.phase("ref_log_prob"):
            batch = self.with_reference(batch, self.train_loader, extra_prefixes=("kl_",))  # ref_logps, ref_kl_logps
        batch.info.update(algorithm="kto", temperature=1.0)
        with timer.phase("update_actor"):
            actor_metrics = _mean_metrics(self.groups.actor.update_preference(batch))
        return {**actor_metrics, **self.step_metrics(batch, timer)}
