"""Conversations and prompt/completion pairs as token ids and a loss mask, through transformers.

A row of a ``chat`` corpus holds ``messages = [{role, content}, ...]`` (the OpenAI / Hugging Face
chat format) or ShareGPT's ``conversations = [{from, value}, ...]`` (roles human, gpt, system:
mapped to user, assistant, system); a row of a ``prompt`` corpus holds ``prompt`` and ``completion`` (strings, or lists
of messages as TRL's conversational prompt-completion rows). Each is rendered by the tokenizer's
own ``chat_template`` through ``apply_chat_template`` (transformers' code, not ours), and the
document is exactly that rendering: nothing is appended, the template ends its turns.

The loss mask marks the tokens that are *predicted* (targets), as transformers' assistant mask
does: the assistant turns' tokens, their end-of-turn token included. Two ways to find them:

- the template marks them with ``{% generation %}`` ... ``{% endgeneration %}``: transformers'
  ``return_assistant_tokens_mask=True`` gives the mask (a row alone); batches of rows take the
  spans from the same transformers renderer and the same overlap rule without its per-token
  Python loop (``_generation_mask``; equal to it byte for byte, tests/distributed/test_sft.py);
- otherwise the conversation is rendered as growing prefixes: the text before assistant turn
  ``k`` (rendered with ``add_generation_prompt``) and the text up to its end. Both must be prefixes
  of the whole rendering (a template that rewrites earlier turns, e.g. one that drops past
  reasoning, breaks this: the row is refused with one line naming it), and the tokens whose text
  starts inside such a span, up to its end-of-turn token (the tokenizer's EOS), are the turn's.

``loss_on``: ``assistant`` (every assistant turn), ``last`` (the last one), ``all`` (every token).
A ``prompt`` row trains on its completion only.
"""

from __future__ import annotations

import json
import logging
import os
import re

import numpy as np

from paratrain.config import ConfigError

FORMATS = ("chat", "prompt", "preference", "unpaired", "text", "auto")
LOSS_ON = ("assistant", "last", "all")
HF_TOKENIZER_DIR = "hf_tokenizer"  # the transformers tokenizer, saved beside the shards
# Characters of conversations tokenized in one batch: as prepare's chunks of text, so that a
# batch's encodings (ids, offsets, masks) stay some tens of MB whatever the rows' count.
BATCH_CHARS = 1 << 20
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
# The tokenizer's outputs we use: ids (and offsets); transformers also builds a Python list of
# ones per token for the attention mask by default, about 13% of a batch's CPU here (a
# 150-conversation batch: 1.88 s with it, 1.63 s without, 1.60 s for tokenizers' encode_batch of
# the same text, as prepare of text does; min of 5, 2 shared cores).
NO_ATTENTION_MASK = {"return_attention_mask": False}
log = logging.getLogger("paratrain")
_fell_back: list[bool] = []  # the batched mask disagreed with transformers' (logged once)


def load_chat_tokenizer(path: str, chat_template: str = ""):
    """The transformers tokenizer of a directory (a model's, or one with tokenizer_config.json +
    tokenizer.json), with ``chat_template`` (a file) replacing its own; never a hub download."""
    if not os.path.isdir(path):
        raise ConfigError(
            f"--tokenizer {path!r}: --format chat/prompt needs a transformers tokenizer directory"
            " (tokenizer_config.json + tokenizer.json, e.g. the model's directory)"
        )
    try:
        tokenizer_class = _tokenizer_class(path)
    except ImportError:
        raise ConfigError(
            "--format chat/prompt needs transformers, which is not installed: pip install 'paratrain[hf]'"
        )
    try:
        tok = tokenizer_class.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise ConfigError(f"--tokenizer {path!r}: transformers cannot load it ({first})") from None
    if not getattr(tok, "is_fast", False):
        raise ConfigError(f"--tokenizer {path!r}: a fast tokenizer (tokenizer.json) is needed for the token offsets")
    if chat_template:
        tok.chat_template = read_chat_template(chat_template)
    if not tok.chat_template:
        raise ConfigError(
            f"--tokenizer {path!r} has no chat_template; pass --chat-template FILE (a Jinja chat template)"
        )
    return tok


def read_chat_template(chat_template: str) -> str:
    """The Jinja template in the file ``--chat-template`` names (the tokenizer's here, the
    processor's in data/images.py load_processor)."""
    if not os.path.isfile(chat_template):
        raise ConfigError(f"--chat-template {chat_template!r}: no such file; give a Jinja template file")
    with open(chat_template) as f:
        return f.read()


