"""GRPO on image-text prompts (docs/vision-language.md, issue 57 item 1's prompt format).

The anchor is code we did not write: plain transformers' ``LlavaForConditionalGeneration`` scoring
**each completion alone** after its prompt and images (its processor's own rendering and image-token
expansion), the reward called as TRL calls it, the group advantages, the clipped surrogate and the
k3 KL written out, under plain SGD. paratrain's steps (loss, ``grad_norm``) must equal it, the
sampler's log-probabilities the trainer's (``logp_gap``), and DDP with accumulation, FSDP2 and
tensor parallel must give the one-process completions, byte for byte, and numbers (Qwen2-VL's under
DDP too). The prompts differ in their images: none (a text prompt), one, or two. The written-out
steps are the text test's (test_grpo.py), given the image-text model's scoring.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import paratrain
from paratrain.config import ConfigError, load_config
from paratrain.testing.dist_utils import plain_sgd, read_metrics, run_ranks, train_layouts
from paratrain.testing.sft_data import write_jsonl
from paratrain.testing.vlm_models import colour_rows, save_tiny_llava, save_tiny_qwen2vl
from tests.distributed.test_grpo import written_out_steps
from tests.distributed.test_vision import load_processor

pytest.importorskip("transformers")
pytest.importorskip("PIL")

PROMPTS, G, NEW, TEMPERATURE, BETA, LR = 8, 4, 5, 0.8, 0.05, 2.0


def prompt_rows(folder: str, n: int, *, wide: bool = False) -> list[dict]:
    """TRL's vision prompt rows: colour_rows' questions (one image, two, or none) without the answer."""
    rows = []
    for row in colour_rows(folder, n, wide=wide):
        rows.append({"prompt": row["messages"][:1], **({"images": row["images"]} if "images" in row else {})})
    return rows


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread, as each rank of the distributed tier runs (two threads on a loaded
    2-core machine made the anchor's forwards 30x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def vrl(tmp_path_factory):
    root = tmp_path_factory.mktemp("vgrpo")
    rows = prompt_rows(str(root), PROMPTS)
    assert sum("images" not in r for r in rows) == 1 and any(len(r.get("images", ())) == 2 for r in rows)
    return {
        "root": str(root),
        "policy": save_tiny_llava(str(root / "policy")),
        "rows": rows,
        "data": write_jsonl(str(root / "prompts.jsonl"), rows),
    }


def config(v: dict, name: str, *extra: str, model: str = "") -> list[str]:
    return [
        f"model.hf='{model or v['policy']}'",
        "data.name='prompts'",
        f"data.args={{path = '{v['data']}', max_prompt_length = 128}}",  # tokenizer: model.hf's processor
        "data.shuffle=false",
        "loss.name='grpo'",
        f"rl.group_size={G}",
        f"rl.max_new_tokens={NEW}",
        f"rl.temperature={TEMPERATURE}",
        f"rl.beta={BETA}",
        "rl.steps_per_generation=2",
        "rl.check_logps=true",
        "rl.rewards=['paratrain.testing.rl_data:byte_mix']",
        f"run.out_dir='{v['root']}/{name}'",
        "batch.global_batch_size=8",
        "batch.micro_batch_size=4",
        "run.steps=2",
        "run.progress=false",
        "metrics.plot=false",
        *plain_sgd(LR),
        *extra,
    ]


def run(v: dict, name: str, *extra: str, model: str = "") -> tuple[list[dict], list[dict]]:
    paratrain.train(load_config(None, config(v, name, *extra, model=model)))
    return outputs(v["root"], name)


def outputs(root: str, name: str) -> tuple[list[dict], list[dict]]:
    """A run's metrics and its rollouts.jsonl's rows."""
    with open(os.path.join(root, name, "rollouts.jsonl")) as f:
        return read_metrics(os.path.join(root, name)), [json.loads(line) for line in f]


def completion_logps(model, processor, root: str, row: dict, tokens: list[int]) -> torch.Tensor:
    """log softmax(logits / T) of one completion's tokens after its prompt and images alone."""
    from PIL import Image

    images = [Image.open(os.path.join(root, p)).convert("RGB") for p in row.get("images", ())]
    text = processor.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
    enc = processor(text=[text], images=images or None, return_tensors="pt", add_special_tokens=False)
    n = enc["input_ids"].shape[1]
    full = torch.cat([enc["input_ids"], torch.tensor([tokens])], 1)
    pixels = {"pixel_values": enc["pixel_values"]} if images else {}
    logits = model(input_ids=full, **pixels).logits[0, n - 1 : n - 1 + len(tokens)].float() / TEMPERATURE
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def anchor(v: dict, rollouts: list[dict]) -> tuple[list[float], list[float]]:
    """(losses, grad norms) of plain SGD on paratrain's completions of a round of two steps, the
    rest written out as the text test writes it (test_grpo.py's ``written_out_steps``), each
    completion scored alone after its prompt and images by plain transformers' LLaVA; the KL is to
    the initial model."""
    from transformers import LlavaForConditionalGeneration

    processor = load_processor(v["policy"])
    policy = LlavaForConditionalGeneration.from_pretrained(v["policy"], attn_implementation="sdpa")
    reference = LlavaForConditionalGeneration.from_pretrained(v["policy"], attn_implementation="sdpa")
    logps = lambda model, r: completion_logps(model, processor, v["root"], v["rows"][r["prompt_index"]], r["tokens"])  # noqa: E731
    decode = lambda ids: processor.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    return written_out_steps(policy, reference, rollouts, logps, decode, group=G, beta=BETA, lr=LR)


