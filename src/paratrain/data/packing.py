"""Whole documents packed into rows (``data.args.packing``), for fine-tuning on conversations.

A packed row is ``block_size`` input positions holding whole documents one after another (a
document longer than ``block_size`` is cut to it and counted). Best-fit decreasing: documents
sorted by length (longest first, ties by their order in the corpus), each into the open row with
the least room that still holds it, else a new row. The rows are a function of the corpus and
``block_size`` alone, never of the layout; the positional sampler (data/sampler.py) then draws
rows by ``(seed, step)`` as it draws any sample, so a "sample" of the global batch is a row.

A sample's input is one int64 tensor ``(2, block_size)``: the token ids and the **position ids**,
which restart at 0 at every document; padding has position -1. The model derives the attention
from the positions alone (:func:`document_mask`): a token attends to the tokens of its own
document at or before it, so packed documents never see each other, as if each ran alone.
Targets: the next token of the same document where the loss mask marks it, else
``IGNORE_INDEX`` (a document's last token has no target; padding has none), so the loss's item
count is the trainable tokens of the step whatever the packing.

``packing = "padded"``: the same rows (the same documents in every step), each document on a row
of its own, padded to the longest document of the micro-batch: plain causal attention, for
checking that packing changes nothing, and for attention paths without document masks.
"""

from __future__ import annotations

import numpy as np
import torch

PACKINGS = ("documents", "padded", "stream")
IGNORE_INDEX = -100  # loss.ignore_index must be this for packed corpora (preflight/__init__.py)


def pack_best_fit(lengths: np.ndarray, capacity: int) -> list[np.ndarray]:
    """Document indices of each row, best-fit decreasing; every length must be <= capacity."""
    order = np.lexsort((np.arange(len(lengths)), -lengths))  # longest first, ties by position
    rows: list[list[int]] = []
    # open rows by their free room: room -> row ids (the most recent last)
    by_room: dict[int, list[int]] = {}
    counts = np.zeros(capacity + 1, dtype=np.int64)  # open rows per free room
    for d in order.tolist():
        n = int(lengths[d])
        fits = np.flatnonzero(counts[n:])
        if len(fits):
            room = n + int(fits[0])
            r = by_room[room].pop()
            counts[room] -= 1
        else:
            room, r = capacity, len(rows)
            rows.append([])
        rows[r].append(d)
        left = room - n
        if left > 0:
            by_room.setdefault(left, []).append(r)
            counts[left] += 1
    return [np.asarray(sorted(r), dtype=np.int64) for r in rows]


