"""The preference (DPO / KTO) objectives: what the actor's `update_preference` trains with.

Sequence log-probs go through the same chunked per-token path as RL (`PolicyLogProbs`); the
reference log-probs are in the batch (the controller put them there). Losses are divided by the
*global* number of examples, which the shared update loop (`rlcore.workers.loops`) sums over
data-parallel ranks, so two ranks take exactly the step one process would. KTO's reference
point z0 is likewise a global mean.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import get_args

import torch
from torch import nn

from rlcore.algorithms import PreferenceObjective
from rlcore.algos.preference import dpo_loss, kto_loss, kto_reference_point_from_sums
from rlcore.config import PreferenceConfig
from rlcore.data.preference import sequence_log_prob_sums, sequence_view
from rlcore.protocol import Batch
from rlcore.workers.loops import (
    GlobalCounts,
    MicroBatching,
    MicroLoss,
    MicroLossFn,
    attention_lengths,
    forward_no_grad,
    value_stats,
)
from rlcore.workers.policy import PolicyLogProbs
from rlcore.workers.ranks import global_sum


@dataclass(frozen=True)
class DPOObjective:
    """Pairwise: chosen and rejected sequences of a micro-batch in one forward."""

    config: PreferenceConfig
    log_probs: PolicyLogProbs
    model: nn.Module

    @staticmethod
    def lengths(mini: Batch) -> torch.Tensor:
        """Tokens per pair (chosen + rejected run in one forward), for micro-batch packing."""
        return mini["chosen_attention_mask"].sum(-1) + mini["rejected_attention_mask"].sum(-1)

    def __call__(self, mini: Batch, counts: GlobalCounts) -> MicroLossFn:
        return partial(self.micro_loss, global_pairs=counts.rows)

    def micro_loss(self, mb: Batch, global_pairs: float) -> MicroLoss:
        p = self.config
        average = p.loss_type == "ipo"
        n = len(mb)
        both = Batch.concat([sequence_view(mb, "chosen_"), sequence_view(mb, "rejected_")])
        logp, _ = self.log_probs(self.model, both)
        seq = sequence_log_prob_sums(logp, both["response_mask"], average)
        out = dpo_loss(seq[:n], seq[n:], mb["ref_chosen_logps"], mb["ref_rejected_logps"],
                       beta=p.beta, loss_type=p.loss_type, label_smoothing=p.label_smoothing)
        response_lengths = both["response_mask"].sum(-1)
        ref = torch.cat([mb["ref_chosen_logps"], mb["ref_rejected_logps"]])
        stats = value_stats({
            "pref/reward_accuracy": (out.chosen_rewards > out.rejected_rewards).float(),
            "pref/margin": out.chosen_rewards - out.rejected_rewards,
            "pref/chosen_reward": out.chosen_rewards,
            "pref/rejected_reward": out.rejected_rewards,
            "pref/chosen_logps": seq[:n].detach(),
            "pref/rejected_logps": seq[n:].detach(),
            "actor/kl": (seq.detach() - ref) / (1.0 if average else response_lengths),
        })
        return MicroLoss(out.losses.sum() / global_pairs, stats=stats)


@dataclass(frozen=True)
class KTOObjective:
    """Unpaired: desirable and undesirable completions against the reference point z0, from the
    mismatched pairs (prompt i, completion i-1) of the mini-batch; no gradient flows through z0."""

    config: PreferenceConfig
    log_probs: PolicyLogProbs
    model: nn.Module
    micro: MicroBatching
    device: torch.device
    lengths = staticmethod(attention_lengths)

    def __call__(self, mini: Batch, counts: GlobalCounts) -> MicroLossFn:
        kl_logps = self._sequence_logps_no_grad(sequence_view(mini, "kl_"))
        logratio_sum = global_sum(float((kl_logps - mini["ref_kl_logps"].cpu()).sum()), self.device)
        z0 = kto_reference_point_from_sums(logratio_sum, counts.rows)
        return partial(self.micro_loss, z0=z0, global_rows=counts.rows)

    def micro_loss(self, mb: Batch, z0: torch.Tensor, global_rows: float) -> MicroLoss:
        p = self.config
        view = sequence_view(mb)
        logp, _ = self.log_probs(self.model, view)
        seq = sequence_log_prob_sums(logp, view["response_mask"])
        good = mb["label"] > 0.5
        out = kto_loss(seq, mb["ref_logps"], good, z0, beta=p.beta,
                       desirable_weight=p.desirable_weight, undesirable_weight=p.undesirable_weight)
        rewards = out.chosen_rewards
        stats = value_stats({
            "pref/reward_accuracy": ((rewards > 0) == good).float(),
            "pref/desirable_reward": rewards[good],
            "pref/undesirable_reward": rewards[~good],
            "pref/desirable_logps": seq.detach()[good],
            "pref/undesirable_logps": seq.detach()[~good],
            "actor/kl": (seq.detach() - mb["ref_logps"]) / view["response_mask"].sum(-1),
        })
        stats["pref/kl_z0"] = (float(z0) * len(mb), float(len(mb)))  # the reference point each example saw
        return MicroLoss(out.losses.sum() / global_rows, stats=stats)

    def _sequence_logps_no_grad(self, view: Batch) -> torch.Tensor:
        def forward(mb: Batch) -> dict[str, torch.Tensor]:
            logp, _ = self.log_probs(self.model, mb)
            return {"logps": sequence_log_prob_sums(logp, mb["response_mask"])}

        return forward_no_grad(self.model, view, forward, self.micro, self.device)["logps"]


ObjectiveBuilder = Callable[[PreferenceConfig, PolicyLogProbs, nn.Module, MicroBatching, torch.device], "DPOObjective | KTOObjective"]
# each objective an algorithm's traits row may name (`AlgorithmTraits.objective`), by that name
OBJECTIVES: dict[PreferenceObjective, ObjectiveBuilder] = {
    "dpo": lambda config, log_probs, model, micro, device: DPOObjective(config, log_probs, model),
    "kto": KTOObjective,  # its reference point z0 is a no-grad pass over the mismatched pairs: micro-batched on `device`
}
if set(OBJECTIVES) != set(get_args(PreferenceObjective)):
    raise AssertionError(f"OBJECTIVES {sorted(OBJECTIVES)} and PreferenceObjective {get_args(PreferenceObjective)} disagree")


def preference_objective(
    objective: PreferenceObjective, config: PreferenceConfig, log_probs: PolicyLogProbs, model: nn.Module,
    micro: MicroBatching, device: torch.device,
) -> DPOObjective | KTOObjective:
    """`objective` (`AlgorithmTraits.objective`) on `model`; its `lengths` are what to pack by."""
    return OBJECTIVES[objective](config, log_probs, model, micro, device)


__all__ = ["DPOObjective", "KTOObjective", "OBJECTIVES", "preference_objective"]
