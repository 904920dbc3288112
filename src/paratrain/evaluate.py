"""The validation loss: a fixed validation set through the training layout, forward only.

``val_loss = sum of item losses / item count`` over the first ``eval.samples`` samples of the
validation set, the same definition as the training loss (step.py), so it is layout-invariant
in the same way: the set is cut into global batches of ``batch.global_batch_size`` (independent
of the layout), each data-parallel rank evaluates its contiguous share of each in
``eval.micro_batch_size`` pieces, tensor-parallel and pipeline ranks run the model as in
training (``step.eval_step``: no gathering of the model), and the float64 sums are reduced over
the ranks. Under ``torch.no_grad`` and ``model.eval()``; the train mode is restored after.

The validation batches are collated once and kept (the set is small and fixed); the model
never sees the training loader, so evaluating does not move the training stream.
"""

from __future__ import annotations

import time

from torch import nn
from torch.utils.data import Dataset

from paratrain.batch.plan import BatchPlan
from paratrain.data.sampler import load_batches, rank_slice
from paratrain.step import StepContext, eval_step


class Evaluator:
    """``evaluator(model, ctx) -> val_loss`` on this rank's share of the validation set."""

    def __init__(self, dataset: Dataset, plan: BatchPlan, *, dp_rank: int):
        self.dataset, self.plan, self.dp_rank = dataset, plan, dp_rank
        self._batches: list[list] | None = None  # per global batch: this rank's collated micro-batches
        self.last_time_s = 0.0
        self.last_items = 0  # the item count of the last evaluation (trainable tokens of a corpus)
        self.last_metrics: dict = {}  # the loss's own metrics of the last evaluation (val_ + name)
        self.samples = getattr(dataset, "real", len(dataset))  # without the empty samples that fill it up

    def _load(self) -> list[list]:
        g = self.plan.global_batch_size
        return [
            load_batches(
                self.dataset,
                rank_slice(list(range(start, start + g)), dp_rank=self.dp_rank, dp=self.plan.dp),
                self.plan.micro_batch_size,
            )
            for start in range(0, len(self.dataset), g)
        ]

    def __call__(self, model: nn.Module, ctx: StepContext) -> float:
        t0 = time.perf_counter()
        if self._batches is None:
            self._batches = self._load()
        was_training = model.training
        model.eval()
        loss_sum, items = 0.0, 0
        try:
            for batches in self._batches:
                s, n = eval_step(model, batches, ctx)
                loss_sum, items = loss_sum + s, items + n
        finally:
            model.train(was_training)
        self.last_time_s = time.perf_counter() - t0
        self.last_items = items
        # A loss over the whole batch may measure more (info_nce: recall@1 and MRR over the set)
        self.last_metrics = ctx.objectives[0].eval_metrics()
        return loss_sum / items


def eval_due(step: int, *, interval: int, last: bool) -> bool:
    """Every ``interval`` steps and after the last one (``interval`` 0: never)."""
    return interval > 0 and (step % interval == 0 or last)
