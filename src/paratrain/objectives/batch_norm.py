"""BatchNorm's running statistics, updated as one process iterating the groups in global order.

torch's BatchNorm updates ``running = (1 - m) running + m stat`` at each training forward, so
the running statistics (what eval uses) depend on how many forwards a step has and in which
order the ranks' ones come. models/batch_norm.py's ``GroupBatchNorm`` leaves each group's
statistics with this objective instead, which updates the running statistics once per step as
one process calling torch's BatchNorm on each group of the global batch in order would: group
``g`` of the ``c``-th call of a module in a forward is update number ``o = c K + g`` of ``T``
(``K`` groups in the global batch; a module called twice per forward, a dual encoder's shared
tower, is called on all queries, then on all documents). That update is linear in the groups'
statistics::

    running_T = a running_0 + sum_o coef_o stat_o,   a = prod_o (1 - m_o),
    coef_o = m_o prod_{j > o} (1 - m_j)

(``m_o`` the momentum, or ``1 / (n_0 + o + 1)`` with ``momentum = None``, torch's cumulative
average), so each rank sums ``coef_o stat_o`` over its own groups in float64 and the sums ride
the step's one reduce: no collective of its own, the same running statistics on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from paratrain.config import ConfigError
from paratrain.objectives.base import Objective
from paratrain.objectives.items import rows


class NormStatistics(Objective):
    """Adds no term to the loss; its sums are the running-statistics updates (module docstring)."""

    name = "batch_norm"
    unit = "sample"

    def __init__(self, layout):
        # layout: the converted modules' NormLayout (models/batch_norm.py, which this floor does not import)
        self.layout = layout
        # run.bitwise: the running statistics' updates are added in one order on every layout
        self.ordered = getattr(layout, "ordered", False)
        self.modules_: list[nn.Module] = []
        self.entries: dict[int, list] = {}
        self.calls: dict[int, int] = {}  # each module's calls per forward, this step

    def bind(self, model: nn.Module) -> None:
        self.modules_ = [
            m for m in model.modules() if getattr(m, "records_group_statistics", False) and m.track_running_stats
        ]

    def count(self, inputs, target) -> int:
        return rows(inputs)

    def static_count(self, inputs) -> int:
        return rows(inputs)

    def start(self, *, scale: float, device: torch.device) -> None:
        self.device, self.k = device, 0
        self.entries = {id(m): [] for m in self.modules_}
        for m in self.modules_:
            m.pending.clear()
            m.recording = True

    def before_micro_batches(self, model: nn.Module, batches: Sequence[tuple], **_) -> None:
        """Each micro-batch's first group in the global batch (the sampler's layout)."""
        micro = rows(batches[0][0])
        total = micro * len(batches) * self.layout.dp
        why = self.layout.check(micro_batch_size=micro, global_batch_size=total)
        if why is not None:  # a batch size the run reached later (batch.adaptive, a resize)
            raise ConfigError(why)
        self.first_groups = self.layout.first_groups(micro_batch_size=micro, global_batch_size=total)
        self.groups = total // self.layout.group

    def loss(self, output, target) -> None:
        """After micro-batch ``k``'s forward: take what its BatchNorm calls recorded."""
        first = self.first_groups[self.k]
        for m in self.modules_:
            for call, (mean, var, counted) in enumerate(m.pending):
                self.entries[id(m)].append((call, first, mean, var, counted))
            m.pending.clear()
        self.k += 1
        return None

    def end_micro_batch(self) -> None:
        for m in self.modules_:  # an activation checkpoint's recomputation recorded them again
            m.pending.clear()

    def sums(self) -> torch.Tensor | None:
        if not self.modules_:
            return None
        parts = []
        for m in self.modules_:
            entries = self.entries[id(m)]
            calls = self.calls[id(m)] = 1 + max((e[0] for e in entries), default=-1)
            _, coef = ema_coefficients(m, updates=calls * self.groups)
            # ordered (run.bitwise): one row per update, filled by the one rank that holds its group
            # (the reduce adds zeros to it: exact), summed in update order in read()
            rows = calls * self.groups if self.ordered else 1
            mean_sum = torch.zeros(rows, m.num_features, dtype=torch.float64, device=self.device)
            var_sum = torch.zeros_like(mean_sum)
            for call, first, mean, var, counted in entries:
                if not counted:  # a group spread over ranks: its first rank counts it
                    continue
                at = [ordinal(call, first + j, calls=calls, groups=self.groups) for j in range(len(mean))]
                w = torch.tensor([coef[o] for o in at], dtype=torch.float64, device=mean.device).unsqueeze(1)
                if self.ordered:
                    mean_sum[at] = (w * mean.double()).to(self.device)
                    var_sum[at] = (w * var.double()).to(self.device)
                    continue
                mean_sum += (w * mean.double()).sum(0).to(self.device)
                var_sum += (w * var.double()).sum(0).to(self.device)
            parts += [
                mean_sum.flatten(),
                var_sum.flatten(),
                torch.tensor([float(calls)], dtype=torch.float64, device=self.device),
            ]
        return torch.cat(parts)

    def read(self, reduced: list[float], *, units: int) -> dict:
        """Apply the reduced update to every rank's running statistics, then stop recording."""
        at = 0
        for m in self.modules_:
            calls = self.calls[id(m)]
            c = m.num_features * (calls * self.groups if self.ordered else 1)
            # ordered: the updates' rows in update order, the same tensor on every rank and layout
            mean_sum = torch.tensor(reduced[at : at + c], dtype=torch.float64).view(-1, m.num_features).sum(0)
            var_sum = torch.tensor(reduced[at + c : at + 2 * c], dtype=torch.float64).view(-1, m.num_features).sum(0)
            at += 2 * c + 1  # then the calls summed over the ranks, each rank's as many
            updates = calls * self.groups
            if updates == 0:
                continue
            a, _ = ema_coefficients(m, updates=updates)
            with torch.no_grad():
                for buf, s in ((m.running_mean, mean_sum), (m.running_var, var_sum)):
                    buf.copy_(a * buf.double() + s.to(buf.device))
                m.num_batches_tracked += updates
        for m in self.modules_:
            m.recording = False
        return {}


def ordinal(call: int, group: int, *, calls: int, groups: int) -> int:
    """The update number of group ``group`` of a module's ``call``-th call in a forward: one
    process runs the whole global batch in one forward, so every group of the first call comes
    before any of the second."""
    return call * groups + group


def ema_coefficients(m: nn.Module, *, updates: int) -> tuple[float, list[float]]:
    """``(a, coef)`` of ``updates`` successive torch BatchNorm updates (module docstring)."""
    n0 = int(m.num_batches_tracked)
    rates = [m.momentum if m.momentum is not None else 1.0 / (n0 + o + 1) for o in range(updates)]
    coef, keep = [0.0] * updates, 1.0
    for o in reversed(range(updates)):
        coef[o] = rates[o] * keep
        keep *= 1.0 - rates[o]
    return keep, coef
