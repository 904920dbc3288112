"""Losses as (sum of item losses, item count), so normalisation is by the global item count.

The count of a micro-batch must be known before any backward of the step (it is gathered over
micro-batches and ranks first), so every loss also counts items from the target alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from paratrain.config import ConfigError, LossConfig, resolve_callable


class Loss:
    """``loss(output, target) -> (sum, count)`` and ``loss.count(target) -> count``."""

    def __init__(self, fn: Callable, count: Callable, name: str):
        self.fn, self._count, self.name = fn, count, name

    def __call__(self, output, target) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fn(output, target)

    def count(self, target) -> torch.Tensor:
        return torch.as_tensor(self._count(target), dtype=torch.float64)


def build_loss(cfg: LossConfig, fn: Callable | None = None) -> Loss:
    ignore = cfg.ignore_index

    def count_not_ignored(target: torch.Tensor) -> torch.Tensor:
        return (target != ignore).sum()

    if fn is not None or ":" in cfg.name:
        user = fn if fn is not None else resolve_callable(cfg.name, "loss.name")
        # A user loss may say how it counts with a `count(target)` attribute; by default the
        # items are the target elements not equal to loss.ignore_index.
        count = getattr(user, "count", count_not_ignored)
        return Loss(_checked(user), count, getattr(user, "__name__", "user"))
    if cfg.name == "cross_entropy":

        def cross_entropy(logits: torch.Tensor, target: torch.Tensor):
            s = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), ignore_index=ignore, reduction="sum"
            )
            return s, count_not_ignored(target)

        return Loss(cross_entropy, count_not_ignored, "cross_entropy")
    if cfg.name == "mse":

        def mse(output: torch.Tensor, target: torch.Tensor):
            return F.mse_loss(output.float(), target.float(), reduction="sum"), target.numel()

        return Loss(mse, lambda t: t.numel(), "mse")
    raise ConfigError(f"loss.name = {cfg.name!r} is unknown; use 'cross_entropy', 'mse' or 'package.module:function'")


def _checked(user: Callable) -> Callable:
    def call(output, target):
        result = user(output, target)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise ConfigError(
                f"a user loss must return (sum_of_item_losses, item_count); it returned {type(result).__name__}"
            )
        return result

    return call