# tokenizer_config.json's names of transformers' generic tokenizers-library class (v5:
# PreTrainedTokenizerFast is an alias of TokenizersBackend).
_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _tokenizer_class(path: str):
    """The class that loads the tokenizer directory ``path``: transformers' ``AutoTokenizer``,
    or, for a tokenizer-only directory that names the generic backend, that class itself.

    ``AutoTokenizer``'s module imports ``configuration_utils``, which imports torch (through
    ``modeling_rope_utils``): 1-2 s of CPU before the first row, where ``prepare`` of text imports
    the tokenizers library alone. ``AutoTokenizer`` picks the class from
    ``tokenizer_config.json`` and, when there is one, the model's ``config.json`` (its model type can
    override the declared class), or runs the directory's own code (``auto_map``). Only where
    neither can apply (no ``config.json``, no ``auto_map``) and the declared class is the generic
    backend does it load ``TokenizersBackend``, with the same result; ``prepare`` saves its
    tokenizer that way (``hf_tokenizer`` beside the shards), so the workers and training take this
    path. Everything else goes through ``AutoTokenizer``."""
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            declared = json.load(f)
    except (OSError, ValueError):
        declared = {}
    generic = (
        isinstance(declared, dict)
        and declared.get("tokenizer_class") in _GENERIC_CLASSES
        and "auto_map" not in declared
        and not os.path.exists(os.path.join(path, "config.json"))
    )
    if generic:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend  # no torch import

        return TokenizersBackend
    from transformers import AutoTokenizer  # an optional extra: paratrain[hf]

    return AutoTokenizer


def has_generation_marks(tok) -> bool:
    return bool(_GENERATION.search(tok.chat_template or ""))


# ShareGPT's layout (Axolotl's and LlamaFactory's other format): ``conversations = [{from, value}]``
# with the roles human / gpt / system; mapped to the chat format's roles.
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}


def _sharegpt(messages: list) -> list:
    """Messages of either layout as ``{role, content}``: ``{from, value}`` renamed, human/gpt roles mapped."""
    out = []
    for m in messages:
        if isinstance(m, dict) and "role" not in m and "from" in m:
            m = {"role": m["from"], "content": m.get("value")}
        if isinstance(m, dict) and m.get("role") in SHAREGPT_ROLES:
            m = {**m, "role": SHAREGPT_ROLES[m["role"]]}
        out.append(m)
    return out


def detect_format(row: dict, where: str) -> str:
    """``auto``: the format a row's fields say."""
    if "messages" in row or "conversations" in row:
        return "chat"
    if "prompt" in row and "completion" in row and "label" in row:
        return "unpaired"
    if "prompt" in row and "completion" in row:
        return "prompt"
    if "chosen" in row and "rejected" in row:
        return "preference"
    if "text" in row:
        return "text"
    raise ConfigError(
        f"{where}: none of the fields messages (or ShareGPT's conversations), prompt + completion or text; pass"
        " --format with the row's format"
    )


def row_messages(row: dict, fmt: str, where: str) -> tuple[list[dict], int]:
    """(messages, index of the first message whose assistant turns train)."""
    if fmt == "chat":
        messages = row.get("messages", row.get("conversations"))
        if not isinstance(messages, list) or not messages:
            raise ConfigError(
                f"{where}: no list field 'messages' of {{role, content}} (or ShareGPT's 'conversations' of"
                " {from, value}); fix the row or pass --format"
            )
        return _checked(_sharegpt(messages), where), 0
    prompt, completion = row.get("prompt"), row.get("completion")
    if prompt is None or completion is None:
        raise ConfigError(f"{where}: a prompt row needs the fields 'prompt' and 'completion'; fix the row")
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    completion = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else completion
    if not isinstance(prompt, list) or not isinstance(completion, list):
        raise ConfigError(f"{where}: 'prompt' and 'completion' must be strings or lists of messages")
    return _checked(_sharegpt(prompt + completion), where), len(prompt)


def _checked(messages: list, where: str) -> list[dict]:
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ConfigError(
                f"{where}: every message needs a string 'role' and 'content' (got {m!r:.80}); fix the row"
            )
    return messages


