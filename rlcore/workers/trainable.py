"""`Trainable`: a model with its optimizer and learning-rate schedule.

It is what the update loop steps and what a checkpoint saves and restores, for every trained
role (actor, critic) alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Trainable:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler

    @property
    def lr(self) -> float:
        """The current learning rate (of the first parameter group)."""
        return float(self.optimizer.param_groups[0]["lr"])
