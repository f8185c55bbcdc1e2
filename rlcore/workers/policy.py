"""Per-token log-probs of responses under a causal LM, with the run's settings.

Shared by the actor (old log-probs, the policy and preference losses) and the reference, so
that every log-prob in a run comes from the same chunking, kernel and temperature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rlcore.config import RoleSpec
from rlcore.protocol import Batch
from rlcore.workers.forward import response_log_probs
from rlcore.workers.loops import MicroBatching, forward_no_grad


@dataclass(frozen=True)
class PolicyLogProbs:
    temperature: float  # what the logits are divided by (`of`)
    chunk_tokens: int
    backend: str
    remove_padding: bool = True  # packed sequences (`model.use_remove_padding`)
    share_prompts: bool = False  # a packed row holds each prompt once (`model.share_prompt_prefix`)

    @classmethod
    def of(cls, spec: RoleSpec[Any]) -> PolicyLogProbs:
        """The role's settings (actor or reference: the actor's keys). Temperature: an algorithm that
        trains on its own samples compares log-probs at the temperature it sampled them at
        (`rollout.temperature`, as the engine's `rollout_log_probs` are:
        `SamplingParams.logprob_temperature`); one that trains on data (preference pairs, supervised
        rows) scores it at 1 (`RoleSpec.logprob_temperature`)."""
        backend = "auto" if spec.fused_kernels else "torch"
        return cls(spec.logprob_temperature, spec.logprob_chunk_tokens, backend, spec.model.use_remove_padding,
                   spec.model.shares_prompts)

    def __call__(self, model: nn.Module, batch: Batch, compute_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropy) of `batch["responses"]`, both [N, R], with gradients."""
        return response_log_probs(
            model, batch, self.temperature, chunk_tokens=self.chunk_tokens, compute_entropy=compute_entropy, backend=self.backend,
            remove_padding=self.remove_padding, share_prompts=self.share_prompts,
        )

    def no_grad(
        self, model: nn.Module, batch: Batch, key: str, micro: MicroBatching, device: torch.device, compute_entropy: bool = False
    ) -> Batch:
        """Log-probs under `key` (and `entropy`) of a whole batch, micro-batch by micro-batch."""

        def forward(mb: Batch) -> dict[str, torch.Tensor]:
            logprobs, entropy = self(model, mb, compute_entropy)
            return {key: logprobs, "entropy": entropy} if compute_entropy else {key: logprobs}

        return Batch(tensors=forward_no_grad(model, batch, forward, micro, device))
