"""Tiny random vision-language models saved with their processor (no network), and images drawn
with Pillow: the test data of docs/vision-language.md.

The model is transformers' ``LlavaForConditionalGeneration`` (a CLIP vision tower, its projector,
a Llama decoder) at 28x28 pixels with 14-pixel patches: 4 image tokens per image. Its processor
is transformers' ``LlavaProcessor`` with the byte-level ChatML tokenizer of testing/sft_data.py
plus the ``<image>`` token, and a ChatML template that writes ``<image>`` for an image part.

The second family is ``Qwen2VLForConditionalGeneration`` (save_tiny_qwen2vl): 14-pixel patches
merged 2x2, images resized by its own image processor to multiples of 28 pixels between 56x56
and 56x112, so an image makes 4 to 8 tokens by its shape (variable patches), and multimodal
rotary positions in its decoder.
"""

from __future__ import annotations

import os

import torch

from paratrain.testing.hf_models import COMMON, TINY  # the tiny causal LMs' shape
from paratrain.testing.sft_data import save_chat_tokenizer  # the byte-level ChatML tokenizer

IMAGE_TOKEN = "<image>"
# ChatML (testing/sft_data.py CHATML) whose content may also be TRL's list of parts: text as it
# is, an image part as the image token, which the processor expands.
VISION_CHATML = (
    "{%- macro content(c) %}{%- if c is string %}{{ c }}{%- else %}{%- for part in c %}"
    "{%- if part['type'] == 'image' %}{{ '<image>' }}{%- elif part['type'] == 'text' %}{{ part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}{%- endmacro %}"
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{ content(message['content']) + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{%- else %}{{ content(message['content']) + '<|im_end|>' + '\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
IMAGE_SIZE, PATCH = 28, 14
# Qwen2-VL's template writes an image part as its vision markers around one <|image_pad|>,
# which its processor repeats by the image's grid.
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
QWEN_CHATML = VISION_CHATML.replace("{{ '<image>' }}", "{{ '" + QWEN_IMAGE + "' }}")


def save_tiny_llava(path: str, *, seed: int = 0, weights: bool = True) -> str:
    """A tiny LLaVA (model and processor) in ``path``."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor, PreTrainedTokenizerFast
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil  # no torchvision here

    save_chat_tokenizer(path, template=VISION_CHATML)
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    # The text model is hf_models' tiny Llama with the image token added and room for the image's tokens.
    text = dict(COMMON, model_type="llama", vocab_size=len(tok), max_position_embeddings=512)
    vision = dict(TINY, model_type="clip_vision_model", image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=32)
    config = LlavaConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",  # the CLS token dropped: (28 / 14)^2 = 4 image tokens
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    if weights:
        model.save_pretrained(path)
    else:
        config.save_pretrained(path)
    size = {"shortest_edge": IMAGE_SIZE}
    images = CLIPImageProcessorPil(size=size, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tok,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=VISION_CHATML,
    )
    processor.save_pretrained(path)
    return path


def save_tiny_qwen2vl(path: str, *, seed: int = 0, version: str = "2") -> str:
    """A tiny Qwen2-VL (model and processor) in ``path``: hf_models' tiny decoder shape (head
    dim 8, M-RoPE sections 2+1+1 of its 4 frequencies), a 2-block vision tower, and
    Qwen2-VL's image processor (the Pil one: no torchvision here) bounded to 56x56..56x112.
    ``version="2.5"``: Qwen2.5-VL (a windowed vision tower, its second block full attention)."""
    import json

    import transformers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    family = {"2": "Qwen2VL", "2.5": "Qwen2_5_VL"}[version]

    save_chat_tokenizer(path, template=QWEN_CHATML)
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": QWEN_TOKENS})
    tok.save_pretrained(path)
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_TOKENS}
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    text = dict(COMMON, vocab_size=len(tok), max_position_embeddings=512, rope_parameters=rope)
    # initializer_range 0.2, not 0.02: attention far from uniform, so positions matter (at 0.02 the
    # loss without M-RoPE was 2.4e-7 relative from the loss with it, under any test's tolerance).
    text.update(bos_token_id=None, eos_token_id=tok.eos_token_id, initializer_range=0.2)
    vision = dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=PATCH)
    if version == "2.5":
        vision = dict(depth=2, hidden_size=32, out_hidden_size=32, intermediate_size=64, num_heads=4, patch_size=PATCH)
        vision.update(window_size=56, fullatt_block_indexes=[1])
    config = getattr(transformers, f"{family}Config")(
        text_config=text,
        vision_config=dict(vision, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    torch.manual_seed(seed)
    getattr(transformers, f"{family}ForConditionalGeneration")(config).save_pretrained(path)
    size = {"shortest_edge": 56 * 56, "longest_edge": 56 * 112}  # pixels: 4 to 8 image tokens
    Qwen2VLImageProcessorPil(size=size, patch_size=PATCH, merge_size=2, temporal_patch_size=2).save_pretrained(path)
    # Written by hand: transformers' Qwen2VLProcessor cannot be built here (its video processor
    # needs torchvision); these files are what its save_pretrained writes, so AutoProcessor loads
    # them where torchvision is installed, and data/images.py loads them without videos here.
    with open(os.path.join(path, "processor_config.json"), "w") as f:
        json.dump({"processor_class": f"{family}Processor"}, f)
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(QWEN_CHATML)
    return path


COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220), "yellow": (230, 210, 40)}


def draw_image(
    path: str, colour: str, *, shape: str = "square", size: int = 40, variant: int = 0, width: int = 0
) -> str:
    """A ``colour`` square or circle on white (``width`` x ``size`` pixels, square by default),
    saved as PNG; ``variant`` moves and sizes it."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (width or size, size), (255, 255, 255))
    side = size * 3 // 5 + variant % 7 * size // 20  # three fifths to most of the image: the colour fills its patches
    x, y = variant * 5 % (size - side + 1), variant * 11 % (size - side + 1)
    box = (x, y, x + side - 1, y + side - 1)
    draw = ImageDraw.Draw(img)
    (draw.ellipse if shape == "circle" else draw.rectangle)(box, fill=COLOURS[colour])
    img.save(path)
    return path


def colour_rows(folder: str, n: int, *, seed: int = 0, wide: bool = False) -> list[dict]:
    """``n`` TRL vision conversations about images drawn into ``folder/images`` (paths relative to
    ``folder``): what colour is the shape; every third row holds a second image, every fifth none
    (a text row), so rows differ in image count and length. ``wide``: every second row's first
    image and every second image is twice as wide as high (Qwen2-VL makes more tokens of it)."""
    os.makedirs(os.path.join(folder, "images"), exist_ok=True)
    names, shapes = sorted(COLOURS), ("square", "circle")
    rows = []
    for i in range(n):
        colour, shape = names[(i + seed) % len(names)], shapes[(i // len(names)) % 2]
        rel = f"images/{i}.png"  # each row its own drawing: rows differ, so they split by their hash
        draw_image(os.path.join(folder, rel), colour, shape=shape, variant=i, width=80 * (wide and i % 2))
        if i % 5 == 4:  # a text-only row among the image rows
            rows.append({"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."}]})
            continue
        parts, images = [{"type": "image"}, {"type": "text", "text": f"What colour is the {shape}?"}], [rel]
        if i % 3 == 2:  # a second image, after the question
            other = f"images/{i}b.png"
            draw_image(os.path.join(folder, other), names[(i + 1) % len(names)], variant=i + 3, width=80 * wide)
            parts, images = [*parts, {"type": "image"}], [rel, other]
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": parts},
                    {"role": "assistant", "content": [{"type": "text", "text": f"It is {colour}."}]},
                ],
                "images": images,
            }
        )
    return rows


