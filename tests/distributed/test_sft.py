"""Supervised fine-tuning on conversations (docs/sft.md): prepared with transformers' chat template,
packed into rows whose documents never see each other, the loss on the assistant tokens only.

The reference is code we did not write: a tiny Llama run by plain ``transformers`` on **each
conversation alone, unpacked**, with the loss mask of ``apply_chat_template(...,
return_assistant_tokens_mask=True)`` and transformers' own ``labels=`` loss. paratrain's
``val_loss`` of the initial model and the gradient of one SGD step (its logged ``grad_norm``)
must equal it. A packing that let attention cross a document boundary, positions that did not
restart, or a mask that counted prompt tokens would each change the number.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import paratrain
from paratrain.config import ConfigError, load_config
from paratrain.data.packing import attention_square, document_mask, pack_best_fit
from paratrain.data.prepare import prepare
from paratrain.data.tokens import build_tokens
from paratrain.launch.eval_worker import eval_checkpoint
from paratrain.testing.dist_utils import REPO, read_metrics
from paratrain.testing.sft import losses_and_norms, reference, sft_config, sft_gpt
from paratrain.testing.sft_data import (
    CHATML_PLAIN,
    prompt_rows,
    save_chat_tokenizer,
    write_jsonl,
)

pytest.importorskip("transformers")


def test_val_loss_and_gradient_equal_transformers_on_each_conversation_alone(sft):
    ref_loss, ref_items, ref_norm = reference(sft, sft["convs"])
    # val_loss of the initial model: what `paratrain eval` runs with no checkpoint, every document
    # once (here in this process; docs/sft.md's recipe runs the command itself).
    result = eval_checkpoint(load_config(None, sft_config(sft, sft["val"], "eval", "batch.global_batch_size=4")), "")
    assert result["val_items"] == ref_items
    torch.testing.assert_close(result["val_loss"], ref_loss, rtol=1e-5, atol=0)
    # The gradient of one step over every conversation (one global batch of all train rows).
    ds = build_tokens(sft["train"], block_size=512)
    rows = len(ds)
    assert len(ds.lengths) / rows > 2  # rows hold several documents: a leak between them would show
    out = os.path.join(sft["root"], "step")
    paratrain.train(
        load_config(None, sft_config(sft, sft["train"], "step", f"batch.global_batch_size={rows}", "run.steps=1"))
    )
    (row,) = read_metrics(out)
    assert row["trainable_tokens"] == ref_items
    torch.testing.assert_close(row["loss"], ref_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(row["grad_norm"], ref_norm, rtol=1e-5, atol=0)


def test_document_mask_is_block_diagonal_and_causal():
    pos = torch.tensor([[0, 1, 2, 0, 1, -1, -1]])
    m = document_mask(pos)[0, 0].int()
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0],
            [0, 0, 0, 1, 0, 0, 0],
            [0, 0, 0, 1, 1, 0, 0],
            [0, 0, 0, 0, 0, 1, 0],  # padding sees itself only: no empty row
            [0, 0, 0, 0, 0, 0, 1],
        ]
    )
    assert torch.equal(m, expected)
    # MFU credits each document's own attention square (3^2 + 2^2), not the row's 7^2.
    packed = torch.stack([torch.zeros_like(pos), pos], dim=1)
    assert attention_square(packed) == 13
    assert attention_square(pos) is None


def test_best_fit_packs_whole_documents_deterministically():
    lengths = np.array([5, 3, 8, 2, 6, 4, 1, 7])
    rows = pack_best_fit(lengths, 10)
    assert sorted(int(d) for r in rows for d in r) == list(range(8))  # each document once
    assert all(lengths[r].sum() <= 10 for r in rows)
    assert len(rows) == 4  # 36 tokens in rows of 10: best fit needs the minimum here
    assert [r.tolist() for r in rows] == [r.tolist() for r in pack_best_fit(lengths, 10)]


def test_the_two_mask_paths_agree_and_prompt_rows_train_the_completion(sft, tmp_path):
    """Without {% generation %} marks the assistant spans come from rendering prefixes; the mask
    is the same bytes as transformers' assistant mask."""
    plain = save_chat_tokenizer(str(tmp_path / "plain"), template=CHATML_PLAIN)
    prepare([sft["chat"]], out_dir=str(tmp_path / "p"), tokenizer=plain, fmt="chat", val_fraction=0, progress=False)
    for name in ("train-00000.bin", "train-mask-00000.bin", "train-docs-00000.bin"):
        with open(os.path.join(sft["train"], name), "rb") as a, open(str(tmp_path / "p" / name), "rb") as b:
            assert a.read() == b.read(), name
    rows = write_jsonl(str(tmp_path / "prompts.jsonl"), prompt_rows(sft["convs"]))
    meta = prepare(
        [rows], out_dir=str(tmp_path / "q"), tokenizer=sft["tok"], fmt="auto", val_fraction=0, progress=False
    )
    assert meta["document_format"] == "prompt" and meta["loss_on"] == "completion"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(sft["tok"])
    ds = build_tokens(str(tmp_path / "q"), block_size=256, packing="padded")
    targets = [t for i in range(len(ds)) for _, t in ds[i].docs]
    text = "".join(tok.decode([int(x) for x in t if x != -100]) for t in targets)
    for r in prompt_rows(sft["convs"]):
        assert r["completion"] + "<|im_end|>" in text and r["prompt"] not in text