@pytest.fixture(scope="module")
def one_process(vrl):
    return run(vrl, "w1")


def test_grpo_on_images_equals_transformers_on_each_completion_with_its_images(vrl, one_process):
    rows, rollouts = one_process
    assert [r["step"] for r in rollouts] == [1] * 8 + [2] * 8 and len({tuple(r["tokens"]) for r in rollouts}) > 8
    # the cached sampler's log-probabilities (the images in the prompt's cache) are the trainer's
    assert all(r["logp_gap"] <= 1e-5 for r in rows)
    assert rows[1]["clip_ratio"] > 0 and rows[1]["kl"] > 0  # step 2 is off-policy: every term at work
    losses, norms = anchor(vrl, rollouts)
    assert [r["loss"] for r in rows] == pytest.approx(losses, rel=1e-5, abs=1e-6)
    assert [r["grad_norm"] for r in rows] == pytest.approx(norms, rel=1e-4)


def test_a_missing_image_of_a_prompt_is_one_line_naming_the_row(vrl):
    from paratrain.data.prompts import build_prompts

    rows = [dict(r) for r in vrl["rows"]]
    rows[2] = dict(rows[2], images=["images/nowhere.png", rows[2]["images"][1]])
    bad = write_jsonl(os.path.join(vrl["root"], "bad.jsonl"), rows)
    with pytest.raises(ConfigError, match=r"bad.jsonl:3: image '.*nowhere.png' is missing or unreadable") as e:
        build_prompts(bad, tokenizer=vrl["policy"])
    assert "\n" not in str(e.value)


def test_what_grpo_on_images_does_not_run_is_refused_in_one_line(vrl):
    from types import SimpleNamespace

    from paratrain.preflight.support import check_support

    dims = SimpleNamespace(pp=1, tp=1, cp=1, ep=1, dp_shard=1, dp_replicate=1, fsdp_enabled=False)
    check_support(load_config(None, config(vrl, "ok")), dims)  # the built-in engine, single-turn, in step
    for over, line in (
        ("rl.engine='vllm'", "rl.engine other than 'builtin' with an image-text model.hf"),
        ("rl.environment='paratrain.testing.rl_data:byte_mix'", "rl.environment or rl.tools with an image-text"),
        ("rl.async_steps=1", "rl.async_steps > 0 with an image-text model.hf"),
    ):
        with pytest.raises(ConfigError, match=line) as e:
            check_support(load_config(None, config(vrl, "refused", over)), dims)
        assert "\n" not in str(e.value)


