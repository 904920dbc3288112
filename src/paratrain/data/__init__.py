"""Built-in datasets and the dataset builder (built-in name or user factory)."""

from __future__ import annotations

import inspect

from torch.utils.data import Dataset, Subset

from paratrain.config import ConfigError, DataConfig, resolve_callable
from paratrain.data.stdlib_bytes import StdlibBytes, build_stdlib_bytes
from paratrain.data.tokens import build_tokens
from paratrain.models import _check_kwargs

BUILTIN_DATASETS = {"stdlib_bytes": build_stdlib_bytes, "tokens": build_tokens}


def dataset_builder(cfg: DataConfig):
    """The builder and its config key, with [data.args] checked against its signature."""
    if cfg.factory:
        fn, key = resolve_callable(cfg.factory, "data.factory"), "data.factory"
    elif cfg.name in BUILTIN_DATASETS:
        fn, key = BUILTIN_DATASETS[cfg.name], "data.name"
    else:
        raise ConfigError(f"data.name = {cfg.name!r} is unknown; use one of {sorted(BUILTIN_DATASETS)} or data.factory")
    _check_kwargs(fn, cfg.args, key, "data.args")
    return fn, key


def build_dataset(cfg: DataConfig) -> Dataset:
    fn, key = dataset_builder(cfg)
    ds = fn(**cfg.args)
    if not hasattr(ds, "__getitem__") or not hasattr(ds, "__len__"):
        raise ConfigError(
            f"{key} returned {type(ds).__name__}, not a map-style Dataset; return one with __len__ and __getitem__"
        )
    return ds


def build_val_dataset(cfg: DataConfig, samples: int = 0) -> Dataset:
    """The first ``samples`` (0 = all) samples of the builder's ``split="val"`` set: a fixed eval set.

    For [eval]: the same windows at every evaluation and for every layout. Needs a builder with a
    ``split`` argument (``tokens`` has one; a user factory may add one).
    """
    fn, key = dataset_builder(cfg)
    if "split" not in inspect.signature(fn).parameters:
        raise ConfigError(f"{key} has no `split` argument, so it has no validation set; add split='train'|'val' to it")
    ds = fn(**{**cfg.args, "split": "val"})
    return Subset(ds, range(min(samples, len(ds)) if samples else len(ds)))


__all__ = ["StdlibBytes", "build_dataset", "build_val_dataset", "BUILTIN_DATASETS"]
