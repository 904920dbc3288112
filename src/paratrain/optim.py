"""Optimiser and learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from paratrain.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    # Weight decay on matrices only: decaying norms' gains and biases hurts (GPT-2, nanoGPT).
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.beta1)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def lr_factor(step: int, *, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of cfg.lr at 0-based ``step``: linear warmup, then the chosen decay."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    if cfg.schedule == "linear":
        decay = 1.0 - progress
    else:
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, *, total_steps: int, scale: Callable[[], float] | None = None
):
    """LambdaLR of lr_factor; ``scale()`` (the batch-size LR scaling) multiplies it when given.

    The scale is read each time the scheduler computes the next step's lr, so a change of the
    global batch decided before ``scheduler.step()`` takes effect from the next step on.
    """
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg=cfg, total_steps=total_steps) * (scale() if scale else 1.0)
    )
