"""The batch arithmetic, in one place, and the layout-invariant global-batch sampler.

``global_batch_size = micro_batch_size * accum_steps * dp``. The samples of a step are a pure
function of ``(seed, consumed_samples)``: the sampler walks an endless stream made of one
seeded permutation per epoch, so a step never depends on how many ranks read it, and a change
of batch size (or a resume) neither skips nor repeats a sample within an epoch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import Dataset, default_collate

from paratrain.config import ConfigError


@dataclass(frozen=True)
class BatchPlan:
    global_batch_size: int
    micro_batch_size: int
    accum_steps: int
    dp: int

    @property
    def per_rank_batch_size(self) -> int:
        return self.micro_batch_size * self.accum_steps

    def describe(self) -> str:
        return (
            f"global_batch_size {self.global_batch_size} = micro_batch_size {self.micro_batch_size}"
            f" x accum_steps {self.accum_steps} x dp {self.dp}"
        )


def plan_batch(*, global_batch_size: int, micro_batch_size: int, dp: int) -> BatchPlan:
    """Derive accumulation steps; micro_batch_size 0 means the whole per-rank batch."""
    if global_batch_size % dp:
        raise ConfigError(
            f"batch.global_batch_size = {global_batch_size} is not divisible by dp = {dp} data-parallel ranks;"
            f" set it to a multiple of {dp}"
        )
    per_rank = global_batch_size // dp
    mbs = micro_batch_size or per_rank
    if per_rank % mbs:
        raise ConfigError(
            f"batch.global_batch_size = {global_batch_size} is not divisible by micro_batch_size {mbs} x dp {dp}"
            f" = {mbs * dp}; set batch.micro_batch_size to a divisor of {per_rank} (the per-rank batch)"
        )
    return BatchPlan(global_batch_size, mbs, per_rank // mbs, dp)


def replan_batch(*, global_batch_size: int, micro_batch_size: int, dp: int) -> BatchPlan:
    """The plan of a global batch the run reached (batch.adaptive grows it) on a new world size.

    After an elastic or by-hand resize, the grown batch that ``micro x dp`` of the old world
    divided may not be a multiple of the new ``micro x dp``: then the micro-batch shrinks to the
    largest divisor of the per-rank batch (the micro-batch is layout, not math), instead of
    stopping the restarted job. Only a batch the new data-parallel degree cannot split at all
    is refused.
    """
    if global_batch_size % dp:
        raise ConfigError(
            f"the adaptive batch reached global batch {global_batch_size}, which dp = {dp} data-parallel"
            f" ranks cannot split evenly; resume on a layout whose dp divides {global_batch_size}, or cap"
            " the growth (batch.max_global_batch_size) at a multiple of micro_batch_size x every dp you resize to"
        )
    per_rank = global_batch_size // dp
    mbs = max(d for d in range(1, min(micro_batch_size or per_rank, per_rank) + 1) if per_rank % d == 0)
    return plan_batch(global_batch_size=global_batch_size, micro_batch_size=mbs, dp=dp)


class GlobalBatchSampler:
    """Indices of the global batch that starts at stream position ``start``.

    Position p falls in epoch ``p // N`` at offset ``p % N`` of that epoch's permutation, which
    is drawn from its own ``torch.Generator`` seeded by ``(seed, epoch)`` (never the global RNG).
    """

    def __init__(self, dataset_len: int, *, seed: int, shuffle: bool = True):
        if dataset_len <= 0:
            raise ConfigError("the dataset is empty; give data.args that yield at least one sample")
        self.n = dataset_len
        self.seed = seed
        self.shuffle = shuffle
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            if len(self._perms) > 2:  # positions only move forward; keep the cache small
                self._perms.pop(min(self._perms))
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._perms[epoch] = torch.randperm(self.n, generator=g)
            else:
                self._perms[epoch] = torch.arange(self.n)
        return self._perms[epoch]

    def epoch_of(self, position: int) -> int:
        return position // self.n

    def global_indices(self, start: int, count: int) -> list[int]:
        out: list[int] = []
        pos = start
        while len(out) < count:
            epoch, offset = divmod(pos, self.n)
            take = min(count - len(out), self.n - offset)
            out.extend(self._perm(epoch)[offset : offset + take].tolist())
            pos += take
        return out


def rank_slice(indices: list[int], *, dp_rank: int, dp: int) -> list[int]:
    """The contiguous share of data-parallel rank ``dp_rank``."""
    per = len(indices) // dp
    return indices[dp_rank * per : (dp_rank + 1) * per]


def micro_batches(indices: list[int], micro_batch_size: int) -> list[list[int]]:
    return [indices[i : i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]


def load_batches(dataset: Dataset, indices: list[int], micro_batch_size: int) -> list:
    """This rank's micro-batches of the step, collated: ``[(input, target), ...]``."""
    return [default_collate([dataset[i] for i in mb]) for mb in micro_batches(indices, micro_batch_size)]
