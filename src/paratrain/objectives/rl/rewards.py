"""Reward functions of reinforcement learning with generation (``rl.rewards``, docs/grpo.md).

A reward function has TRL's signature, so users' functions carry over:
``fn(prompts, completions, **row_fields) -> list[float]``, one reward per completion; ``prompts``
are the rows' prompts as written (strings or message lists), ``completions`` the decoded
completions (strings, or ``[{"role": "assistant", "content": ...}]`` for conversational prompts),
and each other field of the prompt rows comes as a list aligned with them (a group's ``G``
completions repeat their prompt's row), with ``completion_ids`` (each completion's token ids, its
stop token included) as TRL passes them. Several functions are summed with ``rl.reward_weights``.

Built in: ``exact_match`` (1 when the completion, stripped, equals the row's ``rl.answer_field``,
stripped), ``format`` (1 when the completion fully matches ``rl.format_pattern``) and
``overlong`` (DAPO's soft overlong punishment, Yu et al. 2025, eq. 13: 0 up to
``max_new_tokens - overlong_buffer`` tokens, then falling linearly to -1 at ``max_new_tokens``;
a completion cannot be longer, so DAPO's third case, -1 beyond it, never arises). A function
that raises, returns a wrong number of rewards or a non-number ends the run with one line
naming it.
"""

from __future__ import annotations

import math
import os
import re
import sysconfig
import traceback
from collections.abc import Callable

from paratrain.config import ConfigError, RLConfig, resolve_callable


def _text(completion) -> str:
    if isinstance(completion, list):  # conversational: the assistant message
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def exact_match(answer_field: str) -> Callable:
    def reward(prompts, completions, **fields):
        if answer_field not in fields:
            raise ConfigError(
                f"rl.rewards: 'exact_match' compares with the prompt rows' {answer_field!r} field, which they lack;"
                " add it to the rows or set rl.answer_field"
            )
        return [float(_text(c).strip() == str(a).strip()) for c, a in zip(completions, fields[answer_field])]

    reward.__name__ = "exact_match"
    return reward


def format_match(pattern: str) -> Callable:
    if not pattern:
        raise ConfigError("rl.rewards names 'format' but rl.format_pattern is empty; set a regular expression")
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ConfigError(f"rl.format_pattern = {pattern!r} is not a regular expression ({e})") from None

    def reward(prompts, completions, **fields):
        return [float(compiled.fullmatch(_text(c).strip()) is not None) for c in completions]

    reward.__name__ = "format"
    return reward


def overlong(max_new_tokens: int, buffer: int) -> Callable:
    start = max_new_tokens - buffer

    def reward(prompts, completions, completion_ids, **fields):
        return [min(0.0, (start - len(ids)) / buffer) for ids in completion_ids]

    reward.__name__ = "overlong"
    return reward


def call_users(what: str, fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)``, the user's code: an error it raises is one line naming ``what``
    and the ``file:line`` that raised (a ConfigError of its own passes as it is)."""
    try:
        return fn(*args, **kwargs)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's function: its error, named, in one line
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise ConfigError(f"{what} raised {type(e).__name__}: {first} (at {_where(e)}); fix it") from None


def _where(e: BaseException) -> str:
    """``file:line`` of the frame that raised ``e`` inside the reward function: the innermost frame
    outside Python's own library and installed packages (the user's code), else the innermost one."""
    frames = traceback.extract_tb(e.__traceback__)[1:]  # [0] is the call in call_users
    if not frames:
        return "?"
    library = tuple({sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")} - {None})
    own = [f for f in frames if not os.path.abspath(f.filename).startswith(library)]
    frame = (own or frames)[-1]
    path = os.path.relpath(frame.filename) if frame.filename.startswith(os.getcwd() + os.sep) else frame.filename
    return f"{path}:{frame.lineno}"


class Rewards:
    """The run's reward functions and weights: :meth:`__call__` scores a batch of completions."""

    def __init__(self, cfg: RLConfig):
        self.fns: list[tuple[str, Callable]] = []
        for ref in cfg.rewards:
            if ref == "exact_match":
                self.fns.append((ref, exact_match(cfg.answer_field)))
            elif ref == "format":
                self.fns.append((ref, format_match(cfg.format_pattern)))
            elif ref == "overlong":
                self.fns.append((ref, overlong(cfg.max_new_tokens, cfg.overlong_buffer)))
            elif ":" in ref:
                self.fns.append((ref, resolve_callable(ref, "rl.rewards")))
            else:
                raise ConfigError(
                    f"rl.rewards names {ref!r}; use 'exact_match', 'format', 'overlong', 'package.module:function' or"
                    " 'file.py:function'"
                )
        self.weights = [float(w) for w in cfg.reward_weights] or [1.0] * len(self.fns)

    @property
    def names(self) -> list[str]:
        return [name.rpartition(":")[2] for name, _ in self.fns]

    def __call__(self, prompts: list, completions: list, fields: dict) -> tuple[list[float], list[list[float]]]:
        """The weighted sum of every function's rewards, and each function's own."""
        columns = []
        for name, fn in self.fns:
            out = call_users(f"reward function {name!r}", fn, prompts=prompts, completions=completions, **fields)
            if not isinstance(out, (list, tuple)) or len(out) != len(completions):
                got = len(out) if isinstance(out, (list, tuple)) else type(out).__name__
                raise ConfigError(
                    f"reward function {name!r} returned {got} rewards for {len(completions)} completions;"
                    " return a list with one float per completion"
                )
            try:
                values = [float(v) for v in out]
            except (TypeError, ValueError):
                raise ConfigError(f"reward function {name!r} returned a non-number; return floats") from None
            if not all(math.isfinite(v) for v in values):
                raise ConfigError(f"reward function {name!r} returned a NaN or infinite reward; return finite floats")
            columns.append(values)
        total = [sum(w * col[i] for w, col in zip(self.weights, columns)) for i in range(len(completions))]
        return total, columns
