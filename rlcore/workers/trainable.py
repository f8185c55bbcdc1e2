"""`Trainable`: a model with its optimizer and learning-rate schedule (and its LoRA adapter, when
only that trains).

It is what the update loop steps and what a checkpoint saves and restores, for every trained
role (actor, critic) alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from rlcore.workers.lora import Adapter


@dataclass(frozen=True)
class Trainable:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    adapter: Adapter | None = None  # LoRA: only the adapter (and a trained head) is optimized and saved

    @property
    def lr(self) -> float:
        """The current learning rate (of the first parameter group)."""
        return float(self.optimizer.param_groups[0]["lr"])