def _render(tok, messages: list[dict], where: str, **kwargs):
    try:
        return tok.apply_chat_template(messages, **kwargs)
    except Exception as e:  # noqa: BLE001 - jinja's TemplateError or a raise_exception() of the template
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise ConfigError(f"{where}: the chat template rejects this row ({first}); fix the row or the template")


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of ones."""
    padded = np.concatenate([[0], mask.astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(padded))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def encode_conversation(tok, messages: list[dict], first: int, *, loss_on: str, where: str):
    """(token ids, target mask as uint8) of one conversation; the mask keeps the assistant turns
    from message ``first`` on (see the module docstring)."""
    if has_generation_marks(tok):
        ids, mask = _transformers_assistant_mask(tok, messages, where)
        if first:  # a prompt row: the prompt's own assistant turns (few-shot examples) do not train
            mask[: _head_lengths(tok, [(messages, first, where)])[0]] = 0
    else:
        full, spans = _prefix_spans(tok, messages, first, where)
        enc = tok(full, add_special_tokens=False, return_offsets_mapping=True, **NO_ATTENTION_MASK)
        ids, mask = _ids_and_span_mask(enc["input_ids"], enc["offset_mapping"], spans)
    return ids, _keep(mask, loss_on)


def encode_conversations(tok, conversations: list[tuple[list[dict], int, str]], *, loss_on: str) -> list[tuple]:
    """``encode_conversation`` of each ``(messages, first, where)``: the same ids and masks.

    The rows are tokenized in batches of about ``BATCH_CHARS`` characters (one call of
    ``apply_chat_template``, or of the tokenizer, per batch): a call per row took about 1.3x a
    prepare worker's CPU per token of plain text, batches about 1.0x (docs/sft.md). Should a batch fail (a row the template rejects), its rows
    are encoded one by one instead, which raises the error of the first failing row, naming it.
    """
    encoded = []
    for batch in _batches(conversations):
        try:
            if not all(m for m, _, _ in batch):
                raise ValueError("an empty conversation")  # transformers refuses it alone, not in a batch
            encoded += [(ids, _keep(mask, loss_on)) for ids, mask in _encode_batch(tok, batch)]
        except Exception:  # noqa: BLE001 - row by row, the failing row is named (or all succeed alone)
            encoded += [encode_conversation(tok, m, first, loss_on=loss_on, where=where) for m, first, where in batch]
    return encoded


def _batches(conversations: list):
    """Consecutive runs of conversations holding about ``BATCH_CHARS`` characters of content each."""
    batch, size = [], 0
    for c in conversations:
        batch.append(c)
        size += sum(len(m["content"]) for m in c[0])
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encode_batch(tok, conversations: list[tuple[list[dict], int, str]]) -> list[tuple]:
    if has_generation_marks(tok):
        texts, spans = _render_with_spans(tok, [m for m, _, _ in conversations])
        out = tok(texts, add_special_tokens=False, **NO_ATTENTION_MASK)
        encoded = [
            (np.asarray(row, dtype=np.int64), _generation_mask(enc, len(row), s))
            for row, enc, s in zip(out["input_ids"], out.encodings, spans)
        ]
        # Each batch's first row is also encoded by apply_chat_template itself (under 1% of the
        # batch): should another transformers version render or mask differently, the batch takes
        # transformers' own masks instead of this copy of its rule.
        ids, mask = _transformers_assistant_mask(tok, conversations[0][0], conversations[0][2])
        if not (np.array_equal(ids, encoded[0][0]) and np.array_equal(mask, encoded[0][1])):
            if not _fell_back:  # once per process: the masks stay right, prepare is slower
                _fell_back.append(True)
                log.warning(
                    "warning: the batched assistant mask differs from transformers' for this tokenizer and"
                    " template; prepare takes transformers' own masks (the same result, slower)"
                )
            encoded = [_transformers_assistant_mask(tok, m, where) for m, _, where in conversations]
        prompts = [i for i, (_, first, _) in enumerate(conversations) if first]
        for i, n_head in zip(prompts, _head_lengths(tok, [conversations[i] for i in prompts])):
            encoded[i][1][:n_head] = 0  # a prompt row: the prompt's own assistant turns do not train
        return encoded
    rendered = [_prefix_spans(tok, m, first, where) for m, first, where in conversations]
    enc = tok(
        [full for full, _ in rendered], add_special_tokens=False, return_offsets_mapping=True, **NO_ATTENTION_MASK
    )
    return [
        _ids_and_span_mask(ids, offsets, spans)
        for ids, offsets, (_, spans) in zip(enc["input_ids"], enc["offset_mapping"], rendered)
    ]


def _transformers_assistant_mask(tok, messages: list[dict], where: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of one conversation from ``apply_chat_template(..., return_assistant_tokens_mask=True)``."""
    out = _render(
        tok,
        messages,
        where,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        tokenizer_kwargs=NO_ATTENTION_MASK,
    )
    return np.asarray(out["input_ids"], dtype=np.int64), np.asarray(out["assistant_masks"], dtype=np.uint8)


