"""BatchNorm with a layout-free definition: statistics over fixed groups of ``G`` samples.

torch's ``BatchNorm`` normalises over whatever rows one forward holds, so its math changes with
the micro-batch (accumulation, ``micro_batch_size = "auto"``, the GPU's memory) and, as
``SyncBatchNorm``, with the number of GPUs. Goyal et al. 2017 ("Accurate, Large Minibatch SGD",
section 5.2) fixed BatchNorm's batch at 32 per worker precisely so that the math would not
change with the number of workers; Hoffer et al. 2017 call that ghost batch norm. Here the group
is a property of the run (``batch.norm_group``), not of a worker:

- the global batch, in the sampler's order, is cut into groups of ``G`` consecutive samples and
  each group is normalised by its own mean and (biased) variance, in training mode;
- a micro-batch holds whole groups (``G`` divides it) or part of one group whose other parts are
  the same micro-step's rows of ``G / micro`` consecutive data-parallel ranks (the sampler lays
  the rows out so, data/sampler.py ``rank_micro_batches``): the statistics are then all-reduced
  over exactly those ranks, with gradients (``torch.distributed.nn.functional.all_reduce``);
- the running statistics are updated as one process iterating the groups in global order would
  (objectives/batch_norm.py: the update is linear in the groups' statistics, so it rides the
  step's one reduce), not by each forward;
- eval mode is torch's own ``BatchNorm`` (the running statistics), untouched.

At ``G`` = the global batch on one process with one micro-batch this is torch's ``BatchNorm``,
bit for bit (tests/distributed/test_batch_math.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from paratrain.config import ConfigError
from paratrain.data.sampler import rank_micro_batches


@dataclass
class NormLayout:
    """What every converted module of a run shares: the group size ``G`` and the process groups
    of ``span`` consecutive data-parallel ranks that hold one group together (made on first use,
    by every rank at once: every rank's first training forward reaches the first BatchNorm with
    micro-batches of the same size)."""

    group: int
    dp_rank: int = 0
    dp: int = 1
    # run.bitwise (docs/bitwise.md): the running statistics' updates ride the step's reduce one row
    # per group, summed in global group order after it (objectives/batch_norm.py), not per rank
    ordered: bool = False
    _spans: dict = field(default_factory=dict)

    def span(self, rows: int) -> tuple[dist.ProcessGroup, bool]:
        """The process group of the ranks that hold the rest of this micro-batch's group, and
        whether this rank is the first of them (whose statistics the running update counts)."""
        if self.group % rows or self.dp % (self.group // rows) or not dist.is_initialized():
            raise ConfigError(
                f"a BatchNorm forward got {rows} rows, which neither holds whole groups of batch.norm_group"
                f" = {self.group} nor is one of {self.group // max(rows, 1)} data-parallel ranks' parts of one;"
                f" use a micro-batch that is a multiple or a divisor of {self.group} (docs/batch-math.md)"
            )
        s = self.group // rows
        if s not in self._spans:
            self._spans[s] = dist.new_subgroups(group_size=s)[0]
        return self._spans[s], self.dp_rank % s == 0

    def check(self, *, micro_batch_size: int, global_batch_size: int) -> str | None:
        """:func:`check_groups` at this layout's data-parallel degree."""
        return check_groups(
            group=self.group, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, dp=self.dp
        )

    def first_groups(self, *, micro_batch_size: int, global_batch_size: int) -> list[int]:
        """The global index of the first group of each of this rank's micro-batches (the
        sampler's layout, data/sampler.py ``rank_micro_batches``)."""
        positions = rank_micro_batches(
            list(range(global_batch_size)),
            dp_rank=self.dp_rank,
            dp=self.dp,
            micro_batch_size=micro_batch_size,
            group=self.group,
        )
        return [rows[0] // self.group for rows in positions]


class GroupBatchNorm(_BatchNorm):
    """``nn.BatchNorm1d/2d/3d`` and ``nn.SyncBatchNorm`` over groups of ``layout.group`` samples
    (module docstring). Its parameters and buffers are the converted module's own tensors, under
    the same names, so checkpoints and ``state_dict`` keys do not change."""

    records_group_statistics = True  # what objectives/batch_norm.py looks for (it imports no model)

    def __init__(self, source: _BatchNorm, layout: NormLayout):
        super().__init__(
            source.num_features, source.eps, source.momentum, affine=False, track_running_stats=False, device="meta"
        )
        self.affine, self.track_running_stats = source.affine, source.track_running_stats
        for name in ("weight", "bias"):
            setattr(self, name, getattr(source, name))
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            self.register_buffer(name, getattr(source, name))
        self.training = source.training
        self.layout = layout
        # Each training forward's group statistics, kept while a step records them
        # (objectives/batch_norm.py takes them): (mean [groups, C], unbiased var [groups, C], counted).
        self.recording = False
        self.pending: list[tuple[torch.Tensor, torch.Tensor, bool]] = []

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected a 2D or more input (batch, channels, ...), got {input.dim()}D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if not self.training:  # eval: torch's BatchNorm (the running statistics)
            return super().forward(x)
        n, g = x.shape[0], self.layout.group
        # The statistics are kept for a step's forward with a graph only (not a gradient cache's
        # first pass, the probe's or the draw detector's forwards, an activation recomputation's
        # copy is dropped by the objective)
        record = self.recording and self.track_running_stats and torch.is_grad_enabled()
        if n % g == 0:
            out, stats = self._whole_groups(x, n // g, record=record)
        else:
            out, stats = self._spanning_group(x)
        if record:
            self.pending.append(stats)
        return out

    def _whole_groups(self, x: torch.Tensor, k: int, *, record: bool):
        """``k`` whole groups: torch's own batch-norm kernel over ``[G, k x C, ...]`` (each group's
        channels become channels of their own), which at ``k = 1`` is the input itself; and, when
        ``record``, the groups' ``(mean, unbiased var, counted)``."""
        g, c, rest = self.layout.group, x.shape[1], x.shape[2:]
        y = x.reshape(k, g, c, *rest).transpose(0, 1).reshape(g, k * c, *rest)
        w = None if self.weight is None else self.weight.repeat(k)
        b = None if self.bias is None else self.bias.repeat(k)
        out = F.batch_norm(y, None, None, w, b, True, 0.0, self.eps)
        out = out.reshape(g, k, c, *rest).transpose(0, 1).reshape(x.shape)
        if not record:
            return out, None
        with torch.no_grad():
            var, mean = torch.var_mean(y.detach(), dim=[0, *range(2, y.dim())], correction=1)
        return out, (mean.view(k, c), var.view(k, c), True)

    def _spanning_group(self, x: torch.Tensor):
        """Part of one group: its sums all-reduced (with their gradients) over the ranks that
        hold the rest; mean first, then the squared deviations from it (two reduces, the
        numerically stable order)."""
        group, first = self.layout.span(x.shape[0])
        dims = [0, *range(2, x.dim())]
        shape = (1, -1) + (1,) * (x.dim() - 2)
        count = self.layout.group * x[0, 0].numel()
        mean = all_reduce(x.sum(dims), group=group) / count
        centred = x - mean.view(shape)
        var = all_reduce((centred * centred).sum(dims), group=group) / count
        out = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.weight is not None:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        unbiased = var.detach() * (count / max(count - 1, 1))
        return out, (mean.detach().view(1, -1), unbiased.view(1, -1), first)


class _SumOverRanks(torch.autograd.Function):
    """A sum over ``group``'s ranks whose gradient is the sum of the ranks' gradients (each
    rank's output depends on every rank's input). torch.distributed.nn.functional.all_reduce does
    this but is deprecated in torch 2.13, and the functional collectives' all_reduce has no
    backward that reduces."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce(x: torch.Tensor, *, group) -> torch.Tensor:
    return _SumOverRanks.apply(x, group)


BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def has_batch_norm(model: nn.Module) -> bool:
    return any(isinstance(m, BATCH_NORMS + (GroupBatchNorm,)) for m in model.modules())


def convert_batch_norm(model: nn.Module, layout: NormLayout) -> list[GroupBatchNorm]:
    """Replace every ``nn.BatchNorm1d/2d/3d`` and ``nn.SyncBatchNorm`` of ``model`` (a user's, a
    ``transformers`` model's) by a :class:`GroupBatchNorm` over ``layout``'s groups, in place;
    returns the converted modules (the model's root is never a BatchNorm)."""
    converted = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, GroupBatchNorm):  # a model trained before (the Python API): this run's layout
                child.layout = layout
                converted.append(child)
            elif isinstance(child, BATCH_NORMS):
                new = GroupBatchNorm(child, layout)
                setattr(parent, name, new)
                converted.append(new)
    return converted


def norm_group(configured: int, global_batch_size: int) -> int:
    """``batch.norm_group``, or the global batch when that is smaller (documented); 0 (the
    model's BatchNorm stays torch's, layout-dependent) when it is 0."""
    return min(configured, global_batch_size)


def check_groups(*, group: int, global_batch_size: int, micro_batch_size: int, dp: int) -> str | None:
    """Why this layout cannot hold whole groups of ``group`` samples (one line with the fix), or
    None. A micro-batch holds whole groups, or a part of one group that the same micro-step of
    ``group / micro`` consecutive data-parallel ranks completes."""
    m = micro_batch_size
    if global_batch_size % group:
        return (
            f"batch.norm_group = {group} does not divide batch.global_batch_size = {global_batch_size};"
            f" set batch.norm_group to a divisor of {global_batch_size}"
        )
    if m % group == 0:
        return None
    if group % m == 0 and dp % (group // m) == 0:
        return None
    return (
        f"a micro-batch of {m} samples on dp = {dp} cannot hold whole BatchNorm groups of batch.norm_group ="
        f" {group}: a micro-batch must be a multiple of {group}, or {group} / k for a k that divides dp;"
        " set batch.micro_batch_size or batch.norm_group so, or batch.norm_group = 0 for torch's own, layout-dependent"
        " BatchNorm (docs/batch-math.md)"
    )
