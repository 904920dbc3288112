"""Optimiser and learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from paratrain.config import ConfigError, OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig, *, bitwise: bool = False) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    # Weight decay on matrices only: decaying norms' gains and biases hurts (GPT-2, nanoGPT).
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    # torch picks the one-tensor-at-a-time loop on CPU when left to choose
    # (torch/optim/optimizer.py ``_default_to_fused_or_foreach``: foreach is its default on CUDA
    # only). The fused kernel makes one pass over every tensor: on the main job's 65 tensors AdamW
    # takes 1.3 ms instead of 5.3 ms a step on CPU. Its vectorised arithmetic may round the last
    # bit differently from the loop (by an element's place in its tensor), the same on every DDP
    # rank. torch 2.13 has no DTensor rule for fused SGD, takes fused AdamW's plain step counts
    # with DTensor parameters nowhere, and its foreach ops refuse a list mixing plain tensors and
    # DTensors (TP leaves some parameters plain): 'auto' fuses plain tensors (DDP) and keeps the
    # loop for sharded ones (FSDP2, TP, ep). tests/unit/test_optim.py anchors each to torch's loop.
    # run.bitwise (docs/bitwise.md): the loop on every layout, so that one process's plain tensors
    # and FSDP2's shards get the same elementwise arithmetic (fused rounded 1e-9 apart in a step).
    impl = cfg.implementation
    sharded = any(isinstance(p, DTensor) for p in params)
    if impl == "auto":
        impl = "for-loop" if sharded or bitwise else "fused"
    elif impl in ("fused", "foreach") and sharded:
        raise ConfigError(
            f"optim.implementation = {impl!r} takes plain tensors only (DDP), and this layout shards parameters"
            " (FSDP2, tp, cp or ep); set optim.implementation = 'auto' or 'for-loop'"
        )
    impl = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[impl]
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.beta1, **impl)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **impl)


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
