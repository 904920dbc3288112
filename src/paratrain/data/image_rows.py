"""Training on a corpus of image-text conversations (data/images.py prepares it).

``data.name = "tokens"`` on such a corpus: a sample is one conversation; a micro-batch is its
rows padded to the longest (positions -1 on the padding, as ``packing = "padded"``) with the
images of its rows in row order: an :class:`ImageTextBatch`, which models/hf/vision.py takes.
Packing image rows is refused for now (data/tokens.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from paratrain.config import ConfigError
from paratrain.data.packing import IGNORE_INDEX


@dataclass
class ImageTextBatch:
    """A micro-batch of image-text rows: token ids (B, T), position ids (B, T) (-1 on padding), and
    the pixel values of the rows' images in order (N, C, H, W); models/hf/vision.py takes it."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    pixel_values: torch.Tensor
    image_rows: torch.Tensor  # (N,) the row of each image

    def select_rows(self, a: int, b: int) -> ImageTextBatch:
        """Rows ``a:b`` with their images (the layout probe splits a micro-batch in two)."""
        keep = (self.image_rows >= a) & (self.image_rows < b)
        return ImageTextBatch(
            self.input_ids[a:b], self.positions[a:b], self.pixel_values[keep], self.image_rows[keep] - a
        )

    def count_tokens(self) -> int:
        """The real tokens (step.count_tokens: the padding does not count)."""
        return int((self.positions >= 0).sum())


class ImageConversations(torch.utils.data.Dataset):
    """The conversations of one split of an image corpus, one per sample (data/tokens.py builds it)."""

    draws_random = False  # paratrain/randomness.py: no sample_rng around __getitem__

    def __init__(self, corpus, pixels, image_counts: np.ndarray, *, shape, split: str, block_size: int):
        """``corpus``: data/tokens.py Documents; ``pixels``: the ShardedArray of the pixel values;
        ``image_counts``: the images of each document; ``shape``: one image's pixel values."""
        self.corpus, self.pixels = corpus, pixels
        self.image_counts = image_counts.astype(np.int64)
        self.image_starts = np.concatenate([[0], np.cumsum(self.image_counts)[:-1]]).astype(np.int64)
        self.shape = tuple(shape or ())
        self.block_size = block_size
        lengths = self.corpus.doc_lengths
        if len(lengths) and int(lengths.max()) > block_size:
            raise ConfigError(
                f"data.args.block_size = {block_size} is shorter than the longest image conversation of the"
                f" {split} split ({int(lengths.max())} tokens), which cannot be cut through its images; raise"
                f" data.args.block_size to {int(lengths.max())} or prepare with --max-length"
            )
        self.rows = np.flatnonzero(lengths >= 2)  # a one-token document has no target

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        d = int(self.rows[int(i)])
        ids, mask = self.corpus.document(d, int(self.corpus.doc_lengths[d]))
        targets = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
        targets[:-1] = np.where(mask[1:] > 0, ids[1:], IGNORE_INDEX)
        per = int(np.prod(self.shape)) if self.shape else 0
        start, n = int(self.image_starts[d]), int(self.image_counts[d])
        pixels = self.pixels.read(start * per, (start + n) * per).reshape(n, *self.shape) if n else None
        return ids, targets, pixels

    def null_sample(self):
        """A row with no target and no image (a validation set's last batch is filled with these)."""
        return np.zeros(1, np.int64), np.full(1, IGNORE_INDEX, np.int64), None

    def collate(self, samples: list) -> tuple[ImageTextBatch, torch.Tensor]:
        """Rows padded to the longest of the micro-batch; images concatenated in row order."""
        width = max(len(ids) for ids, _, _ in samples)
        ids = np.zeros((len(samples), width), np.int64)
        pos = np.full((len(samples), width), -1, np.int64)
        tgt = np.full((len(samples), width), IGNORE_INDEX, np.int64)
        for r, (i, t, _) in enumerate(samples):
            ids[r, : len(i)], tgt[r, : len(i)], pos[r, : len(i)] = i, t, np.arange(len(i))
        images = [p for _, _, p in samples if p is not None]
        pv = np.concatenate(images) if images else np.zeros((0, *self.shape), np.float32)
        owner = [r for r, (_, _, p) in enumerate(samples) if p is not None for _ in range(len(p))]
        batch = ImageTextBatch(
            torch.from_numpy(ids),
            torch.from_numpy(pos),
            torch.from_numpy(np.ascontiguousarray(pv)),
            torch.tensor(owner, dtype=torch.int64),
        )
        return batch, torch.from_numpy(tgt)
