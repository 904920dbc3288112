"""LoRA on an image-text model, ``generate --image`` and ``export --peft`` / ``--hf --merge`` of it
(docs/vision-language.md, issue 57).

The references are code we did not write: PEFT's ``get_peft_model`` on transformers' own
``LlavaForConditionalGeneration``, each conversation alone through its processor (step-1 loss and
``grad_norm``); transformers' ``generate`` and forward of the exported directories loaded by
``AutoModelForImageTextToText`` (+ ``PeftModel.from_pretrained``). Then DDP over 2 ranks with
accumulation against one process (slow tier).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

import paratrain
from paratrain.cli import main as cli_main
from paratrain.config import ConfigError, load_config, to_toml
from paratrain.data.prepare import prepare
from paratrain.models import build
from paratrain.preflight.support import check_support
from paratrain.testing.dist_utils import plain_sgd, read_metrics, run_ranks, train_rank
from paratrain.testing.sft_data import write_jsonl
from paratrain.testing.vlm_models import colour_rows, save_tiny_llava

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("PIL")

# Adapters on q_proj and v_proj: the Llama decoder's and, with model.vision = 'train', CLIP's.
LORA = ["model.lora.r=4", "model.lora.alpha=8", "model.lora.target_modules=['q_proj', 'v_proj']"]
SGD = [*plain_sgd(0.5), "run.progress=false", "metrics.plot=false", "run.probe=false"]
QUESTION = "What colour is the square?"


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """A tiny LLaVA with weights and its processor, 12 rows (one or two images, or none) in one
    train corpus, and the one-process LoRA run on it: step 1 over every conversation."""
    root = tmp_path_factory.mktemp("vlm_lora")
    model = save_tiny_llava(str(root / "llava"))
    rows = colour_rows(str(root), 12)
    data = write_jsonl(str(root / "rows.jsonl"), rows)
    prepare([data], out_dir=str(root / "train"), tokenizer=model, fmt="chat", val_fraction=0, progress=False)
    vlm = {"root": str(root), "model": model, "rows": rows}
    paratrain.train(load_config(None, config(vlm, "one", "checkpoint.at_end=true")))
    return vlm


def config(vlm: dict, name: str, *extra: str) -> list[str]:
    return [
        f"model.hf='{vlm['model']}'",
        "data.name='tokens'",
        f"data.args={{path = '{vlm['root']}/train', block_size = 128}}",
        f"run.out_dir='{vlm['root']}/{name}'",
        "batch.global_batch_size=12",
        "run.steps=2",
        *LORA,
        *SGD,
        *extra,
    ]


def peft_reference(vlm: dict, adapters: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(loss, grad_norm) of PEFT's get_peft_model on transformers' LLaVA over each conversation
    alone (the processor's rendering, ChatML's assistant turns as labels), its adapters set to
    paratrain's initial ones (by transformers' name)."""
    from peft import LoraConfig, get_peft_model
    from PIL import Image
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(vlm["model"])
    base = LlavaForConditionalGeneration.from_pretrained(vlm["model"], attn_implementation="sdpa")
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    trainable = {n.removeprefix("base_model.model."): p for n, p in model.named_parameters() if p.requires_grad}
    assert sorted(trainable) == sorted(adapters)  # the same adapted modules, CLIP's included
    with torch.no_grad():
        for n, p in trainable.items():
            p.copy_(adapters[n])
    tok = processor.tokenizer
    start = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    losses, count = [], 0
    for row in vlm["rows"]:
        images = [Image.open(os.path.join(vlm["root"], p)).convert("RGB") for p in row.get("images", [])]
        enc = processor(
            text=[processor.apply_chat_template(row["messages"], tokenize=False)],
            images=images or None,
            return_tensors="pt",
        )
        ids = enc["input_ids"][0].tolist()
        labels = [-100] * len(ids)
        for i in range(len(ids)):  # an assistant turn's tokens after its header, its <|im_end|> included
            if ids[i : i + len(start)] == start:
                for j in range(i + len(start), len(ids)):
                    labels[j] = ids[j]
                    if ids[j] == end:
                        break
        labels = torch.tensor([labels])
        n = int((labels[0, 1:] != -100).sum())
        losses.append(model(**enc, labels=labels).loss * n)
        count += n
    loss = torch.stack(losses).sum() / count
    grads = torch.autograd.grad(loss, list(trainable.values()))
    return float(loss.detach()), float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))


