"""Prompts for reinforcement learning with generation (``data.name = 'prompts'``, docs/grpo.md).

Rows of TRL's prompt-only formats, in ``.jsonl`` or ``.parquet``: ``prompt`` is a string (plain)
or a list of messages (conversational, rendered by the tokenizer's chat template with the
generation prompt added); every other field of the row (an ``answer``, a ``solution``...) is
handed to the reward functions, as TRL hands them. A prompt set is small (thousands of rows), so
it is read and tokenised when the run starts, on every rank alike, not prepared into shards.

``tokenizer``: a transformers tokenizer directory (by default ``model.hf``'s, set by the build);
``""`` with the built-in GPT on bytes: a prompt's ids are its UTF-8 bytes. Plain prompts are
tokenised without special tokens, as TRL's GRPOTrainer does.

A sample is ``(ids, target)``: the prompt's ids right-padded with 0 to ``max_prompt_length``, and
``[row index, prompt length]``, from which the generation phase (paratrain/objectives/rl/rollout.py) finds the
row's fields.

**Image-text prompts** (TRL's vision format, docs/vision-language.md): a conversational prompt whose
messages hold ``{"type": "image"}`` parts, with an ``images`` column (paths relative to the file,
or bytes in parquet), read with an image-text model's processor (the tokenizer directory must hold
it): the processor renders the prompt, expands its image tokens and makes the pixel values, once,
when the set is read, as prepare does for a chat corpus (data/images.py). :meth:`images_of` gives a
row's pixel values (and ``image_grid_thw`` for variable patches), which the sampler and the
training rows carry with the row; a missing image is one line naming the row.
"""

from __future__ import annotations

import itertools
import json
import os

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from paratrain.config import ConfigError
from paratrain.data.chat import _tokenizer_class
from paratrain.data.image_rows import ImageTextBatch
from paratrain.data.images import is_image_row, load_processor, prompt_images
from paratrain.data.prepare import IMAGE_SCAN_ROWS, expand_inputs, iter_rows


