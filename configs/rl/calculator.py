"""The multi-turn recipe's tool, reward and data (docs/multi-turn.md): products of two-digit
numbers, which a tiny model cannot compute but can learn to ask a calculator for.

    python configs/rl/calculator.py   # writes configs/rl/calculator_sft.jsonl and calculator.jsonl
"""

import json
import random


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a * b


def answer_correct(prompts, completions, answer, **fields):
    """1 when the episode's last assistant message, stripped, is the answer."""
    out = []
    for messages, a in zip(completions, answer):
        said = [m["content"] for m in messages if m["role"] == "assistant"]
        out.append(float(bool(said) and said[-1].strip() == str(a)))
    return out


def called_the_tool(prompts, completions, **fields):
    """1 when the episode holds a tool's answer that is a number (the call worked)."""
    return [float(any(m["role"] == "tool" and m["content"].isdigit() for m in c)) for c in completions]


def _call(a: int, b: int) -> str:
    return "<tool_call>" + json.dumps({"name": "multiply", "arguments": {"a": a, "b": b}}) + "</tool_call>"


if __name__ == "__main__":
    r = random.Random(0)
    pairs = [(r.randint(10, 99), r.randint(10, 99)) for _ in range(1256)]
    with open("configs/rl/calculator_sft.jsonl", "w") as f:
        for a, b in pairs[:1000]:
            messages = [
                {"role": "user", "content": f"{a}*{b}"},
                {"role": "assistant", "content": _call(a, b)},
                {"role": "tool", "content": str(a * b)},
                {"role": "assistant", "content": str(a * b)},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    with open("configs/rl/calculator.jsonl", "w") as f:
        for a, b in pairs[1000:]:
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"{a}*{b}"}], "answer": str(a * b)}) + "\n")
