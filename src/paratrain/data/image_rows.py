"""Training on a corpus of image-text conversations (data/images.py prepares it).

``data.name = "tokens"`` on such a corpus: with ``packing = "padded"`` (the default) a sample is
one conversation; a micro-batch is its rows padded to the longest (positions -1 on the padding)
with the images of its rows in row order: an :class:`ImageTextBatch`, which models/hf/vision.py
takes. With ``packing = "documents"`` a sample is a row of ``block_size`` holding whole
conversations best-fit (data/packing.py), their positions restarting at 0 at each one (so each
attends to itself only, as text packing does) and their images in row order: the row's image
tokens, in order, are its documents' images in order, which is the order the model scatters the
image features in (models/hf/vision.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from paratrain.config import ConfigError
from paratrain.data.packing import IGNORE_INDEX, pack_best_fit
from paratrain.data.preference import PreferencePairs


@dataclass
class ImageTextBatch:
    """A micro-batch of image-text rows: token ids (B, T), position ids (B, T) (-1 on padding), and
    the pixel values of the rows' images in order (N, C, H, W); models/hf/vision.py takes it.
    With variable patches (Qwen2-VL) ``pixel_values`` are the images' patch rows in order (sum of
    patches, D) and ``image_grid_thw`` (N, 3) says how many rows each image has (t * h * w)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    pixel_values: torch.Tensor
    image_rows: torch.Tensor  # (N,) the row of each image
    image_grid_thw: torch.Tensor | None = None

    def select_rows(self, a: int, b: int) -> ImageTextBatch:
        """Rows ``a:b`` with their images (the layout probe splits a micro-batch in two)."""
        keep = (self.image_rows >= a) & (self.image_rows < b)
        grid, patches = self.image_grid_thw, keep
        if grid is not None:
            patches, grid = keep.repeat_interleave(grid.prod(-1)), grid[keep]
        return ImageTextBatch(
            self.input_ids[a:b], self.positions[a:b], self.pixel_values[patches], self.image_rows[keep] - a, grid
        )

    def count_tokens(self) -> int:
        """The real tokens (step.count_tokens: the padding does not count)."""
        return int((self.positions >= 0).sum())

    def __len__(self) -> int:
        """The rows (loss.rows: a preference batch counts a pair per row)."""
        return self.input_ids.shape[0]


