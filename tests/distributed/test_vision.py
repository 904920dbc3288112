"""Image-text fine-tuning (docs/vision-language.md, issue 57): TRL's vision conversations
prepared with the model's own processor, a tiny LLaVA and a tiny Qwen2-VL trained through model.hf.

The reference is code we did not write: plain transformers' ``LlavaForConditionalGeneration`` on
**each conversation alone**, its processor's own rendering and image-token expansion, its own
``labels=`` loss over the assistant turns (found in the processor's ids by ChatML's markers, not
by our mask code). paratrain's validation loss, item count, step-1 loss and ``grad_norm`` must
equal it; the data-parallel layouts must equal one process.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

import paratrain
from paratrain.config import ConfigError, load_config
from paratrain.data.prepare import prepare
from paratrain.launch.eval_worker import eval_checkpoint
from paratrain.preflight.support import check_support
from paratrain.testing.dist_utils import plain_sgd, read_metrics, run_ranks, train_layouts, train_rank
from paratrain.testing.sft_data import write_jsonl
from paratrain.testing.vlm_models import colour_rows, save_tiny_llava, save_tiny_qwen2vl

pytest.importorskip("transformers")
pytest.importorskip("PIL")

SGD = [*plain_sgd(0.1), "run.progress=false", "metrics.plot=false", "run.save_model=false"]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """A tiny LLaVA with its processor, 12 rows (one or two images, or none) and two corpora:
    every row in train, every row in val."""
    root = tmp_path_factory.mktemp("vlm")
    model = save_tiny_llava(str(root / "llava"))
    rows = colour_rows(str(root), 12)
    data = write_jsonl(str(root / "rows.jsonl"), rows)
    train, val = str(root / "train"), str(root / "val")
    prepare([data], out_dir=train, tokenizer=model, fmt="chat", val_fraction=0, progress=False)
    prepare([data], out_dir=val, tokenizer=model, fmt="chat", val_fraction=1, progress=False)
    return {"root": str(root), "model": model, "rows": rows, "data": data, "train": train, "val": val}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A tiny Qwen2-VL with its processor, 8 rows (one or two images, or none) whose images are
    56x56 or 56x84 after its resize (4 or 6 image tokens: variable patches); two corpora, every
    row in train, every row in val."""
    root = tmp_path_factory.mktemp("qwen2vl")
    model = save_tiny_qwen2vl(str(root / "qwen"))
    rows = colour_rows(str(root), 8, wide=True)
    data = write_jsonl(str(root / "rows.jsonl"), rows)
    corpus = str(root / "corpus")
    prepare([data], out_dir=corpus, tokenizer=model, fmt="chat", val_fraction=0, progress=False)
    prepare([data], out_dir=str(root / "val"), tokenizer=model, fmt="chat", val_fraction=1, progress=False)
    return {"root": str(root), "model": model, "rows": rows, "train": corpus, "val": str(root / "val")}


def load_processor(path: str):
    """transformers' own processor of ``path``; Qwen2-VL's without its video processor, which
    needs torchvision (not importable here): the same class, its own __call__ and expansion."""
    import transformers
    from transformers import AutoConfig, AutoProcessor

    family = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}.get(
        AutoConfig.from_pretrained(path).model_type
    )
    if family is None:
        return AutoProcessor.from_pretrained(path)

    class ImagesOnly(getattr(transformers, family)):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return ImagesOnly.from_pretrained(path)


