"""Multi-turn test data made offline (tests/distributed/test_multiturn.py, docs/multi-turn.md): an
ASCII tokenizer with a ChatML template that knows tools, tools, and scripted environments.

The tokenizer's ids are the 128 ASCII bytes and ChatML's special tokens: whatever a random model
samples decodes to text that encodes back to the same ids, so the conversation's own tokenization
(transformers' ``return_assistant_tokens_mask``) can be compared with the rows token for token."""

from __future__ import annotations

import os
import time

from paratrain.testing.sft_data import CHATML

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 128 + len(SPECIALS)
# ChatML as Qwen2.5 writes tools: their JSON schemas in a system turn; a tool's answer in a turn of
# its own role. {% generation %} marks the assistant's content and its <|im_end|>.
CHATML_TOOLS = (
    "{%- if tools %}"
    "{{ '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    '{{ \'\\n</tools>\\nCall one as <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>\\n\' }}'
    "{%- endif %}"
) + CHATML.replace(
    "['system', 'user', 'assistant']", "['system', 'user', 'assistant', 'tool']"
)  # then sft_data's ChatML


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-ins of the bytes (the ByteLevel pre-tokenizer's map)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, n = keep[:], 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars), strict=True))


def save_ascii_chat_tokenizer(path: str, *, template: str = CHATML_TOOLS) -> str:
    """A byte-level tokenizer of the ASCII bytes (ids 0..127 are the bytes) and ChatML's special
    tokens (128..130), with ``template`` as its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    stand_in = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={stand_in[b]: b for b in range(128)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    fast.chat_template = template
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(path)
    return path


def echo(text: str) -> str:
    """Echo a text back.

    Args:
        text: the text to echo
    """
    return text


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


def fails(x: int) -> int:
    """A tool that always raises.

    Args:
        x: any integer
    """
    raise ValueError(f"no luck with {x}")


def sleeps(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: how long to sleep
    """
    time.sleep(seconds)
    return "awake"


def undocumented(x):
    return x


class EchoEnvironment:
    """A scripted environment: answers each of the model's first ``turns - 1`` turns with a tool
    message echoing the turn's first characters, then ends; a function of the conversation."""

    def __init__(self, turns: int = 3):
        self.turns = turns

    def step(self, messages: list[dict]) -> tuple[list[dict], bool]:
        said = [m for m in messages if m["role"] == "assistant"]
        if len(said) >= self.turns:
            return [], True
        return [{"role": "tool", "content": f"echo {len(said)}: " + said[-1]["content"][:6]}], False


def echo_environment(tools):
    """``rl.environment`` of the tests: three turns."""
    return EchoEnvironment(3)


def endless_environment(tools):
    """``rl.environment`` that never ends an episode: the limits must."""
    return EchoEnvironment(10**9)


class VariedEnvironment(EchoEnvironment):
    """Ends after 1 to 3 turns, as the first character of the model's first turn says: episodes of
    different lengths, so that ranks run out of episodes at different turns."""

    def step(self, messages: list[dict]) -> tuple[list[dict], bool]:
        said = [m for m in messages if m["role"] == "assistant"]
        self.turns = 1 + ord((said[0]["content"] or "a")[0]) % 3
        return super().step(messages)


def varied_environment(tools):
    """``rl.environment`` of episodes of 1 to 3 turns."""
    return VariedEnvironment()


class BrokenEnvironment:
    """An environment whose step raises: the run stops with its error in one line."""

    def step(self, messages: list[dict]) -> tuple[list[dict], bool]:
        return {"role": "tool"}["content"], False


def broken_environment(tools):
    return BrokenEnvironment()


def byte_mix_episode(prompts, completions, **fields):
    """A reward in [0, 1) of every character of the episode's messages (assistant and tool), so
    the episodes of a group rarely tie."""
    texts = ["".join(m["content"] for m in c) for c in completions]
    return [sum(ord(c) % 7 for c in text) / (7.0 * max(len(text), 1)) for text in texts]
