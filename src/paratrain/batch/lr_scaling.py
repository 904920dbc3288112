"""Batch-size LR scaling (``optim.lr_scaling``): the lr multiplier for a global batch tuned at another.

The scheduler (optim.py) multiplies its factor by ``LRScaling()``; the adaptive batch
(batch/adaptive.py) updates it when the batch grows.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from paratrain.config import OptimConfig


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
