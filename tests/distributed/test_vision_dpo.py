"""DPO on image-text preference pairs (docs/vision-language.md, issue 57 item 4).

The anchor is code we did not write: plain transformers' ``LlavaForConditionalGeneration`` on
**each side of each pair alone** (its processor's own rendering and image-token expansion of the
prompt with one reply, the reply's tokens found by ChatML's markers), the log-probabilities summed
from its logits and DPO's formula written out, a policy and a reference model that differ.
paratrain's step-1 loss and ``grad_norm`` must equal it; DDP with accumulation must equal one process.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import paratrain
from paratrain.config import ConfigError, load_config
from paratrain.data.prepare import prepare
from paratrain.data.tokens import Documents, ShardedArray
from paratrain.testing.dist_utils import plain_sgd, read_metrics, run_ranks, sgd_step, train_layouts, train_rank
from paratrain.testing.sft_data import write_jsonl
from paratrain.testing.vlm_models import colour_rows, save_tiny_llava, save_tiny_qwen2vl
from tests.distributed.test_vision import load_processor

pytest.importorskip("transformers")
pytest.importorskip("PIL")

PAIRS = 8
PRECOMPUTE = ("preference.precompute=true",)  # into run.out_dir/reference_store
SGD = [*plain_sgd(0.1), "run.progress=false", "metrics.plot=false", "run.save_model=false", "data.shuffle=false"]


def pair_rows(folder: str, n: int, *, wide: bool = False) -> list[dict]:
    """TRL's vision preference rows from colour_rows' conversations: the prompt shows one or two
    images (or none: a text pair among them), ``chosen`` names the right colour, ``rejected`` a
    wrong one in more words (the sides differ in length)."""
    rows = []
    for row in colour_rows(folder, n, wide=wide):
        prompt, answer = row["messages"][0], row["messages"][1]["content"]
        text = answer if isinstance(answer, str) else answer[0]["text"]
        rejected = [{"type": "text", "text": "I think it is grey, or black."}]
        pair = {"prompt": [prompt], "chosen": [{"role": "assistant", "content": answer}]}
        pair["rejected"] = [{"role": "assistant", "content": rejected if isinstance(answer, list) else "Go away."}]
        if "images" in row:
            pair["images"] = row["images"]
        assert text
        rows.append(pair)
    return rows


def unpaired_rows(rows: list[dict]) -> list[dict]:
    """KTO's unpaired form of the pairs (TRL's vision rows: the prompt's images in ``images``): the
    chosen reply (desirable) of even rows, the rejected (undesirable) of odd ones."""
    return [
        {
            "prompt": r["prompt"],
            "completion": r["chosen" if i % 2 == 0 else "rejected"],
            "label": i % 2 == 0,
            **({"images": r["images"]} if "images" in r else {}),
        }
        for i, r in enumerate(rows)
    ]


@pytest.fixture(scope="module")
def vdpo(tmp_path_factory):
    root = tmp_path_factory.mktemp("vdpo")
    policy = save_tiny_llava(str(root / "policy"), seed=0)
    ref = save_tiny_llava(str(root / "ref"), seed=1)
    rows = pair_rows(str(root), PAIRS)
    # Row 7's text is row 3's about another image (a yellow circle, not a square): the same tokens,
    # so a reference store keyed without the images would give them one entry.
    rows[7] = {**rows[7], "prompt": rows[3]["prompt"], "chosen": rows[3]["chosen"]}
    data = write_jsonl(str(root / "pairs.jsonl"), rows)
    corpus = str(root / "corpus")
    prepare([data], out_dir=corpus, tokenizer=policy, fmt="preference", val_fraction=0, progress=False)
    return {"root": str(root), "policy": policy, "ref": ref, "rows": rows, "corpus": corpus}


def config(v: dict, name: str, *extra: str) -> list[str]:
    return [
        f"model.hf='{v['policy']}'",
        "data.name='tokens'",
        f"data.args={{path = '{v['corpus']}', block_size = 192}}",
        "loss.name='preference'",
        f"run.out_dir='{v['root']}/{name}'",
        f"batch.global_batch_size={PAIRS}",
        "run.steps=2",
        *SGD,
        *extra,
    ]


def side_logp(model, processor, root: str, row: dict, reply: str) -> torch.Tensor:
    """log pi(reply | prompt, images) of one side alone: the processor renders and expands the
    prompt with this reply; the reply's tokens are the assistant turn's after its header, its
    <|im_end|> included (ChatML's markers, not our mask code)."""
    from PIL import Image

    images = [Image.open(os.path.join(root, p)).convert("RGB") for p in row.get("images", [])]
    text = processor.apply_chat_template(row["prompt"] + row[reply], tokenize=False)
    enc = processor(text=[text], images=images or None, return_tensors="pt")
    ids = enc["input_ids"][0].tolist()
    tok = processor.tokenizer
    start = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    first = next(i for i in range(len(ids)) if ids[i : i + len(start)] == start) + len(start)
    last = ids.index(end, first)
    logits = model(**enc).logits[0, :-1].float()
    token_logp = logits.log_softmax(-1).gather(-1, enc["input_ids"][0, 1:, None])[:, 0]
    return token_logp[first - 1 : last].sum()  # logits at t predict token t + 1


def anchor(v: dict, *, beta: float = 0.1) -> tuple[float, float]:
    """(step-1 loss, grad_norm) of sigmoid DPO over the pairs, each side alone, the formula written out."""
    from transformers import AutoModelForImageTextToText

    processor = load_processor(v["policy"])  # Qwen2-VL's without its video processor (no torchvision)
    policy = AutoModelForImageTextToText.from_pretrained(v["policy"], attn_implementation="sdpa")
    ref = AutoModelForImageTextToText.from_pretrained(v["ref"], attn_implementation="sdpa")
    terms = []
    for row in v["rows"]:
        pc, pr = (side_logp(policy, processor, v["root"], row, k) for k in ("chosen", "rejected"))
        with torch.no_grad():
            rc, rr = (side_logp(ref, processor, v["root"], row, k) for k in ("chosen", "rejected"))
        terms.append(-F.logsigmoid(beta * ((pc - rc) - (pr - rr))))
    return sgd_step(policy, torch.stack(terms).mean(), 0.1)


def test_image_dpo_equals_transformers_on_each_side_alone(vdpo):
    """One process, every pair in one micro-batch, the reference a model directory: the step-1 loss
    and grad_norm are transformers' on each side alone; the initial copy as reference gives log 2.
    The reference precomputed (preference.precompute) gives the same numbers bit for bit, its store
    one entry per pair: rows 3 and 7 share their tokens, not their images."""
    loss, norm = anchor(vdpo)
    assert abs(loss - 0.6931472) > 1e-3  # the reference differs from the policy
    paratrain.train(load_config(None, config(vdpo, "dir", f"preference.reference='{vdpo['ref']}'")))
    got = vdpo["dir"] = read_metrics(os.path.join(vdpo["root"], "dir"))
    torch.testing.assert_close(got[0]["loss"], loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(got[0]["grad_norm"], norm, rtol=1e-5, atol=0)
    assert {"rewards_chosen", "reward_accuracy"} <= got[0].keys()
    paratrain.train(
        load_config(None, config(vdpo, "pre", f"preference.reference='{vdpo['ref']}'", *PRECOMPUTE, "run.steps=1"))
    )
    pre = read_metrics(os.path.join(vdpo["root"], "pre"))
    assert (pre[0]["loss"], pre[0]["grad_norm"]) == (got[0]["loss"], got[0]["grad_norm"])
    store = torch.load(os.path.join(vdpo["root"], "pre", "reference_store", "values.pt"), weights_only=True)
    assert len(store["keys"]) == PAIRS


@pytest.mark.slow  # world 2 (issue 53's budget): the anchor above stays fast
def test_image_dpo_ddp_with_accumulation_and_lora_equal_one_process(vdpo):
    """DDP over 2 ranks with one pair per micro-batch (4 accumulation steps) against one process,
    the initial copy as reference (step 1: log 2). LoRA's default reference, the adapters off, is
    its initial copy (adapters of B = 0) at every step: step 2, after the adapters moved, equal."""
    paratrain.train(load_config(None, config(vdpo, "init_one")))
    run_ranks(train_rank, 2, config(vdpo, "init_ddp", "parallel.dp_replicate=2", "batch.micro_batch_size=1"))
    one, two = (read_metrics(os.path.join(vdpo["root"], f"init_{k}")) for k in ("one", "ddp"))
    assert [r["accum_steps"] for r in two] == [4, 4]
    assert one[0]["loss"] == pytest.approx(0.6931472, abs=1e-6) and one[1]["loss"] != one[0]["loss"]
    torch.testing.assert_close([r["loss"] for r in two], [r["loss"] for r in one], rtol=1e-5, atol=0)
    torch.testing.assert_close([r["grad_norm"] for r in two], [r["grad_norm"] for r in one], rtol=1e-4, atol=0)
    lora = ("model.lora.target_modules=['q_proj', 'v_proj']", "model.lora.r=4", "model.lora.alpha=8")
    paratrain.train(load_config(None, config(vdpo, "lora_off", *lora, "batch.micro_batch_size=4")))
    paratrain.train(load_config(None, config(vdpo, "lora_init", *lora, "preference.reference='initial'")))
    off, init = (read_metrics(os.path.join(vdpo["root"], k)) for k in ("lora_off", "lora_init"))
    assert off[1]["loss"] != off[0]["loss"]
    torch.testing.assert_close([r["loss"] for r in off], [r["loss"] for r in init], rtol=1e-5, atol=0)
    torch.testing.assert_close([r["grad_norm"] for r in off], [r["grad_norm"] for r in init], rtol=1e-4, atol=0)


def kto_anchor(v: dict, rows: list[dict], *, beta: float = 0.1) -> tuple[float, float, float]:
    """(step-1 loss, grad_norm, z0) of KTO (Ethayarajh et al. 2024) over ``rows``, each example
    alone on transformers' forward: ``ratio = log pi - log ref`` of the prompt (its images) with its
    completion; z0 the mean of the same over each prompt (its images) with the next row's
    completion, at least 0; ``1 - sigmoid(beta (ratio - z0))`` (desirable) or ``(z0 - ratio)``."""
    from transformers import AutoModelForImageTextToText

    processor = load_processor(v["policy"])
    policy = AutoModelForImageTextToText.from_pretrained(v["policy"], attn_implementation="sdpa")
    ref = AutoModelForImageTextToText.from_pretrained(v["ref"], attn_implementation="sdpa")

    def logp(model, i: int, j: int) -> torch.Tensor:  # prompt i (its images) with completion j
        return side_logp(model, processor, v["root"], {**rows[i], "reply": rows[j]["completion"]}, "reply")

    n = len(rows)
    with torch.no_grad():
        z0 = max(
            0.0, float(torch.stack([logp(policy, i, (i + 1) % n) - logp(ref, i, (i + 1) % n) for i in range(n)]).mean())
        )
    terms = []
    for i in range(n):
        with torch.no_grad():
            r_ref = logp(ref, i, i)
        ratio = logp(policy, i, i) - r_ref
        terms.append(1 - torch.sigmoid(beta * ((ratio - z0) if rows[i]["label"] else (z0 - ratio))))
    return (*sgd_step(policy, torch.stack(terms).mean(), 0.1), z0)


@pytest.mark.slow  # world 2 (issue 57 item 4's budget): the store's one-process case stays fast
def test_image_kto_and_precomputed_reference_on_ddp_with_accumulation(vdpo, tmp_path):
    """KTO on image rows against transformers on each example alone (its KL rows: each prompt's
    images with the next row's completion; the policy and reference swapped so that z0 > 0), and
    with the precomputed reference, DDP over 2 ranks with one row per micro-batch (4 accumulation
    steps) against one process: loss 1e-5, grad_norm 1e-4."""
    rows = unpaired_rows(vdpo["rows"])
    corpus = str(tmp_path / "kto")
    prepare(
        [write_jsonl(os.path.join(vdpo["root"], "kto.jsonl"), rows)],
        out_dir=corpus,
        tokenizer=vdpo["policy"],
        fmt="unpaired",
        val_fraction=0,
        progress=False,
    )
    swapped = {**vdpo, "policy": vdpo["ref"], "ref": vdpo["policy"], "corpus": corpus}
    loss, norm, z0 = kto_anchor(swapped, rows)
    assert z0 > 0.1  # the KL rows count
    kto = config(swapped, "kto_one", f"preference.reference='{vdpo['policy']}'", "preference.loss_type='kto'")
    paratrain.train(load_config(None, kto))
    one = read_metrics(os.path.join(vdpo["root"], "kto_one"))
    torch.testing.assert_close(one[0]["loss"], loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(one[0]["grad_norm"], norm, rtol=1e-5, atol=0)
    torch.testing.assert_close(one[0]["kto_kl"], z0, rtol=1e-5, atol=0)
    if "dir" not in vdpo:
        test_image_dpo_equals_transformers_on_each_side_alone(vdpo)
    ddp = ("parallel.dp_replicate=2", "batch.micro_batch_size=1")
    pre = config(vdpo, "", f"preference.reference='{vdpo['ref']}'", *PRECOMPUTE)
    # one launch, two runs (train_layouts names each run's out_dir)
    runs = {
        k: [x for x in c if not x.startswith("run.out_dir")] + list(ddp)
        for k, c in (("kto_ddp", kto), ("pre_ddp", pre))
    }
    run_ranks(train_layouts, 2, runs, vdpo["root"])
    for name, want in (("kto_ddp", one), ("pre_ddp", vdpo["dir"])):
        got = read_metrics(os.path.join(vdpo["root"], name))
        assert [r["accum_steps"] for r in got] == [4, 4]
        torch.testing.assert_close([r["loss"] for r in got], [r["loss"] for r in want], rtol=1e-5, atol=0)
        torch.testing.assert_close([r["grad_norm"] for r in got], [r["grad_norm"] for r in want], rtol=1e-4, atol=0)


@pytest.mark.slow
def test_qwen2vl_image_dpo_equals_transformers_on_each_side_alone(tmp_path):
    """Qwen2-VL (variable patches, multimodal rotary positions; images of 4 or 6 tokens): the
    packed pair's rejected side gets its M-RoPE shifted by a constant (get_rope_index over the whole
    row), which its rotary attention does not see: each side still equals its rendering alone."""
    v = {"root": str(tmp_path), "rows": pair_rows(str(tmp_path), 6, wide=True)}
    v["policy"], v["ref"] = (save_tiny_qwen2vl(str(tmp_path / k), seed=s) for k, s in (("policy", 0), ("ref", 1)))
    v["corpus"] = str(tmp_path / "corpus")
    data = write_jsonl(str(tmp_path / "pairs.jsonl"), v["rows"])
    prepare([data], out_dir=v["corpus"], tokenizer=v["policy"], fmt="preference", val_fraction=0, progress=False)
    loss, norm = anchor(v)
    paratrain.train(
        load_config(None, config(v, "q", f"preference.reference='{v['ref']}'", "batch.global_batch_size=6"))
    )
    got = read_metrics(os.path.join(v["root"], "q"))
    torch.testing.assert_close(got[0]["loss"], loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(got[0]["grad_norm"], norm, rtol=1e-5, atol=0)


def test_image_pairs_prepare_and_refusals_are_one_line(vdpo, tmp_path):
    """Each pair's images are stored once, under its chosen side; a missing image names its row;
    GRPO on an image-text model stays refused, KTO and the precomputed reference run. KTO's
    unpaired image rows: each example beside its KL row, the images once, under the example."""
    import json

    from paratrain.preflight.support import check_support

    meta = json.load(open(os.path.join(vdpo["corpus"], "meta.json")))
    assert meta["document_format"] == "preference" and meta["images"]["shape"]
    rows = [dict(r) for r in vdpo["rows"]]
    rows[1]["images"] = ["images/nowhere.png"]
    bad = write_jsonl(os.path.join(vdpo["root"], "bad.jsonl"), rows)
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: image .*nowhere.png' is missing"):
        prepare([bad], out_dir=str(tmp_path / "bad"), tokenizer=vdpo["policy"], fmt="preference", progress=False)
    assert not os.path.exists(tmp_path / "bad" / "meta.json")
    dims = SimpleNamespace(pp=1, tp=1, cp=1, ep=1, dp_shard=1, dp_replicate=1, fsdp_enabled=False)
    line = "loss.name other than 'cross_entropy', 'preference' or 'grpo' with an image-text model.hf"
    with pytest.raises(ConfigError, match=line) as e:
        check_support(load_config(None, config(vdpo, "refused", "loss.name='mse'")), dims)
    assert "\n" not in str(e.value)
    for over in ("preference.loss_type='kto'", "preference.precompute=true"):  # issue 57 item 4: they run
        check_support(load_config(None, config(vdpo, "runs", over)), dims)
    # KTO's rows (prepare --format unpaired): each row its example (mask 1 desirable, 2 not) and its
    # KL row, the next row's completion (mask 3), the prompt's images stored once, under the example.
    rows = unpaired_rows(vdpo["rows"])
    corpus = str(tmp_path / "kto")
    prepare(
        [write_jsonl(os.path.join(vdpo["root"], "kto.jsonl"), rows)],
        out_dir=corpus,
        tokenizer=vdpo["policy"],
        fmt="unpaired",
        val_fraction=0,
        progress=False,
    )
    meta = json.load(open(os.path.join(corpus, "meta.json")))
    assert meta["document_format"] == "unpaired" and meta["images"]["shape"] == [3, 28, 28]
    docs = Documents(corpus, meta, "train")
    counts = ShardedArray(corpus, meta["splits"]["train"]["image_files"], "uint32")
    assert counts.read(0, len(counts)).tolist() == [x for r in rows for x in (len(r.get("images", [])), 0)]
    marks = [set(docs.document(d, int(docs.doc_lengths[d]))[1].tolist()) - {0} for d in range(2 * PAIRS)]
    assert marks == [x for r in rows for x in ({1} if r["label"] else {2}, {3})]
    rows[2] = {**rows[2], "completion": [{"role": "assistant", "content": [{"type": "image"}]}]}
    with pytest.raises(ConfigError, match=r"kto_bad.jsonl:3: image parts in 'completion'"):
        prepare(
            [write_jsonl(os.path.join(vdpo["root"], "kto_bad.jsonl"), rows)],
            out_dir=str(tmp_path / "kto_bad"),
            tokenizer=vdpo["policy"],
            fmt="unpaired",
            progress=False,
        )
