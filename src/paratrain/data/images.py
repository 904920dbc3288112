"""Image-text conversations (TRL's vision format) for ``prepare --format chat`` and training.

A row holds ``messages`` whose ``content`` may be a list of parts, ``{"type": "text", "text":
...}`` or ``{"type": "image"}``, and ``images``: one entry per image part, in order, each a path
relative to the data file (or, in parquet, ``{"bytes": ...}`` / ``{"path": ...}`` as datasets
writes images). The model's own processor (``AutoProcessor`` of ``--tokenizer DIR``: its chat
template, tokenizer and image processor) renders and processes it:

- the conversation is rendered by the processor's chat template and its targets found as for a
  text conversation (data/chat.py, on the unexpanded text: one image token per image);
- the processor then expands each image token into the image's tokens and makes the pixel values;
  our ids, each image token repeated as many times as the processor did, must equal the
  processor's own ids (else the row is refused, one line): the expansion is the processor's;
- image tokens are never targets (TRL's ``DataCollatorForVisionLanguageModeling`` masks them too).

The processed pixel values are stored beside the token shards (``{split}-pixels-*.bin``, float32,
and ``{split}-images-*.bin``, uint32, the image count of each document), so a resume, another world
size or the validation set reads the same numbers without running the image processor again.
A family with variable patches (Qwen2-VL: ``pixel_values`` are (patches, D) rows, their number set
by each image's size) also stores each image's ``image_grid_thw`` (``{split}-grids-*.bin``, uint32,
3 per image), from which a row's patch count and its image tokens follow.

Training reads them through data/image_rows.py. This module stays torch-free, as prepare is.
"""

from __future__ import annotations

import io
import os

import numpy as np

from paratrain.config import ConfigError
from paratrain.data.chat import (
    encode_conversation,
    read_chat_template,
    row_key,
    row_messages,
    split_pair,
    split_unpaired,
)

HF_PROCESSOR_DIR = "hf_processor"  # the model's processor, saved beside the shards


def is_image_row(row: dict) -> bool:
    """A row in TRL's vision format: an ``images`` field, or a message whose content is a list of parts."""
    messages = row.get("messages", row.get("conversations", row.get("prompt")))  # prompt: a preference row
    return "images" in row or (
        isinstance(messages, list) and any(isinstance(m, dict) and isinstance(m.get("content"), list) for m in messages)
    )


def load_processor(path: str, chat_template: str = ""):
    """The transformers processor of a model directory (chat template + tokenizer + image processor)."""
    if not os.path.isdir(path):
        raise ConfigError(
            f"--tokenizer {path!r}: image rows need the model's directory with its processor (processor_config.json)"
        )
    try:
        from transformers import AutoProcessor  # an optional extra: paratrain[hf]
    except ImportError:
        raise ConfigError("image rows need transformers, which is not installed: pip install 'paratrain[hf]'")
    try:
        processor = (_image_only(path) or AutoProcessor).from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise ConfigError(f"--tokenizer {path!r}: transformers cannot load its processor ({first})") from None
    if getattr(processor, "image_processor", None) is None or getattr(processor, "image_token", None) is None:
        raise ConfigError(
            f"--tokenizer {path!r} has no image processor (an image-text-to-text model's processor); give the"
            " vision-language model's directory"
        )
    if chat_template:
        processor.chat_template = read_chat_template(chat_template)
    if not processor.chat_template:
        raise ConfigError(f"--tokenizer {path!r}: its processor has no chat_template; pass --chat-template FILE")
    # The text path (data/chat.py) renders through the tokenizer: it takes the processor's template.
    processor.tokenizer.chat_template = processor.chat_template
    return processor


# transformers' Qwen2-VL processors load a video processor, which needs torchvision (whose wheels
# here do not import against the CPU torch); paratrain reads no video, so it loads them without it.
_IMAGE_ONLY = ("Qwen2VLProcessor", "Qwen2_5_VLProcessor")