def _render_with_spans(tok, conversations: list[list[dict]]) -> tuple[list[str], list[list[tuple[int, int]]]]:
    """The renderings and the [start, end) characters of each ``{% generation %}`` block: what
    ``apply_chat_template(..., return_assistant_tokens_mask=True)`` renders, through the same
    transformers function with the same arguments (its messages without None values, the
    tokenizer's special tokens as template variables), before it builds the mask."""
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = [[{k: v for k, v in m.items() if v is not None} for m in c] for c in conversations]
    return render_jinja_template(
        conversations=messages,
        chat_template=tok.get_chat_template(),
        return_assistant_tokens_mask=True,
        **tok.special_tokens_map,
    )


def _generation_mask(encoding, n: int, spans: list[tuple[int, int]]) -> np.ndarray:
    """transformers' assistant mask: the tokens whose characters overlap a span. transformers
    finds them with a Python loop over every token's offsets (about 5% of a batch's CPU,
    docs/sft.md); here, per span, from the first token holding its first character
    (``char_to_token`` gives the first) to the last token holding its last one (a character can
    span several tokens: the bytes of one character in a byte-level BPE). An empty span, or an
    edge in no token (a normalizer dropped it), takes transformers' own rule over all offsets."""
    mask = np.zeros(n, dtype=np.uint8)
    for lo, hi in spans:
        a = encoding.char_to_token(lo) if hi > lo else None
        b = encoding.char_to_token(hi - 1) if hi > lo else None
        if a is None or b is None:
            offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
            return np.any([(offsets[:, 0] < e) & (offsets[:, 1] > s) for s, e in spans], axis=0).astype(np.uint8)
        while b + 1 < n and (encoding.token_to_chars(b + 1) or (hi, hi))[0] < hi:
            b += 1
        mask[a : b + 1] = 1
    return mask


def _head_lengths(tok, conversations: list[tuple[list[dict], int, str]]) -> list[int]:
    """How many tokens the prompt of each prompt row is (rendered with the generation prompt)."""
    heads = [
        _render(tok, m[:first], where, tokenize=False, add_generation_prompt=True) for m, first, where in conversations
    ]
    return [len(ids) for ids in tok(heads, add_special_tokens=False, **NO_ATTENTION_MASK)["input_ids"]] if heads else []


def _keep(mask: np.ndarray, loss_on: str) -> np.ndarray:
    """The mask for ``loss_on``: every assistant turn as found, the last one, or every token."""
    if loss_on == "all":
        return np.ones_like(mask)
    if loss_on == "last":
        runs = _runs(mask)
        mask = np.zeros_like(mask)
        if runs:
            mask[runs[-1][0] : runs[-1][1]] = 1
    return mask


