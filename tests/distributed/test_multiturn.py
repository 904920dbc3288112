"""Multi-turn GRPO (docs/multi-turn.md): episodes of a scripted environment on a tiny Qwen2, their
loss mask against the conversation's own tokenization, the same episodes and losses on every
layout, the limits and the tools' outcomes."""

from __future__ import annotations

import json
import os

import pytest
import torch

import paratrain
from paratrain.config import ConfigError, RLConfig, load_config
from paratrain.objectives.rl.env import ToolEnvironment, load_tools, parse_tool_calls
from paratrain.testing.dist_utils import plain_sgd, read_metrics, run_ranks, train_rank
from paratrain.testing.hf_models import save_tiny
from paratrain.testing.rl_data import addition_rows
from paratrain.testing.sft_data import write_jsonl
from paratrain.testing.tool_data import (
    CHATML_TOOLS,
    VOCAB,
    add,
    broken_environment,
    echo,
    fails,
    save_ascii_chat_tokenizer,
    sleeps,
)

pytest.importorskip("transformers")

G, NEW = 4, 6
ENV = "paratrain.testing.tool_data:echo_environment"


@pytest.fixture(scope="module")
def mt(tmp_path_factory):
    root = tmp_path_factory.mktemp("mt")
    rows = addition_rows(8, conversational=True)
    return {
        "root": str(root),
        "tok": save_ascii_chat_tokenizer(str(root / "tok")),
        "data": write_jsonl(str(root / "prompts.jsonl"), rows),
        "policy": save_tiny("qwen2", str(root / "policy"), vocab_size=VOCAB, max_position_embeddings=512, seed=0),
    }


def _config(mt: dict, name: str, *extra: str) -> list[str]:
    return [
        f"model.hf='{mt['policy']}'",
        "data.name='prompts'",
        f"data.args={{path = '{mt['data']}', tokenizer = '{mt['tok']}', max_prompt_length = 40}}",
        "data.shuffle=false",
        "loss.name='grpo'",
        f"rl.group_size={G}",
        f"rl.max_new_tokens={NEW}",
        "rl.temperature=0.8",
        f"rl.environment='{ENV}'",
        "rl.max_episode_tokens=200",
        "rl.check_logps=true",  # the trainer's log-probabilities of the scored tokens against the sampler's
        "rl.rewards=['paratrain.testing.tool_data:byte_mix_episode']",
        f"run.out_dir='{mt['root']}/{name}'",
        "batch.global_batch_size=8",
        "batch.micro_batch_size=4",
        "run.steps=2",
        "run.progress=false",
        "metrics.plot=false",
        *plain_sgd(1.0),
        *extra,
    ]


