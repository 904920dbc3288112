"""The vision covering design (issue 57): the combination sweep of testing/sweep.py over the
features of image-text training, on a tiny LLaVA and a tiny Qwen2-VL (testing/vlm_models.py).

Every pair of (feature, level) of ``VISION_FEATURES`` is either held by a layout run against one
process under plain SGD (per-step loss within 1e-5, ``grad_norm`` within 1e-4) or refused by the
preflight in one line. The design is sweep.py's (the same greedy builder, runner and comparison,
given this table and ``configure``); the text design and its 4-block GPT are left as they are.

``python -m paratrain.testing.vision_sweep`` rebuilds tests/distributed/vision_sweep_design.json
from its seed and runs it; tests/distributed/test_vision_sweep.py checks the stored design (fast
tier) and runs it (slow tier).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from paratrain.config import plain_sgd
from paratrain.data.prepare import prepare
from paratrain.preflight.support import Feature
from paratrain.testing.sft_data import write_jsonl
from paratrain.testing.sweep import ROOT, Design, Layout, build_design, load_design, run_layouts, save_design
from paratrain.testing.vlm_models import colour_rows, save_tiny_llava, save_tiny_qwen2vl

DESIGN_FILE = os.path.join(ROOT, "tests", "distributed", "vision_sweep_design.json")
# 4 rows a step (conversations, packed rows or preference pairs): 2 per rank at world 2, so that one
# row per micro-batch is accumulation there; 2 steps, as the text sweep (the second checks the update).
GLOBAL_BATCH, STEPS = 4, 2
LORA = ("model.lora.r=4", "model.lora.alpha=8", "model.lora.target_modules=['q_proj', 'v_proj']")


VISION_FEATURES: dict[str, Feature] = {
    f.name: f
    for f in (
        # The family's model and corpus are picked by configure() below: no override of its own.
        Feature(
            "family", "the image-text family", lambda c, d: bool(c.model.hf), {"llava": (), "qwen2vl": ()}, math=True
        ),
        Feature(
            "layout",
            "DDP, FSDP2 or tensor parallel (the decoder split, the vision tower whole), over 2 ranks",
            lambda c, d: d.world_size > 1,
            {
                "ddp": ("parallel.dp_replicate=2",),
                "fsdp2": ("parallel.dp_shard=2",),
                "tp": ("parallel.tp=2",),
            },
        ),
        Feature(
            "accumulation",
            "one row per micro-batch",
            lambda c, d: c.batch.micro_batch_size == 1,
            {"mbs1": ("batch.micro_batch_size=1",)},
        ),
        Feature(
            "activation_checkpointing",
            "activation checkpointing of the decoder's and the vision tower's blocks",
            lambda c, d: c.parallel.activation_checkpointing != "none",
            {"full": ("parallel.activation_checkpointing='full'",)},
        ),
        Feature(
            "packing",
            "packed image-text documents (block-diagonal attention, per-document (M-RoPE) positions)",
            lambda c, d: c.data.args.get("packing", "stream") != "stream",
            {"documents": ("data.args.packing='documents'",)},
            math=True,
        ),
        # Model and objective options of one level each (the one-process reference has them too).
        *(
            Feature(name, doc, on, {level: settings}, math=True)
            for name, doc, on, level, settings in (
                (
                    "lora",
                    "LoRA on q_proj and v_proj (the decoder's, and LLaVA's CLIP's while the vision tower trains)",
                    lambda c, d: c.model.lora.enabled,
                    "qv",
                    LORA,
                ),
                (
                    "vision",
                    "the vision tower and projector frozen",
                    lambda c, d: c.model.vision == "freeze",
                    "freeze",
                    ("model.vision='freeze'",),
                ),
                (
                    "objective",
                    "DPO on image-text preference pairs (the initial model, or the adapters off, as reference)",
                    lambda c, d: c.loss.name == "preference",
                    "dpo",
                    ("loss.name='preference'",),
                ),
            )
        ),
    )
}


def configure(data: str, layout: Layout) -> list[str]:
    """A layout's whole config: its family's model and corpus (chat rows, or preference pairs with
    DPO) from ``data`` (make_data), plain SGD, and the layout's levels."""
    on = dict(layout.levels)
    folder = os.path.join(data, on.get("family", "llava"))
    corpus, block = ("dpo", 192) if "objective" in on else ("sft", 128)
    return [
        f"model.hf='{folder}/model'",
        "data.name='tokens'",
        f"data.args={{path = '{folder}/{corpus}', block_size = {block}}}",
        f"batch.global_batch_size={GLOBAL_BATCH}",
        f"run.steps={STEPS}",
        *plain_sgd(0.1),
        "run.progress=false",
        "run.probe=false",
        "metrics.plot=false",
        "run.save_model=false",
        *layout.overrides(),
    ]


