"""Built-in datasets and the dataset builder (built-in name or user factory)."""

from __future__ import annotations

import inspect

import torch
from torch.utils.data import Dataset, Subset, TensorDataset

from paratrain.config import ConfigError, DataConfig, check_kwargs, resolve_callable
from paratrain.data.code_search import code_search
from paratrain.data.prompts import build_prompts
from paratrain.data.stdlib_bytes import StdlibBytes, build_stdlib_bytes
from paratrain.data.tokens import build_tokens

BUILTIN_DATASETS = {
    "stdlib_bytes": build_stdlib_bytes,
    "tokens": build_tokens,
    "code_search": code_search,
    "prompts": build_prompts,  # loss.name = 'grpo' (data/prompts.py)
}


def dataset_builder(cfg: DataConfig):
    """The builder and its config key, with [data.args] checked against its signature."""
    if cfg.factory:
        fn, key = resolve_callable(cfg.factory, "data.factory"), "data.factory"
    elif cfg.name in BUILTIN_DATASETS:
        fn, key = BUILTIN_DATASETS[cfg.name], "data.name"
    else:
        raise ConfigError(f"data.name = {cfg.name!r} is unknown; use one of {sorted(BUILTIN_DATASETS)} or data.factory")
    check_kwargs(fn, cfg.args, key, "data.args")
    return fn, key


def build_dataset(cfg: DataConfig) -> Dataset:
    fn, key = dataset_builder(cfg)
    ds = fn(**cfg.args)
    if not hasattr(ds, "__getitem__") or not hasattr(ds, "__len__"):
        raise ConfigError(
            f"{key} returned {type(ds).__name__}, not a map-style Dataset; return one with __len__ and __getitem__"
        )
    return ds


def static_items_per_sample(dataset: Dataset) -> int | None:
    """The data path's static count: a dataset whose every sample has exactly ``items_per_sample``
    target elements, any of them a class id (so never a negative ignore index), declares it as
    that attribute (the built-in plain token streams do; masked and packed data do not). The
    step then knows the global item count without its all-reduce (step.count_global_items) and
    checks the loss's own count against it. Wrappers (``Subset``, the filled-up validation set)
    hide it on purpose: their samples need not be the declared ones."""
    n = getattr(dataset, "items_per_sample", None)
    if n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ConfigError(
            f"the dataset's items_per_sample = {n!r} must be a positive int (its target elements per sample);"
            " fix or remove that attribute"
        )
    return n


def tensor_items_per_sample(dataset: Dataset, *, ignore_index: int | None) -> int | None:
    """The static count of an in-memory ``TensorDataset(inputs, targets)`` (how most users hand
    their own tensors over), read off its targets once at start instead of declared: every
    sample's target elements, when none of them is ``ignore_index`` (cross-entropy, integer class
    ids) or all of them count (``ignore_index`` None: mse). The step checks the loss's own count
    against it every step, as for a declared one. None for anything else."""
    if type(dataset) is not TensorDataset or len(dataset.tensors) != 2:
        return None
    targets = dataset.tensors[1]
    if targets.dim() == 0 or len(targets) == 0:
        return None
    if ignore_index is not None and (targets.is_floating_point() or bool((targets == ignore_index).any())):
        return None
    return targets[0].numel()


def build_val_dataset(
    cfg: DataConfig, samples: int = 0, multiple_of: int = 1, *, pad_target: int | None = None
) -> Dataset:
    """The first ``samples`` samples of the validation set: a fixed eval set.

    ``samples = 0``: all of it. Validation runs in whole global batches (``multiple_of``): with
    ``pad_target`` (the loss's ignore index, for a loss that counts by it) the last batch is
    filled up with samples whose every target is ``pad_target`` (they add nothing to the sum or
    the count, so every sample is evaluated exactly once, on any layout); without it the set is
    rounded down to whole batches. The validation set is ``data.val_factory(**data.args)`` when set, else
    the builder's ``split="val"`` set (``tokens`` and ``stdlib_bytes`` have one; a user factory
    may add a ``split`` argument). The same samples at every evaluation and for every layout.
    """
    if cfg.val_factory:
        fn, key = resolve_callable(cfg.val_factory, "data.val_factory"), "data.val_factory"
        check_kwargs(fn, cfg.args, key, "data.args")
        ds = fn(**cfg.args)
    else:
        fn, key = dataset_builder(cfg)
        if "split" not in inspect.signature(fn).parameters:
            raise ConfigError(
                f"{key} has no `split` argument, so it has no validation set; add split='train'|'val' to it"
                " or set data.val_factory"
            )
        ds = fn(**{**cfg.args, "split": "val"})
    if not hasattr(ds, "__getitem__") or not hasattr(ds, "__len__"):
        raise ConfigError(f"{key} returned {type(ds).__name__}, not a map-style Dataset; return one with __len__")
    if not samples and pad_target is not None and len(ds):
        return FilledUp(ds, -(-len(ds) // multiple_of) * multiple_of, pad_target)
    n = samples or len(ds) - len(ds) % multiple_of
    if n == 0 or n > len(ds):
        raise ConfigError(
            f"the validation set has {len(ds)} samples, fewer than eval.samples = {samples or multiple_of}"
            " (at least one global batch); lower eval.samples or batch.global_batch_size, or give more validation data"
        )
    return Subset(ds, range(n))


class FilledUp(Dataset):
    """A dataset followed by samples with no target, up to ``total`` (see build_val_dataset)."""

    def __init__(self, dataset: Dataset, total: int, pad_target: int):
        self.dataset = dataset
        self.total, self.real = total, len(dataset)
        if hasattr(dataset, "null_sample"):
            self.null = dataset.null_sample()
        else:
            x, t = dataset[0]
            self.null = (x, torch.full_like(torch.as_tensor(t), pad_target))

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, i: int):
        return self.dataset[i] if i < self.real else self.null


__all__ = ["StdlibBytes", "build_dataset", "build_val_dataset", "BUILTIN_DATASETS"]