def test_lora_vlm_exports_answer_images_as_the_run(vlm, tmp_path, capsys):
    """``generate --image`` (greedy) of a LoRA run answers token for token as transformers'
    generate of ``export --peft`` of the run (PeftModel onto AutoModelForImageTextToText) and of
    ``export --hf --merge`` of its last checkpoint, whose logits equal paratrain's forward of the run (1e-5, merged 1e-4).
    model.vision = 'freeze' keeps adapters out of the vision tower. Bad --image input is one
    line, exit 2."""
    from peft import PeftModel
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from paratrain.data.image_rows import ImageTextBatch

    cfg = load_config(None, config(vlm, "one"))
    frozen, spec = build(load_config(None, config(vlm, "x", "model.vision='freeze'")).model)
    names = [n for n, p in frozen.named_parameters() if p.requires_grad]
    assert names and not [n for n in names if n.startswith(("vision_tower.", "multi_modal_projector."))]
    # LoRA dropout: keyed by a row's tokens, so in the decoder only (the tower's rows are images).
    dims = SimpleNamespace(pp=1, tp=1, cp=1, ep=1, dp_shard=1, dp_replicate=1, fsdp_enabled=False)
    check_support(load_config(None, config(vlm, "x", "model.lora.dropout=0.1", "model.vision='freeze'")), dims)
    with pytest.raises(ConfigError, match=r"model.lora.dropout > 0 with adapters in the vision tower") as e:
        check_support(load_config(None, config(vlm, "x", "model.lora.dropout=0.1")), dims)
    assert "\n" not in str(e.value)

    run, image = cfg.run.out_dir, os.path.join(vlm["root"], "images", "0.png")
    capsys.readouterr()
    greedy = ["--temperature", "0", "--max-new-tokens", "8"]
    assert cli_main(["generate", run, "--chat", QUESTION, "--image", image, *greedy]) == 0
    reply = capsys.readouterr().out.removesuffix("\n")
    assert cli_main(["export", run, "--peft", str(tmp_path / "peft")]) == 0
    # The checkpoint holds the adapters alone: merged into model.hf's files (LLaVA's older names).
    assert cli_main(["export", f"{run}/checkpoints/step-2", "--hf", str(tmp_path / "merged"), "--merge"]) == 0

    processor = AutoProcessor.from_pretrained(str(tmp_path / "merged"))  # the processor travels with it
    content = [{"type": "image"}, {"type": "text", "text": QUESTION}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    enc = processor(text=[text], images=[Image.open(image).convert("RGB")], return_tensors="pt")
    ours_model, _ = build(cfg.model)  # paratrain's own forward of the run's final weights
    spec.materialize(ours_model, device=torch.device("cpu"))
    ours_model.load_state_dict(load_file(os.path.join(run, "model.safetensors")))
    ids = enc["input_ids"]
    batch = ImageTextBatch(ids, torch.arange(ids.shape[1])[None], enc["pixel_values"], torch.zeros(1, dtype=torch.long))
    peft_model = PeftModel.from_pretrained(
        AutoModelForImageTextToText.from_pretrained(vlm["model"]), str(tmp_path / "peft")
    ).eval()
    merged = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        ours = ours_model.eval()(batch)
        torch.testing.assert_close(peft_model(**enc).logits, ours, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(merged(**enc).logits, ours, rtol=1e-4, atol=1e-4)
        for hf in (peft_model, merged):
            out = hf.generate(**enc, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :].tolist()
            if processor.tokenizer.eos_token_id in out:
                out = out[: out.index(processor.tokenizer.eos_token_id)]
            assert processor.tokenizer.decode(out, skip_special_tokens=True) == reply

    text_run = tmp_path / "text_run"  # a text-only run: its config.toml is what generate reads first
    text_run.mkdir()
    (text_run / "config.toml").write_text(to_toml(load_config(None, [])))
    capsys.readouterr()  # transformers' loading bars above
    for argv, needle in (
        ([run, "--chat", QUESTION, "--image", str(tmp_path / "nowhere.png")], "nowhere.png: missing or unreadable"),
        ([str(text_run), "--chat", QUESTION, "--image", image], "trained a text-only model; drop --image"),
        ([run, "--image", image], "--image goes with --chat"),
    ):
        assert cli_main(["generate", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and "\n" not in err, err


@pytest.mark.slow
def test_lora_vlm_equals_peft_and_ddp_with_accumulation_equals_one_process(vlm):
    """Step 1 of the one-process LoRA run (every conversation) equals PEFT's get_peft_model on
    transformers' LLaVA (loss and grad_norm 1e-5); DDP over 2 ranks, one row per micro-batch (6
    accumulation steps; text rows leave the vision adapters out of their graph), gives its
    losses (1e-5) and grad_norm (1e-4) under plain SGD."""
    cfg = load_config(None, config(vlm, "one"))
    torch.manual_seed(cfg.run.seed)  # paratrain's initial adapters, as build_run makes them
    model, spec = build(cfg.model)
    spec.materialize(model, device=torch.device("cpu"))
    adapters = {model.hf_name(n): p.detach() for n, p in model.named_parameters() if p.requires_grad}
    assert any(n.startswith("model.vision_tower.") for n in adapters)  # CLIP's q_proj/v_proj adapted too
    ref_loss, ref_norm = peft_reference(vlm, adapters)
    first = read_metrics(cfg.run.out_dir)[0]
    torch.testing.assert_close(first["loss"], ref_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(first["grad_norm"], ref_norm, rtol=1e-5, atol=0)

    ddp = ["parallel.dp_replicate=2", "batch.micro_batch_size=1", "run.save_model=false"]
    run_ranks(train_rank, 2, config(vlm, "ddp", *ddp))
    one, got = (read_metrics(os.path.join(vlm["root"], n)) for n in ("one", "ddp"))
    assert [r["accum_steps"] for r in got] == [6, 6]
    torch.testing.assert_close([r["loss"] for r in got], [r["loss"] for r in one], rtol=1e-5, atol=0)
    torch.testing.assert_close([r["grad_norm"] for r in got], [r["grad_norm"] for r in one], rtol=1e-4, atol=0)