def _run(mt: dict, name: str, *extra: str, world: int = 1) -> tuple[list[dict], list[dict]]:
    over = _config(mt, name, *extra)
    if world == 1:
        paratrain.train(load_config(None, over))
    else:
        run_ranks(train_rank, world, over)
    out = os.path.join(mt["root"], name)
    with open(os.path.join(out, "rollouts.jsonl")) as f:
        return read_metrics(out), [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def one_process(mt):
    return _run(mt, "w1")


def test_the_loss_mask_is_the_models_own_tokens_of_the_conversation(mt, one_process):
    """Independently of the rows: transformers renders and tokenizes each whole conversation and
    marks the assistant's tokens (``return_assistant_tokens_mask``); the episode's tokens must be
    that conversation's, and its scored tokens the assistant's, except an ``<|im_end|>`` the
    template wrote after a turn cut at ``max_new_tokens`` (one the model did not sample)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(mt["tok"])
    rows = [json.loads(line) for line in open(mt["data"])]
    metrics, rollouts = one_process
    assert {r["turns"] for r in rollouts} == {3}  # the scripted environment's three turns
    # each scored position holds the sampler's log-probability of the token after it
    assert max(m["logp_gap"] for m in metrics) < 1e-5
    for r in rollouts:
        opening = rows[r["prompt_index"]]["prompt"]
        prompt = tok.apply_chat_template(opening, add_generation_prompt=True, tokenize=True, return_dict=True)
        whole = tok.apply_chat_template(
            opening + r["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        p = len(prompt["input_ids"])
        ids, mask = whole["input_ids"][p:], whole["assistant_masks"][p:]
        n = len(r["tokens"])
        assert r["tokens"] == ids[:n]
        expected = list(mask[:n])
        # a turn of max_new_tokens content tokens was cut there: its closing <|im_end|> is the template's
        starts = [k for k in range(n) if mask[k] and (k == 0 or not mask[k - 1])]
        for k in starts:
            end = k
            while end < len(mask) and mask[end]:
                end += 1
            if end - 1 - k == NEW and end - 1 < n:  # NEW content tokens, then the template's <|im_end|>
                expected[end - 1] = 0
        assert r["own"] == expected
        tools = [m for m in r["messages"] if m["role"] == "tool"]
        said = [m for m in r["messages"] if m["role"] == "assistant"]
        assert [m["content"] for m in tools] == [f"echo {i + 1}: " + said[i]["content"][:6] for i in range(2)]


def test_episodes_and_losses_are_the_same_with_accumulation_and_at_world_2(mt, one_process):
    """Every turn's tokens and every observation, and the plain-SGD losses and gradient norms."""
    rows1, rollouts1 = one_process
    rows_a, rollouts_a = _run(mt, "acc", "batch.micro_batch_size=2", "rl.generation_batch_size=3")
    rows2, rollouts2 = _run(mt, "w2", "batch.micro_batch_size=2", "rl.generation_batch_size=3", world=2)
    cut = lambda rs: [{k: v for k, v in r.items() if k != "advantage"} for r in rs]  # noqa: E731
    assert cut(rollouts_a) == cut(rollouts1) and cut(rollouts2) == cut(rollouts1)
    for rows in (rows_a, rows2):
        for key in ("loss", "grad_norm", "reward", "completion_length", "turns"):
            torch.testing.assert_close([r[key] for r in rows], [r[key] for r in rows1], rtol=1e-5, atol=1e-6, msg=key)


def test_an_episodes_first_turn_is_the_single_turn_completion(mt, one_process):
    """Turn 0 draws from the completion's own key: without tools the prompt renders as in
    single-turn GRPO, so the first turn's tokens are its completion's."""
    single = "rl.environment=''"
    _, completions = _run(mt, "single", single, "run.steps=1")
    _, rollouts = one_process
    for c, r in zip(completions, [r for r in rollouts if r["step"] == 1], strict=True):
        first = r["own"].index(0) if 0 in r["own"] else len(r["own"])
        assert r["tokens"][:first] == c["tokens"]


@pytest.mark.parametrize("layout", ["parallel.dp_shard=2", pytest.param("parallel.tp=2", marks=pytest.mark.slow)])
def test_episodes_of_different_lengths_are_the_same_on_fsdp2_and_tensor_parallel(mt, layout):
    """Ranks that agree on every turn (FSDP2's gathers, tensor parallel's reductions in the
    forward), with episodes of 1 to 3 turns so that one rank may run out before the other."""
    varied = "rl.environment='paratrain.testing.tool_data:varied_environment'"
    name = layout.split(".")[1].split("=")[0]
    rows1, rollouts1 = _run(mt, f"varied_{name}_1", varied)
    rows2, rollouts2 = _run(mt, f"varied_{name}_2", varied, layout, "batch.micro_batch_size=2", world=2)
    assert len({r["turns"] for r in rollouts1}) > 1
    cut = lambda rs: [{k: v for k, v in r.items() if k != "advantage"} for r in rs]  # noqa: E731
    assert cut(rollouts2) == cut(rollouts1)
    for key in ("loss", "grad_norm", "reward"):
        torch.testing.assert_close([r[key] for r in rows2], [r[key] for r in rows1], rtol=1e-5, atol=1e-6, msg=key)


def test_the_limits_end_an_episode_truncated(mt):
    endless = "rl.environment='paratrain.testing.tool_data:endless_environment'"
    metrics, turns = _run(mt, "turns", endless, "rl.max_turns=2", "run.steps=1")
    assert all(r["turns"] == 2 and r["truncated"] for r in turns)
    assert (metrics[0]["turns"], metrics[0]["truncated"]) == (2.0, 1.0)  # the means logged per step
    assert all(r["messages"][-1]["role"] == "assistant" for r in turns)  # the last answer is not appended
    # A turn of 6 tokens and the echo's answer (35 tokens) leave 3 of 44 to the second turn, cut there.
    _, tokens = _run(mt, "tokens", endless, "rl.max_turns=50", "rl.max_episode_tokens=44", "run.steps=1")
    assert all(r["truncated"] and len(r["tokens"]) <= 44 for r in tokens)
    assert any(len(r["tokens"]) == 44 and r["turns"] == 2 for r in tokens)
    # An answer that leaves no room for a token of the model ends the episode before it.
    _, room = _run(mt, "room", endless, "rl.max_turns=50", "rl.max_episode_tokens=20", "run.steps=1")
    assert all(r["truncated"] and r["turns"] == 1 and all(r["own"]) for r in room)


def test_tool_calls_are_parsed_in_the_hermes_format():
    text = 'a <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> b <tool_call>\n{"name": "echo"}\n</tool_call>'
    assert parse_tool_calls(text) == [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "echo", "arguments": {}}]
    assert parse_tool_calls("no call") == []
    bad = parse_tool_calls('<tool_call>{"name": add}</tool_call><tool_call>{"arguments": {}}</tool_call>')
    assert [set(c) for c in bad] == [{"error"}, {"error"}]


