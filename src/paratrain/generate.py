"""Sample text from a trained model: ``paratrain generate OUT_DIR --prompt "def "``.

Byte-level runs decode bytes; runs on ``data.name = 'tokens'`` decode with the tokenizer the
corpus was prepared with (its ``tokenizer.json``, found through the run's config.toml).
``--chat MESSAGE`` renders one user turn through the chat template of a conversation corpus
(``paratrain prepare --format chat`` keeps the transformers tokenizer beside the shards) and
prints the reply, up to the template's end of turn.

A ``model.hf`` run samples with transformers' own ``generate`` and a transformers tokenizer (the
chat corpus's, else the model.hf directory's): full fine-tuning from ``out_dir/hf``, a LoRA run
from its ``model.safetensors`` loaded into the transformers model with PEFT's adapters injected
as training had them (``load_hf_run``).

An image-text run (docs/vision-language.md) answers ``--chat MESSAGE --image PATH`` (repeatable):
the user turn is the images then the text, rendered by the run's processor (its chat template,
its image processor, the image tokens expanded) and decoded by transformers' ``generate`` of the
family's own class (``load_vision_run``); ``--temperature 0`` decodes greedily.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file

from paratrain.config import ConfigError, load_config
from paratrain.data.prepare import load_tokenizer
from paratrain.data.tokens import resolve_model_vocab, tokens_meta
from paratrain.models import build_model
from paratrain.models.lora import apply_lora


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
    if _is_hf_run(out_dir):  # a model.hf run (full or LoRA): transformers' own generate and tokenizer
        cfg = _run_config(out_dir)
        tok = _hf_tokenizer(out_dir, cfg, chat=False)
        model = load_hf_run(out_dir, cfg)
        ids = tok(prompt or tok.bos_token or " ", return_tensors="pt").input_ids
        out = _sample_hf(
            model, tok, ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed
        )
        return tok.decode(out[0], skip_special_tokens=True)
    model, cfg = _load_run(out_dir)
    meta = tokens_meta(cfg.data)
    vocab = getattr(getattr(model, "cfg", None), "vocab_size", None)
    if meta is not None:
        tok = load_tokenizer(meta["path"])
        ids = tok.encode(prompt) or [tok.eos_id]
    else:
        tok, ids = None, list(prompt.encode("utf-8")) or [10]
    if not hasattr(model, "generate"):
        what = f"model.factory = {cfg.model.factory!r}" if cfg.model.factory else f"model.name = {cfg.model.name!r}"
        raise ConfigError(
            f"generate: the run {out_dir!r} trained {what}, which has no generate(); paratrain samples from the"
            " built-in GPT (on bytes or a prepared corpus) and from model.hf runs; load model.safetensors yourself"
        )
    if meta is None and vocab != 256:
        raise ConfigError(
            f"generate: the run {out_dir!r} trained a GPT of vocab_size {vocab} on data.name = {cfg.data.name!r}"
            f"{' (a data.factory)' if cfg.data.factory else ''}: no tokenizer to encode the prompt with (bytes need"
            " 256, a prepared corpus keeps its own); decode its model.safetensors with your tokenizer"
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
    return chat_turn(out_dir, message, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed)[
        0
    ]


def chat_turn(
    out_dir: str,
    message: str,
    *,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
    images: list[str] | None = None,
) -> tuple[str, str | None]:
    """:func:`chat_reply`, and a note when the reply is empty (:func:`empty_reply_note`), else None.
    ``images``: image files shown before the message (an image-text run only)."""
    options = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed)
    hf = _is_hf_run(out_dir)
    if hf and _is_vision_run(out_dir, _run_config(out_dir)):
        return image_chat_turn(out_dir, message, images or [], **options)
    if images:
        raise ConfigError(
            f"generate --image: the run {out_dir!r} trained a text-only model; drop --image, or pass the run of an"
            " image-text model.hf (docs/vision-language.md)"
        )
    model, cfg = (None, _run_config(out_dir)) if hf else _load_run(out_dir)
    tok = _hf_tokenizer(out_dir, cfg, chat=True)
    ids = tok.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"]) if isinstance(ids, dict) or hasattr(ids, "keys") else list(ids)
    idx = torch.tensor([ids], dtype=torch.long)
    if hf:
        out = _sample_hf(
            load_hf_run(out_dir, cfg),
            tok,
            idx,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            seed=seed,
        )
    else:
        out = model.generate(
            idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=torch.Generator().manual_seed(seed)
        )
    reply = out[0, len(ids) :].tolist()
    if tok.eos_token_id in reply:
        reply = reply[: reply.index(tok.eos_token_id)]
    text = tok.decode(reply, skip_special_tokens=True)
    return text, empty_reply_note(text, reply, eos=tok.eos_token)


def empty_reply_note(text: str, reply: list[int], *, eos: str | None) -> str | None:
    """Why a reply prints as an empty line (a bare empty line looks like a failure), or None when
    it does not: the reply ended at once, or its tokens decode to nothing visible."""
    if text.strip():
        return None
    if not reply:
        return f"(the reply ended at once: the model's first token was end-of-turn {eos!r})"
    return f"(the reply is {len(reply)} tokens that print as nothing: special tokens or white space)"


def _run_config(out_dir: str):
    path = os.path.join(out_dir, "config.toml")
    if not os.path.isfile(path):
        raise ConfigError(f"'{path}' not found; pass the run.out_dir of a finished `paratrain train` run")
    return load_config(path)


def read_images(paths: list[str]) -> list:
    """The RGB images of ``--image`` paths; a missing or unreadable one is one line naming it."""
    from PIL import Image  # with the image extra (transformers' image processors read PIL images)

    out = []
    for path in paths:
        try:
            with Image.open(path) as img:
                out.append(img.convert("RGB"))
        except (OSError, ValueError) as e:  # PIL's UnidentifiedImageError is an OSError
            raise ConfigError(
                f"generate --image {path}: missing or unreadable ({type(e).__name__}); pass an image file (PNG, JPEG)"
            ) from None
    return out


def image_chat_turn(
    out_dir: str, message: str, images: list[str], *, max_new_tokens: int, temperature: float, top_k: int, seed: int
) -> tuple[str, str | None]:
    """One reply of an image-text run to ``images`` then ``message`` (one user turn): the run's
    processor renders it as prepare rendered the training rows (chat template, image tokens
    expanded), transformers' ``generate`` decodes it."""
    pictures = read_images(images)  # before the model loads: a bad path costs nothing
    cfg = _run_config(out_dir)
    processor = _hf_processor(out_dir, cfg)
    content = [*({"type": "image"} for _ in pictures), {"type": "text", "text": message}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    enc = processor(text=[text], images=pictures or None, return_tensors="pt")
    tok = processor.tokenizer
    ids = enc.pop("input_ids")
    enc.pop("attention_mask", None)
    opts = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed)
    out = _sample_hf(load_vision_run(out_dir, cfg), tok, ids, **opts, **enc)
    reply = out[0, ids.shape[1] :].tolist()
    if tok.eos_token_id in reply:
        reply = reply[: reply.index(tok.eos_token_id)]
    text = tok.decode(reply, skip_special_tokens=True)
    return text, empty_reply_note(text, reply, eos=tok.eos_token)


