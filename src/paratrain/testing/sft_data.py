"""Fine-tuning test data made offline: a byte-level tokenizer with a ChatML template, and
conversations about the standard library's own modules (their docstrings and functions)."""

from __future__ import annotations

import ast
import json
import os
import sysconfig

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML with {% generation %} marks around what the assistant says (its <|im_end|> included),
# so transformers' return_assistant_tokens_mask works; an unknown role is refused.
CHATML = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{%- endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{%- else %}{{ message['content'] + '<|im_end|>' + '\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
# The same rendering without the marks: the assistant turns are then found from prefixes.
CHATML_PLAIN = CHATML.replace("{% generation %}", "").replace("{% endgeneration %}", "")
VOCAB = 256 + len(SPECIALS)


def save_chat_tokenizer(path: str, *, template: str | None = CHATML) -> str:
    """A byte-level tokenizer (ids 0..255 are bytes through GPT-2's byte map, no merges) with
    ChatML's special tokens at 256.. and ``template`` as its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_map = sorted(alphabet)  # 256 printable stand-ins of the bytes
    vocab = {ch: i for i, ch in enumerate(byte_map)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    if template:
        fast.chat_template = template
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(path)
    return path


def stdlib_conversations(n: int, *, seed: int = 0) -> list[dict]:
    """``n`` conversations about standard-library modules: one or two exchanges each, some with a
    system turn; deterministic (sorted files, ``seed`` picks the starting module)."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(f for f in os.listdir(root) if f.endswith(".py") and not f.startswith("_"))
    out = []
    i = seed
    while len(out) < n and i < seed + 10 * n + len(files):
        name = files[i % len(files)]
        i += 1
        try:
            tree = ast.parse(open(os.path.join(root, name), encoding="utf-8").read())
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        doc = (ast.get_docstring(tree) or "").strip().split("\n\n")[0][:160]
        funcs = [f.name for f in tree.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")]
        if not doc or not funcs:
            continue
        mod = name[:-3]
        messages = [{"role": "system", "content": "Answer briefly."}] if len(out) % 3 == 0 else []
        messages += [
            {"role": "user", "content": f"What is the module {mod} for?"},
            {"role": "assistant", "content": doc},
        ]
        if len(out) % 2 == 0:
            messages += [
                {"role": "user", "content": "Name one of its functions."},
                {"role": "assistant", "content": f"{mod}.{funcs[len(out) % len(funcs)]}"},
            ]
        out.append({"messages": messages})
    return out


def write_jsonl(path: str, rows: list[dict]) -> str:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def prompt_rows(conversations: list[dict]) -> list[dict]:
    """The first exchange of each conversation as a prompt/completion row."""
    rows = []
    for c in conversations:
        user = next(m for m in c["messages"] if m["role"] == "user")
        reply = next(m for m in c["messages"] if m["role"] == "assistant")
        rows.append({"prompt": user["content"], "completion": reply["content"]})
    return rows


def write_example(out: str, *, conversations: int = 200) -> None:
    """The committed example of docs/sft.md: ``out/model`` (a tiny Llama's config.json, no weights,
    and the chat tokenizer) and ``out/conversations.jsonl``. Regenerate with
    ``python -m paratrain.testing.sft_data configs/sft configs/preference`` (the second: docs/preference.md's pairs)."""
    from transformers import AutoConfig

    model = os.path.join(out, "model")
    config = AutoConfig.for_model(
        "llama",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    config.save_pretrained(model)
    save_chat_tokenizer(model)
    write_jsonl(os.path.join(out, "conversations.jsonl"), stdlib_conversations(conversations))


DISMISSIVE = ("I don't know.", "No idea, sorry.", "Look it up yourself.", "That is not something I can say.")


def preference_pairs(n: int, *, seed: int = 0) -> list[dict]:
    """``n`` conversational preference rows (TRL's explicit-prompt form): the question about a
    module, its own docstring chosen; rejected, in turn, the next module's docstring (a wrong
    answer) or a dismissive reply (no answer)."""
    convs = stdlib_conversations(n + 1, seed=seed)
    rows = []
    for i, (here, there) in enumerate(zip(convs, convs[1:])):
        user = next(m for m in here["messages"] if m["role"] == "user")
        good = next(m for m in here["messages"] if m["role"] == "assistant")
        bad = next(m for m in there["messages"] if m["role"] == "assistant")
        if i % 2:
            bad = {"role": "assistant", "content": DISMISSIVE[i // 2 % len(DISMISSIVE)]}
        rows.append({"prompt": [user], "chosen": [good], "rejected": [bad]})
    return rows


if __name__ == "__main__":
    import sys

    write_example(sys.argv[1])
    if len(sys.argv) > 2:  # python -m paratrain.testing.sft_data configs/sft configs/preference
        os.makedirs(sys.argv[2], exist_ok=True)
        write_jsonl(os.path.join(sys.argv[2], "pairs.jsonl"), preference_pairs(200))
