"""A loss over the whole global batch (in-batch negatives), exact on every layout: the gradient cache.

A contrastive loss (CLIP, InfoNCE, sentence-embedding and retrieval losses) scores each sample
against the other samples of its batch, so "the batch" is part of its definition: computed per
micro-batch it changes with accumulation and with the number of GPUs (53% on the issue's dual
encoder). Here the batch is always the global batch, by the gradient-cache method (Gao et al.
2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup"):

1. every micro-batch of the rank is run forward without a graph (under the step's autocast and
   with its rows' keyed draws, paratrain/randomness.py, so that step 3 sees the same dropout);
2. the outputs are gathered over the data-parallel ranks in global-batch order (one all-gather
   per output tensor), the loss is computed on the whole global batch, and its gradient with
   respect to those outputs is kept (every rank computes the same loss);
3. each micro-batch is run again with its graph, and ``sum(output * cached gradient)`` is
   backpropagated: its gradient is the loss's, for the parameters.

Activation memory then grows with the micro-batch, not the global batch; the price is one more
forward per micro-batch. An output without a row per sample (a learnable logit scale, as
CLIP's) is shared by every row: its gradient is split evenly over the global batch's
micro-batches.

The loss's unit is the sample: the loss function returns the mean over the global batch, the
objective's sum is that mean times the global batch, its count the samples.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from paratrain.loss import Loss, retrieval_metrics
from paratrain.objectives.base import Objective
from paratrain.objectives.items import check_count, rows


class BatchLoss(Objective):
    """``loss.name`` a loss over the whole global batch (``info_nce`` or a user's with
    ``loss.over = "global_batch"``): ``fn(outputs, targets) -> mean``, where ``outputs`` is the
    model's output for every sample of the global batch (each tensor's rows concatenated in the
    global batch's order) and ``targets`` the targets likewise."""

    name = "loss"
    unit = "sample"

    def __init__(
        self, loss_fn: Loss, *, positions: Callable, dp_rank: int = 0, dp: int = 1, dp_group=None, norm_group: int = 0
    ):
        self.loss_fn, self.dp_rank, self.dp, self.dp_group = loss_fn, dp_rank, dp, dp_group
        # data/sampler.py's rank_micro_batches (given: this floor imports no data module); BatchNorm
        # groups wider than a micro-batch lay the rows out otherwise (``norm_group``)
        self.positions, self.norm_group = positions, norm_group
        self.cached: list | None = None
        self.retrieved: list[tuple[torch.Tensor, torch.Tensor]] = []  # eval: queries, documents

    def count(self, inputs, target) -> int:
        return rows(inputs)

    def static_count(self, inputs) -> int:
        return rows(inputs)

    def start(self, *, scale: float, device: torch.device) -> None:
        self.scale, self.device, self.k = scale, device, 0
        self.cached, self.value, self.seen, self.training = None, None, 0, False
        self.kept: list = []  # eval: the micro-batches' outputs, the loss taken in sums()

    def before_micro_batches(self, model: nn.Module, batches: Sequence[tuple], *, forward: Callable = None, **_):
        """Steps 1 and 2 (module docstring): the cached gradient of each micro-batch's outputs."""
        sizes = [rows(x) for x, _ in batches]
        self.total, self.training = sum(sizes) * self.dp, True
        flat = [tree_flatten(forward(k)) for k in range(len(batches))]
        leaves, per_row = self._whole([f[0] for f in flat], [t for _, t in batches], sizes)
        inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in leaves[:-1]]
        with torch.enable_grad():
            value = self.loss_fn(tree_unflatten(inputs, flat[0][1]), leaves[-1])
            differentiable = [t for t in inputs if t.requires_grad]
            found = iter(torch.autograd.grad(value, differentiable, allow_unused=True))
        grads = [next(found) if t.requires_grad else None for t in inputs]
        self.value = value.detach().double()
        mine = torch.tensor([p for mb in self._layout(sizes, self.dp_rank) for p in mb], device=self.device)
        shares = len(batches) * self.dp
        self.cached = [[] for _ in batches]
        for g, row in zip(grads, per_row, strict=True):
            if g is None:
                parts = [None] * len(batches)
            elif row:
                parts = list(g[mine].split(sizes))
            else:
                parts = [g / shares] * len(batches)
            for k, part in enumerate(parts):
                self.cached[k].append(part)

    def _layout(self, sizes: list[int], rank: int) -> list[list[int]]:
        """Positions in the global batch of rank ``rank``'s micro-batches (data/sampler.py; the
        eval step's rows are each rank's contiguous share)."""
        group = self.norm_group if self.training else 0
        return self.positions(
            list(range(sum(sizes) * self.dp)), dp_rank=rank, dp=self.dp, micro_batch_size=sizes[0], group=group
        )

    def _whole(self, outputs: list[list[torch.Tensor]], targets: list, sizes: list[int]):
        """The global batch's output leaves, then its targets (the last leaf), gathered in global
        order; and which output leaves have a row per sample (the others are shared)."""
        per_row = [t.dim() > 0 and t.shape[0] == sizes[0] for t in outputs[0]]
        local = [
            torch.cat([o[i] for o in outputs]) if row else outputs[0][i].detach().clone()
            for i, row in enumerate(per_row)
        ]
        local.append(torch.cat([torch.as_tensor(t) for t in targets]).to(self.device))
        if self.dp == 1:
            return local, per_row
        order = torch.tensor([p for r in range(self.dp) for mb in self._layout(sizes, r) for p in mb])
        whole = []
        for t, row in zip(local, [*per_row, True], strict=True):
            if not row:
                whole.append(t)
                continue
            parts = [torch.empty_like(t) for _ in range(self.dp)]
            dist.all_gather(parts, t.contiguous(), group=self.dp_group)
            ordered = torch.empty((len(order), *t.shape[1:]), dtype=t.dtype, device=t.device)
            ordered[order.to(t.device)] = torch.cat(parts)
            whole.append(ordered)
        return whole, per_row

    def loss(self, output, target) -> torch.Tensor | None:
        """Step 3: this micro-batch's outputs against their cached gradient (in training), or
        kept for :meth:`sums` (the eval step has no first pass)."""
        self.seen += rows(target)
        leaves, spec = tree_flatten(output)
        if self.cached is None:
            self.kept.append(([t.detach() for t in leaves], spec, target))
            return None
        grads = self.cached[self.k]
        self.k += 1
        terms = [(leaf * g.to(leaf.dtype)).sum() for leaf, g in zip(leaves, grads, strict=True) if g is not None]
        if not terms:
            return None
        # scale = dp / global samples: times the global samples is dp, which DDP's (and FSDP's)
        # mean over the ranks turns back into the sum of the ranks' parts of the gradient.
        return torch.stack(terms).sum() * (self.scale * self.total)

    def sums(self) -> torch.Tensor:
        if self.cached is None and self.kept:  # eval: the loss of the whole global batch now
            sizes = [rows(t) for *_, t in self.kept]
            leaves, _ = self._whole([k[0] for k in self.kept], [t for *_, t in self.kept], sizes)
            whole = tree_unflatten(leaves[:-1], self.kept[0][1])
            with torch.no_grad():
                self.value = self.loss_fn(whole, leaves[-1]).double()
                retrieval = getattr(self.loss_fn.fn, "retrieval", None)  # the built-in info_nce's
                if retrieval is not None:
                    self.retrieved.append(tuple(t.cpu() for t in retrieval(whole)))
            self.kept = []
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        first = zero if self.value is None or self.dp_rank else self.value.to(self.device) * (self.seen * self.dp)
        return torch.stack([first, torch.tensor(float(self.seen), dtype=torch.float64, device=self.device)])

    def read(self, reduced: list[float], *, units: int) -> dict:
        check_count(reduced[1], units)
        return {"loss": reduced[0] / units}

    def eval_metrics(self) -> dict:
        """After an evaluation: recall@1 and MRR of each held-out query among all the held-out
        documents (every eval batch's, the same on every rank and layout); then forgotten."""
        if not self.retrieved:
            return {}
        queries, documents = (torch.cat(parts) for parts in zip(*self.retrieved, strict=True))
        self.retrieved = []
        return retrieval_metrics(queries, documents)
