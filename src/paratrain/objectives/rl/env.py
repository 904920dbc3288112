"""Environments and tools of multi-turn reinforcement learning (``rl.environment``, ``rl.tools``,
docs/multi-turn.md).

An environment is any object with

- ``reset(row) -> list of messages or None`` (optional): the episode's opening conversation from
  its prompt row; ``None`` (or no ``reset``): the row's prompt (a string becomes one user message);
- ``step(messages) -> (observation messages, done)``: called with the conversation so far after
  each assistant turn; its messages (``{"role": "tool" or "user", "content": ...}``) are appended
  and the model takes the next turn unless ``done``.

``step`` must be a function of the conversation alone (no hidden state, no clock, no randomness of
its own): that, and the keyed draws of each turn, make an episode the same on every layout. The
run builds it once per process as ``factory(tools=[the rl.tools functions])``.

The built-in :class:`ToolEnvironment` (``rl.tools`` without ``rl.environment``) parses the
assistant turn's tool calls (:func:`parse_tool_calls`), calls the functions and answers with one
``{"role": "tool", "name": ..., "content": str(result)}`` message per call; a turn without a tool
call ends the episode. A tool that raises answers with its error text (``"ValueError: ..."``),
which the model sees and can react to, as TRL does; so do an unknown tool name, arguments that
are not a JSON object, and a call running longer than ``rl.tool_timeout_s``. The timeout runs
the tool in a daemon thread and stops waiting for it: a thread cannot be killed, so a hung tool
keeps its thread to the end of the process (a process could be killed, but would pickle every
call and its result and start slowly; tools are meant to be quick, pure functions). A timeout is
the one outcome that depends on the machine's speed, not the conversation: keep
``tool_timeout_s`` far above a tool's running time.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable

from paratrain.config import ConfigError, RLConfig, resolve_callable
from paratrain.objectives.rl.rewards import call_users

# Qwen2 / Qwen2.5 / Qwen3 and Hermes 2 Pro write a call as <tool_call>{"name": ..., "arguments": {...}}</tool_call>
# (their chat templates' tool-calling instructions); TRL parses the same (trl/chat_template_utils.py).
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str, family: str = "hermes") -> list[dict]:
    """The tool calls of an assistant turn, in order: ``{"name": str, "arguments": dict}`` each, or
    ``{"error": str}`` for a call that is not one (bad JSON, no name, arguments not an object),
    answered with that error. ``family``: the model family's format; only ``'hermes'`` (Qwen2 and
    later, Hermes) so far: another family is one more branch here."""
    if family != "hermes":
        raise ConfigError(f"tool calls in the {family!r} format are not parsed yet; use a Qwen2/Hermes-style model")
    calls = []
    for body in _HERMES.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append({"error": f"the tool call is not JSON ({e.msg} at character {e.pos})"})
            continue
        args = call.get("arguments", {}) if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(args, dict):
            calls.append({"error": 'a tool call is {"name": "...", "arguments": {...}}'})
            continue
        calls.append({"name": call["name"], "arguments": args})
    return calls


def call_tool(fn: Callable, arguments: dict, timeout_s: float) -> str:
    """``str(fn(**arguments))``, or the error text the model sees when it raises or runs longer
    than ``timeout_s`` (module docstring: a daemon thread, left running)."""
    out: dict = {}

    def run():
        try:
            out["result"] = str(fn(**arguments))
        except Exception as e:  # noqa: BLE001 - the tool's error is the model's observation
            out["result"] = f"{type(e).__name__}: {e}"

    thread = threading.Thread(target=run, name=f"tool-{getattr(fn, '__name__', 'tool')}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return f"TimeoutError: the tool ran longer than rl.tool_timeout_s = {timeout_s:g} s"
    return out["result"]


class ToolEnvironment:
    """The built-in environment of ``rl.tools`` (module docstring)."""

    def __init__(self, tools: list[Callable], *, timeout_s: float, family: str = "hermes"):
        self.tools = {fn.__name__: fn for fn in tools}
        self.timeout_s, self.family = timeout_s, family

    def step(self, messages: list[dict]) -> tuple[list[dict], bool]:
        calls = parse_tool_calls(str(messages[-1].get("content", "")), self.family)
        answers = []
        for call in calls:
            if "error" in call:
                answers.append({"role": "tool", "name": "", "content": f"Error: {call['error']}"})
            elif call["name"] not in self.tools:
                known = ", ".join(sorted(self.tools))
                answers.append(
                    {"role": "tool", "name": call["name"], "content": f"Error: no tool {call['name']!r} ({known})"}
                )
            else:
                fn = self.tools[call["name"]]
                answers.append(
                    {"role": "tool", "name": call["name"], "content": call_tool(fn, call["arguments"], self.timeout_s)}
                )
        return answers, not calls


def load_tools(refs: list[str]) -> list[Callable]:
    """``rl.tools``' functions, each checked to have a JSON schema (transformers' ``get_json_schema``:
    type hints and a Google-style docstring with its arguments), which the chat template shows."""
    from transformers.utils import get_json_schema  # transformers: only for runs with tools

    tools = []
    for ref in refs:
        fn = resolve_callable(ref, "rl.tools")
        try:
            get_json_schema(fn)
        except Exception as e:  # noqa: BLE001 - transformers' TypeHint/DocstringParsingException
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            raise ConfigError(
                f"rl.tools names {ref!r}, whose schema transformers cannot write ({first}); give it type hints and a"
                " Google-style docstring with an 'Args:' line per argument"
            ) from None
        tools.append(fn)
    names = [fn.__name__ for fn in tools]
    if len(set(names)) != len(names):
        raise ConfigError(f"rl.tools = {refs!r} holds two functions of one name; the model calls a tool by its name")
    return tools


def build_environment(cfg: RLConfig, tools: list[Callable]):
    """The run's environment: ``rl.environment``'s factory called with the tools, else the tool
    environment; checked for a ``step``."""
    if not cfg.environment:
        return ToolEnvironment(tools, timeout_s=cfg.tool_timeout_s)
    factory = resolve_callable(cfg.environment, "rl.environment")
    try:
        env = factory(tools=tools)
    except Exception as e:  # noqa: BLE001 - the user's factory: its error in one line
        first = (str(e).strip().splitlines() or [""])[0][:160]
        raise ConfigError(f"rl.environment = {cfg.environment!r} raised {type(e).__name__}: {first}; fix it") from None
    if not callable(getattr(env, "step", None)):
        raise ConfigError(
            f"rl.environment = {cfg.environment!r} returned {type(env).__name__}, which has no step(messages) method;"
            " return an object with step(messages) -> (observation messages, done)"
        )
    return env


def _call(env, method: str, arg):
    """``env.<method>(arg)``; the user's error in one line, with the ``file:line`` that raised."""
    return call_users(f"rl.environment's {method}", getattr(env, method), arg)


def _messages(out) -> bool:
    return isinstance(out, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in out)


def opening(env, row: dict) -> list[dict]:
    """The episode's opening messages: ``env.reset(row)``, else the row's prompt."""
    messages = _call(env, "reset", row) if callable(getattr(env, "reset", None)) else None
    if messages is None:
        prompt = row["prompt"]
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
    if not _messages(messages) or not messages:
        raise ConfigError(
            "rl.environment's reset returned no list of messages; return [{'role': ..., 'content': ...}, ...] or None"
        )
    return [dict(m) for m in messages]


def step(env, messages: list[dict]) -> tuple[list[dict], bool]:
    """``env.step(messages)``, checked: (observation messages, done)."""
    out = _call(env, "step", [dict(m) for m in messages])
    if not (isinstance(out, tuple) and len(out) == 2 and _messages(out[0])):
        raise ConfigError(
            "rl.environment's step returned something other than (messages, done); return a list of"
            " {'role': ..., 'content': ...} messages and a bool"
        )
    return out[0], bool(out[1])