def test_the_tool_environment_answers_each_call_and_its_errors():
    env = ToolEnvironment([add, echo, fails, sleeps], timeout_s=0.2)
    turn = lambda text: [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}]  # noqa: E731
    call = lambda name, **a: f"<tool_call>{json.dumps({'name': name, 'arguments': a})}</tool_call>"  # noqa: E731
    out, done = env.step(turn(call("add", a=3, b=4) + call("echo", text="hi")))
    assert not done and out == [
        {"role": "tool", "name": "add", "content": "7"},
        {"role": "tool", "name": "echo", "content": "hi"},
    ]
    (raised,), done = env.step(turn(call("fails", x=5)))
    assert not done and raised["content"] == "ValueError: no luck with 5"  # the model sees the error
    (slow,), _ = env.step(turn(call("sleeps", seconds=5)))
    assert slow["content"].startswith("TimeoutError: ")
    (unknown,), _ = env.step(turn(call("mul", a=1)))
    assert unknown["content"].startswith("Error: no tool 'mul'")
    (wrong,), _ = env.step(turn(call("add", a=1, c=2)))
    assert wrong["content"].startswith("TypeError: ")
    assert env.step(turn("the answer is 7")) == ([], True)  # no call ends the episode


def test_a_template_that_rerenders_earlier_turns_is_refused_in_one_line(tmp_path):
    """As Qwen3's drops earlier turns' reasoning: here an earlier assistant turn renders empty."""
    from paratrain.data.prompts import load_tokenizer
    from paratrain.objectives.rl.episodes import Episodes

    forgetful = CHATML_TOOLS.replace(
        "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}",
        "{% generation %}{{ (message['content'] if loop.last else '') + '<|im_end|>' }}{% endgeneration %}",
    )
    tok = load_tokenizer(save_ascii_chat_tokenizer(str(tmp_path / "tok"), template=forgetful))
    dataset = type("Prompts", (), {"tokenizer": tok})()
    episodes = Episodes(RLConfig(environment=ENV), dataset)
    e = episodes.start({"prompt": [{"role": "user", "content": "1+2="}]})
    with pytest.raises(ConfigError, match="renders the earlier turns differently") as err:
        episodes._turn(e, list(b"abc"), [0.0] * 3, (tok.eos_token_id,), last=False)
    assert "\n" not in str(err.value)
    # the same turn under a template that keeps it: the tool's answer follows, unscored
    episodes.tokenizer = load_tokenizer(save_ascii_chat_tokenizer(str(tmp_path / "tok2")))
    e = episodes.start({"prompt": [{"role": "user", "content": "1+2="}]})
    episodes._turn(e, list(b"abc"), [0.0] * 3, (tok.eos_token_id,), last=False)
    assert sorted(e.logps) == [e.prompt_len, e.prompt_len + 1, e.prompt_len + 2] and len(e.ids) > e.prompt_len + 3
    # an environment that raises: its error and the line that raised, in one line
    episodes.env = broken_environment(tools=[])
    with pytest.raises(ConfigError, match=r"step raised KeyError: 'content' \(at .*tool_data.py:\d+\)") as err:
        episodes._turn(e, list(b"d"), [0.0], (tok.eos_token_id,), last=False)
    assert "\n" not in str(err.value)


def test_bad_multi_turn_input_is_one_line(mt):
    with pytest.raises(ConfigError, match="schema transformers cannot write") as e:
        load_tools(["paratrain.testing.tool_data:undocumented"])
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="cannot import module"):
        load_tools(["paratrain.no_such:fn"])
    with pytest.raises(ConfigError, match="rl.max_turns"):
        load_config(None, _config(mt, "bad", "rl.max_turns=0"))
    with pytest.raises(ConfigError, match="'overlong'"):
        load_config(None, _config(mt, "bad", "rl.rewards=['overlong']", "rl.overlong_buffer=2"))
