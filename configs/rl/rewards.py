"""Reward functions of the GRPO recipes (configs/grpo.toml, configs/grpo_reverse.toml,
docs/grpo.md), with TRL's signature: ``fn(prompts, completions, **row_fields) -> list[float]``,
one reward per completion.

A model that starts from random weights almost never writes the whole answer, so the first
recipe's rewards are dense: the share of the completion's characters that are digits, and the
share of the answer's digits it gets right from the first one on. The second recipe (after SFT)
adds the share of digits in their place to ``exact_match``.
"""


def digits(prompts, completions, **fields):
    """The share of the completion's characters that are digits (0 for an empty one)."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def answer_prefix(prompts, completions, answer, **fields):
    """How many of the answer's characters the completion starts with, over the answer's length."""
    out = []
    for text, want in zip(completions, answer):
        n = 0
        while n < min(len(text), len(want)) and text[n] == want[n]:
            n += 1
        out.append(n / len(want))
    return out


def digits_in_place(prompts, completions, answer, **fields):
    """The share of the answer's characters the completion has at the same place (conversational
    completions are ``[{"role": "assistant", "content": ...}]``)."""
    out = []
    for completion, want in zip(completions, answer):
        text = completion if isinstance(completion, str) else completion[0]["content"]
        out.append(sum(a == b for a, b in zip(text.strip(), want)) / len(want))
    return out
