"""Reward functions of the GRPO recipe (configs/grpo.toml, docs/grpo.md), with TRL's signature:
``fn(prompts, completions, **row_fields) -> list[float]``, one reward per completion.

A model that starts from random weights almost never writes the whole answer, so the recipe's
reward is dense: the share of the completion's characters that are digits, and the share of the
answer's digits it gets right from the first one on.
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