class ImageConversations(torch.utils.data.Dataset):
    """The conversations of one split of an image corpus, one per sample, or packed several to a
    sample with ``packing = "documents"`` (data/tokens.py builds it)."""

    draws_random = False  # paratrain/randomness.py: no sample_rng around __getitem__

    def __init__(
        self,
        corpus,
        pixels,
        image_counts: np.ndarray,
        *,
        shape,
        split: str,
        block_size: int,
        grids=None,
        packing: str = "padded",
    ):
        """``corpus``: data/tokens.py Documents; ``pixels``: the ShardedArray of the pixel values;
        ``image_counts``: the images of each document; ``shape``: one image's pixel values (one
        patch's with ``grids``, the image_grid_thw of every image in order, flat); ``packing``:
        ``padded`` (a conversation per row) or ``documents`` (conversations packed best-fit)."""
        self.corpus, self.pixels = corpus, pixels
        self.image_counts = image_counts.astype(np.int64)
        self.image_starts = np.concatenate([[0], np.cumsum(self.image_counts)[:-1]]).astype(np.int64)
        self.shape = tuple(shape or ())
        self.grids = None if grids is None else np.asarray(grids, np.int64).reshape(-1, 3)
        # Where each image's values start, in units of ``shape``: its first patch with grids.
        sizes = np.ones(int(self.image_counts.sum()), np.int64)
        if self.grids is not None:
            sizes = self.grids.prod(-1)
        self.unit_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.block_size = block_size
        lengths = self.corpus.doc_lengths
        if len(lengths) and int(lengths.max()) > block_size:
            raise ConfigError(
                f"data.args.block_size = {block_size} is shorter than the longest image conversation of the"
                f" {split} split ({int(lengths.max())} tokens), which cannot be cut through its images; raise"
                f" data.args.block_size to {int(lengths.max())} or prepare with --max-length"
            )
        keep = np.flatnonzero(lengths >= 2)  # a one-token document has no target
        self.packing = packing
        # The documents of each row: one each, or whole conversations best-fit (a function of the
        # corpus and block_size alone, never of the layout, as for text: data/packing.py).
        self.rows = [keep[r] for r in pack_best_fit(lengths[keep], block_size)] if packing == "documents" else keep

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        if self.packing != "documents":
            return self._document(int(self.rows[int(i)]))
        docs = [self._document(int(d)) for d in self.rows[int(i)]]
        ids, targets, pos = (np.concatenate([doc[k] for doc in docs]) for k in range(3))
        images = [doc for doc in docs if doc[3] is not None]  # each document's images, in row order
        if not images:
            return ids, targets, pos, None, None
        grids = None if self.grids is None else np.concatenate([doc[4] for doc in images])
        return ids, targets, pos, np.concatenate([doc[3] for doc in images]), grids

    def _document(self, d: int):
        """(ids, targets, positions, pixel values or None, grids or None) of document ``d``."""
        ids, mask = self.corpus.document(d, int(self.corpus.doc_lengths[d]))
        targets = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
        targets[:-1] = np.where(mask[1:] > 0, ids[1:], IGNORE_INDEX)
        per = int(np.prod(self.shape)) if self.shape else 0
        start, n = int(self.image_starts[d]), int(self.image_counts[d])
        positions = np.arange(len(ids), dtype=np.int64)
        if not n:
            return ids, targets, positions, None, None
        a, b = int(self.unit_starts[start]), int(self.unit_starts[start + n])
        pixels = self.pixels.read(a * per, b * per).reshape(b - a, *self.shape)
        return ids, targets, positions, pixels, None if self.grids is None else self.grids[start : start + n]

    def probe_indices(self, n: int, micro_batch_size: int) -> list[int]:
        """``n`` rows for the memory estimate's micro-batches (batch/measure.py): each micro-batch
        is the longest row (its width is the micro-batch's) and ``micro_batch_size - 1`` copies of
        the row with the most image values (patches with grids; Qwen2-VL's largest grids), ties
        to the longer: real rows, as wide as the widest micro-batch, with the most patches a row has."""
        docs = [np.atleast_1d(self.rows[i]) for i in range(len(self))]
        lengths = self.corpus.doc_lengths
        images = self.unit_starts[self.image_starts + self.image_counts] - self.unit_starts[self.image_starts]
        tokens = [int(lengths[d].sum()) for d in docs]
        values = [int(images[d].sum()) for d in docs]
        longest = max(range(len(docs)), key=lambda r: (tokens[r], values[r]))
        heaviest = max(range(len(docs)), key=lambda r: (values[r], tokens[r]))
        one = [longest] + [heaviest] * (micro_batch_size - 1)
        return (one * (n // micro_batch_size + 1))[:n]

    def null_sample(self):
        """A row with no target and no image (a validation set's last batch is filled with these)."""
        pos = np.full(1, -1 if self.packing == "documents" else 0, np.int64)  # a packed one is all padding
        return np.zeros(1, np.int64), np.full(1, IGNORE_INDEX, np.int64), pos, None, None

    def collate(self, samples: list) -> tuple[ImageTextBatch, torch.Tensor]:
        """Rows padded to the longest of the micro-batch (packed rows: to block_size, as text's);
        images concatenated in row order."""
        width = self.block_size if self.packing == "documents" else max(len(ids) for ids, *_ in samples)
        ids = np.zeros((len(samples), width), np.int64)
        pos = np.full((len(samples), width), -1, np.int64)
        tgt = np.full((len(samples), width), IGNORE_INDEX, np.int64)
        for r, (i, t, p, *_) in enumerate(samples):
            ids[r, : len(i)], tgt[r, : len(i)], pos[r, : len(i)] = i, t, p
        images = [p for *_, p, _ in samples if p is not None]
        pv = np.concatenate(images) if images else np.zeros((0, *self.shape), np.float32)
        # One entry per image: a grid row of each image with variable patches, else a pixel row.
        per_image = [(r, g if g is not None else p) for r, (*_, p, g) in enumerate(samples) if p is not None]
        owner = [r for r, images_of_row in per_image for _ in range(len(images_of_row))]
        grid = None
        if self.grids is not None:
            grid = torch.from_numpy(
                np.concatenate([g for _, g in per_image]) if per_image else np.zeros((0, 3), np.int64)
            )
        batch = ImageTextBatch(
            torch.from_numpy(ids),
            torch.from_numpy(pos),
            torch.from_numpy(np.ascontiguousarray(pv)),
            torch.tensor(owner, dtype=torch.int64),
            grid,
        )
        return batch, torch.from_numpy(tgt)


class ImagePreferencePairs(PreferencePairs):
    """The pairs of an image-text ``preference`` corpus (data/images.py): each pair one row
    ``[chosen | rejected]`` as for text (data/preference.py; the positions restart at the rejected
    side, so each side attends to itself only) whose image tokens take the pair's images twice,
    once per side, in row order: each side is its prompt's images, prompt and reply, as the
    processor renders it alone. The images are stored once per pair (under its chosen document).
    With variable patches (Qwen2-VL) each image's grid is repeated with it. The family's
    ``get_rope_index`` over the packed row numbers the rejected side's multimodal positions on from
    the chosen side's; the wrapper takes that constant off (models/hf/vision.py rope_positions), so
    each side has its positions alone, and the masks follow the 1-D positions, which restart.

    A pair is never cut (its sides would lose image tokens): a longer one is refused. ``labels``:
    an unpaired (KTO) corpus, each row its example and its KL row (data/preference.py), which take
    the row's images the same way: the prompt's, once per side."""

    def __init__(
        self,
        corpus,
        pixels,
        image_counts: np.ndarray,
        *,
        shape,
        block_size: int,
        pad_to: int,
        grids=None,
        labels: bool = False,
    ):
        longest = int(corpus.doc_lengths.reshape(-1, 2).sum(1).max()) if len(corpus.doc_lengths) else 0
        if isinstance(block_size, int) and longest > block_size:
            raise ConfigError(
                f"data.args.block_size = {block_size} is shorter than the longest image-text pair ({longest} tokens,"
                f" both sides), which cannot be cut through its images; raise data.args.block_size to {longest}"
            )
        super().__init__(corpus, block_size=block_size, pad_to=pad_to, labels=labels)
        self.pixels, self.shape = pixels, tuple(shape or ())
        counts = image_counts.astype(np.int64)
        self.image_counts, self.image_starts = counts, np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        self.grids = None if grids is None else np.asarray(grids, np.int64).reshape(-1, 3)
        # Where each image's values start, in units of ``shape`` (ImageConversations'): patches with grids.
        sizes = np.ones(int(counts.sum()), np.int64) if self.grids is None else self.grids.prod(-1)
        self.unit_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    def __getitem__(self, i: int):
        inputs, target = super().__getitem__(i)
        d = 2 * int(self.pairs[int(i)])  # the chosen document holds the pair's images
        start, n = int(self.image_starts[d]), int(self.image_counts[d])
        a, b = int(self.unit_starts[start]), int(self.unit_starts[start + n])
        per = int(np.prod(self.shape)) if self.shape else 0
        pixels = self.pixels.read(a * per, b * per).reshape(b - a, *self.shape)
        grid = None if self.grids is None else self.grids[start : start + n]
        return inputs, target, (pixels, n, grid)

    def null_sample(self):
        """A row with no pair and no image (a validation set's last batch is filled with these)."""
        inputs, target, _ = self[0]
        inputs, target = torch.zeros_like(inputs), torch.full_like(target, IGNORE_INDEX)
        inputs[1] = -1  # every position padding
        empty = None if self.grids is None else np.zeros((0, 3), np.int64)
        return inputs, target, (np.zeros((0, *self.shape), np.float32), 0, empty)

    def collate(self, samples: list):
        """The text pairs' collate (data/preference.py), then an :class:`ImageTextBatch` whose
        pixel values (and grids) hold each row's images twice, the chosen side's then the rejected side's."""
        inputs, target = super().collate([(x, t) for x, t, _ in samples])
        twice = [(r, images) for r, (_, _, images) in enumerate(samples) for _ in range(2)]
        pv = [p for _, (p, _, _) in twice]
        pv = np.concatenate(pv) if pv else np.zeros((0, *self.shape), np.float32)
        owner = [r for r, (_, n, _) in twice for _ in range(n)]
        grid = None
        if self.grids is not None:
            grid = torch.from_numpy(np.concatenate([g for _, (_, _, g) in twice] or [np.zeros((0, 3), np.int64)]))
        batch = ImageTextBatch(
            inputs[:, 0].contiguous(),
            inputs[:, 1].contiguous(),
            torch.from_numpy(np.ascontiguousarray(pv, dtype=np.float32)),
            torch.tensor(owner, dtype=torch.int64),
            grid,
        )
        return batch, target
