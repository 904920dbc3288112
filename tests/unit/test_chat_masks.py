"""The loss masks of `prepare --loss-on last/all`, and the batched mask's fallback said once.

The default (`assistant`) is what tests/distributed/test_sft.py checks against transformers; these are the
other choices a user can make, checked on the tokens the training targets hold.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from paratrain.data.prepare import prepare
from paratrain.data.tokens import build_tokens
from paratrain.testing.sft_data import CHATML, CHATML_PLAIN, save_chat_tokenizer, write_jsonl

pytest.importorskip("transformers")

CONVERSATIONS = [
    {
        "messages": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is os for?"},
            {"role": "assistant", "content": "FIRST reply about os."},
            {"role": "user", "content": "Name one function."},
            {"role": "assistant", "content": "LAST reply: os.getcwd."},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "And json?"},
            {"role": "assistant", "content": "ONLY reply: json.dumps."},
        ]
    },
]


def _trained_text(tmp_path, template: str, loss_on: str) -> list[str]:
    """What each prepared document trains on (its targets, decoded), one string per conversation."""
    from transformers import AutoTokenizer

    name = "marks" if template == CHATML else "plain"
    tok_dir = save_chat_tokenizer(str(tmp_path / f"tok-{name}"), template=template)
    rows = write_jsonl(str(tmp_path / "chat.jsonl"), CONVERSATIONS)
    out = str(tmp_path / f"{name}-{loss_on}")
    meta = prepare([rows], out_dir=out, tokenizer=tok_dir, fmt="chat", val_fraction=0, progress=False, loss_on=loss_on)
    assert meta["loss_on"] == loss_on
    tok = AutoTokenizer.from_pretrained(tok_dir)
    ds = build_tokens(out, block_size=256, packing="padded")
    docs = [t for i in range(len(ds)) for _, t in ds[i].docs]
    assert len(docs) == len(CONVERSATIONS)
    return sorted(tok.decode([int(x) for x in t if x != -100]) for t in docs)


@pytest.mark.parametrize("template", [CHATML, CHATML_PLAIN], ids=["generation-marks", "prefixes"])
def test_loss_on_last_trains_the_last_assistant_turn_only(tmp_path, template):
    assert _trained_text(tmp_path, template, "last") == [
        "LAST reply: os.getcwd.<|im_end|>",
        "ONLY reply: json.dumps.<|im_end|>",
    ]
    both = _trained_text(tmp_path, template, "assistant")
    assert "FIRST reply about os.<|im_end|>" in both[0] and "LAST reply: os.getcwd.<|im_end|>" in both[0], both


def test_loss_on_all_trains_every_token_but_the_first(tmp_path):
    first = next(t for t in _trained_text(tmp_path, CHATML, "all") if "os" in t)
    assert all(s in first for s in ("What is os for?", "FIRST reply", "Name one function.", "LAST reply")), first


def test_a_batched_mask_that_disagrees_with_transformers_is_said_once(tmp_path, monkeypatch, caplog):
    from transformers import AutoTokenizer

    from paratrain.data import chat

    tok = AutoTokenizer.from_pretrained(save_chat_tokenizer(str(tmp_path / "tok")))
    rows = [(c["messages"], 0, f"row {i}") for i, c in enumerate(CONVERSATIONS)]
    monkeypatch.setattr(chat, "_fell_back", [])
    caplog.set_level(logging.WARNING, logger="paratrain")
    good = chat._encode_batch(tok, rows)
    assert not caplog.records
    monkeypatch.setattr(chat, "_generation_mask", lambda enc, n, spans: np.zeros(n, dtype=np.uint8))
    for _ in range(2):
        got = chat._encode_batch(tok, rows)
        assert [(i.tolist(), m.tolist()) for i, m in got] == [(i.tolist(), m.tolist()) for i, m in good]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "transformers' own masks" in lines[0], lines


def test_chat_template_file_replaces_the_tokenizers_and_a_missing_one_is_one_line(tmp_path):
    """--chat-template FILE (data/chat.py read_chat_template, also load_processor's)."""
    from paratrain.config import ConfigError
    from paratrain.data.chat import load_chat_tokenizer

    tok_dir = save_chat_tokenizer(str(tmp_path / "tok"), template=CHATML)
    (tmp_path / "plain.jinja").write_text(CHATML_PLAIN)
    assert load_chat_tokenizer(tok_dir, str(tmp_path / "plain.jinja")).chat_template == CHATML_PLAIN
    with pytest.raises(ConfigError, match="no such file; give a Jinja template file"):
        load_chat_tokenizer(tok_dir, str(tmp_path / "missing.jinja"))
