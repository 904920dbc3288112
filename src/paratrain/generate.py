"""Sample text from a trained model: ``paratrain generate OUT_DIR --prompt "def "``.

Byte-level runs decode bytes; runs on ``data.name = 'tokens'`` decode with the tokenizer the
corpus was prepared with (its ``tokenizer.json``, found through the run's config.toml).
``--chat MESSAGE`` renders one user turn through the chat template of a conversation corpus
(``paratrain prepare --format chat`` keeps the transformers tokenizer beside the shards) and
prints the reply, up to the template's end of turn.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file

from paratrain.config import ConfigError, load_config
from paratrain.data.prepare import load_tokenizer
from paratrain.data.tokens import resolve_model_vocab, tokens_meta
from paratrain.models import build_model


def load_trained_model(out_dir: str) -> torch.nn.Module:
    return _load_run(out_dir)[0]


def _load_run(out_dir: str):
    cfg_path, weights = os.path.join(out_dir, "config.toml"), os.path.join(out_dir, "model.safetensors")
    for path in (cfg_path, weights):
        if not os.path.isfile(path):
            raise ConfigError(f"'{path}' not found; pass the run.out_dir of a finished `paratrain train` run")
    cfg = load_config(cfg_path)
    resolve_model_vocab(cfg.model, cfg.data)
    model = build_model(cfg.model)

    model.load_state_dict(load_file(weights))
    return model.eval(), cfg


def generate_text(
    out_dir: str, prompt: str, *, max_new_tokens: int = 200, temperature: float = 0.8, top_k: int = 40, seed: int = 0
) -> str:
    if os.path.isfile(os.path.join(out_dir, "hf", "config.json")):  # a model.hf run: its own format and tokenizer
        return generate_hf(
            os.path.join(out_dir, "hf"),
            prompt,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            seed=seed,
        )
    model, cfg = _load_run(out_dir)
    meta = tokens_meta(cfg.data)
    vocab = getattr(getattr(model, "cfg", None), "vocab_size", None)
    if meta is not None:
        tok = load_tokenizer(meta["path"])
        ids = tok.encode(prompt) or [tok.eos_id]
    else:
        tok, ids = None, list(prompt.encode("utf-8")) or [10]
    if not hasattr(model, "generate") or (meta is None and vocab != 256):
        raise ConfigError(
            "generate needs the built-in GPT (model.name = 'gpt') on bytes (vocab_size 256) or on data.name = 'tokens'"
        )
    idx = torch.tensor([ids], dtype=torch.long)
    out = model.generate(
        idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=torch.Generator().manual_seed(seed)
    )
    if tok is not None:
        return tok.decode(out[0].tolist())
    return bytes(out[0].tolist()).decode("utf-8", errors="replace")


def chat_reply(
    out_dir: str, message: str, *, max_new_tokens: int = 200, temperature: float = 0.8, top_k: int = 40, seed: int = 0
) -> str:
    """One reply of a fine-tuned run to ``message`` (a user turn) through its corpus's chat template."""
    model, cfg = (
        (None, load_config(os.path.join(out_dir, "config.toml"))) if _is_hf_run(out_dir) else _load_run(out_dir)
    )
    tok = _chat_tokenizer(out_dir, cfg)
    ids = tok.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"]) if isinstance(ids, dict) or hasattr(ids, "keys") else list(ids)
    idx = torch.tensor([ids], dtype=torch.long)
    if model is None:
        from transformers import AutoModelForCausalLM  # an optional extra: paratrain[hf]

        hf = AutoModelForCausalLM.from_pretrained(os.path.join(out_dir, "hf")).eval()
        torch.manual_seed(seed)
        out = hf.generate(
            idx,
            max_new_tokens=max_new_tokens,
            do_sample=True,
            temperature=temperature,
            top_k=top_k,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        )
    else:
        out = model.generate(
            idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=torch.Generator().manual_seed(seed)
        )
    reply = out[0, len(ids) :].tolist()
    if tok.eos_token_id in reply:
        reply = reply[: reply.index(tok.eos_token_id)]
    return tok.decode(reply, skip_special_tokens=True)


def _is_hf_run(out_dir: str) -> bool:
    return os.path.isfile(os.path.join(out_dir, "hf", "config.json"))


def _chat_tokenizer(out_dir: str, cfg):
    try:
        from transformers import AutoTokenizer  # an optional extra: paratrain[hf]
    except ImportError:
        raise ConfigError("generate --chat needs transformers: pip install 'paratrain[hf]'") from None
    meta = tokens_meta(cfg.data)
    corpus_tok = (meta or {}).get("tokenizer", {}).get("transformers_dir")
    for path in ([os.path.join(meta["path"], corpus_tok)] if corpus_tok else []) + [os.path.join(out_dir, "hf")]:
        if os.path.isfile(os.path.join(path, "tokenizer_config.json")):
            tok = AutoTokenizer.from_pretrained(path)
            if tok.chat_template:
                return tok
    raise ConfigError(
        f"generate --chat: the run {out_dir!r} has no chat template (neither its corpus, prepared with --format chat,"
        " nor its model.hf directory has one); use --prompt"
    )


def generate_hf(path: str, prompt: str, *, max_new_tokens: int, temperature: float, top_k: int, seed: int) -> str:
    """Sample with transformers' own generate and the tokenizer files the run's source directory had."""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer  # an optional extra: paratrain[hf]
    except ImportError:
        raise ConfigError("generating from a model.hf run needs transformers: pip install 'paratrain[hf]'") from None

    if not os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        raise ConfigError(f"{path} has no tokenizer files (the model.hf directory had none); add them to decode text")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = tok(prompt or tok.bos_token or " ", return_tensors="pt").input_ids
    torch.manual_seed(seed)
    # Token 0 is a real token in many vocabularies: pad with the tokenizer's own pad (or end) token.
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    out = model.generate(
        ids, max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature, top_k=top_k, pad_token_id=pad
    )
    return tok.decode(out[0], skip_special_tokens=True)
