"""The reference store's key of an image-text row holds its images (issue 57 item 4): rows of the
same tokens about other pixels, or the same pixels cut into other grids (Qwen2-VL), are other rows."""

import torch

from paratrain.data.image_rows import ImageTextBatch
from paratrain.objectives.reference_store import row_keys


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