def _image_only(path: str):
    """The family's processor class without its video processor, for a directory whose
    processor_config.json (or, in older checkpoints, preprocessor_config.json) names one of
    _IMAGE_ONLY; None for any other (AutoProcessor loads it)."""
    import json

    names = []
    for file in ("processor_config.json", "preprocessor_config.json"):
        try:
            with open(os.path.join(path, file)) as f:
                names.append(json.load(f).get("processor_class"))
        except (OSError, ValueError, AttributeError):
            pass
    name = next((n for n in names if n in _IMAGE_ONLY), None)
    if name is None:
        return None
    import transformers

    family = getattr(transformers, name)

    # ProcessorMixin takes its sub-processors from __init__'s signature: no video_processor. The
    # family's name: save_pretrained (prepare's hf_processor/) writes it as the processor_class.
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        family.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return type(name, (family,), {"__init__": __init__})


def image_token_id(processor) -> int:
    return int(processor.tokenizer.convert_tokens_to_ids(processor.image_token))


def _data_file(where: str) -> str:
    """The file of a row's ``where`` (prepare.iter_rows: ``path:line`` or ``path row n``)."""
    return where.rsplit(" row ", 1)[0] if " row " in where else where.rsplit(":", 1)[0]


def open_images(row: dict, where: str, n_parts: int) -> list:
    """The row's images as RGB PIL images, one per image part; a missing or unreadable one is one line."""
    from PIL import Image

    entries = row.get("images") or []
    if not isinstance(entries, list) or len(entries) != n_parts:
        raise ConfigError(
            f"{where}: {n_parts} image part(s) in the messages but 'images' holds"
            f" {len(entries) if isinstance(entries, list) else repr(entries)}; give one image per {{'type': 'image'}}"
        )
    out = []
    for entry in entries:
        data = entry.get("bytes") if isinstance(entry, dict) else None
        path = entry.get("path") if isinstance(entry, dict) else entry
        if data is None and not isinstance(path, str):
            raise ConfigError(f"{where}: an image must be a path or {{'bytes': ...}}, got {entry!r:.80}; fix the row")
        if data is None:
            path = path if os.path.isabs(path) else os.path.join(os.path.dirname(_data_file(where)), path)
        try:
            with Image.open(io.BytesIO(data) if data is not None else path) as img:
                out.append(img.convert("RGB"))
        except (OSError, ValueError) as e:  # PIL's UnidentifiedImageError is an OSError
            name = "its bytes" if data is not None else repr(path)
            raise ConfigError(
                f"{where}: image {name} is missing or unreadable ({type(e).__name__}); fix the path (relative to the"
                " data file) or drop the row"
            ) from None
    return out


def _image_parts(messages: list[dict]) -> int:
    return sum(
        1
        for m in messages
        if isinstance(m.get("content"), list)
        for p in m["content"]
        if isinstance(p, dict) and p.get("type") == "image"
    )


def _check_parts(messages: list[dict], where: str) -> None:
    for m in messages:
        content = m.get("content")
        parts = content if isinstance(content, list) else []
        if not isinstance(content, (str, list)) or any(
            not isinstance(p, dict) or p.get("type") not in ("text", "image") for p in parts
        ):
            raise ConfigError(
                f"{where}: a message's content must be a string or a list of {{'type': 'text'|'image'}} parts; fix the row"
            )


def expand_like_processor(ids: np.ndarray, mask: np.ndarray, expanded: np.ndarray, image_id: int, where: str):
    """Our (ids, mask) with each image token repeated as the processor expanded it: one run of
    image tokens in ``expanded`` (the processor's ids) per image when the runs are apart (Qwen2-VL
    writes vision markers around each: its images make different numbers of tokens), else the runs
    split evenly over our image tokens (a fixed number per image, as LLaVA's, whose images may sit
    side by side). The result must equal ``expanded``; image tokens get mask 0."""
    ours = int((ids == image_id).sum())
    total = int((expanded == image_id).sum())
    repeat = np.ones(len(ids), dtype=np.int64)
    is_image = np.concatenate([[0], (expanded == image_id).astype(np.int8), [0]])
    starts, ends = np.flatnonzero(np.diff(is_image) == 1), np.flatnonzero(np.diff(is_image) == -1)
    if ours and len(starts) == ours:
        repeat[ids == image_id] = ends - starts
    elif ours:
        if total % ours:
            raise ConfigError(
                f"{where}: the processor made {total} image tokens for {ours} images, not the same number per"
                " image; this model family is not supported yet (docs/vision-language.md)"
            )
        repeat[ids == image_id] = total // ours
    out_ids, out_mask = np.repeat(ids, repeat), np.repeat(mask, repeat)
    if not np.array_equal(out_ids, expanded):
        raise ConfigError(
            f"{where}: the processor's tokens differ from the chat template's rendering beyond the image tokens;"
            " check the processor's chat template"
        )
    out_mask[out_ids == image_id] = 0
    return out_ids, out_mask