def test_prepare_format_prompt_takes_image_prompts_as_the_chat_format_takes_the_conversation(vrl, tmp_path):
    """TRL's vision prompt-completion rows (the images in the prompt) prepare into the token, mask
    and pixel shards of the same conversations prepared as chat rows; a missing image is one line."""
    from paratrain.data.prepare import prepare

    chats = colour_rows(vrl["root"], PROMPTS)
    pairs = [
        {
            "prompt": r["messages"][:1],
            "completion": r["messages"][1:],
            **({"images": r["images"]} if "images" in r else {}),
        }
        for r in chats
    ]
    files = {}
    for fmt, rows in (("chat", chats), ("prompt", pairs)):
        data = write_jsonl(os.path.join(vrl["root"], f"{fmt}_rows.jsonl"), rows)
        meta = prepare(
            [data], out_dir=str(tmp_path / fmt), tokenizer=vrl["policy"], fmt=fmt, val_fraction=0, progress=False
        )
        assert meta["document_format"] == fmt and meta["images"]["shape"] and meta["splits"]["train"]["documents"] == 8
        files[fmt] = {
            kind: [f["sha256"] for f in meta["splits"]["train"][kind]]
            for kind in ("files", "doc_files", "mask_files", "pixel_files", "image_files")
        }
    assert files["prompt"] == files["chat"]
    pairs[6] = dict(pairs[6], images=["images/nowhere.png"])
    bad = write_jsonl(os.path.join(vrl["root"], "bad_prompt.jsonl"), pairs)
    with pytest.raises(ConfigError, match=r"bad_prompt.jsonl:7: image '.*nowhere.png' is missing or unreadable"):
        prepare([bad], out_dir=str(tmp_path / "bad"), tokenizer=vrl["policy"], fmt="prompt", progress=False)
    assert not os.path.exists(tmp_path / "bad" / "meta.json")


@pytest.mark.slow
def test_grpo_on_images_is_the_same_on_every_layout_and_on_qwen2vl(vrl, one_process, tmp_path):
    """One launch of 2 ranks runs DDP with accumulation (micro-batches of 2, generation batches of
    3 rows: a group's images split over two of them), FSDP2 and tensor parallel (the language model
    split, the vision tower whole on each rank), and Qwen2-VL under DDP; each gives its one-process
    completions byte for byte and its numbers. Qwen2-VL (variable patches, multimodal rotary
    positions) samples with its cache, the new tokens' positions continuing from the images' as the
    trainer's whole-row forward numbers them (``logp_gap``: the new tokens at their text positions
    instead gave 5.3 here)."""
    qwen = save_tiny_qwen2vl(str(tmp_path / "qwen"))
    wide = dict(vrl, data=write_jsonl(str(tmp_path / "wide.jsonl"), prompt_rows(str(tmp_path), PROMPTS, wide=True)))
    split = ("batch.micro_batch_size=2", "rl.generation_batch_size=3")
    layouts = {
        "ddp": config(vrl, "ddp", *split),
        "fsdp": config(vrl, "fsdp", *split, "parallel.dp_shard=2"),
        "tp": config(vrl, "tp", "batch.micro_batch_size=2", "parallel.tp=2"),
        "qwen_ddp": config(wide, "qwen_ddp", *split, model=qwen),
    }
    run_ranks(train_layouts, 2, layouts, vrl["root"])
    rows_q, rollouts_q = run(wide, "qwen", model=qwen)
    assert len({tuple(r["tokens"]) for r in rollouts_q}) > 8
    assert all(r["logp_gap"] <= 1e-5 for r in rows_q)  # the trainer's forward, no cache, with the same positions
    for name, one in (("ddp", "w1"), ("fsdp", "w1"), ("tp", "w1"), ("qwen_ddp", "qwen")):  # w1: one_process's
        written = []
        for n in (one, name):
            with open(os.path.join(vrl["root"], n, "rollouts.jsonl"), "rb") as f:
                written.append(f.read())
        assert written[1] == written[0], name  # byte for byte: tokens, texts, rewards and advantages
        rows, rows2 = (read_metrics(os.path.join(vrl["root"], n)) for n in (one, name))
        for key in ("loss", "grad_norm", "reward", "kl", "clip_ratio"):
            assert [r[key] for r in rows2] == pytest.approx([r[key] for r in rows], rel=1e-5, abs=1e-7), (name, key)
        assert all(r["logp_gap"] <= 1e-5 for r in rows2), name  # the sampler's log-probabilities are the trainer's
