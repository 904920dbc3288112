"""A prefetching loader: worker processes build the next steps' micro-batches ahead of time.

It is ``torch.utils.data.DataLoader`` over a dataset whose items are *steps*: item = this rank's
list of micro-batch ``(epoch, index)`` lists, value = the list of collated micro-batches
(the dataset's collate, ``default_collate`` by default, of ``[dataset[i] for i in mb]`` each). The index lists come from a
``StepSampler``, a pure function of ``consumed_samples`` (batching.GlobalBatchSampler), so the
loader holds no state but its queue: resume, resize or a change of batch size is a new loader
started at another position. The DataLoader keeps the order of its sampler whatever
``num_workers`` is, so the batches are exactly those of the inline loop.

Two details keep exactness: the DataLoader gets its own ``torch.Generator`` (without one it
draws its workers' base seed from the global RNG when an iterator is created, which would shift
the model's dropout stream between 0 and N workers); and on CUDA, ``pin_memory`` lets the step
copy with ``non_blocking=True`` (PyTorch's "pinned memory" tutorial).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from paratrain.data.sampler import GlobalBatchSampler, collate_of, rank_micro_batches
from paratrain.randomness import row_keys, sample_rng


class StepSampler(Sampler):
    """This rank's micro-batch index lists of ``steps`` steps (None: endless) from stream position ``start``."""

    def __init__(
        self,
        sampler: GlobalBatchSampler,
        *,
        start: int,
        steps: int | None,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int,
        dp: int,
        norm_group: int = 0,
    ):
        self.sampler, self.start, self.steps = sampler, start, steps
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp, self.norm_group = dp_rank, dp, norm_group

    def step_samples(self, position: int) -> list[list[tuple[int, int]]]:
        """This rank's micro-batches of the step at ``position``: ``(epoch, dataset index)`` lists."""
        samples = self.sampler.global_samples(position, self.global_batch_size)
        return rank_micro_batches(
            samples, dp_rank=self.dp_rank, dp=self.dp, micro_batch_size=self.micro_batch_size, group=self.norm_group
        )

    def __iter__(self) -> Iterator[list[list[tuple[int, int]]]]:
        s = 0
        while self.steps is None or s < self.steps:
            yield self.step_samples(self.start + s * self.global_batch_size)
            s += 1


class CollatedSteps(Dataset):
    """Item = one step's micro-batch ``(epoch, index)`` lists -> its collated micro-batches.

    ``keyed_seed``: each ``dataset[i]`` runs under :func:`~paratrain.randomness.sample_rng` of
    ``(seed, epoch, i)``, so what it draws from the global RNGs is the same on every layout,
    in the main process or a worker; None calls it as it is."""

    def __init__(self, dataset: Dataset, keyed_seed: int | None = None):
        self.dataset, self.keyed_seed = dataset, keyed_seed
        self.collate = collate_of(dataset)

    def item(self, epoch: int, index: int):
        if self.keyed_seed is None:
            return self.dataset[index]
        with sample_rng(self.keyed_seed, epoch, index):
            return self.dataset[index]

    def __getitem__(self, step: list[list[tuple[int, int]]]) -> list:
        return [self.collate([self.item(e, i) for e, i in mb]) for mb in step]


def build_loader(
    dataset: Dataset,
    steps,
    *,
    workers: int = 0,
    prefetch: int = 2,
    pin_memory: bool = False,
    seed: int = 0,
    keyed_seed: int | None = None,
) -> DataLoader:
    """Iterate to get, step after step, the list of collated micro-batches of ``steps``.

    ``steps`` is any iterable of per-step micro-batch ``(epoch, index)`` lists (a StepSampler
    for training); ``keyed_seed``: CollatedSteps'.
    """
    return DataLoader(
        CollatedSteps(dataset, keyed_seed),
        batch_size=None,  # the sampler's items are whole steps, collated by CollatedSteps
        sampler=steps,
        num_workers=workers,
        prefetch_factor=prefetch if workers else None,
        persistent_workers=False,  # one loader per start position; workers end with it
        pin_memory=pin_memory,
        generator=torch.Generator().manual_seed(seed),  # never the global RNG (module docstring)
    )


def to_device(batch, device: torch.device):
    """Copy a collated micro-batch to ``device``; non-blocking from pinned memory."""
    non_blocking = device.type == "cuda"
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return type(batch)(to_device(b, device) for b in batch)