_VISION: tuple | None = None  # (processor, loss_on) of a prepare worker


def init_image_worker(processor_dir: str, loss_on: str) -> None:
    global _VISION
    _VISION = (load_processor(processor_dir), loss_on)


def encode_image_rows(
    rows: list[tuple[str, dict]],
    *,
    dtype: str,
    max_length: int,
    splits: tuple,
    split_of,
    skip_reason,
    pairs: bool = False,
    unpaired: bool = False,
    prompts: bool = False,
) -> dict:
    """prepare.encode_rows for image rows: tokens, masks, lengths per split (``split_of(row key)``
    picks it), plus ``pixels`` (float32, flat) and ``image_counts`` (per document). A row cut by ``max_length`` inside its image tokens
    is skipped and counted: a partial image cannot be fed to the vision tower.

    ``pairs``: TRL's vision preference rows (``prepare --format preference``): each row two
    documents, chosen then rejected (data/preference.py), each rendered and expanded by the
    processor with the row's images; the images are stored once, under the chosen document
    (its count n, the rejected one's 0), and data/image_rows.py gives both sides the same pixels.

    ``unpaired``: TRL's vision KTO rows (``prepare --format unpaired``) the same way, as the text
    path writes them (prepare.encode_unpaired_rows): the prompt with its completion (mask 1
    desirable, 2 undesirable), then the prompt with the next row's completion (mask 3: KTO's KL
    row), both with the prompt's images, which are the row's: the KL row asks how likely another
    row's answer is about this row's images, as TRL's KL pass does with each prompt's own pixels.

    ``prompts``: TRL's prompt-completion rows (``prepare --format prompt``) whose prompt holds the
    images: one document, prompt then completion, its targets the completion's assistant turns."""
    processor, loss_on = _VISION
    pairs = pairs or unpaired
    # a pair's or a prompt row's targets: its reply's assistant turns (data/chat.py)
    loss_on = "assistant" if pairs or prompts else loss_on
    tok, image_id = processor.tokenizer, image_token_id(processor)
    out, masks, lengths, pixels, counts, grids = ({s: [] for s in splits} for _ in range(6))
    skipped = truncated = text_bytes = 0
    reasons: dict[str, int] = {}
    shape = None
    marks = _unpaired_sides(rows) if unpaired else None  # each row's (sides, images, the sides' marks)
    for i, (where, row) in enumerate(rows):
        if marks is not None:
            sides, images, mark = marks[i]
        else:
            side = _pair_sides if pairs else _prompt_side if prompts else _conversation_side
            sides, images = side(row, where)
            mark = (1,) * len(sides)
        docs = []
        for (messages, first), m in zip(sides, mark):
            ids, mask = encode_conversation(tok, messages, first, loss_on=loss_on, where=where)
            text = tok.apply_chat_template(messages, tokenize=False)
            enc = processor(text=[text], images=images or None, return_tensors="np")
            ids, mask = expand_like_processor(ids, mask, np.asarray(enc["input_ids"][0]), image_id, where)
            docs.append((ids, mask * np.uint8(m)))
        # The sides hold the same images: their pixel values are the same numbers (the last side's).
        pv = np.zeros((0,), np.float32) if not images else np.asarray(enc["pixel_values"], dtype=np.float32)
        grid = enc.get("image_grid_thw") if images else None  # variable patches (Qwen2-VL): (images, 3)
        if images:
            if shape is None:
                shape = list(pv.shape[1:])
            if list(pv.shape[1:]) != shape:
                raise ConfigError(
                    f"{where}: images of {list(pv.shape[1:])} pixel values, not {shape}; one size per corpus"
                )
        key = row_key(row)
        text_bytes += len(key.encode("utf-8", errors="replace"))
        cut = bool(max_length) and any(len(ids) > max_length for ids, _ in docs)
        if cut:
            truncated += 1
            if any((ids[max_length:] == image_id).any() for ids, _ in docs):
                skipped += 1
                reason = "cut by --max-length inside its image tokens"
                reasons[reason] = reasons.get(reason, 0) + 1
                continue
            docs = [(ids[:max_length], mask[:max_length]) for ids, mask in docs]
        if not all(mask[1:].any() for _, mask in docs):
            skipped += 1
            reason = (
                "a reply without a target token (empty, or cut by --max-length)"
                if pairs
                else skip_reason(sides[0][0], cut=cut)
            )
            reasons[reason] = reasons.get(reason, 0) + 1
            continue
        split = split_of(key)
        for d, (ids, mask) in enumerate(docs):
            out[split].append(ids.astype(dtype))
            masks[split].append(mask)
            lengths[split].append(len(ids))
            counts[split].append(len(images) if d == 0 else 0)
        pixels[split].append(pv.reshape(-1))
        if grid is not None:
            grids[split].append(np.asarray(grid, dtype=np.uint32).reshape(-1))
    cat = {s: np.concatenate(v) if v else np.empty(0, dtype) for s, v in out.items()}
    return {
        "tokens": cat,
        "masks": {s: np.concatenate(v) if v else np.empty(0, np.uint8) for s, v in masks.items()},
        "lengths": lengths,
        "pixels": {s: np.concatenate(v) if v else np.empty(0, np.float32) for s, v in pixels.items()},
        "image_counts": counts,
        "grids": {s: np.concatenate(v) if v else np.empty(0, np.uint32) for s, v in grids.items()},
        "image_shape": shape,
        "skipped": skipped,
        "skipped_by_reason": reasons,
        "truncated": truncated,
        "text_bytes": text_bytes,
    }


