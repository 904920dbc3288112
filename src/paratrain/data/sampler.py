"""The layout-invariant global-batch sampler and the rank and micro-batch slices of a step.

The samples of a step are a pure function of ``(seed, consumed_samples)``: the sampler walks an
endless stream made of one seeded permutation per epoch, so a step never depends on how many
ranks read it, and a change of batch size (or a resume) neither skips nor repeats a sample
within an epoch. How the global batch divides (``BatchPlan``) is batch/plan.py's.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, default_collate

from paratrain.config import ConfigError


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
        return [index for _, index in self.global_samples(start, count)]

    def global_samples(self, start: int, count: int) -> list[tuple[int, int]]:
        """``(epoch, dataset index)`` of each sample of the global batch: what keys its random
        draws (paratrain/randomness.py), the same on every layout and after a resume."""
        out: list[tuple[int, int]] = []
        pos = start
        while len(out) < count:
            epoch, offset = divmod(pos, self.n)
            take = min(count - len(out), self.n - offset)
            out.extend((epoch, i) for i in self._perm(epoch)[offset : offset + take].tolist())
            pos += take
        return out


def rank_slice(indices: list, *, dp_rank: int, dp: int) -> list:
    """The contiguous share of data-parallel rank ``dp_rank``."""
    per = len(indices) // dp
    return indices[dp_rank * per : (dp_rank + 1) * per]


def micro_batches(indices: list, micro_batch_size: int) -> list[list]:
    return [indices[i : i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]


def rank_micro_batches(indices: list, *, dp_rank: int, dp: int, micro_batch_size: int, group: int = 0) -> list[list]:
    """This rank's micro-batches of the global batch ``indices``: its contiguous share cut into
    micro-batches, unless ``group`` (BatchNorm's ``batch.norm_group``, models/batch_norm.py) is
    larger than a micro-batch. Then each group of ``group`` consecutive samples is laid out over
    ``s = group / micro`` consecutive ranks at the same micro-step (rank ``j s + i`` holds part
    ``i`` of group ``m dp / s + j`` at micro-step ``m``), so that one forward of those ranks
    holds it whole. The global batch and its groups are the same on every layout; only which
    rank reads which rows changes."""
    m = micro_batch_size
    if not group or group <= m:
        return micro_batches(rank_slice(indices, dp_rank=dp_rank, dp=dp), m)
    s = group // m
    if group % m or dp % s:  # models/batch_norm.py check_groups refuses such a layout before any step
        raise ConfigError(f"a micro-batch of {m} samples on dp = {dp} cannot hold BatchNorm groups of {group}")
    blocks, (j, i) = dp // s, divmod(dp_rank, s)
    steps = len(indices) // (m * dp)
    return [
        indices[(step * blocks + j) * group + i * m : (step * blocks + j) * group + (i + 1) * m]
        for step in range(steps)
    ]


def collate_of(dataset: Dataset):
    """The dataset's own ``collate`` (packed documents lay out a micro-batch themselves), through
    wrappers that keep it in ``.dataset`` (``Subset``); torch's ``default_collate`` otherwise."""
    while not hasattr(dataset, "collate") and isinstance(getattr(dataset, "dataset", None), Dataset):
        dataset = dataset.dataset
    return getattr(dataset, "collate", default_collate)


def load_batches(dataset: Dataset, indices: list[int], micro_batch_size: int) -> list:
    """This rank's micro-batches of the step, collated: ``[(input, target), ...]``."""
    collate = collate_of(dataset)
    return [collate([dataset[i] for i in mb]) for mb in micro_batches(indices, micro_batch_size)]
