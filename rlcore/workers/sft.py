"""The supervised objective: what the actor's `update_sft` trains with.

A supervised batch (`rlcore.data.sft.collate_sft`) is the RL layout with a one-token prompt: each
row's first token, then every later token as its `responses`, right-padded, and `response_mask`
on the tokens that have a label (the response, or every assistant turn). Their log-probs go
through the same chunked, packed per-token path as RL (`PolicyLogProbs`), so FSDP2, LoRA,
sequence parallelism and the fused kernel apply to SFT as they do to the policy. The loss is the
mean negative log-likelihood over every labelled token of the optimizer batch: each micro-batch's
sum divided by the *global* (rank-summed) token count, which the shared update loop
(`rlcore.workers.loops`) provides, so micro-batches and ranks add up to the one-process step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from torch import nn

from rlcore.protocol import Batch
from rlcore.workers.loops import GlobalCounts, MicroLoss, MicroLossFn
from rlcore.workers.policy import PolicyLogProbs


@dataclass(frozen=True)
class SFTObjective:
    """Mean next-token negative log-likelihood of the labelled tokens."""

    log_probs: PolicyLogProbs
    model: nn.Module

    def __call__(self, mini: Batch, counts: GlobalCounts) -> MicroLossFn:
        return partial(self.micro_loss, global_tokens=counts.tokens)

    def micro_loss(self, mb: Batch, global_tokens: float) -> MicroLoss:
        logp, _ = self.log_probs(self.model, mb)
        nll = -(logp * mb["response_mask"].to(logp.dtype)).sum()
        return MicroLoss(nll / max(global_tokens, 1.0), terms={"micro_batches": 1.0})


__all__ = ["SFTObjective"]