def _is_vision_run(out_dir: str, cfg) -> bool:
    from paratrain.models.hf.vision import is_vision_dir  # reads config.json only

    return is_vision_dir(cfg.model.hf) or is_vision_dir(os.path.join(out_dir, "hf"))


def _hf_processor(out_dir: str, cfg):
    """The processor the run's corpus was prepared with (``hf_processor/`` beside its shards), else
    model.hf's, else the one ``out_dir/hf`` was written with."""
    from transformers import AutoProcessor  # an optional extra: paratrain[hf]

    meta = tokens_meta(cfg.data) or {}
    saved = (meta.get("images") or {}).get("processor")
    paths = [os.path.join(meta["path"], saved)] if saved else []
    for path in [*paths, cfg.model.hf, os.path.join(out_dir, "hf")]:
        if path and os.path.isfile(os.path.join(path, "processor_config.json")):
            return AutoProcessor.from_pretrained(path)
    raise ConfigError(
        f"generate: the image-text run {out_dir!r} has no processor (processor_config.json) in its corpus,"
        f" model.hf {cfg.model.hf!r} or hf/; add the model's processor files to model.hf"
    )


def load_vision_run(out_dir: str, cfg) -> torch.nn.Module:
    """The trained transformers image-text model of a run (``load_hf_run`` for its family's class):
    full fine-tuning from ``out_dir/hf``; a LoRA run from ``model.safetensors`` into the model with
    PEFT's adapters injected where training put them (models/hf/vision.py)."""
    from transformers import AutoModelForImageTextToText  # an optional extra: paratrain[hf]

    # Beside transformers: these modules need the optional extra too, only for model.hf runs.
    from paratrain.models.hf.vision import (  # transformers too (the same extra)
        HFVisionLM,
        image_text_model_from_config,
        lora_keep_out,
    )

    return _load_hf_family_run(
        out_dir,
        cfg,
        AutoModelForImageTextToText,
        image_text_model_from_config,
        HFVisionLM,
        keep_out=lambda config: lora_keep_out(cfg.model, config),
    )


def _final_weights(out_dir: str) -> str:
    weights = os.path.join(out_dir, "model.safetensors")
    if not os.path.isfile(weights):
        raise ConfigError(
            f"'{weights}' not found; the run {out_dir!r} saved no final weights (run.save_model = false, or it"
            " did not finish): train it to the end, or export a checkpoint with paratrain export"
        )
    return weights


