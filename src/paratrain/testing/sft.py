"""The supervised fine-tuning tests' corpus (a chat tokenizer, stdlib conversations, a tiny Llama,
prepared train and val corpora), their reference (plain transformers on each conversation alone)
and the overrides of their runs; transformers is imported where it is used."""

from __future__ import annotations

import torch

from paratrain.data.prepare import prepare
from paratrain.testing.dist_utils import plain_sgd, read_metrics
from paratrain.testing.hf_models import save_tiny
from paratrain.testing.sft_data import VOCAB, save_chat_tokenizer, stdlib_conversations, write_jsonl

SGD = [*plain_sgd(0.1), "run.progress=false", "metrics.plot=false"]


def sft_corpus(root) -> dict:
    """A tokenizer with a chat template, 24 conversations, a tiny Llama of the tokenizer's
    vocabulary, and two corpora: every conversation in train, and every one in val."""
    tok = save_chat_tokenizer(str(root / "tok"))
    convs = stdlib_conversations(24)
    chat = write_jsonl(str(root / "chat.jsonl"), convs)
    model = save_tiny("llama", str(root / "llama"), vocab_size=VOCAB, max_position_embeddings=512)
    train = str(root / "train")
    val = str(root / "val")
    prepare([chat], out_dir=train, tokenizer=tok, fmt="chat", val_fraction=0, progress=False)
    prepare([chat], out_dir=val, tokenizer=tok, fmt="chat", val_fraction=1, progress=False)
    return {"root": str(root), "tok": tok, "convs": convs, "chat": chat, "model": model, "train": train, "val": val}


def reference(sft: dict, convs: list[dict]) -> tuple[float, int, float]:
    """(mean loss, trainable tokens, gradient norm) of plain transformers over each conversation
    alone: its own labels= loss (mean over the conversation's targets), weighted back to a sum."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(sft["tok"])
    model = AutoModelForCausalLM.from_pretrained(sft["model"], attn_implementation="sdpa")
    total, count = 0.0, 0
    model.zero_grad()
    losses = []
    for c in convs:
        out = tok.apply_chat_template(c["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids = torch.tensor([out["input_ids"]])
        mask = torch.tensor([out["assistant_masks"]])
        labels = torch.where(mask.bool(), ids, -100)
        n = int((labels[0, 1:] != -100).sum())  # transformers shifts the labels inside
        loss = model(input_ids=ids, labels=labels).loss * n
        losses.append(loss)
        total, count = total + float(loss.detach()), count + n
    (torch.stack(losses).sum() / count).backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    return total / count, count, float(norm)


def sft_config(sft: dict, corpus: str, name: str, *extra: str) -> list[str]:
    return [
        f"model.hf='{sft['model']}'",
        "data.name='tokens'",
        f"data.args={{path = '{corpus}', block_size = 512}}",
        f"run.out_dir='{sft['root']}/{name}'",
        *SGD,
        *extra,
    ]


def sft_gpt(sft: dict, name: str, *extra: str, packing: str = "documents") -> list[str]:
    return [
        "model.name='gpt'",
        "model.args={n_layer = 2, n_head = 4, d_model = 32, block_size = 256}",
        "data.name='tokens'",
        f"data.args={{path = '{sft['train']}', block_size = 256, packing = '{packing}'}}",
        "batch.global_batch_size=8",
        "run.steps=3",
        f"run.out_dir='{sft['root']}/{name}'",
        *SGD,
        *extra,
    ]


def losses_and_norms(out_dir: str) -> tuple[torch.Tensor, torch.Tensor]:
    rows = read_metrics(out_dir)
    return torch.tensor([r["loss"] for r in rows]), torch.tensor([r["grad_norm"] for r in rows])
