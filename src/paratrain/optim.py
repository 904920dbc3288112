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


# ----------------------------------------------------------------------------- batch-size LR scaling


def lr_scale(
    rule: str, *, global_batch_size: int, reference_batch_size: int, noise_scale: float | None = None
) -> float:
    """Multiplier of the lr for a global batch B tuned at reference batch B0.

    - linear: B/B0 (Goyal et al. 2017, "Accurate, Large Minibatch SGD", with warmup);
    - sqrt: sqrt(B/B0), the variance-preserving rule (Krizhevsky 2014; Hoffer et al. 2017), often
      the better one for Adam;
    - adascale: the gain of Johnson et al. 2020 ("AdaScale SGD"), r = (sigma^2 + |G|^2) /
      (sigma^2/S + |G|^2) with S = B/B0 and sigma^2 the variance of a B0-sample gradient. With the
      noise scale B_noise = tr(Sigma)/|G|^2 this is r = (1 + B_noise/B0) / (1 + B_noise/B): 1 where
      the gradient is noise-free, S where it is all noise. Without an estimate yet, r = 1.
    """
    ratio = global_batch_size / reference_batch_size
    if rule == "none":
        return 1.0
    if rule == "linear":
        return ratio
    if rule == "sqrt":
        return math.sqrt(ratio)
    if rule == "adascale":
        if noise_scale is None or not math.isfinite(noise_scale) or noise_scale <= 0:
            return 1.0
        return (1.0 + noise_scale / reference_batch_size) / (1.0 + noise_scale / global_batch_size)
    raise ValueError(f"unknown lr scaling rule {rule!r}")


class LRScaling:
    """The current batch-size LR multiplier, read by the scheduler; logs each change."""

    def __init__(self, cfg: OptimConfig, *, global_batch_size: int, log: Callable[[str], None] | None = None):
        self.rule = cfg.lr_scaling
        self.reference = cfg.reference_batch_size or global_batch_size
        self.base_lr = cfg.lr
        self._log = log
        self.factor: float | None = None
        self.update(global_batch_size=global_batch_size)

    def update(self, *, global_batch_size: int, noise_scale: float | None = None) -> float:
        new = lr_scale(
            self.rule, global_batch_size=global_batch_size, reference_batch_size=self.reference, noise_scale=noise_scale
        )
        # Logged at start; later only the batch-driven changes (AdaScale's gain moves every step).
        if (
            self._log
            and self.rule != "none"
            and (self.factor is None or (self.rule != "adascale" and new != self.factor))
        ):
            self._log(
                f"lr scaling {self.rule}: global batch {global_batch_size} vs reference {self.reference}"
                f" -> x{new:.4g} (peak lr {self.base_lr * new:.4g})"
            )
        self.factor = new
        return new

    def __call__(self) -> float:
        return self.factor