def _prefix_spans(tok, messages: list[dict], first: int, where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendering of a conversation and the [start, end) characters of its trained assistant
    turns, found by rendering growing prefixes."""
    full = _render(tok, messages, where, tokenize=False)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant" or k < first:
            continue
        before = _render(tok, messages[:k], where, tokenize=False, add_generation_prompt=True)
        upto = _render(tok, messages[: k + 1], where, tokenize=False)
        if not (full.startswith(upto) and upto.startswith(before)):
            raise ConfigError(
                f"{where}: the chat template renders earlier turns differently once later ones follow, so the"
                " assistant turns cannot be found by rendering prefixes; use a template with {% generation %} marks"
                " (--chat-template FILE)"
            )
        # The turn ends at its end-of-turn token: what the template writes after it (ChatML's
        # newline) belongs to no one's reply, as the {% generation %} marks would say.
        eot = full.rfind(tok.eos_token, len(before), len(upto)) if tok.eos_token else -1
        spans.append((len(before), eot + len(tok.eos_token) if eot >= 0 else len(upto)))
    return full, spans


def _ids_and_span_mask(ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]]):
    """Token ids, and the mask of the tokens whose text starts inside one of ``spans``."""
    ids = np.asarray(ids, dtype=np.int64)
    starts = np.asarray([s for s, _ in offsets], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=np.uint8)
    for lo, hi in spans:
        mask[(starts >= lo) & (starts < hi)] = 1
    return ids, mask


def row_key(row: dict) -> str:
    """The text the train/validation split hashes for a row (its JSON, keys sorted)."""
    return json.dumps(row, sort_keys=True, ensure_ascii=False)


# --- preference rows (data/preference.py trains them): torch-free, as prepare is


def common_prefix(a: list, b: list) -> int:
    """Length of the longest common leading run of two sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def split_pair(row: dict, where: str, *, checked=None) -> tuple[object, object, object]:
    """``(prompt, chosen, rejected)`` of a row: lists of messages, or strings. ``checked``: the
    messages' check (data/images.py passes one that takes lists of text and image parts)."""
    if not isinstance(row, dict) or "chosen" not in row or "rejected" not in row:
        raise ConfigError(
            f"{where}: a preference row needs the fields 'chosen' and 'rejected' (and 'prompt'); fix the row"
        )
    prompt, chosen, rejected = row.get("prompt"), row["chosen"], row["rejected"]
    if isinstance(chosen, str) and isinstance(rejected, str):
        if prompt is None:  # implicit prompt: the common leading text
            n = common_prefix(chosen, rejected)
            if 0 < n < len(chosen) and chosen[n - 1] == " ":
                n -= 1  # the space belongs to the replies
            prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
        if not isinstance(prompt, str):
            raise ConfigError(f"{where}: 'prompt' must be a string when 'chosen' and 'rejected' are; fix the row")
        return prompt, chosen, rejected
    if not isinstance(chosen, list) or not isinstance(rejected, list):
        raise ConfigError(
            f"{where}: 'chosen' and 'rejected' must both be strings or both lists of messages; fix the row"
        )
    chosen, rejected = _sharegpt(chosen), _sharegpt(rejected)
    if prompt is None:  # implicit prompt: the common leading messages
        n = common_prefix(chosen, rejected)
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    elif isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise ConfigError(
            f"{where}: the pair has no prompt (no common leading message, or an empty 'prompt'); fix the row"
        )
    if not chosen or not rejected:
        raise ConfigError(f"{where}: 'chosen' and 'rejected' are the same conversation; fix or drop the row")
    checked = checked or _checked
    return checked(_sharegpt(prompt), where), checked(chosen, where), checked(rejected, where)


def split_unpaired(row: dict, where: str, *, checked=None) -> tuple[object, object, bool]:
    """``(prompt, completion, label)`` of an unpaired row (TRL's KTO format): lists of messages,
    or strings; ``label`` true for a desirable completion. ``checked``: as split_pair's."""
    if not isinstance(row, dict) or not all(k in row for k in ("prompt", "completion", "label")):
        raise ConfigError(f"{where}: an unpaired row needs the fields 'prompt', 'completion' and 'label'; fix the row")
    prompt, completion, label = row["prompt"], row["completion"], row["label"]
    if not isinstance(label, bool):
        raise ConfigError(
            f"{where}: 'label' must be true (desirable) or false (undesirable), got {label!r}; fix the row"
        )
    if isinstance(prompt, str) and isinstance(completion, str):
        return prompt, completion, label
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if isinstance(completion, str):
        completion = [{"role": "assistant", "content": completion}]
    if not isinstance(prompt, list) or not isinstance(completion, list) or not prompt or not completion:
        raise ConfigError(
            f"{where}: 'prompt' and 'completion' must be strings or non-empty lists of messages; fix the row"
        )
    checked = checked or _checked
    return checked(_sharegpt(prompt), where), checked(_sharegpt(completion), where), label


def encode_plain(tok, prompt: str, reply: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of a plain-text pair side: prompt ids + reply ids + EOS, the reply and EOS marked."""
    p = tok(prompt, add_special_tokens=False)["input_ids"] if prompt else []
    r = tok(reply, add_special_tokens=False)["input_ids"]
    bos = [tok.bos_token_id] if tok.bos_token_id is not None and tok.bos_token_id != tok.eos_token_id else []
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    ids = np.asarray(bos + p + r + eos, dtype=np.int64)
    mask = np.zeros(len(ids), dtype=np.uint8)
    mask[len(bos) + len(p) :] = 1
    return ids, mask
