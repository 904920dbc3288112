"""The reference store's key of an image-text row holds its images (issue 57 item 4): rows of the
same tokens about other pixels, or the same pixels cut into other grids (Qwen2-VL), are other rows;
a validation set's filler row is no real pair's; a store of another reference says what differs."""

import numpy as np
import pytest
import torch

from paratrain.config import ConfigError
from paratrain.data.datasets import FilledUp
from paratrain.data.image_rows import ImageTextBatch
from paratrain.data.preference import IGNORE_INDEX, PreferencePairs
from paratrain.objectives.reference_store import ReferenceStore, row_keys


def test_an_image_rows_key_holds_its_pixels_and_grids():
    ids = torch.tensor([[5, 9, 9, 9, 9, 7, 0]] * 4)  # four rows of the same tokens, four image tokens each
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, -1]] * 4)
    pixels = torch.arange(4 * 4 * 6, dtype=torch.float32).reshape(16, 6)  # each image's 4 patch rows
    pixels[8:12] = pixels[0:4]  # row 2: row 0's pixels, in another grid
    pixels[12:16] = pixels[0:4]  # row 3: row 0's pixels and grid
    grid = torch.tensor([[1, 2, 2], [1, 2, 2], [1, 4, 1], [1, 2, 2]])
    batch = ImageTextBatch(ids, positions, pixels, torch.arange(4), grid)
    keys = row_keys(batch)
    assert len(set(keys[:3])) == 3 and keys[3] == keys[0]
    assert row_keys(batch.select_rows(1, 3)) == keys[1:3]  # a row's key is its own, not its neighbours'
    assert keys[0] not in row_keys(torch.stack([ids, positions], 1))  # a text row of these tokens


class _Corpus:
    """Two pairs of documents (ids, mask): the reply tokens are the targets."""

    doc_lengths = np.array([5, 4, 6, 3])

    def document(self, d: int, n: int):
        ids = np.arange(n, dtype=np.int64) + 10 * d + 3
        return ids, (np.arange(n) >= 2).astype(np.int64)


def test_a_filled_up_validation_row_is_no_pairs_key():
    """The validation set's last batch is filled up with rows of no pair (data/datasets.py FilledUp).
    A copy of pair 0 with its targets off, as the generic filler made, had pair 0's key at the same
    width, and the store served one of the two values for both: DPO's precomputed val_loss was
    0.885 for 0.684 at micro-batch 2 (docs/preference.md)."""
    pairs = PreferencePairs(_Corpus(), block_size=16)
    filled = FilledUp(pairs, 4, IGNORE_INDEX)
    inputs, target = pairs.collate([filled[i] for i in range(4)])
    keys = row_keys(inputs)
    assert len(set(keys[:2])) == 2 and keys[2] not in keys[:2] and keys[2] == keys[3]
    assert (target[2:, 0] == IGNORE_INDEX).all()  # the filler has no target


def test_a_store_of_another_reference_names_what_differs_in_a_short_line(tmp_path):
    """The reference directory's files by name: their [name, size, mtime] lists made a 700-character line."""
    files = [["config.json", 646, 1], ["model.safetensors", 430944, 2]]
    ReferenceStore(str(tmp_path), {"model": "/m", "files": files}).save()
    changed = {"model": "/m", "files": [files[0], ["model.safetensors", 430944, 3], ["tokenizer.json", 9, 4]]}
    with pytest.raises(
        ConfigError, match=r"numbers \(files: model.safetensors changed, tokenizer.json added\); point"
    ) as e:
        ReferenceStore(str(tmp_path), changed)
    assert "430944" not in str(e.value)  # no sizes or times
