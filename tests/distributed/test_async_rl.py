"""Asynchronous GRPO rounds (``rl.async_steps``, docs/async-rl.md): round r is sampled with the
weights at the start of round max(r - k, 0), whatever the timing and the layout, and the stale
sampler is corrected by its importance weight, anchored here to its formula.

``async_steps = 0`` is today's GRPO, bit for bit: test_grpo.py and the GRPO record of
benchmarks/parallel/bitwise_runs.py check it.
"""

from __future__ import annotations

import json
import math
from dataclasses import fields

import pytest
import torch

import paratrain
from paratrain.config import ConfigError, ModelConfig, load_config
from paratrain.objectives.policy_gradient import PolicyGradientLoss, Rollout, importance_weights, token_weights
from paratrain.objectives.rl.rollout import completion_keys, sample, training_rows
from paratrain.objectives.rl.stale import DELAY_ENV, StaleRounds
from paratrain.randomness import row_keys
from paratrain.testing.dist_utils import REPO, plain_sgd, read_metrics, run_ranks, train_rank

G, NEW, STEPS = 4, 6, 3
ARGS = {"n_layer": 2, "n_head": 4, "d_model": 32, "block_size": 32}


def _config(out, *extra: str) -> list[str]:
    return [
        "model.args={n_layer = 2, n_head = 4, d_model = 32, block_size = 32}",
        "data.name='prompts'",
        f"data.args={{path = '{REPO}/configs/rl/additions.jsonl', max_prompt_length = 8}}",
        "data.shuffle=false",
        "loss.name='grpo'",
        f"rl.group_size={G}",
        f"rl.max_new_tokens={NEW}",
        "rl.temperature=0.8",
        "rl.rewards=['paratrain.testing.rl_data:byte_mix']",
        "batch.global_batch_size=16",
        "batch.micro_batch_size=4",
        f"run.steps={STEPS}",
        "run.progress=false",
        "metrics.plot=false",
        *plain_sgd(0.5),
        f"run.out_dir='{out}'",
        *extra,
    ]


def _run(out, *extra: str, world: int = 1) -> tuple[list[dict], list[dict]]:
    over = _config(out, *extra)
    if world == 1:
        paratrain.train(load_config(None, over))
    else:
        run_ranks(train_rank, world, over)
    with open(out / "rollouts.jsonl") as f:
        return read_metrics(str(out)), [json.loads(line) for line in f]


def _sample_with(weights: str, rollouts: list[dict], step: int) -> list[list[int]]:
    """The completions of ``step``'s prompts sampled here, on the built-in GPT loaded with
    ``weights`` (a run's model.safetensors), keyed as the run keys them (seed 0, epoch 0)."""
    from safetensors.torch import load_file

    from paratrain.models import build

    model, _ = build(ModelConfig(args={**ARGS, "vocab_size": 256}))
    model.load_state_dict(load_file(weights))
    model.eval()
    rows = [json.loads(line) for line in open(f"{REPO}/configs/rl/additions.jsonl")]
    index = sorted({r["prompt_index"] for r in rollouts if r["step"] == step})
    ids = [list(rows[i]["prompt"].encode()) for i in index]
    lengths = torch.tensor([len(x) for x in ids]).repeat_interleave(G)
    prompts = torch.tensor([x + [0] * (8 - len(x)) for x in ids]).repeat_interleave(G, 0)
    keys = completion_keys(row_keys(load_config(None, []).run.seed, [(0, i) for i in index]), G)
    tokens, _, n = sample(model, prompts, lengths, keys, max_new_tokens=NEW, temperature=0.8, stop=(10,), cached=True)
    return [tokens[i, : int(n[i])].tolist() for i in range(len(tokens))]