def _conversation_side(row: dict, where: str) -> tuple[list, list]:
    """A chat row's one document ``[(messages, first target message)]`` and its images."""
    raw = row.get("messages", row.get("conversations"))
    if isinstance(raw, list):
        _check_parts([m for m in raw if isinstance(m, dict)], where)
    messages, first = _vision_messages(row, where)
    return [(messages, first)], open_images(row, where, _image_parts(messages))


def _prompt_side(row: dict, where: str) -> tuple[list, list]:
    """A vision prompt-completion row's one document ``[(prompt + completion, len(prompt))]`` and
    its images, which the prompt shows (strings are a user's and an assistant's message)."""
    prompt, completion = row.get("prompt"), row.get("completion")
    if prompt is None or completion is None:
        raise ConfigError(f"{where}: a prompt row needs the fields 'prompt' and 'completion'; fix the row")
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    completion = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else completion
    if not isinstance(prompt, list) or not isinstance(completion, list) or not prompt or not completion:
        raise ConfigError(f"{where}: 'prompt' and 'completion' must be strings or lists of messages; fix the row")
    _parts_checked(prompt + completion, where)
    if _image_parts(completion):
        raise ConfigError(f"{where}: image parts in 'completion'; the images belong to the prompt")
    return [(prompt + completion, len(prompt))], open_images(row, where, _image_parts(prompt))