def write_example(out: str, *, rows: int = 160) -> None:
    """The committed example of docs/vision-language.md: ``out/model`` (a tiny LLaVA's config and
    processor, no weights), ``out/rows.jsonl`` and the PNGs it names, drawn here. Regenerate with
    ``python -m paratrain.testing.vlm_models configs/vlm``."""
    save_tiny_llava(os.path.join(out, "model"), weights=False)
    from paratrain.testing.sft_data import write_jsonl  # the same jsonl writer as the SFT example

    write_jsonl(os.path.join(out, "rows.jsonl"), colour_rows(out, rows))


def colour_accuracy(run: str, folder: str, *, val_fraction: float = 0.2) -> tuple[int, int]:
    """(right, asked) over the validation rows with images of ``folder/rows.jsonl`` (the split
    prepare gives them at ``val_fraction``): the exported model ``run/hf`` loaded by transformers'
    own classes answers greedily, and a reply is right when it starts "It is COLOUR"."""
    import json

    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from paratrain.data.chat import row_key  # the row's text that prepare's split hashes
    from paratrain.data.prepare import split_of  # the split prepare put the row in

    processor = AutoProcessor.from_pretrained(os.path.join(run, "hf"))
    model = AutoModelForImageTextToText.from_pretrained(os.path.join(run, "hf")).eval()
    right = asked = 0
    with open(os.path.join(folder, "rows.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    for row in rows:
        if split_of(row_key(row), val_fraction) != "val" or not row.get("images"):
            continue
        images = [Image.open(os.path.join(folder, p)).convert("RGB") for p in row["images"]]
        text = processor.apply_chat_template(row["messages"][:1], tokenize=False, add_generation_prompt=True)
        enc = processor(text=[text], images=images, return_tensors="pt")
        out = model.generate(**enc, max_new_tokens=12, do_sample=False)
        reply = processor.tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        colour = row["messages"][1]["content"][0]["text"].split()[-1].rstrip(".")
        right, asked = right + reply.startswith(f"It is {colour}"), asked + 1
    return right, asked


if __name__ == "__main__":
    import sys

    if sys.argv[1] == "accuracy":  # python -m paratrain.testing.vlm_models accuracy runs/vlm configs/vlm
        right, asked = colour_accuracy(sys.argv[2], sys.argv[3])
        print(f"val colour accuracy {right}/{asked}")
    else:
        write_example(sys.argv[1])