def test_batched_chat_masks_are_transformers_assistant_masks(sft, tmp_path, monkeypatch):
    """prepare encodes conversations in batches and finds the assistant tokens from the
    characters at each {% generation %} span's edges, not transformers' loop over every token;
    the ids and masks must be ``apply_chat_template(..., return_assistant_tokens_mask=True)``'s,
    byte for byte: with multi-byte characters at the edges (one character, several byte tokens),
    spans that end inside a character, a BPE whose merges cross them, a whitespace-splitting
    tokenizer (edges in no token), an empty assistant turn and None-valued keys."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from paratrain.data import chat
    from paratrain.data.chat import _encode_batch, _generation_mask, _render_with_spans
    from paratrain.testing.sft_data import CHATML

    tricky = [
        [
            {"role": "user", "content": "héllo 😀"},
            {"role": "assistant", "content": "😀é wörld ñ😀", "tool_calls": None},
        ],
        [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": " spaced  out "}],
    ]
    convs = [c["messages"] for c in sft["convs"][:8]] + tricky
    texts = [m["content"] for c in convs for m in c]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    for kind in ("bpe", "words"):
        model = models.BPE(unk_token="<unk>") if kind == "bpe" else models.WordLevel(unk_token="<unk>")
        raw = Tokenizer(model)
        if kind == "bpe":
            raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            trainer = trainers.BpeTrainer(
                vocab_size=400,
                special_tokens=["<unk>", *specials],
                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            )
        else:
            raw.pre_tokenizer = pre_tokenizers.Whitespace()  # spaces are in no token
            trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", *specials])
        raw.train_from_iterator(texts, trainer)
        fast = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>")
        fast.chat_template = CHATML
        fast.save_pretrained(str(tmp_path / kind))
    # The turn's end outside the span, which then ends in the content's last character.
    content_only = CHATML.replace(
        "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}",
        "{% generation %}{{ message['content'] }}{% endgeneration %}{{ '<|im_end|>' }}",
    )
    assert content_only != CHATML
    save_chat_tokenizer(str(tmp_path / "content"), template=content_only)
    for path in (sft["tok"], *(str(tmp_path / k) for k in ("content", "bpe", "words"))):
        tok = AutoTokenizer.from_pretrained(path)
        refs = [
            tok.apply_chat_template(c, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            for c in convs
        ]
        # The rule itself (the batch's own check against apply_chat_template would hide a fault).
        texts, spans = _render_with_spans(tok, convs)
        out = tok(texts, add_special_tokens=False)
        for c, ref, row, enc, s in zip(convs, refs, out["input_ids"], out.encodings, spans):
            assert row == ref["input_ids"], path
            assert _generation_mask(enc, len(row), s).tolist() == ref["assistant_masks"], (path, c)
        got = _encode_batch(tok, [(c, 0, "row") for c in convs])
        assert [(i.tolist(), m.tolist()) for i, m in got] == [(r["input_ids"], r["assistant_masks"]) for r in refs]
    # A rule that disagrees with transformers on a batch's first row: the batch is transformers'.
    monkeypatch.setattr(chat, "_generation_mask", lambda enc, n, spans: np.zeros(n, dtype=np.uint8))
    got = _encode_batch(tok, [(c, 0, "row") for c in convs])
    assert [(i.tolist(), m.tolist()) for i, m in got] == [(r["input_ids"], r["assistant_masks"]) for r in refs]


def test_bad_chat_input_is_one_line(sft, tmp_path):
    bad = write_jsonl(str(tmp_path / "bad.jsonl"), [{"messages": [{"role": "tool", "content": "x"}]}])
    with pytest.raises(ConfigError, match="bad.jsonl:1: the chat template rejects this row"):
        prepare([bad], out_dir=str(tmp_path / "o1"), tokenizer=sft["tok"], fmt="chat", progress=False)
    missing = write_jsonl(str(tmp_path / "m.jsonl"), [{"text": "hello"}])
    with pytest.raises(ConfigError, match="m.jsonl:1: no list field 'messages'"):
        prepare([missing], out_dir=str(tmp_path / "o2"), tokenizer=sft["tok"], fmt="chat", progress=False)
    none = save_chat_tokenizer(str(tmp_path / "none"), template=None)
    with pytest.raises(ConfigError, match="has no chat_template; pass --chat-template FILE"):
        prepare([sft["chat"]], out_dir=str(tmp_path / "o3"), tokenizer=none, fmt="chat", progress=False)
    users = write_jsonl(str(tmp_path / "u.jsonl"), [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ConfigError, match="no row with an assistant token"):
        prepare([users], out_dir=str(tmp_path / "o4"), tokenizer=sft["tok"], fmt="chat", progress=False)
    assert not os.path.exists(str(tmp_path / "o4" / "meta.json"))  # nothing written as complete


# ----------------------------------------------------------------------------- layouts


def test_padded_documents_give_the_packed_losses(sft, gpt_reference):
    """The same documents each on a row of its own (plain causal attention, positions from 0):
    packing changes nothing. Fails if packed rows leak attention or do not restart positions
    (the GPT's learned positions see an offset, where RoPE's relative positions would not)."""
    import paratrain

    name = "gpt_padded"
    over = sft_gpt(sft, name, "batch.micro_batch_size=4", packing="padded")
    paratrain.train(paratrain.load_config(None, over))
    losses, norms = losses_and_norms(os.path.join(sft["root"], name))
    torch.testing.assert_close(losses, gpt_reference[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(norms, gpt_reference[1], rtol=1e-5, atol=0)


def test_auto_micro_batch_on_packed_rows(sft, gpt_reference):
    """``batch.micro_batch_size = 'auto'`` runs the step on fake tensors, packed rows' document
    positions included: it once failed on every layout (DynamicOutputShapeException from the
    attention count's boolean indexing, `paratrain train configs/sft.toml` with 'auto')."""
    import paratrain

    name = "gpt_auto"
    paratrain.train(paratrain.load_config(None, sft_gpt(sft, name, "batch.micro_batch_size='auto'")))
    losses, norms = losses_and_norms(os.path.join(sft["root"], name))
    torch.testing.assert_close(losses, gpt_reference[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(norms, gpt_reference[1], rtol=1e-5, atol=0)


def test_two_ranks_with_accumulation_give_the_one_process_losses(sft, gpt_reference):
    from paratrain.testing.dist_utils import run_ranks, train_rank

    name = "gpt_ddp_accum"
    run_ranks(train_rank, 2, sft_gpt(sft, name, "parallel.dp_replicate=2", "batch.micro_batch_size=1"))
    losses, norms = losses_and_norms(os.path.join(sft["root"], name))
    torch.testing.assert_close(losses, gpt_reference[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(norms, gpt_reference[1], rtol=1e-5, atol=0)


def test_pipeline_stages_get_the_positions(sft, gpt_reference):
    """pp = 2 (1F1B): the second stage builds its document mask from the positions the schedule
    hands every stage. Fails (grad_norm off by 1e-4) if a later stage falls back to the causal mask."""
    from paratrain.testing.dist_utils import run_ranks, train_rank

    name = "gpt_pp_1f1b"
    over = sft_gpt(sft, name, "parallel.pp=2", "parallel.pp_schedule='1f1b'", "batch.micro_batch_size=4")
    run_ranks(train_rank, 2, over + ["parallel.pp_microbatches=2"])
    losses, norms = losses_and_norms(os.path.join(sft["root"], name))
    torch.testing.assert_close(losses, gpt_reference[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(norms, gpt_reference[1], rtol=1e-5, atol=0)


def test_flex_attention_evaluates_like_sdpa_and_refuses_cpu_training(sft):
    """``model.args.attention = "flex"`` (FlexAttention with the documents' BlockMask, the GPU
    path): the validation loss of packed rows equals SDPA with the boolean mask. Training with it
    on CPU, which torch cannot (no FlexAttention backward there), is one line."""
    import paratrain

    def val_loss(attention: str) -> float:
        over = sft_gpt(sft, f"flex_{attention}", "batch.micro_batch_size=4")
        over += [
            f"model.args={{n_layer = 2, n_head = 4, d_model = 32, block_size = 256, attention = '{attention}'}}",
            f"data.args={{path = '{sft['val']}', block_size = 256}}",
        ]
        return eval_checkpoint(load_config(None, over), "")["val_loss"]

    torch.testing.assert_close(val_loss("flex"), val_loss("sdpa"), rtol=1e-6, atol=0)
    over = sft_gpt(sft, "flex_train", "run.steps=1", "model.args.attention='flex'")
    with pytest.raises(ConfigError, match="'flex' trains on GPU only"):
        paratrain.train(paratrain.load_config(None, over))


SLOW_LAYOUTS = {
    2: {
        "gpt_pp_gpipe": ["parallel.pp=2", "parallel.pp_schedule='gpipe'", "batch.micro_batch_size=4"],
        "gpt_ddp_compile": ["parallel.dp_replicate=2", "train.compile=true", "batch.micro_batch_size=4"],
        "gpt_fsdp": ["parallel.dp_shard=2", "batch.micro_batch_size=2"],
        "gpt_tp": ["parallel.tp=2", "batch.micro_batch_size=4"],
        "gpt_tp_sp": ["parallel.tp=2", "parallel.sequence_parallel=true", "batch.micro_batch_size=4"],
        "gpt_ddp_padded_ac": [
            "parallel.dp_replicate=2",
            "parallel.activation_checkpointing='full'",
            "batch.micro_batch_size=4",
        ],
    },
    4: {
        "gpt_ddp4_accum": ["parallel.dp_replicate=4", "batch.micro_batch_size=1"],
        "gpt_fsdp_tp": ["parallel.dp_shard=2", "parallel.tp=2", "batch.micro_batch_size=2"],
        "gpt_pp_fsdp": [
            "parallel.pp=2",
            "parallel.dp_shard=2",
            "parallel.pp_schedule='1f1b'",
            "batch.micro_batch_size=2",
        ],
        "gpt_pp_tp": ["parallel.pp=2", "parallel.tp=2", "parallel.pp_schedule='gpipe'", "batch.micro_batch_size=4"],
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(SLOW_LAYOUTS))
def test_every_layout_gives_the_one_process_losses(sft, gpt_reference, world):
    """DDP, FSDP2, TP (with sequence parallel), PP (gpipe, 1f1b), FSDP2 x TP, PP x FSDP2, PP x TP,
    activation checkpointing, compile, accumulation and padding at worlds 2 and 4: losses and
    grad_norm within 1e-5 (DP, PP) / 1e-4 (sharded, compiled) of one process."""
    from paratrain.testing.dist_utils import run_ranks, train_layouts

    runs = {
        name: [
            o
            for o in sft_gpt(sft, name, *extra, packing="padded" if "padded" in name else "documents")
            if not o.startswith("run.out_dir")
        ]
        for name, extra in SLOW_LAYOUTS[world].items()
    }
    run_ranks(train_layouts, world, runs, sft["root"], timeout=900)
    for name in runs:
        losses, norms = losses_and_norms(os.path.join(sft["root"], name))
        tol = 1e-4 if any(k in name for k in ("fsdp", "tp", "compile")) else 1e-5
        torch.testing.assert_close(losses, gpt_reference[0], rtol=tol, atol=0, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(norms, gpt_reference[1], rtol=tol, atol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_pipelined_hf_model_equals_transformers_on_each_conversation_alone(sft):
    """A Llama in two pipeline stages (1F1B) at world 2, one SGD step over every conversation:
    loss and grad_norm equal plain transformers on each conversation alone."""
    from paratrain.testing.dist_utils import run_ranks, train_rank

    ref_loss, ref_items, ref_norm = reference(sft, sft["convs"])
    rows = len(build_tokens(sft["train"], block_size=512))
    name = "hf_pp"
    over = sft_config(sft, sft["train"], name, f"batch.global_batch_size={rows}", "run.steps=1", "parallel.pp=2")
    run_ranks(train_rank, 2, over + ["parallel.pp_schedule='1f1b'", f"batch.micro_batch_size={rows}"])
    (row,) = read_metrics(os.path.join(sft["root"], name))
    assert row["trainable_tokens"] == ref_items
    torch.testing.assert_close(row["loss"], ref_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(row["grad_norm"], ref_norm, rtol=1e-5, atol=0)


@pytest.mark.slow  # about 30 s: four tiny HF trainings
def test_gpu_sft_check_script_runs_on_cpu():
    """benchmarks/gpu/gpu_sft.py (the GPU check of this issue, for a task lent a device) works here."""
    import subprocess
    import sys

    repo = REPO
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(repo, "src"), repo]), "OMP_NUM_THREADS": "1"}
    script = os.path.join(repo, "benchmarks", "gpu", "gpu_sft.py")
    out = subprocess.run(
        [sys.executable, script, "--dry-run-cpu"], capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for run in ("hf documents, chunk 0", "hf padded, chunk 1024"):
        assert run in out.stdout, out.stdout[-2000:]


@pytest.mark.slow
def test_lora_on_packed_conversations(sft):
    """LoRA on the fine-tuning path (packed documents, assistant-only loss): the first loss is
    transformers' own on each conversation alone (B starts at zero, so the adapted model is the
    base); full activation checkpointing, and FSDP2 with selective checkpointing at world 2, give
    the one-process losses and grad_norm over two plain SGD steps."""
    import paratrain
    from paratrain.testing.dist_utils import run_ranks, train_layouts

    ref_loss, _, _ = reference(sft, sft["convs"])
    rows = len(build_tokens(sft["train"], block_size=512))
    lora = ["model.lora.r=4", "model.lora.alpha=8", "model.lora.target_modules='all-linear'"]
    every = [*lora, f"batch.global_batch_size={rows}", "run.steps=1"]  # one batch of every row
    paratrain.train(load_config(None, sft_config(sft, sft["train"], "lora_all", *every)))
    (first,) = read_metrics(os.path.join(sft["root"], "lora_all"))
    torch.testing.assert_close(first["loss"], ref_loss, rtol=1e-5, atol=0)

    two = [*lora, f"batch.global_batch_size={rows - rows % 2}", "run.steps=2"]  # dp 2 divides it
    paratrain.train(load_config(None, sft_config(sft, sft["train"], "lora_ref", *two)))
    paratrain.train(
        load_config(None, sft_config(sft, sft["train"], "lora_ac", *two, "parallel.activation_checkpointing='full'"))
    )
    fsdp = sft_config(
        sft, sft["train"], "lora_fsdp", *two, "parallel.dp_shard=2", "parallel.activation_checkpointing='selective'"
    )
    run_ranks(train_layouts, 2, {"lora_fsdp": fsdp}, sft["root"], timeout=600)
    ref = read_metrics(os.path.join(sft["root"], "lora_ref"))
    for name in ("lora_ac", "lora_fsdp"):
        got = read_metrics(os.path.join(sft["root"], name))
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(
                [r[key] for r in got], [r[key] for r in ref], rtol=1e-5, atol=0, msg=lambda m: f"{name} {key}: {m}"
            )
