"""Preference pairs: rows of TRL's preference formats as two documents each, and the pairs as
rows of a packed batch (``paratrain prepare --format preference``; docs/preference.md). KTO's
unpaired rows (``--format unpaired``: ``prompt``, ``completion``, ``label``) the same way: the
example, and its prompt with the next row's completion (KTO's mismatched pair for its KL term).

A row holds ``chosen`` and ``rejected`` and, explicitly or not, the ``prompt`` they answer:

- conversational, explicit prompt: ``prompt`` a list of messages, ``chosen``/``rejected`` lists
  of the reply's messages (one assistant turn, most often);
- conversational, implicit prompt: ``chosen`` and ``rejected`` whole conversations; the prompt
  is their longest common run of leading messages;
- plain strings, explicit (``prompt``, ``chosen``, ``rejected``) or implicit (``chosen`` and
  ``rejected`` whole texts, the prompt their longest common leading text, ending before the
  space that separates it from the replies, as TRL's ``extract_prompt`` cuts it).

Conversations are rendered by the tokenizer's chat template, as SFT's prompt rows are
(data/chat.py): the targets are the reply's assistant tokens, never the prompt's. Plain strings
are not templated (TRL does not template them either): ``prompt ids + reply ids + EOS``, the
reply and its EOS the targets.

(The rows are read by data/chat.py's ``split_pair`` and ``split_unpaired``, torch-free like the rest
of ``prepare``.) Each pair is written as two consecutive documents of one split, chosen then rejected, with their
masks; both land in the split the whole row hashes to. A pair is one sample of the dataset
(:class:`PreferencePairs`): one packed row ``[chosen | rejected]`` with position ids that restart
at each document (so each attends to itself only), whatever the layout. Its target is ``(2, T)``:
the next-token targets, and which reply each position belongs to (0 chosen, 1 rejected, -1 none).
"""

from __future__ import annotations

import numpy as np
import torch

from paratrain.config import ConfigError

IGNORE_INDEX = -100
CHOSEN, REJECTED, NEITHER = 0, 1, -1


class PreferencePairs(torch.utils.data.Dataset):
    """The pairs of one split of a ``preference`` corpus (documents ``2i``, ``2i + 1``), each one
    packed row of ``block_size`` tokens ``[chosen | rejected | padding]``.

    A pair longer than ``block_size`` has each side cut to ``block_size // 2`` tokens (counted:
    ``truncated``); a pair with a side left without a target is dropped (``dropped``). Whole
    pairs only, so a pair is never split across micro-batches or ranks."""

    draws_random = False  # paratrain/randomness.py: no sample_rng around __getitem__

    def __init__(self, corpus, *, block_size: int, labels: bool = False, pad_to: int = 8):
        if not isinstance(block_size, int) or block_size < 4:
            raise ConfigError(f"data.args.block_size = {block_size!r} must be an integer >= 4 for preference pairs")
        if not isinstance(pad_to, int) or isinstance(pad_to, bool) or pad_to < 0:
            raise ConfigError(f"data.args.pad_to = {pad_to!r} must be an integer >= 0 (0: every row block_size wide)")
        self.pad_to = pad_to
        # labels: an unpaired corpus (KTO): side 0 is the example (its mask 1 desirable, 2
        # undesirable), side 1 its prompt with another row's completion; the target gets a third
        # row, the label (1 desirable, 0 undesirable).
        self.corpus, self.block_size, self.labels = corpus, block_size, labels
        lengths = corpus.doc_lengths
        if len(lengths) % 2:
            raise ConfigError("the preference corpus has an odd number of documents; prepare it again")
        pairs = lengths.reshape(-1, 2)
        cut = pairs.sum(1) > block_size
        self.truncated = int(cut.sum())
        self.lengths = np.where(cut[:, None], np.minimum(pairs, block_size // 2), pairs)
        # prepare keeps only pairs whose sides both have a target; a cut pair may have lost one.
        lost = [i for i in np.flatnonzero(cut) if not all((self._targets(i, s)[1] >= 0).any() for s in (0, 1))]
        keep = np.setdiff1d(np.arange(len(pairs)), np.asarray(lost, dtype=np.int64))
        self.dropped = len(lost)
        self.pairs = keep.astype(np.int64)

    def __len__(self) -> int:
        return len(self.pairs)

    def _targets(self, pair: int, side: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, next-token targets) of one side, cut to its length."""
        n = int(self.lengths[pair, side])
        ids, mask = self.corpus.document(2 * pair + side, n)
        targets = np.full(n, IGNORE_INDEX, dtype=np.int64)
        targets[:-1] = np.where(mask[1:] > 0, ids[1:], IGNORE_INDEX)
        return ids, targets

    def __getitem__(self, i: int):
        pair = int(self.pairs[int(i)])
        width = self.block_size
        ids = np.zeros(width, np.int64)
        pos = np.full(width, -1, np.int64)
        tgt = np.full(width, IGNORE_INDEX, np.int64)
        side = np.full(width, NEITHER, np.int64)
        at = 0
        for s in (CHOSEN, REJECTED):
            d_ids, d_tgt = self._targets(pair, s)
            n = len(d_ids)
            ids[at : at + n], tgt[at : at + n], pos[at : at + n] = d_ids, d_tgt, np.arange(n)
            side[at : at + n] = s
            at += n
        rows = [tgt, side]
        if self.labels:
            _, mask = self.corpus.document(2 * pair, int(self.lengths[pair, CHOSEN]))
            rows.append(np.full(width, int(mask.max() == 1), np.int64))
        return torch.from_numpy(np.stack([ids, pos])), torch.from_numpy(np.stack(rows))

    def null_sample(self):
        """A row with no pair: every position padding, no target (a validation set's last batch is
        filled up with these, data/datasets.py FilledUp). Not pair 0 with its targets off, the
        generic filler: the reference store keys a row by its tokens and width
        (objectives/reference_store.py), so such a copy took pair 0's key, and whichever of the two
        was stored last served both (a validation loss of 0.885 for 0.684 at micro-batch 2)."""
        inputs, target = self[0]
        inputs, target = torch.zeros_like(inputs), torch.full_like(target, IGNORE_INDEX)
        inputs[1], target[1] = -1, NEITHER
        if self.labels:
            target[2] = 0
        return inputs, target

    def collate(self, samples: list):
        """Stack the pairs and cut the padding every row of the micro-batch has: the rows end at the
        micro-batch's longest pair, rounded up to a multiple of ``pad_to`` (0: ``block_size`` wide).

        TRL pads a micro-batch to its longest reply the same way; rows of ``block_size`` cost the
        step the padding (1.3x the positions in benchmarks/peers/vs_trl_dpo.py). A pair's numbers do not
        depend on the cut but by rounding: each side attends to itself only (its positions
        restart), and the cut columns are padding (position -1, no target); the kernels' order of
        sums may change with the width, so the reference store keys a row by it too
        (objectives/reference_store.py). ``pad_to`` is a multiple of tp with sequence
        parallel (the sequence is split over the tp ranks); 0 keeps one shape for train.compile."""
        inputs, target = torch.utils.data.default_collate(samples)
        if self.pad_to:
            longest = max(1, int((inputs[:, 1] >= 0).sum(1).max()))  # a row's pair: its leading columns
            width = min(self.block_size, -(-longest // self.pad_to) * self.pad_to)
            inputs, target = inputs[..., :width].contiguous(), target[..., :width].contiguous()
        return inputs, target