class PromptSet(Dataset):
    prompts_of_rows = True  # the trainer's check: this is a prompt set, for loss.name = 'grpo'

    def __init__(self, path, *, tokenizer: str = "", max_prompt_length: int = 128):
        files = expand_inputs([path] if isinstance(path, str) else list(path))
        self.rows, self.ids, self.images = [], [], []
        # An image-text prompt set (told by its first rows) is read with the model's processor.
        scan = (row for _, row in itertools.islice(iter_rows(files), IMAGE_SCAN_ROWS))
        self.processor = _processor(tokenizer) if tokenizer and any(map(is_image_row, scan)) else None
        self.tokenizer = (
            self.processor.tokenizer if self.processor else load_tokenizer(tokenizer) if tokenizer else None
        )
        for where, row in iter_rows(files):
            if "prompt" not in row:
                raise ConfigError(f"{where}: a prompt row needs a 'prompt' field (a string or a list of messages)")
            if self.processor is not None:
                ids, images = prompt_images(self.processor, row, where)
                self.images.append(images)
            else:
                ids = self.encode(row["prompt"], where)
            if not ids:
                raise ConfigError(f"{where}: the prompt is empty; remove the row")
            if len(ids) > max_prompt_length:
                raise ConfigError(
                    f"{where}: the prompt has {len(ids)} tokens, more than data.args.max_prompt_length ="
                    f" {max_prompt_length}; raise it or shorten the prompt"
                )
            self.rows.append(row)
            self.ids.append(ids)
        if not self.rows:
            raise ConfigError(f"data.args.path = {path!r} holds no prompt rows")
        self.max_prompt_length = max_prompt_length
        self.description = {"prompts": len(self.rows), "max_prompt_tokens": max(map(len, self.ids))}

    def encode(self, prompt, where: str) -> list[int]:
        if self.tokenizer is None:
            if not isinstance(prompt, str):
                raise ConfigError(
                    f"{where}: a conversational prompt needs a tokenizer with a chat template; set data.args.tokenizer"
                )
            return list(prompt.encode("utf-8"))
        if isinstance(prompt, list):
            if not self.tokenizer.chat_template:
                raise ConfigError(f"{where}: the prompt is a conversation but the tokenizer has no chat template")
            out = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            return list(out["input_ids"] if hasattr(out, "keys") else out)
        if not isinstance(prompt, str):
            raise ConfigError(f"{where}: 'prompt' must be a string or a list of messages, not {type(prompt).__name__}")
        return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def images_of(self, i: int):
        """Row ``i``'s ``(pixel values, image_grid_thw or None)`` (numpy; no image: 0 rows), or
        None for a text prompt set."""
        return self.images[i] if self.processor is not None else None

    def image_batch(self, ids: torch.Tensor, positions: torch.Tensor, rows) -> ImageTextBatch | None:
        """Prompt-set rows ``rows`` (one per row of ``ids``, repeats allowed: a group's completions)
        as the image-text model takes them: ``ids`` and ``positions`` (-1 on padding) with each
        row's images in row order (data/image_rows.py), on ``ids``' device; None for a text set."""
        if self.processor is None:
            return None
        images = [(r, self.images[int(i)]) for r, i in enumerate(rows) if self.images[int(i)][0] is not None]
        device = ids.device
        if not images:  # text prompts only: no pixel values, no grids
            shape = next((im[0].shape[1:] for im in self.images if im[0] is not None), ())
            pixels, owner, grid = torch.zeros(0, *shape), torch.zeros(0, dtype=torch.long), None
            if any(im[1] is not None for im in self.images):
                grid = torch.zeros(0, 3, dtype=torch.long)
        else:
            pixels = torch.from_numpy(np.concatenate([im[0] for _, im in images]))
            counts = [len(im[1]) if im[1] is not None else len(im[0]) for _, im in images]
            owner = torch.tensor([r for (r, _), n in zip(images, counts, strict=True) for _ in range(n)])
            grid = None if images[0][1][1] is None else torch.from_numpy(np.concatenate([im[1] for _, im in images]))
        return ImageTextBatch(
            ids, positions, pixels.to(device), owner.to(device), None if grid is None else grid.to(device)
        )

    def collate(self, samples: list):
        """torch's default collate; an image-text set's prompts as an :class:`ImageTextBatch` with
        their images (the model's input, e.g. for the forward that finds a model's random draws)."""
        ids, meta = default_collate(samples)
        if self.processor is None:
            return ids, meta
        at = torch.arange(ids.shape[1]).expand(len(ids), -1)
        return self.image_batch(ids, torch.where(at < meta[:, 1:], at, -1), meta[:, 0]), meta

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def eos_id(self) -> int | None:
        if self.tokenizer is None:
            return 10  # bytes: a completion is a line
        return self.tokenizer.eos_token_id

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        ids = self.ids[i]
        x = torch.zeros(self.max_prompt_length, dtype=torch.long)
        x[: len(ids)] = torch.tensor(ids, dtype=torch.long)
        return x, torch.tensor([i, len(ids)], dtype=torch.long)


def _processor(path: str):
    """The image-text model's processor of ``data.args.tokenizer`` (data/images.py names prepare's flag)."""
    try:
        return load_processor(path)
    except ConfigError as e:
        raise ConfigError(str(e).replace("--tokenizer ", "data.args.tokenizer = ", 1)) from None


def load_tokenizer(path: str):
    if not os.path.isdir(path):
        raise ConfigError(f"data.args.tokenizer = {path!r} is not a directory; give a transformers tokenizer directory")
    try:
        return _tokenizer_class(path).from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise ConfigError(f"data.args.tokenizer = {path!r}: transformers cannot load it ({first})") from None


def build_prompts(path, tokenizer: str = "", max_prompt_length: int = 128) -> PromptSet:
    return PromptSet(path, tokenizer=tokenizer, max_prompt_length=max_prompt_length)
