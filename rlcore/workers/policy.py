"""Per-token log-probs of responses under a causal LM, with the run's settings.

Shared by the actor (old log-probs, the policy and preference losses) and the reference, so
that every log-prob in a run comes from the same chunking, kernel and temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from rlcore.config import Config
from rlcore.protocol import Batch
from rlcore.workers.forward import response_log_probs
from rlcore.workers.loops import MicroBatching, forward_no_grad


@dataclass(frozen=True)
class PolicyLogProbs:
    temperature: float  # when the batch does not say (`batch.info["temperature"]`, set by the rollout)
    chunk_tokens: int
    backend: str
    remove_padding: bool = True  # packed sequences (`model.use_remove_padding`)
    share_prompts: bool = False  # a packed row holds each prompt once (`model.share_prompt_prefix`)

    @classmethod
    def of(cls, config: Config) -> PolicyLogProbs:
        backend = "auto" if config.actor.fused_kernels else "torch"
        return cls(config.rollout.temperature, config.actor.logprob_chunk_tokens, backend, config.model.use_remove_padding,
                   config.model.shares_prompts)

    def __call__(self, model: nn.Module, batch: Batch, compute_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropy) of `batch["responses"]`, both [N, R], with gradients."""
        temperature = float(batch.info.get("temperature", self.temperature))
        return response_log_probs(
            model, batch, temperature, chunk_tokens=self.chunk_tokens, compute_entropy=compute_entropy, backend=self.backend,
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