def reference(vlm: dict, *, flat: bool = False) -> tuple[float, int, float, float, float]:
    """(mean loss, target tokens, gradient norm) of plain transformers over each conversation alone,
    the mean loss of the same logits with the labels one token late (the fault the test must see),
    and with ``flat`` the mean loss of Qwen2-VL given 1-D positions, no M-RoPE (another fault)."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    processor = load_processor(vlm["model"])
    model = AutoModelForImageTextToText.from_pretrained(vlm["model"], attn_implementation="sdpa")
    tok = processor.tokenizer
    start = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    losses, total, count, late, flat_total = [], 0.0, 0, 0.0, 0.0
    for row in vlm["rows"]:
        images = [Image.open(os.path.join(vlm["root"], p)).convert("RGB") for p in row.get("images", [])]
        text = processor.apply_chat_template(row["messages"], tokenize=False)
        enc = processor(text=[text], images=images or None, return_tensors="pt")
        ids = enc["input_ids"][0].tolist()
        labels = [-100] * len(ids)
        for i in range(len(ids)):  # ChatML: an assistant turn's tokens after its header, its <|im_end|> included
            if ids[i : i + len(start)] == start:
                j = i + len(start)
                while j < len(ids):
                    labels[j] = ids[j]
                    if ids[j] == end:
                        break
                    j += 1
        labels = torch.tensor([labels])
        n = int((labels[0, 1:] != -100).sum())  # transformers shifts the labels inside
        out = model(**enc, labels=labels)
        if flat:
            with torch.no_grad():
                flat_total += float(model(**enc, labels=labels, position_ids=torch.arange(len(ids))[None]).loss) * n
        loss = out.loss * n
        late += float(
            torch.nn.functional.cross_entropy(
                out.logits[0, :-1].detach(), labels.roll(1, dims=1)[0, 1:], reduction="sum"
            )
        )
        losses.append(loss)
        total, count = total + float(loss.detach()), count + n
    (torch.stack(losses).sum() / count).backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    return total / count, count, float(norm), late / count, flat_total / count


def config(vlm: dict, corpus: str, name: str, *extra: str) -> list[str]:
    return [
        f"model.hf='{vlm['model']}'",
        "data.name='tokens'",
        f"data.args={{path = '{corpus}', block_size = 128}}",
        f"run.out_dir='{vlm['root']}/{name}'",
        *SGD,
        *extra,
    ]


def test_val_loss_step_and_gradient_equal_transformers(vlm):
    """The anchor: one process with the whole batch in one micro-batch; its validation loss, step-1
    loss and gradient norm are plain transformers' (the layouts are the slow test's below)."""
    ref_loss, ref_items, ref_norm, late, _ = reference(vlm)
    result = eval_checkpoint(load_config(None, config(vlm, vlm["val"], "eval", "batch.global_batch_size=4")), "")
    assert result["val_items"] == ref_items
    torch.testing.assert_close(result["val_loss"], ref_loss, rtol=1e-5, atol=0)
    # Step 1 is over every conversation: its loss and the gradient of the global batch, here in
    # micro-batches of one row (12 accumulation steps, rows of unequal lengths and image counts), so
    # a normaliser per micro-batch or an image given to another row's micro-batch fails the fast tier.
    paratrain.train(load_config(None, config(vlm, vlm["train"], "one", *WHOLE_BATCH, "batch.micro_batch_size=1")))
    one = read_metrics(os.path.join(vlm["root"], "one"))
    assert one[0]["accum_steps"] == 12
    torch.testing.assert_close(one[0]["loss"], ref_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(one[0]["grad_norm"], ref_norm, rtol=1e-5, atol=0)
    assert abs(late - ref_loss) / ref_loss > 1e-3  # the anchor can fail: labels one token late are another loss


WHOLE_BATCH = ["batch.global_batch_size=12", "run.steps=2"]


@pytest.mark.slow  # the fast tier's budget (issue 53): the anchor above stays fast
def test_two_ranks_with_accumulation_and_tensor_parallel_equal_one_process(vlm):
    """DDP over 2 ranks with one row per micro-batch (6 accumulation steps) and activation
    checkpointing ('full'), and tensor parallel over 2 ranks (the decoder split, the vision
    tower and projector whole on both, 4 accumulation steps), against one process with the whole
    batch: the rows' images travel with them, and the loss is over the global batch's target
    tokens whatever the split. One process with 'selective' checkpointing gives the same bits."""
    keep = [*WHOLE_BATCH, "run.save_model=true"]
    for name, extra in (("one_whole", []), ("one_selective", ["parallel.activation_checkpointing='selective'"])):
        paratrain.train(load_config(None, config(vlm, vlm["train"], name, *keep, *extra)))
    one, selective = (read_metrics(os.path.join(vlm["root"], n)) for n in ("one_whole", "one_selective"))
    assert [(r["loss"], r["grad_norm"]) for r in selective] == [(r["loss"], r["grad_norm"]) for r in one]
    runs = {
        "ddp_ac": [
            "parallel.dp_replicate=2",
            "batch.micro_batch_size=1",
            "parallel.activation_checkpointing='full'",
        ],
        "tp": ["parallel.tp=2", "batch.micro_batch_size=3"],
    }
    root = os.path.join(vlm["root"], "world2")
    run_ranks(train_layouts, 2, {n: config(vlm, vlm["train"], n, *keep, *o) for n, o in runs.items()}, root)
    for name, accum in (("ddp_ac", 6), ("tp", 4)):
        got = read_metrics(os.path.join(root, name))
        assert [r["accum_steps"] for r in got] == [accum, accum]
        torch.testing.assert_close([r["loss"] for r in got], [r["loss"] for r in one], rtol=1e-5, atol=0)
        torch.testing.assert_close([r["grad_norm"] for r in got], [r["grad_norm"] for r in one], rtol=1e-4, atol=0)
    # The tp run's vision tower and projector (rank 0's; every tp rank got the same gradient,
    # the all-reduced one of the residual stream) moved as the one process's did.
    from safetensors.torch import load_file

    ref, tp = (
        load_file(os.path.join(d, "model.safetensors"))
        for d in (os.path.join(vlm["root"], "one_whole"), os.path.join(root, "tp"))
    )
    vision = [k for k in ref if k.startswith(("vision_tower.", "multi_modal_projector."))]
    assert len(vision) > 10 and ref.keys() == tp.keys()
    for k in ref:
        torch.testing.assert_close(tp[k], ref[k], rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.slow
def test_fsdp2_gives_the_one_process_losses_and_a_frozen_vision_tower_stays(vlm):
    """FSDP2 over 2 ranks (the decoder layers sharded block by block, the vision tower with the
    root) with accumulation, and HSDP 2x2 (issue 57 item 3: two replicas of FSDP2 over 2), against
    one process; model.vision = 'freeze' leaves the vision tower as loaded while the decoder moves."""
    steps = ["batch.global_batch_size=4", "run.steps=3", "batch.micro_batch_size=1"]
    paratrain.train(load_config(None, config(vlm, vlm["train"], "one_mb1", *steps)))
    run_ranks(train_rank, 2, config(vlm, vlm["train"], "fsdp", *steps, "parallel.dp_shard=2"))
    hsdp = ["parallel.dp_shard=2", "parallel.dp_replicate=2"]
    run_ranks(train_rank, 4, config(vlm, vlm["train"], "hsdp", *steps, *hsdp))
    a = read_metrics(os.path.join(vlm["root"], "one_mb1"))
    for name in ("fsdp", "hsdp"):
        b = read_metrics(os.path.join(vlm["root"], name))
        torch.testing.assert_close([r["loss"] for r in b], [r["loss"] for r in a], rtol=1e-5, atol=0, msg=name)
        torch.testing.assert_close(
            [r["grad_norm"] for r in b], [r["grad_norm"] for r in a], rtol=1e-4, atol=0, msg=name
        )
    frozen = [*steps, "model.vision='freeze'", "run.save_model=true"]
    paratrain.train(load_config(None, config(vlm, vlm["train"], "frozen", *frozen)))
    from safetensors.torch import load_file
    from transformers import LlavaForConditionalGeneration

    trained = load_file(os.path.join(vlm["root"], "frozen", "model.safetensors"))
    start = LlavaForConditionalGeneration.from_pretrained(vlm["model"]).model
    assert torch.equal(
        trained["vision_tower.encoder.layers.0.mlp.fc1.weight"], start.vision_tower.encoder.layers[0].mlp.fc1.weight
    )
    assert torch.equal(trained["multi_modal_projector.linear_1.weight"], start.multi_modal_projector.linear_1.weight)
    assert not torch.equal(trained["layers.0.mlp.up_proj.weight"], start.language_model.layers[0].mlp.up_proj.weight)


def test_checkpointed_decoder_gives_the_same_bits_and_tp_leaves_the_vision_tower_whole(vlm):
    """Activation checkpointing wraps every decoder layer of the image-text wrapper, and every
    encoder layer of its vision tower, and its recomputation gives the same loss and gradients (the vision tower's included) bit for bit;
    the tensor-parallel plan (the text config's own) splits the decoder and lm_head only, so the
    vision tower and projector stay whole on every tp rank (tp's losses: the slow test below)."""
    import copy

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from paratrain.data.tokens import build_tokens
    from paratrain.distributed.activation_checkpoint import apply_ac
    from paratrain.models import build

    model, spec = build(load_config(None, [f"model.hf='{vlm['model']}'"]).model, meta_enabled=False)
    ds = build_tokens(vlm["train"], block_size=128)
    batch, target = ds.collate([ds[i] for i in range(4)])
    assert batch.pixel_values.shape[0] > 0
    results = []
    for mode in ("none", "full"):  # 'selective': the slow test's tp run
        m = copy.deepcopy(model)
        apply_ac(m, mode=mode, blocks_attr=spec.blocks_attr)
        blocks = [*m.layers.values(), *m.vision_tower.encoder.layers]  # the decoder's and the vision tower's
        assert all(isinstance(b, CheckpointWrapper) for b in blocks) == (mode != "none")
        loss = torch.nn.functional.cross_entropy(m(batch).flatten(0, 1), target.flatten(), reduction="sum")
        loss.backward()
        results.append([loss.detach(), *(p.grad for p in m.parameters())])
    assert model.vision_tower.encoder.layers[0].mlp.fc1.weight.requires_grad and len(results[0]) > 40
    for other in results[1:]:
        assert len(other) == len(results[0]) and all(torch.equal(a, b) for a, b in zip(other, results[0]))
    plan = spec.tp_plan(model, sequence_parallel=False, loss_parallel=False)
    assert "layers.0.self_attn.q_proj" in plan and "lm_head" in plan
    assert all(name.startswith(("layers.", "lm_head")) for name in plan)


def test_pixels_stored_beside_the_shards_and_image_tokens_never_targets(vlm):
    from paratrain.data.tokens import build_tokens, read_meta

    meta = read_meta(vlm["train"])
    assert meta["images"]["shape"] == [3, 28, 28]
    ds = build_tokens(vlm["train"], block_size=128)
    batch, target = ds.collate([ds[i] for i in range(len(ds))])
    image = meta["images"]["token_id"]
    n_images = sum(len(r.get("images", [])) for r in vlm["rows"])
    assert batch.pixel_values.shape[0] == n_images and int((batch.input_ids == image).sum()) == 4 * n_images
    assert not (target == image).any()  # no image token is a target
    half = batch.select_rows(0, 5)  # the layout probe's split keeps each row's images
    assert half.pixel_values.shape[0] == int((half.input_ids == image).sum()) // 4


def test_bad_image_rows_are_one_line(vlm, tmp_path):
    row = dict(vlm["rows"][0], images=["images/nowhere.png"])
    bad = write_jsonl(str(tmp_path / "bad.jsonl"), [vlm["rows"][4], row])  # a text row, then the bad one
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: image '.*nowhere.png' is missing or unreadable"):
        prepare([bad], out_dir=str(tmp_path / "o1"), tokenizer=vlm["model"], fmt="chat", progress=False)
    assert not os.path.exists(str(tmp_path / "o1" / "meta.json"))
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "junk.png").write_bytes(b"not an image")
    junk = write_jsonl(str(tmp_path / "junk.jsonl"), [dict(vlm["rows"][0], images=["images/junk.png"])])
    with pytest.raises(ConfigError, match=r"junk.jsonl:1: image '.*junk.png' is missing or unreadable"):
        prepare([junk], out_dir=str(tmp_path / "o2"), tokenizer=vlm["model"], fmt="chat", progress=False)
    two = write_jsonl(str(tmp_path / "two.jsonl"), [dict(vlm["rows"][0], images=[])])
    with pytest.raises(ConfigError, match=r"two.jsonl:1: 1 image part\(s\) in the messages but 'images' holds 0"):
        prepare([two], out_dir=str(tmp_path / "o3"), tokenizer=vlm["model"], fmt="chat", progress=False)


@pytest.mark.parametrize(
    "over, dims, line",
    [
        (["parallel.sequence_parallel=true"], dict(tp=2), "parallel.sequence_parallel = true with an image-text"),
        ([], dict(pp=2), "parallel.pp > 1 with an image-text model.hf"),
        (["loss.name='mse'"], {}, "loss.name other than 'cross_entropy', 'preference' or 'grpo' with"),
    ],
)
def test_what_this_slice_does_not_run_is_refused_in_one_line(vlm, over, dims, line):
    cfg = load_config(None, [f"model.hf='{vlm['model']}'", *over])
    degrees = dict(pp=1, tp=1, cp=1, ep=1, dp_shard=1, dp_replicate=1) | dims
    with pytest.raises(ConfigError, match=line) as e:
        check_support(cfg, SimpleNamespace(**degrees, fsdp_enabled=False))
    assert "\n" not in str(e.value)


def packed_and_padded(corpus: str, model_dir: str) -> list[tuple]:
    """(batch, rope positions or None, mean loss, gradient norm) of one forward and backward over
    every conversation of ``corpus``: packed into rows of 128 ('documents'), then one per row
    ('padded'); the model (random from the seed) built once."""
    from paratrain.data.tokens import build_tokens
    from paratrain.models import build

    model, _ = build(load_config(None, [f"model.hf='{model_dir}'"]).model, meta_enabled=False)
    out = []
    for packing in ("documents", "padded"):
        ds = build_tokens(corpus, block_size=128, packing=packing)
        batch, target = ds.collate([ds[i] for i in range(len(ds))])
        model.zero_grad()
        n = int((target != -100).sum())
        loss = torch.nn.functional.cross_entropy(model(batch).flatten(0, 1), target.flatten(), reduction="sum") / n
        loss.backward()
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
        out.append((batch, model.rope_positions(batch), loss.item(), norm.item()))
    return out


def images_by_document(batch, image: int) -> dict:
    """Each document's token ids -> the pixel values the batch gives its image tokens: the
    images (patch rows with grids) taken in order, each by as many image tokens as it makes."""
    units = torch.ones(len(batch.image_rows), dtype=torch.int64)
    if batch.image_grid_thw is not None:
        units = batch.image_grid_thw.prod(-1)
    slots = batch.input_ids == image
    tokens, total = int(slots.sum()), int(units.sum())  # an image makes units x tokens / total image tokens
    rows = torch.cat([torch.zeros(1, dtype=torch.int64), units.cumsum(0)])
    out, taken = {}, 0
    for r in range(len(batch)):
        positions = batch.positions[r]
        starts = [*torch.nonzero(positions == 0).flatten().tolist(), int((positions >= 0).sum())]
        for a, b in zip(starts, starts[1:]):
            n, first = int(slots[r, a:b].sum()) * total, taken
            while n > 0:
                n, taken = n - int(units[taken]) * tokens, taken + 1
            out[tuple(batch.input_ids[r, a:b].tolist())] = batch.pixel_values[rows[first] : rows[taken]]
    return out


def test_packed_image_conversations_give_the_padded_loss_and_gradient(vlm, qwen):
    """data.args.packing = 'documents' on an image corpus: several conversations per row, each
    attending to itself only (positions restart), their images in row order; the mean loss over
    the corpus and its gradient are those of one conversation per row. Qwen2-VL: each document's
    multimodal rotary positions are exactly the ones it has alone. DDP: the slow test below."""
    from paratrain.data.tokens import build_tokens, read_meta

    for fixture in (vlm, qwen):
        (packed, rope, loss, norm), (padded, rope_alone, ref_loss, ref_norm) = packed_and_padded(
            fixture["train"], fixture["model"]
        )
        image = read_meta(fixture["train"])["images"]["token_id"]
        document = (packed.positions == 0).cumsum(-1)  # the document of each token within its row
        imaged = [document[r][packed.input_ids[r] == image].unique().numel() for r in range(len(packed))]
        assert len(packed) < len(padded) and max(imaged) >= 2  # rows hold several documents with images
        assert int((packed.positions == 0).sum()) == len(padded)
        mine, alone = images_by_document(packed, image), images_by_document(padded, image)
        assert mine.keys() == alone.keys() and all(torch.equal(mine[d], alone[d]) for d in alone)  # its own images
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-4, atol=0)
    # Qwen2-VL (the last): each packed document's M-RoPE positions equal its own row's when padded.
    alone = {}
    for r in range(len(padded)):
        n = int((padded.positions[r] >= 0).sum())
        alone[tuple(padded.input_ids[r, :n].tolist())] = rope_alone[:, r, :n]
    for r in range(len(packed)):
        starts = [*torch.nonzero(packed.positions[r] == 0).flatten().tolist(), int((packed.positions[r] >= 0).sum())]
        for a, b in zip(starts, starts[1:]):
            assert torch.equal(rope[:, r, a:b], alone[tuple(packed.input_ids[r, a:b].tolist())])
    with pytest.raises(ConfigError, match="raise data.args.block_size to"):
        build_tokens(vlm["train"], block_size=16, packing="documents")


@pytest.mark.slow  # world 2; the fast in-process check above is one process packed against padded
def test_packed_image_rows_under_ddp_give_the_padded_one_process_losses(vlm, qwen):
    """The trainer with data.args.packing = 'documents', DDP over 2 ranks with one packed row per
    micro-batch (3 accumulation steps), against one process padded, every conversation in each
    step (LLaVA: 6 packed rows of 128 or 12 conversations; Qwen2-VL: 6 rows or 8): the loss is
    the global batch's target-token mean however the rows are packed and split."""
    root = os.path.join(vlm["root"], "packed")
    runs = {}
    for name, fixture, whole in (("llava", vlm, 12), ("qwen", qwen, 8)):
        padded = config(fixture, fixture["train"], "unused", f"batch.global_batch_size={whole}", "run.steps=2")
        paratrain.train(load_config(None, [*padded, f"run.out_dir='{root}/{name}_padded'"]))
        runs[f"{name}_ddp"] = config(
            fixture,
            fixture["train"],
            "unused",
            "data.args.packing='documents'",
            "batch.global_batch_size=6",
            "run.steps=2",
            "parallel.dp_replicate=2",
            "batch.micro_batch_size=1",
        )
    run_ranks(train_layouts, 2, runs, root)
    for name in ("llava", "qwen"):
        ref, ddp = (read_metrics(os.path.join(root, f"{name}_{r}")) for r in ("padded", "ddp"))
        assert [r["accum_steps"] for r in ddp] == [3, 3] and [r["tokens"] for r in ddp] == [r["tokens"] for r in ref]
        torch.testing.assert_close([r["loss"] for r in ddp], [r["loss"] for r in ref], rtol=1e-5, atol=0)
        torch.testing.assert_close([r["grad_norm"] for r in ddp], [r["grad_norm"] for r in ref], rtol=1e-4, atol=0)


def test_trainable_tokens_are_the_targets_of_text_and_image_chat_corpora(vlm, tmp_path):
    """meta.json's trainable_tokens of a text chat corpus is unchanged by the image path beside it
    (an `else` once attached to the image branch counted every token of a text chat corpus)."""
    from paratrain.data.tokens import build_tokens, read_meta
    from paratrain.testing.sft_data import save_chat_tokenizer, stdlib_conversations

    tok = save_chat_tokenizer(str(tmp_path / "tok"))
    chat = write_jsonl(str(tmp_path / "chat.jsonl"), stdlib_conversations(6))
    text = str(tmp_path / "text")
    prepare([chat], out_dir=text, tokenizer=tok, fmt="chat", val_fraction=0, progress=False)
    for corpus in (text, vlm["train"]):
        ds = build_tokens(corpus, block_size=512)
        targets = sum(int((torch.as_tensor(ds.collate([ds[i]])[1]) != -100).sum()) for i in range(len(ds)))
        assert read_meta(corpus)["splits"]["train"]["trainable_tokens"] == targets


def test_verify_compares_a_parameter_left_at_zero_by_symmetry_as_zero():
    """CLIP's k_proj.bias gets a zero gradient (softmax ignores a shift shared by every key): its
    zero init moves by 1e-15 of rounding, which verify once called a 70% difference between layouts."""
    from paratrain.verify import rel_diff

    assert rel_diff(torch.full((32,), 3e-15), torch.full((32,), -2e-15)) < 1e-6
    assert rel_diff(torch.full((4,), 1.1), torch.ones(4)) == pytest.approx(0.1)


def test_qwen2vl_val_loss_step_and_gradient_equal_transformers(qwen):
    """The second family against plain transformers: variable patches (each image's grid travels
    with its row) and multimodal rotary positions (the family's own get_rope_index over the
    micro-batch) give each conversation's own loss; 1-D positions would not (the reference
    without M-RoPE is 8e-4 off: the anchor sees a lost M-RoPE)."""
    from paratrain.data.tokens import build_tokens, read_meta
    from paratrain.models.hf.vision import check_family

    ds = build_tokens(qwen["train"], block_size=128)
    batch, _ = ds.collate([ds[i] for i in range(len(ds))])
    pad = read_meta(qwen["train"])["images"]["token_id"]  # <|image_pad|>
    grid, image = batch.image_grid_thw, (batch.input_ids == pad).sum(-1)
    assert sorted({int(n) for n in grid.prod(-1)}) == [16, 24]  # 56x56 and 56x84 images: variable patches
    assert (
        batch.pixel_values.shape[0] == int(grid.prod(-1).sum()) and int(image.sum()) * 4 == batch.pixel_values.shape[0]
    )
    half = batch.select_rows(0, 3)  # the layout probe's split keeps each row's patches and grids
    assert half.pixel_values.shape[0] == int(half.image_grid_thw.prod(-1).sum()) == 4 * int(image[:3].sum())
    with pytest.raises(ConfigError, match="the image-text model type 'idefics3' is not supported yet"):
        check_family(SimpleNamespace(model_type="idefics3"))
    ref_loss, ref_items, ref_norm, _, flat = reference(qwen, flat=True)
    result = eval_checkpoint(load_config(None, config(qwen, qwen["val"], "eval", "batch.global_batch_size=4")), "")
    assert result["val_items"] == ref_items
    torch.testing.assert_close(result["val_loss"], ref_loss, rtol=1e-5, atol=0)
    paratrain.train(load_config(None, config(qwen, qwen["train"], "one", "batch.global_batch_size=8", "run.steps=1")))
    one = read_metrics(os.path.join(qwen["root"], "one"))
    torch.testing.assert_close(one[0]["loss"], ref_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(one[0]["grad_norm"], ref_norm, rtol=1e-5, atol=0)
    assert abs(flat - ref_loss) / ref_loss > 1e-4  # the anchor can fail: without M-RoPE it is another loss


@pytest.mark.slow
def test_qwen2vl_ddp_fsdp2_and_tensor_parallel_give_the_one_process_losses(qwen):
    """DDP over 2 ranks with one row per micro-batch (2 accumulation steps: each micro-batch's
    patches and grids are its own row's), FSDP2 over 2 ranks, and tensor parallel over 2 ranks
    with 'selective' activation checkpointing (the multimodal rotary positions pass through the
    split attention as they are), against one process; one launch runs the three."""
    steps = ["batch.global_batch_size=4", "run.steps=2", "batch.micro_batch_size=1"]
    paratrain.train(load_config(None, config(qwen, qwen["train"], "one_gb4", *steps[:2])))
    one = read_metrics(os.path.join(qwen["root"], "one_gb4"))
    runs = {
        "ddp": ["parallel.dp_replicate=2"],
        "fsdp": ["parallel.dp_shard=2"],
        "tp": ["parallel.tp=2", "parallel.activation_checkpointing='selective'"],
    }
    root = os.path.join(qwen["root"], "world2")
    run_ranks(train_layouts, 2, {n: config(qwen, qwen["train"], n, *steps, *o) for n, o in runs.items()}, root)
    for name, accum in (("ddp", 2), ("fsdp", 2), ("tp", 4)):
        got = read_metrics(os.path.join(root, name))
        assert [r["accum_steps"] for r in got] == [accum, accum]
        torch.testing.assert_close([r["loss"] for r in got], [r["loss"] for r in one], rtol=1e-5, atol=0)
        torch.testing.assert_close([r["grad_norm"] for r in got], [r["grad_norm"] for r in one], rtol=1e-4, atol=0)


@pytest.mark.slow
def test_qwen2_5_vl_val_loss_equals_transformers(tmp_path):
    """Qwen2.5-VL (a windowed vision tower) through the same wrapper: the validation loss of
    plain transformers' Qwen2_5_VLForConditionalGeneration on each conversation alone."""
    model = save_tiny_qwen2vl(str(tmp_path / "qwen25"), version="2.5")
    rows = colour_rows(str(tmp_path), 6, wide=True)
    data = write_jsonl(str(tmp_path / "rows.jsonl"), rows)
    prepare([data], out_dir=str(tmp_path / "val"), tokenizer=model, fmt="chat", val_fraction=1, progress=False)
    q25 = {"root": str(tmp_path), "model": model, "rows": rows}
    ref_loss, ref_items, _, _, flat = reference(q25, flat=True)
    result = eval_checkpoint(
        load_config(None, config(q25, str(tmp_path / "val"), "eval", "batch.global_batch_size=2")), ""
    )
    assert result["val_items"] == ref_items
    torch.testing.assert_close(result["val_loss"], ref_loss, rtol=1e-5, atol=0)
    assert abs(flat - ref_loss) / ref_loss > 1e-4  # without M-RoPE: another loss (8.8e-4 off)