def test_stale_rounds_are_fixed_by_the_config_and_the_layout_not_the_timing(tmp_path, monkeypatch):
    """k = 1: the same completions and losses with generation slower than training at world 1 as
    with training slower than generation at world 2 with accumulation (and generation batches of
    3); and round 2 is the sampling of the weights after step 1 (the start of round 1), loaded from a run
    that stops there and sampled here."""
    monkeypatch.setenv(DELAY_ENV, "generate=0.3")  # training waits for every round
    rows, rollouts = _run(tmp_path / "k1", "rl.async_steps=1")
    monkeypatch.setenv(DELAY_ENV, "train=0.2")  # every round is ready before it is needed
    rows2, rollouts2 = _run(
        tmp_path / "w2", "rl.async_steps=1", "batch.micro_batch_size=2", "rl.generation_batch_size=3", world=2
    )
    monkeypatch.delenv(DELAY_ENV)
    cut = lambda rs: [{k: v for k, v in r.items() if k != "advantage"} for r in rs]  # noqa: E731
    assert cut(rollouts2) == cut(rollouts)
    for key in ("loss", "grad_norm", "reward", "importance_weight"):
        assert [r[key] for r in rows2] == pytest.approx([r[key] for r in rows], rel=1e-5, abs=1e-7), key
    # round 0 is sampled with the weights that train on it, round 1 is stale
    assert rows[0]["importance_weight"] == pytest.approx(1, abs=1e-5) and abs(rows[1]["importance_weight"] - 1) > 1e-3
    # the weights that sampled round 2: those after step 1 (a run that stops there writes them)
    _run(tmp_path / "step1", "rl.async_steps=1", "run.steps=1")
    mine = [r["tokens"] for r in rollouts if r["step"] == 3]
    assert mine == _sample_with(str(tmp_path / "step1" / "model.safetensors"), rollouts, 3)
    assert mine != _sample_with(str(tmp_path / "k1" / "model.safetensors"), rollouts, 3)  # the newest differ


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_stale_rounds_sampled_by_a_thread_equal_those_sampled_at_the_boundary_by_fsdp2(tmp_path):
    """k = 2 with two steps per round and token-level truncation: one process (a background thread
    on two snapshot copies in turn) against FSDP2 at world 2 with accumulation (each round sampled
    at the boundary by the sharded live model): the same completions, losses and weights."""
    extra = ("rl.async_steps=2", "rl.steps_per_generation=2", "rl.importance='token_truncate'", "run.steps=8")
    rows, rollouts = _run(tmp_path / "w1", *extra)
    rows2, rollouts2 = _run(tmp_path / "fsdp", *extra, "parallel.dp_shard=2", "batch.micro_batch_size=2", world=2)
    cut = lambda rs: [{k: v for k, v in r.items() if k != "advantage"} for r in rs]  # noqa: E731
    assert cut(rollouts2) == cut(rollouts) and len({r["step"] for r in rollouts}) == 8
    for key in ("loss", "grad_norm", "importance_weight", "clip_ratio"):
        assert [r[key] for r in rows2] == pytest.approx([r[key] for r in rows], rel=1e-5, abs=1e-7), key
    assert rows[-1]["logp_gap"] > 1e-3 and rows[-1]["importance_weight"] != 1


def test_round_r_takes_the_weights_of_round_r_minus_k_with_and_without_a_thread():
    """The schedule alone: a 'model' whose one weight is the round it was set at; each round
    records the weight it was sampled with."""
    for k in (1, 2):
        for overlap in (True, False):
            live = torch.nn.Linear(1, 1, bias=False)
            stale = StaleRounds(k, live=lambda live=live: live, overlap=overlap, rounds=6)
            seen = []
            for r in range(6):
                with torch.no_grad():
                    live.weight.fill_(r)  # the weights at the start of round r

                def job(j, sampler, r=r):
                    return r + j, (sampler or live).weight.detach().item()

                got_round, weight = stale.take(r, job)
                seen.append(weight)
                assert got_round == r
            assert seen == [float(max(r - k, 0)) for r in range(6)], (k, overlap)
    with pytest.raises(ConfigError, match="resumes at round 2 with rl.async_steps = 1"):
        StaleRounds(1, live=lambda: live, overlap=False, rounds=6).take(2, job)