def split_packed(inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(token ids (B, T), position ids (B, T) or None) of a model input: packed inputs are
    int tensors (B, 2, T); any other input has no positions of its own."""
    if (
        isinstance(inputs, torch.Tensor)
        and not inputs.is_floating_point()
        and inputs.dim() == 3
        and inputs.shape[1] == 2
    ):
        return inputs[:, 0], inputs[:, 1]
    return inputs, None


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """Boolean attention mask (B, 1, T, T) from position ids: query j sees key i when
    ``j - positions[j] <= i <= j`` (its own document, causally). A padding query (position -1)
    sees itself only, so no row of the mask is empty."""
    t = positions.shape[-1]
    j = torch.arange(t, device=positions.device)
    start = j - positions.clamp(min=0)  # (B, T): where each query's document starts
    i = j.view(1, 1, t)
    return ((i >= start.unsqueeze(-1)) & (i <= j.view(1, t, 1))).unsqueeze(1)


def document_block_mask(positions: torch.Tensor):
    """:func:`document_mask` as a FlexAttention ``BlockMask`` (torch.nn.attention.flex_attention):
    the same rule, evaluated per block, so blocks that the documents leave empty are skipped
    instead of computed and masked (the GPU path of ``model.args.attention = "flex"``)."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, t = positions.shape
    start = torch.arange(t, device=positions.device) - positions.clamp(min=0)

    def same_document_causal(batch, head, q, k):
        return (k >= start[batch, q]) & (k <= q)

    return create_block_mask(same_document_causal, b, None, t, t, device=positions.device)


def count_input_tokens(inputs) -> int | None:
    """Real (non-padding) tokens of packed inputs; None when ``inputs`` are not packed."""
    if hasattr(inputs, "count_tokens"):  # a typed batch that knows its padding (data/images.py ImageTextBatch)
        return inputs.count_tokens()
    _, positions = split_packed(inputs)
    return None if positions is None else int((positions >= 0).sum())


def attention_square(inputs) -> int | None:
    """The (query, key) pairs of packed inputs' attention, counted as MFU counts a sequence (the
    whole square, PaLM appendix B): the sum of the documents' squared lengths, which is the sum
    over real tokens of ``2 x position + 1``. None when ``inputs`` are not packed."""
    _, positions = split_packed(inputs)
    if positions is None:
        return None
    # A mask, not boolean indexing: the memory estimate runs this on fake tensors, which cannot
    # give indexing's data-dependent shape (DynamicOutputShapeException: 'auto' on packed rows).
    return int(((2 * positions + 1) * (positions >= 0)).sum())


class PackedRows(torch.utils.data.Dataset):
    """The rows of one split of a prepared corpus with document boundaries (format 2)."""

    draws_random = False  # paratrain/randomness.py: no sample_rng around __getitem__

    def __init__(self, corpus, *, block_size: int, packing: str = "documents"):
        self.corpus, self.block_size, self.packing = corpus, block_size, packing
        full = corpus.doc_lengths
        self.lengths = np.minimum(full, block_size)
        self.truncated = int((full > block_size).sum())
        # A document of one token has no target: it never enters a row.
        keep = np.flatnonzero(self.lengths >= 2)
        self.dropped = int(len(full) - len(keep))
        self.rows = [keep[r] for r in pack_best_fit(self.lengths[keep], block_size)]

    def __len__(self) -> int:
        return len(self.rows)

    def _document(self, d: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, targets) of document ``d`` cut to the block."""
        n = int(self.lengths[d])
        ids, mask = self.corpus.document(d, n)
        targets = np.full(n, IGNORE_INDEX, dtype=np.int64)
        targets[:-1] = np.where(mask[1:] > 0, ids[1:], IGNORE_INDEX)
        return ids, targets

    def __getitem__(self, i: int):
        docs = [self._document(int(d)) for d in self.rows[int(i)]]
        if self.packing == "padded":
            return PaddedGroup(docs)
        return _row(docs, self.block_size)

    def null_sample(self):
        """A sample with no target (a validation set's last batch is filled up with these)."""
        empty = [(np.zeros(1, np.int64), np.full(1, IGNORE_INDEX, np.int64))]
        return PaddedGroup(empty) if self.packing == "padded" else _row(empty, self.block_size, pad_only=True)

    def collate(self, samples: list):
        """Stack rows; in ``padded`` mode, one row per document, padded to the longest."""
        if self.packing != "padded":
            return torch.utils.data.default_collate(samples)
        docs = [doc for group in samples for doc in group.docs]
        width = max(len(ids) for ids, _ in docs)
        return _row_batch(docs, width)


class PaddedGroup:
    """The documents of one packed row, to be laid out one per row by ``PackedRows.collate``."""

    def __init__(self, docs: list[tuple[np.ndarray, np.ndarray]]):
        self.docs = docs


def _row(docs: list, width: int, *, pad_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    ids = np.zeros(width, np.int64)
    pos = np.full(width, -1, np.int64)
    tgt = np.full(width, IGNORE_INDEX, np.int64)
    at = 0
    for d_ids, d_tgt in [] if pad_only else docs:
        n = len(d_ids)
        ids[at : at + n], tgt[at : at + n], pos[at : at + n] = d_ids, d_tgt, np.arange(n)
        at += n
    return torch.from_numpy(np.stack([ids, pos])), torch.from_numpy(tgt)


def _row_batch(docs: list, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [_row([doc], width) for doc in docs]
    return torch.stack([x for x, _ in rows]), torch.stack([t for _, t in rows])
