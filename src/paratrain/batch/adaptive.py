"""Adaptive global batch: grow it while the gradient noise scale exceeds it.

McCandlish et al. 2018, "An Empirical Model of Large-Batch Training" (appendix A): with the
squared norm of a gradient averaged over a small batch B_small and over a big batch B_big,

    |G|^2   ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(S)   ~ (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)

are unbiased, and the "simple" noise scale is B_simple = tr(S) / |G|^2, the batch beyond which
a larger batch stops paying off. Both estimators are noisy, so each is smoothed by its own
exponential moving average (bias-corrected like Adam's) and the ratio is taken of the averages,
as the paper recommends.

Where the two gradients come from, for free:
- big: the step's gradient after the data-parallel reduce, whose norm ``clip_grad_norm_``
  computes anyway (before clipping): the mean over all ``items`` of the global batch.
- small: the local gradient after the *first* micro-batch's backward, which runs under
  ``no_sync`` (no reduce yet) whenever a rank has two or more micro-batches. One squared-norm
  pass over the local gradients, no copy, no communication hook (so it composes with the
  compression hooks of the communication options). The ranks average their values with one
  2-element all-reduce per step, which also makes every rank take the same decisions.
  A step with a single micro-batch per rank has no such point: the adaptive mode then runs it as
  two half micro-batches, which by the layout invariance changes nothing in the math.

Units: the estimators count loss *items* (tokens for a language model); the noise scale is
converted to samples with the batch's items per sample, to compare with the global batch.

Growth: every ``batch.adapt_every`` steps, once the averages hold that many updates, if the noise
scale exceeds the global batch, accumulation rises to the smallest whole number of micro-batches
whose global batch reaches the noise scale, capped by ``batch.max_global_batch_size``; it never
shrinks. The micro-batch size and data-parallel degree stay; ``plan_batch`` derives the plan.
Because the sampler is positional (``consumed_samples``), a larger step simply takes the next
samples of the stream: none is skipped or repeated within an epoch.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from paratrain.batch.plan import BatchPlan, plan_batch
from paratrain.config import BatchConfig, ConfigError
from paratrain.distributed.grad_norm import global_grad_norm

log = logging.getLogger("paratrain")


@dataclass
class GradNoiseScale:
    """Exponentially smoothed unbiased |G|^2 and tr(Sigma) estimators; their ratio is B_simple."""

    decay: float = 0.95
    g2: float = 0.0  # EMA of the |G|^2 estimates (before bias correction)
    trace: float = 0.0  # EMA of the tr(Sigma) estimates
    weight: float = 0.0  # 1 - decay^n, Adam's bias correction
    updates: int = 0

    def update(self, *, small_sq: float, b_small: float, big_sq: float, b_big: float) -> None:
        if not b_big > b_small > 0:
            raise ValueError(f"need b_big > b_small > 0, got {b_big}, {b_small}")
        g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
        trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
        self.g2 = self.decay * self.g2 + (1 - self.decay) * g2
        self.trace = self.decay * self.trace + (1 - self.decay) * trace
        self.weight = self.decay * self.weight + (1 - self.decay)
        self.updates += 1

    @property
    def value(self) -> float | None:
        """B_simple in the units of the batches given (None before any update or if |G|^2 <= 0)."""
        if self.updates == 0 or self.g2 <= 0:
            return None
        return max(0.0, (self.trace / self.weight) / (self.g2 / self.weight))

    def state_dict(self) -> dict:
        return {"g2": self.g2, "trace": self.trace, "weight": self.weight, "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)


def local_grad_sq_norm(model: nn.Module) -> torch.Tensor | None:
    """Sum of squares of this rank's gradients (DTensor shards are reduced to their full norm).

    None when no parameter holds a gradient yet: FSDP2 without gradient sync keeps the
    accumulated gradients in its unsharded buffers and sets ``p.grad`` only at the reduce.
    """

    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return None
    # Mixed plain and DTensor gradients (tensor parallel), even on several meshes.
    return global_grad_norm(params).detach().double() ** 2


class BatchAdapter:
    """Measures the noise scale each step and grows the plan's accumulation when it pays."""

    def __init__(self, cfg: BatchConfig, *, plan: BatchPlan, dp_group: dist.ProcessGroup | None, grow: bool):
        self.cfg = cfg
        self.grow = grow  # False: only measure (for lr_scaling = 'adascale' without batch.adaptive)
        self.dp_group = dp_group
        self.noise = GradNoiseScale(decay=cfg.noise_ema)
        self.noise_samples: float | None = None
        if plan.per_rank_batch_size < 2:
            raise ConfigError(
                "batch.adaptive (and optim.lr_scaling = 'adascale') needs at least 2 samples per rank"
                f" to measure the gradient noise; raise batch.global_batch_size above {plan.global_batch_size}"
            )
        self._set_cap(plan, announce=False)  # start() announces the cap of the plan the run starts from
        self._probe_sq = None
        self._probe_items = 0.0
        self._probe_ran = False
        self.base = plan  # the plan adapted from; a step may run it with a smaller micro-batch (run_plan)
        self._warned = False

    def _set_cap(self, plan: BatchPlan, *, announce: bool) -> None:
        max_global = self.cfg.max_global_batch_size or 8 * self.cfg.global_batch_size
        step = plan.micro_batch_size * plan.dp  # the global batch grows in these whole steps
        self.max_accum = max(plan.accum_steps, max_global // step)
        cap = self.max_accum * step
        if announce and self.grow and cap != max_global:
            log.info(
                "adaptive batch: max_global_batch_size %d rounded down to %d (a multiple of micro x dp = %d)",
                max_global,
                cap,
                step,
            )
        self.max_global = cap

    def start(self, plan: BatchPlan) -> BatchPlan:
        """Take ``plan`` as the batch to adapt from; returns the plan the first step runs.

        After a resume on another world size ``plan`` has the new ``dp`` (and perhaps a smaller
        micro-batch, batching.replan_batch): the cap is rounded again in its whole steps."""
        self.base = plan
        self._set_cap(plan, announce=True)
        return self.run_plan(plan)

    def run_plan(self, plan: BatchPlan) -> BatchPlan:
        """The plan a step runs: ``plan``, its micro-batch halved when a rank would have a single
        one (the probe needs the gradient after a first micro-batch that is not the whole batch)."""
        if plan.accum_steps >= 2:
            return plan
        mbs = plan.micro_batch_size // 2 if plan.micro_batch_size % 2 == 0 else 1
        return BatchPlan(plan.global_batch_size, mbs, plan.per_rank_batch_size // mbs, plan.dp)

    def probe(self, model: nn.Module, first_batch, loss_fn):
        """The ``after_backward`` callable of train_step: records the local gradient after micro-batch 0."""
        self._probe_sq, self._probe_ran = None, False
        self._probe_items = float(loss_fn.count(first_batch[1]))

        def after_backward(k: int) -> None:
            if k == 0:
                self._probe_sq, self._probe_ran = local_grad_sq_norm(model), True

        return after_backward

    def after_step(self, *, result, step: int) -> BatchPlan:
        """Update the noise scale from this step; return the plan the next step runs."""
        self.base = self._next_base(result=result, plan=self.base, step=step)
        return self.run_plan(self.base)

    def _next_base(self, *, result, plan: BatchPlan, step: int) -> BatchPlan:
        if not self._probe_ran:
            raise RuntimeError("the gradient-noise probe did not run; pass BatchAdapter.probe to train_step")
        # Every rank takes part in the all-reduce below, with a flag saying whether it measured.
        measured = self._probe_sq is not None and self._probe_items > 0
        if not measured and not self._warned:
            log.warning(
                "adaptive batch: no local gradient after the first micro-batch on this layout; the"
                " gradient noise scale is not measured and the batch stays"
            )
            self._warned = True
        # Local gradient after micro-batch 0 = (dp / items) * sum of its item gradients, so its
        # mean item gradient is that times items / (dp * n0).
        n0 = self._probe_items
        small = self._probe_sq.double().cpu() * (result.items / (plan.dp * n0)) ** 2 if measured else 0.0
        stats = torch.tensor([float(small), n0, float(not measured)], dtype=torch.float64)
        if self.dp_group is not None:
            dist.all_reduce(stats, group=self.dp_group)
            stats[:2] /= plan.dp
        small_sq, b_small, missing = stats.tolist()
        if not missing and result.items > b_small and math.isfinite(result.grad_norm):
            self.noise.update(small_sq=small_sq, b_small=b_small, big_sq=result.grad_norm**2, b_big=result.items)
        items_per_sample = result.items / plan.global_batch_size
        value = self.noise.value
        self.noise_samples = None if value is None else value / items_per_sample
        if (
            self.grow
            and step % self.cfg.adapt_every == 0
            and self.noise.updates >= self.cfg.adapt_every
            and self.noise_samples is not None
            and self.noise_samples > plan.global_batch_size
            and plan.accum_steps < self.max_accum
        ):
            per_step = plan.micro_batch_size * plan.dp
            accum = min(self.max_accum, max(plan.accum_steps + 1, math.ceil(self.noise_samples / per_step)))
            new = plan_batch(global_batch_size=accum * per_step, micro_batch_size=plan.micro_batch_size, dp=plan.dp)
            log.info(
                "adaptive batch: step %d, noise scale %.1f samples > global batch %d -> %s",
                step,
                self.noise_samples,
                plan.global_batch_size,
                new.describe(),
            )
            return new
        return plan

    def state_dict(self) -> dict:
        return self.noise.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.noise.load_state_dict(state)


def build_batch_adapter(
    cfg: BatchConfig, *, lr_scaling: str, plan: BatchPlan, dp_group: dist.ProcessGroup | None
) -> BatchAdapter | None:
    """None unless batch.adaptive or the AdaScale lr rule needs the noise scale."""
    if not cfg.adaptive and lr_scaling != "adascale":
        return None
    return BatchAdapter(cfg, plan=plan, dp_group=dp_group, grow=cfg.adaptive)
