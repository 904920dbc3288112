"""Prompts and reward functions of the GRPO tests (tests/distributed/test_grpo.py): additions of small numbers,
and rewards that differ within a group from the first step of a random model on, so that the
advantages, and so the gradient, are never all zero."""

from __future__ import annotations

import random


def addition_rows(n: int, *, seed: int = 0, high: int = 49, conversational: bool = False) -> list[dict]:
    """``n`` prompt rows ``a+b=`` with their ``answer``; a user message each when ``conversational``."""
    r = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = r.randint(0, high), r.randint(0, high)
        prompt = f"{a}+{b}="
        rows.append(
            {"prompt": [{"role": "user", "content": prompt}] if conversational else prompt, "answer": str(a + b)}
        )
    return rows


def text_of(completion) -> str:
    """A completion as TRL hands it: a string, or (conversational prompts) ``[{"role":
    "assistant", "content": ...}]``."""
    return completion if isinstance(completion, str) else completion[0]["content"]


def byte_mix(prompts, completions, **fields):
    """A reward in [0, 1) of every character of the completion: continuous, so the completions of
    a group rarely tie, and independent of the answer (a random model earns it too)."""
    texts = [text_of(c) for c in completions]
    return [sum(ord(c) % 7 for c in text) / (7.0 * max(len(text), 1)) for text in texts]


def answer_digits(prompts, completions, answer, **fields):
    """How many of the answer's digits the completion starts with, over the answer's length."""
    out = []
    for text, a in zip(map(text_of, completions), answer):
        n = 0
        for x, y in zip(text, a):
            if x != y:
                break
            n += 1
        out.append(n / len(a))
    return out


def wrong_length(prompts, completions, **fields):
    return [0.0]


def raises(prompts, completions, **fields):
    raise KeyError("solution")