def test_importance_weights_are_their_formula():
    """Hand-computed: rho_t = exp(old_t - behaviour_t). token_truncate: min(rho_t, C);
    sequence_mask: the completion's product of rho_t, 0 above C (TRL's vllm_importance_sampling_mode)."""
    behaviour = torch.zeros(2, 3, dtype=torch.float64)
    old = torch.tensor([[math.log(2), math.log(0.5), math.log(4)], [math.log(1.5), math.log(1.2), 5.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    w, capped = importance_weights(old, behaviour, mask, mode="token_truncate", cap=3.0)
    torch.testing.assert_close(w[mask], torch.tensor([2.0, 0.5, 3.0, 1.5, 1.2], dtype=torch.float64))
    assert capped.tolist() == [[False, False, True], [False, False, False]]
    w, capped = importance_weights(old, behaviour, mask, mode="sequence_mask", cap=3.0)
    torch.testing.assert_close(w[mask], torch.tensor([0.0, 0.0, 0.0, 1.8, 1.8], dtype=torch.float64))  # 2*.5*4 = 4 > 3
    assert capped.tolist() == [[True, True, True], [False, False, False]]
    w, capped = importance_weights(old, behaviour, mask, mode="none", cap=3.0)
    assert w.eq(1).all() and not capped.any()


@pytest.mark.parametrize("on_policy", [False, True])
@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_the_weight_multiplies_the_surrogate_and_leaves_the_normaliser(mode, on_policy):
    """Over two micro-batches: sum of w_t * surrogate_t + beta * KL_t (the KL unweighted, as TRL)
    over units counted as without the weight, a masked completion included. pi_old is the
    recomputation (several steps a round) or, on-policy, the differentiated policy itself."""
    g = torch.Generator().manual_seed(0)
    lengths = [3, 1, 4, 2]
    tokens = torch.full((4, 4), -1)
    for i, c in enumerate(lengths):
        tokens[i, :c] = torch.randint(0, 11, (c,), generator=g)
    logits = torch.randn(4, 3 + 4, 11, generator=g, requires_grad=True)
    behaviour = torch.randn(4, 4, generator=g).clamp(max=0) - 1
    old = behaviour + torch.tensor([[0.1, -0.2, 0.3, 0.0], [2.0, 0, 0, 0], [-0.5, 0.4, 0.2, 0.1], [0.3, 0.2, 0, 0]])
    adv = torch.randn(4, generator=g)
    prompts = torch.randint(0, 11, (4, 3), generator=g)
    _, target = training_rows(
        prompts, torch.full((4,), 3), tokens, behaviour, adv, token_weights("grpo", torch.tensor(lengths))
    )
    target.old[:, 2:6] = torch.where(tokens >= 0, old, 0.0).double()  # the trainer's recomputation
    target.ref[:, 2:6] = torch.where(tokens >= 0, behaviour - 0.3, 0.0).double()
    objective = PolicyGradientLoss("grpo", beta=0.1, on_policy=on_policy, importance=mode, importance_cap=3.0)
    halves = [Rollout(*(getattr(target, f.name)[a : a + 2] for f in fields(Rollout))) for a in (0, 2)]
    units = sum(int(objective.count(None, t)) for t in halves)
    assert units == 4
    objective.start(scale=1 / units, device=torch.device("cpu"))
    total = 0
    for part, t in zip(logits.split(2), halves, strict=True):
        total = total + objective.loss(part, t)
        objective.end_micro_batch()
    by, weights = 0, []
    for i, c in enumerate(lengths):
        lp = logits[i, 2 : 2 + c].log_softmax(-1).gather(-1, tokens[i, :c, None])[:, 0]
        pi_old = lp.detach() if on_policy else old[i, :c]
        rho = torch.exp(pi_old - behaviour[i, :c])
        if mode == "token_truncate":
            w = rho.clamp(max=3.0)
        else:
            w = rho.prod().expand(c) * (rho.prod() <= 3.0)
        weights.append(w)
        ratio = torch.exp(lp - pi_old)
        surrogate = torch.minimum(ratio * adv[i], ratio.clamp(0.8, 1.2) * adv[i])
        gap = behaviour[i, :c] - 0.3 - lp
        by = by + (-w * surrogate + 0.1 * (torch.exp(gap) - gap - 1)).mean()
    by = by / 4
    assert total.item() == pytest.approx(by.item(), rel=1e-5)
    torch.testing.assert_close(
        torch.autograd.grad(total, logits)[0], torch.autograd.grad(by, logits)[0], rtol=1e-5, atol=1e-7
    )
    read = objective.read(objective.sums().tolist(), units=units)
    assert read["importance_weight"] == pytest.approx(torch.cat(weights).mean().item(), rel=1e-6)
    if mode == "sequence_mask" and not on_policy:  # row 1: exp(2) > 3, masked
        assert read["importance_capped"] == pytest.approx(1 / 10)


def test_bad_async_input_is_refused_in_one_line():
    for over, expected in (
        ("rl.async_steps=-1", "rl.async_steps = -1 must be >= 0"),
        ("rl.importance_cap=0", "rl.importance_cap = 0.0 must be > 0"),
        ("rl.importance='token_mask'", "rl.importance = 'token_mask' is not allowed"),
        ("rl.async_steps=1 rl.engine='vllm'", "rl.async_steps = 1 with rl.engine = 'vllm': stale rounds"),
    ):
        with pytest.raises(ConfigError, match=expected):
            load_config(None, ["loss.name='grpo'", *over.split()])