def pair_rows(folder: str, n: int, *, wide: bool = False) -> list[dict]:
    """TRL's vision preference rows made of colour_rows' conversations: ``chosen`` the right
    colour, ``rejected`` a wrong one in more words (sides of unequal lengths)."""
    rows = []
    for row in colour_rows(folder, n, wide=wide):
        prompt, answer = row["messages"]
        parts = isinstance(answer["content"], list)  # an image row (a text row answers in a string)
        rejected = [{"type": "text", "text": "I think it is grey, or black."}] if parts else "Go away."
        pair = {"prompt": [prompt], "chosen": [answer], "rejected": [{"role": "assistant", "content": rejected}]}
        rows.append(pair | ({"images": row["images"]} if "images" in row else {}))
    return rows


def make_data(out: str) -> str:
    """``out/{llava,qwen2vl}``: the tiny model with its processor, ``sft`` (8 conversations with
    one, two or no images; Qwen2-VL's of 4 or 6 image tokens) and ``dpo`` (6 pairs)."""
    for family, save in (("llava", save_tiny_llava), ("qwen2vl", save_tiny_qwen2vl)):
        folder, wide = os.path.join(out, family), family == "qwen2vl"
        model = save(os.path.join(folder, "model"))
        for fmt, name, rows in (
            ("chat", "sft", colour_rows(folder, 8, wide=wide)),
            ("preference", "dpo", pair_rows(folder, 6, wide=wide)),
        ):
            data = write_jsonl(os.path.join(folder, f"{name}.jsonl"), rows)
            corpus = os.path.join(folder, name)
            prepare([data], out_dir=corpus, tokenizer=model, fmt=fmt, val_fraction=0, progress=False)
    return out


def build(data: str, seed: int = 0) -> Design:
    """sweep.py's design over VISION_FEATURES; a layout that names no family is LLaVA's and says
    so (one run, one reference per model and data, whatever the builder left unnamed)."""
    design = build_design(data, seed=seed, table=VISION_FEATURES, configure=configure)
    for i, lay in enumerate(design.layouts):
        if "family" not in dict(lay.levels):
            design.layouts[i] = Layout((("family", "llava"), *lay.levels), VISION_FEATURES)
    return design


def load() -> Design:
    return load_design(DESIGN_FILE, VISION_FEATURES)


def run(layouts: list[Layout], data: str, root: str, *, timeout: float = 600) -> dict[Layout, dict]:
    return run_layouts(
        layouts, data, root, timeout=timeout, configure=configure, global_batch=GLOBAL_BATCH, loss_tolerance=1e-5
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m paratrain.testing.vision_sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0, help="the seed of the design's candidates")
    p.add_argument("--design-only", action="store_true", help=f"write {DESIGN_FILE} and stop")
    p.add_argument("--stored", action="store_true", help="run the stored design as it is (no rebuild)")
    args = p.parse_args(argv)
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        data = make_data(os.path.join(tmp, "data"))
        if args.stored:
            design = load()
        else:
            design = build(data, args.seed)
            save_design(design, DESIGN_FILE, seed=args.seed)
        print(f"{len(design.layouts)} layouts, {len(design.refused)} refused pairs: {DESIGN_FILE}", flush=True)
        for target, why in design.refused.items():
            print(f"refused {target}: {why}")
        if args.design_only:
            return 0
        results = run(design.layouts, data, tmp)
    for lay, r in results.items():
        mark = "ok" if r["ok"] else f"WRONG {r.get('error', '')}"
        print(f"{lay.name} (world {lay.world}): loss {r['loss']:.1e} grad_norm {r['grad_norm']:.1e} {mark}")
    print(f"{time.monotonic() - start:.0f} s")
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
