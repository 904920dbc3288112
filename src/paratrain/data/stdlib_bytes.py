"""Byte-level language modelling on the Python standard library's own source files.

Every machine with Python has this corpus, so the built-in job needs no download. The files
are read in sorted order (test suites excluded) up to ``max_bytes``; the corpus's size and
SHA-256 go into the run's summary, since the stdlib differs between Python versions.

``split = "val"`` is the ``val_bytes`` bytes that follow the training bytes in that order: held
out, deterministic, and the training split stays the first ``max_bytes`` bytes it always was
(only a standard library smaller than ``max_bytes + val_bytes`` shortens it to make room).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterator

import torch
from torch.utils.data import Dataset

from paratrain.config import ConfigError


def stdlib_files() -> Iterator[tuple[str, str]]:
    """``(root, path)`` of the standard library's ``.py`` files in sorted order, test suites and
    site-packages excluded: this corpus's and data/code_search.py's."""
    root = sysconfig.get_paths()["stdlib"]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in ("test", "tests", "site-packages", "idle_test", "__pycache__")
        )
        for name in sorted(f for f in filenames if f.endswith(".py")):
            yield root, os.path.join(dirpath, name)


def stdlib_corpus(max_bytes: int) -> bytes:
    chunks, total = [], 0
    for _, path in stdlib_files():
        with open(path, "rb") as f:
            data = f.read()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            return b"".join(chunks)[:max_bytes]
    return b"".join(chunks)


class StdlibBytes(Dataset):
    """Non-overlapping windows: sample i is bytes [i*T, i*T+T) -> the next byte of each."""

    draws_random = False  # paratrain/randomness.py: no sample_rng around __getitem__

    def __init__(self, block_size: int = 128, max_bytes: int = 4_000_000, split: str = "train", val_bytes: int = 0):
        raw = stdlib_corpus(max_bytes + val_bytes)
        train_end = max(0, min(max_bytes, len(raw) - val_bytes))
        raw = raw[:train_end] if split == "train" else raw[train_end : train_end + val_bytes]
        self.block_size = block_size
        self.items_per_sample = block_size  # every next byte is a target (data/datasets.py static_items_per_sample)
        self.data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
        self.description = {
            "name": "stdlib_bytes",
            "split": split,
            "bytes": len(raw),
            "sha256": hashlib.sha256(raw).hexdigest(),
            "block_size": block_size,
            "samples": len(self),
        }

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.block_size
        window = self.data[start : start + self.block_size + 1]
        return window[:-1], window[1:]


def build_stdlib_bytes(
    block_size: int = 128, max_bytes: int = 4_000_000, split: str = "train", val_bytes: int = 262_144
) -> StdlibBytes:
    """``split``: 'train' (the first ``max_bytes`` bytes) or 'val' (the next ``val_bytes``)."""
    if split not in ("train", "val"):
        raise ConfigError(f"data.args.split = {split!r}; use 'train' or 'val'")
    if not isinstance(val_bytes, int) or val_bytes < 0:
        raise ConfigError(f"data.args.val_bytes = {val_bytes!r} must be an integer >= 0")
    ds = StdlibBytes(block_size=block_size, max_bytes=max_bytes, split=split, val_bytes=val_bytes)
    if split == "val" and len(ds) == 0:
        raise ConfigError(
            f"data.args.val_bytes = {val_bytes} holds no window of block_size + 1 = {block_size + 1} bytes; raise it"
        )
    return ds