def _pair_sides(row: dict, where: str) -> tuple[list, list]:
    """A vision preference row's two documents ``[(prompt + chosen, len(prompt)), (prompt +
    rejected, ...)]`` and its images, which the prompt shows (TRL's vision DPO rows: a
    conversational ``prompt`` whose parts hold the images, replies as messages or strings)."""
    prompt = row.get("prompt") if isinstance(row, dict) else None
    if isinstance(prompt, list):  # replies given as strings answer a conversational prompt
        row = {
            **row,
            **{
                k: [{"role": "assistant", "content": row[k]}]
                for k in ("chosen", "rejected")
                if isinstance(row.get(k), str)
            },
        }
    prompt, chosen, rejected = split_pair(row, where, checked=_parts_checked)
    if isinstance(prompt, str):
        raise ConfigError(
            f"{where}: a pair of plain strings in an image-text corpus; give 'prompt' as messages whose content"
            " lists the {'type': 'image'} parts"
        )
    if _image_parts(chosen) or _image_parts(rejected):
        raise ConfigError(f"{where}: image parts in 'chosen' or 'rejected'; the images belong to the prompt")
    sides = [(prompt + chosen, len(prompt)), (prompt + rejected, len(prompt))]
    return sides, open_images(row, where, _image_parts(prompt))


def _unpaired_sides(rows: list[tuple[str, dict]]) -> list[tuple[list, list, tuple[int, int]]]:
    """Each vision KTO row's two documents ``[(prompt + completion, len(prompt)), (prompt + the
    next row's completion, ...)]`` (the chunk's last row takes its first row's, as
    prepare.encode_unpaired_rows), its images (the prompt's) and the documents' marks."""
    parsed = [split_unpaired(row, where, checked=_parts_checked) for where, row in rows]
    out = []
    for i, ((where, row), (prompt, completion, label)) in enumerate(zip(rows, parsed)):
        if isinstance(prompt, str):
            raise ConfigError(
                f"{where}: an unpaired row of plain strings in an image-text corpus; give 'prompt' as messages"
                " whose content lists the {'type': 'image'} parts"
            )
        if _image_parts(completion):
            raise ConfigError(f"{where}: image parts in 'completion'; the images belong to the prompt")
        other = parsed[(i + 1) % len(parsed)][1]
        other = [{"role": "assistant", "content": other}] if isinstance(other, str) else other
        sides = [(prompt + completion, len(prompt)), (prompt + other, len(prompt))]
        out.append((sides, open_images(row, where, _image_parts(prompt)), (1 if label else 2, 3)))
    return out


def _parts_checked(messages: list, where: str) -> list[dict]:
    """data/chat.py's check of a pair's messages, with content a string or a list of parts."""
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ConfigError(f"{where}: every message needs a string 'role' (got {m!r:.80}); fix the row")
    _check_parts(messages, where)
    return messages


def _vision_messages(row: dict, where: str) -> tuple[list[dict], int]:
    """data/chat.py row_messages for content that may be a list of parts (checked by _check_parts)."""
    messages = row.get("messages", row.get("conversations"))
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: no list field 'messages' of {{role, content}}; fix the row")
    if all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
        return row_messages(row, "chat", where)  # a text-only row of an image corpus: as the text path
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ConfigError(f"{where}: every message needs a string 'role' (got {m!r:.80}); fix the row")
    return messages, 0


def prompt_images(processor, row: dict, where: str) -> tuple[list[int], tuple]:
    """A GRPO prompt row of TRL's vision format (data/prompts.py): its ids as the processor renders
    (the generation prompt added) and expands them, and ``(pixel values, image_grid_thw or None)``
    of its images (float32 / int64 numpy; ``(None, None)`` for a row without one). No special
    tokens are added, as TRL's GRPOTrainer calls the processor (``add_special_tokens=False``)."""
    prompt = row["prompt"]
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not isinstance(prompt, list) or not prompt:
        raise ConfigError(f"{where}: 'prompt' must be a string or a non-empty list of messages; fix the row")
    _parts_checked(prompt, where)
    images = open_images(row, where, _image_parts(prompt))
    text = processor.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    enc = processor(text=[text], images=images or None, return_tensors="np", add_special_tokens=False)
    if not images:
        return [int(x) for x in enc["input_ids"][0]], (None, None)
    grid = enc.get("image_grid_thw")
    pixels = np.asarray(enc["pixel_values"], dtype=np.float32)
    return [int(x) for x in enc["input_ids"][0]], (pixels, None if grid is None else np.asarray(grid, np.int64))