def _is_hf_run(out_dir: str) -> bool:
    """A model.hf run: its transformers directory (full fine-tuning) or its config says so (LoRA)."""
    if os.path.isfile(os.path.join(out_dir, "hf", "config.json")):
        return True
    path = os.path.join(out_dir, "config.toml")
    return os.path.isfile(path) and bool(load_config(path).model.hf)


def load_hf_run(out_dir: str, cfg) -> torch.nn.Module:
    """The trained transformers model of a ``model.hf`` run, ready for ``generate``.

    Full fine-tuning wrote ``out_dir/hf`` (from_pretrained reads it); a LoRA run wrote its weights,
    adapters included, to ``model.safetensors`` under paratrain's names: the model is built on the
    CPU as training built it (PEFT's adapters injected into the transformers model) and loaded
    through the wrapper that shares its modules, so transformers' ``generate`` runs the adapters.
    """
    if cfg.model.head == "score":
        # Its hf/ folder is a sequence classifier: read as a causal LM it got a random LM head and
        # sampled noise, with exit code 0.
        raise ConfigError(
            f"generate: the run {out_dir!r} trained a reward model (model.head = 'score'), which scores a text and"
            " writes none; load its hf/ folder with transformers' AutoModelForSequenceClassification"
        )
    from transformers import AutoModelForCausalLM  # an optional extra: paratrain[hf]

    # Beside transformers: these modules need the optional extra too, only for model.hf runs.
    from paratrain.models.hf.model import HFCausalLM, causal_lm_from_config

    if _is_vision_run(out_dir, cfg):  # its family's own class, the processor's rendering
        return load_vision_run(out_dir, cfg)
    return _load_hf_family_run(out_dir, cfg, AutoModelForCausalLM, causal_lm_from_config, HFCausalLM)


def _load_hf_family_run(
    out_dir: str, cfg, auto_class, from_config, wrapper, keep_out=lambda config: None
) -> torch.nn.Module:
    """``out_dir/hf`` through ``auto_class``, else ``model.safetensors`` (paratrain's names, LoRA
    adapters included) through ``wrapper`` into the model ``from_config`` builds as training did."""
    # Beside transformers: these modules need the optional extra too, only for model.hf runs.
    from paratrain.models.hf.model import load_hf_config
    from paratrain.models.hf.weights import quiet_progress  # transformers too (the same extra)

    if os.path.isfile(os.path.join(out_dir, "hf", "config.json")):
        with quiet_progress():
            return auto_class.from_pretrained(os.path.join(out_dir, "hf")).eval()
    weights = _final_weights(out_dir)
    hf_model = from_config(load_hf_config(cfg.model.hf, cfg.model.args))
    if cfg.model.lora.enabled:
        apply_lora(hf_model, cfg.model.lora, keep_out=keep_out(hf_model.config))
    wrapper(hf_model).load_state_dict(load_file(weights))
    hf_model.config.use_cache = True  # training turned the cache off; sampling wants it
    return hf_model.eval()


def _sample_hf(model, tok, ids, *, max_new_tokens: int, temperature: float, top_k: int, seed: int, **inputs):
    """transformers' generate from ``ids`` (and ``inputs``: an image-text model's pixel values);
    ``temperature`` 0: greedy."""
    torch.manual_seed(seed)
    # Token 0 is a real token in many vocabularies: pad with the tokenizer's own pad (or end) token.
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    sampling = dict(do_sample=True, temperature=temperature, top_k=top_k) if temperature > 0 else dict(do_sample=False)
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            eos_token_id=tok.eos_token_id,
            pad_token_id=pad,
            **sampling,
            **inputs,
        )


def _hf_tokenizer(out_dir: str, cfg, *, chat: bool):
    """The run's transformers tokenizer: its chat corpus's, else its model.hf directory's, else the
    one ``out_dir/hf`` was written with; with ``chat``, the first that has a chat template."""
    try:
        from transformers import AutoTokenizer  # an optional extra: paratrain[hf]
    except ImportError:
        raise ConfigError("generate needs transformers for this run: pip install 'paratrain[hf]'") from None
    meta = tokens_meta(cfg.data)
    corpus_tok = (meta or {}).get("tokenizer", {}).get("transformers_dir")
    paths = [os.path.join(meta["path"], corpus_tok)] if corpus_tok else []
    paths += [p for p in (cfg.model.hf, os.path.join(out_dir, "hf")) if p]
    for path in paths:
        if os.path.isfile(os.path.join(path, "tokenizer_config.json")):
            tok = AutoTokenizer.from_pretrained(path)
            if tok.chat_template or not chat:
                return tok
    if chat:
        raise ConfigError(
            f"generate --chat: the run {out_dir!r} has no chat template (neither its corpus, prepared with"
            " --format chat, nor its model.hf directory has one); use --prompt"
        )
    raise ConfigError(
        f"generate: the run {out_dir!r} has no transformers tokenizer to encode the prompt (its model.hf"
        f" directory {cfg.model.hf!r} has no tokenizer files); add them to that directory"
    )
