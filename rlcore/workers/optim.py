"""AdamW with linear warmup and an optional cosine decay, stepped once per training step."""

from __future__ import annotations

import math

import torch
from torch import nn

from rlcore.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters. Its state takes their dtype and device: float32 master
    weights under bf16 compute (bf16 only with model.pure_bf16), host memory with CPU offload."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, foreach=False)


def lr_multiplier(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Warmup from lr/warmup to lr over `warmup_steps`, then constant or cosine to min_lr_ratio."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg, total_steps))