class BatchSource(Protocol):
    """Where the loop's batches come from (trainer.loop): the step loader by default, or the
    loss's plug-in's own (objectives/registry.py ``Plugin.source``: GRPO's rollouts)."""

    metrics: dict  # columns of the step's metrics row (GRPO: reward, completion length)

    def for_step(
        self, step: int, consumed: int, global_batch_size: int, micro_batch_size: int, *, keyed: bool
    ) -> tuple[list, list | None]: ...

    def consumed_after(self, step: int, global_batch_size: int) -> int: ...

    def between_rounds(self, steps_done: int) -> bool: ...


class StepLoader:
    """The trainer's view: the collated micro-batches of the step at ``position``.

    Consecutive calls (position advancing by the global batch, same batch sizes) are served by
    one prefetching DataLoader; any other call (resume, a new batch size from the adaptive
    mode) starts a new one there. ``workers = 0`` loads inline, exactly as before.
    """

    def __init__(
        self,
        dataset: Dataset,
        sampler: GlobalBatchSampler,
        *,
        dp_rank: int,
        dp: int,
        workers: int = 0,
        prefetch: int = 2,
        pin_memory: bool = False,
        seed: int = 0,
        keyed_seed: int | None = None,
        norm_group: int = 0,
    ):
        self.dataset, self.sampler, self.dp_rank, self.dp = dataset, sampler, dp_rank, dp
        self.norm_group = norm_group  # StepSampler's
        self.workers, self.prefetch, self.pin_memory, self.seed = workers, prefetch, pin_memory, seed
        self.keyed_seed = keyed_seed
        self._it, self._expect = None, None
        # The last call's key and batches: a second call for the same step (the start-of-run
        # layout probe's, then the step's own) reads no sample twice and restarts no worker.
        self._last: tuple[tuple, list] | None = None

    def _steps(self, position: int, global_batch_size: int, micro_batch_size: int) -> StepSampler:
        return StepSampler(
            self.sampler,
            start=position,
            steps=None,  # endless: the few steps prefetched past the end are dropped with the loader
            global_batch_size=global_batch_size,
            micro_batch_size=micro_batch_size,
            dp_rank=self.dp_rank,
            dp=self.dp,
            norm_group=self.norm_group,
        )

    def keys(self, position: int, global_batch_size: int, micro_batch_size: int, *, seed: int) -> list[torch.Tensor]:
        """The row keys of this rank's micro-batches of the step (paratrain/randomness.py), from
        the samples' ``(epoch, index)`` alone: what the model's keyed dropout draws from."""
        steps = self._steps(position, global_batch_size, micro_batch_size)
        return [row_keys(seed, mb) for mb in steps.step_samples(position)]

    def batches(self, position: int, global_batch_size: int, micro_batch_size: int) -> list:
        key = (position, global_batch_size, micro_batch_size)
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        self._last = (key, self._load(position, global_batch_size, micro_batch_size))
        return self._last[1]

    def _load(self, position: int, global_batch_size: int, micro_batch_size: int) -> list:
        steps = self._steps(position, global_batch_size, micro_batch_size)
        if self.workers == 0:
            return CollatedSteps(self.dataset, self.keyed_seed)[steps.step_samples(position)]
        key = (position, global_batch_size, micro_batch_size)
        if self._it is None or self._expect != key:
            self.close()
            loader = build_loader(
                self.dataset,
                steps,
                workers=self.workers,
                prefetch=self.prefetch,
                pin_memory=self.pin_memory,
                seed=self.seed,
                keyed_seed=self.keyed_seed,
            )
            self._it = iter(loader)
        self._expect = (position + global_batch_size, global_batch_size, micro_batch_size)
        return next(self._it)

    # --- the loop's batch source (trainer.loop): the default; a plug-in may give another
    # (objectives/registry.py Plugin.source: GRPO's rollouts, objectives/rl/rollout.py)

    @property
    def metrics(self) -> dict:
        """A source's columns of the step's metrics row: none here."""
        return {}

    def for_step(self, step: int, consumed: int, global_batch_size: int, micro_batch_size: int, *, keyed: bool):
        """This rank's micro-batches of optimiser step ``step`` (0-based), which begins at sample
        ``consumed``, and, when ``keyed`` (the model's draws keyed by the sample), their rows' keys."""
        batches = self.batches(consumed, global_batch_size, micro_batch_size)
        keys = self.keys(consumed, global_batch_size, micro_batch_size, seed=self.seed) if keyed else None
        return batches, keys

    def consumed_after(self, step: int, global_batch_size: int) -> int:
        """The samples step ``step`` consumed: its global batch."""
        return global_batch_size

    def between_rounds(self, steps_done: int) -> bool:
        """Whether the run may stop after ``steps_done`` steps (a preemption): always."""
        return True

    def close(self) -> None:
        """End the workers (dropping the iterator shuts them down)."""
        self._it = None
