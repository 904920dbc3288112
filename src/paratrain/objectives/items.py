"""The step's loss: the built-in token or item loss, a user's ``(sum, count)`` loss and the
chunked cross-entropy (paratrain/loss.py builds all three as a :class:`~paratrain.loss.Loss`),
over the global count of target items."""

from __future__ import annotations

import torch

# DTensor is imported in the functions that use it: its import costs seconds, which the launcher,
# whose preflight reads this module through the models, must not pay (tests/e2e/test_startup.py).
from paratrain.config import ConfigError
from paratrain.loss import Loss, rows
from paratrain.objectives.base import Objective


class ItemLoss(Objective):
    """``sum of item losses / global item count``: the mean over every target item of the
    global batch (a token not equal to ``loss.ignore_index``, an element for ``mse``, what a user
    loss's ``count(target)`` says), never a mean of micro-batch means.

    Its sums are ``[loss sum, the loss's own returned count]``; :meth:`read` checks that count
    against the one formed before the backward. ``items_per_sample`` (the data path's static
    count, data/datasets.py): every sample has exactly that many items, so the count is known
    from the rows alone (no collective), and the check then catches a wrong declaration.
    """

    name = "loss"
    unit = "target item"
    counts_target_tokens = True

    def __init__(self, loss_fn: Loss, *, items_per_sample: int | None = None):
        self.loss_fn, self.items_per_sample = loss_fn, items_per_sample
        self.scale = 1.0
        self._last = None

    def count(self, inputs, target) -> torch.Tensor:
        return self.loss_fn.count(target)

    def static_count(self, inputs) -> int | None:
        if self.items_per_sample is None:
            return None
        return self.items_per_sample * rows(inputs)

    def start(self, *, scale: float, device: torch.device) -> None:
        self.scale, self.device = scale, device
        self.loss_sum = torch.zeros((), device=device, dtype=torch.float64)
        self.returned = torch.zeros((), device=device, dtype=torch.float64)
        self._last = None

    def loss(self, output, target) -> torch.Tensor:
        s, c = self.loss_fn(output, target)
        self._last = (s, c)
        return s * self.scale

    def end_micro_batch(self) -> None:
        s, c = self._last
        self._last = None
        self.add(plain(s).detach().double(), torch.as_tensor(c, device=self.device, dtype=torch.float64))

    def add(self, loss_sum: torch.Tensor, returned: torch.Tensor) -> None:
        """Sums computed elsewhere: a pipeline's schedule runs the loss on its last stage."""
        self.loss_sum += loss_sum
        self.returned += returned

    def sums(self) -> torch.Tensor:
        return torch.stack([self.loss_sum, self.returned])

    def read(self, reduced: list[float], *, units: int) -> dict:
        check_count(reduced[1], units, static=self.items_per_sample is not None)
        return {"loss": reduced[0] / units}


def plain(s: torch.Tensor) -> torch.Tensor:
    # loss_parallel: a replicated scalar DTensor
    from torch.distributed.tensor import DTensor

    return s.full_tensor() if isinstance(s, DTensor) else s


def check_count(returned_total: float, items: int, *, static: bool = False) -> None:
    """The loss's own item count against the pre-backward ``items``, on the reduced numbers, so
    every rank raises the same error together. ``static``: ``items`` came from the data path's
    declared count (ItemLoss.items_per_sample), not from counting the targets."""
    if int(returned_total) == items:
        return
    if static:
        raise ConfigError(
            f"the loss returned item count {int(returned_total)} but the dataset's items_per_sample gave"
            f" {items}; a dataset that declares items_per_sample must have exactly that many targets per sample,"
            " none of them loss.ignore_index: fix or remove its items_per_sample"
        )
    raise ConfigError(
        f"the loss returned item count {int(returned_total)} but counting the targets gave"
        f" {items}; give the loss function a count(target) attribute that matches"
    )
