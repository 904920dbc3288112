"""Reinforcement learning with generation (docs/grpo.md): GRPO and its variants, exact on every layout.

The anchor is code we did not write: plain ``transformers`` scoring **each completion alone**
(the prompt rendered by the tokenizer's chat template, then the completion's tokens), the reward
function called as TRL calls it, the group advantages, the clipped surrogate and the k3 KL written
out here, under plain SGD. paratrain's steps (loss, and ``grad_norm``: the gradient's size) must
equal it, and every layout (world size, accumulation, FSDP2, tensor parallel, a resume at another
world size) must give the one-process numbers and the same completions, token for token.
"""

from __future__ import annotations

import json
import os
from dataclasses import fields

import pytest
import torch

import paratrain
from paratrain.config import RL_LOSS_TYPES, load_config
from paratrain.objectives.policy_gradient import PolicyGradientLoss, Rollout, token_weights
from paratrain.objectives.rl.rollout import advantages, completion_keys, filtered_probs, pick, sample, training_rows
from paratrain.testing.dist_utils import REPO, paratrain_cli, plain_sgd, read_metrics, run_ranks, sgd_step, train_rank
from paratrain.testing.hf_models import ARCHS, save_tiny
from paratrain.testing.rl_data import addition_rows, byte_mix
from paratrain.testing.sft_data import VOCAB, save_chat_tokenizer, write_jsonl

pytest.importorskip("transformers")

PROMPTS, G, NEW, TEMPERATURE, BETA, LR = 16, 4, 5, 0.8, 0.05, 2.0


@pytest.fixture(scope="module")
def rl(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    rows = addition_rows(PROMPTS, conversational=True)
    return {
        "root": str(root),
        "tok": save_chat_tokenizer(str(root / "tok")),
        "rows": rows,
        "data": write_jsonl(str(root / "prompts.jsonl"), rows),
        "policy": save_tiny("qwen2", str(root / "policy"), vocab_size=VOCAB, max_position_embeddings=512, seed=0),
        # another model of the same shape, as the reference of rl.reference = DIR
        "other": save_tiny("qwen2", str(root / "other"), vocab_size=VOCAB, max_position_embeddings=512, seed=1),
    }


def _config(rl: dict, name: str, *extra: str) -> list[str]:
    return [
        f"model.hf='{rl['policy']}'",
        "data.name='prompts'",
        f"data.args={{path = '{rl['data']}', tokenizer = '{rl['tok']}', max_prompt_length = 40}}",
        "data.shuffle=false",
        "loss.name='grpo'",
        f"rl.group_size={G}",
        f"rl.max_new_tokens={NEW}",
        f"rl.temperature={TEMPERATURE}",
        f"rl.beta={BETA}",
        "rl.steps_per_generation=2",
        "rl.rewards=['paratrain.testing.rl_data:byte_mix']",
        f"run.out_dir='{rl['root']}/{name}'",
        "batch.global_batch_size=8",
        "batch.micro_batch_size=4",
        "run.steps=2",
        "run.progress=false",
        "metrics.plot=false",
        *plain_sgd(LR),
        *extra,
    ]


def same_rollouts(mine: list[dict], theirs: list[dict]) -> None:
    """Token for token; the advantages to float64's rounding (torch's std over a different count
    of groups may take another reduction order)."""
    cut = lambda rows: [{k: v for k, v in r.items() if k != "advantage"} for r in rows]  # noqa: E731
    assert cut(mine) == cut(theirs)
    assert [r["advantage"] for r in mine] == pytest.approx([r["advantage"] for r in theirs], rel=1e-12, abs=1e-12)


def _run(rl: dict, name: str, *extra: str, world: int = 1) -> tuple[list[dict], list[dict]]:
    over = _config(rl, name, *extra)
    if world == 1:
        paratrain.train(load_config(None, over))
    else:
        run_ranks(train_rank, world, over)
    out = os.path.join(rl["root"], name)
    with open(os.path.join(out, "rollouts.jsonl")) as f:
        return read_metrics(out), [json.loads(line) for line in f]


def completion_logps(model, tok, prompt: list[dict], tokens: list[int]) -> torch.Tensor:
    """log softmax(logits / T) of one completion's tokens after its prompt alone (transformers)."""
    rendered = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    ids = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    full = torch.tensor([ids + tokens])
    logits = model(input_ids=full).logits[0, len(ids) - 1 : len(ids) - 1 + len(tokens)].float() / TEMPERATURE
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def anchor(rl: dict, rollouts: list[dict], *, reference: str = "policy", **variant):
    """The written-out steps on the tiny text model, its tokenizer's chat template rendering each
    prompt; ``reference``: the fixture's model the KL is to."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(rl["tok"])
    policy = AutoModelForCausalLM.from_pretrained(rl["policy"], attn_implementation="sdpa")
    ref = AutoModelForCausalLM.from_pretrained(rl[reference], attn_implementation="sdpa")
    logps = lambda model, r: completion_logps(model, tok, rl["rows"][r["prompt_index"]]["prompt"], r["tokens"])  # noqa: E731
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    return written_out_steps(policy, ref, rollouts, logps, decode, **variant)


def written_out_steps(
    policy,
    reference,
    rollouts: list[dict],
    logps,
    decode,
    *,
    loss_type: str = "grpo",
    spg: int = 2,
    eps: float = 0.2,
    beta: float = BETA,
    rloo: bool = False,
    overlong: int = 0,
    group: int = G,
    lr: float = LR,
):
    """(losses, grad norms) of plain SGD on paratrain's completions, everything else written out:
    rewards from the text, advantages, ratios to the round's first policy, the k3 KL to
    ``reference``, the variant's normaliser over the step's completions. ``logps(model, rollout)``
    scores one completion alone after its prompt (transformers); ``decode`` turns its tokens into
    the text the rewards read. The image-text test (test_vision_grpo.py) runs it on LLaVA."""
    steps = sorted({r["step"] for r in rollouts})
    old: dict[int, torch.Tensor] = {}
    losses, norms = [], []
    for step in steps:
        rows = [(i, r) for i, r in enumerate(rollouts) if r["step"] == step]
        if (step - 1) % spg == 0:  # a round's start: the old policy's log-probabilities
            with torch.no_grad():
                for i, r in enumerate(rollouts):
                    if step <= r["step"] < step + spg:
                        old[i] = logps(policy, r)
        text = [decode(r["tokens"]) for _, r in rows]
        assert text == [r["text"] for _, r in rows]
        reward = byte_mix(None, [[{"role": "assistant", "content": t}] for t in text])
        if overlong:  # DAPO's eq. 13: 0 up to NEW - L tokens, then linearly down to -1 at NEW
            reward = [x + min(0.0, (NEW - overlong - len(r["tokens"])) / overlong) for x, (_, r) in zip(reward, rows)]
        assert reward == pytest.approx([r["reward"] for _, r in rows], abs=1e-12)
        grouped = torch.tensor(reward, dtype=torch.float64).view(-1, group)
        if rloo:  # each completion against the mean of the other G - 1 of its group
            base = torch.stack([torch.cat([g[:i], g[i + 1 :]]).mean() for g in grouped for i in range(group)])
            base = base.view(-1, group)
        else:
            base = grouped.mean(-1, keepdim=True)
        adv = ((grouped - base) / (grouped.std(-1, keepdim=True) + 1e-4)).view(-1)
        total, tokens = 0, 0
        for (i, r), a in zip(rows, adv.float(), strict=True):
            logp = logps(policy, r)
            with torch.no_grad():
                ref = logps(reference, r)
            ratio = torch.exp(logp - old[i])
            surrogate = torch.minimum(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a)
            per_token = -surrogate + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
            total = total + (per_token.mean() if loss_type == "grpo" else per_token.sum())
            tokens += len(r["tokens"])
        units = {"grpo": len(rows), "seq_mean_token_sum": len(rows), "dapo": tokens, "dr_grpo": len(rows) * NEW}
        loss, norm = sgd_step(policy, total / units[loss_type], lr)
        losses.append(loss)
        norms.append(norm)
    return losses, norms


@pytest.fixture(scope="module")
def one_process(rl):
    return _run(rl, "w1")


def test_grpo_equals_transformers_on_each_completion_alone(rl, one_process):
    rows, rollouts = one_process
    assert len(rollouts) == 2 * 8 and [r["step"] for r in rollouts] == [1] * 8 + [2] * 8
    assert all(r["logp_gap"] <= 1e-6 for r in rows)  # the sampler's log-probabilities are the trainer's
    assert rows[1]["clip_ratio"] > 0 and rows[1]["kl"] > 0  # step 2 is off-policy: both terms at work
    losses, norms = anchor(rl, rollouts)
    assert [r["loss"] for r in rows] == pytest.approx(losses, rel=1e-5, abs=1e-6)
    assert [r["grad_norm"] for r in rows] == pytest.approx(norms, rel=1e-4)


def test_two_ranks_with_accumulation_give_the_one_process_numbers(rl, one_process):
    rows, rollouts = one_process
    # generation batches of 3 rows (the last one 1) against micro-batches of 2: the same tokens
    rows2, rollouts2 = _run(rl, "w2", "batch.micro_batch_size=2", "rl.generation_batch_size=3", world=2)
    same_rollouts(rollouts2, rollouts)
    for key in ("loss", "grad_norm", "reward", "kl", "clip_ratio"):
        assert [r[key] for r in rows2] == pytest.approx([r[key] for r in rows], rel=1e-5, abs=1e-7), key
    from safetensors.torch import load_file

    one, two = (load_file(os.path.join(rl["root"], n, "model.safetensors")) for n in ("w1", "w2"))
    assert one.keys() == two.keys()
    for name in one:  # the weights after the steps
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-6)


def test_a_reference_from_a_directory_is_that_models(rl):
    """rl.reference = DIR: the KL is to that model (here a differently initialised one), not the
    initial policy; one step per round, so the recomputation runs for the reference alone."""
    rows, rollouts = _run(rl, "ref_dir", "rl.steps_per_generation=1", f"rl.reference='{rl['other']}'")
    losses, norms = anchor(rl, rollouts, spg=1, reference="other")
    assert [r["loss"] for r in rows] == pytest.approx(losses, rel=1e-5, abs=1e-6)
    assert [r["grad_norm"] for r in rows] == pytest.approx(norms, rel=1e-4)
    assert rows[0]["kl"] > 0.01  # the initial policy would give 0 at the first step


def test_an_on_policy_step_without_kl_skips_the_recomputation(rl):
    """One step per round and beta 0: no step needs the old policy's or the reference's
    log-probabilities, so none are recomputed (no logp_gap), and the step is still the written-out
    one (its ratio is exp(logp - logp.detach())). With RLOO's leave-one-out baseline and DAPO's
    overlong penalty added to the reward, both written out in the anchor."""
    extra = (
        "rl.advantage='rloo'",
        "rl.rewards=['paratrain.testing.rl_data:byte_mix', 'overlong']",
        "rl.overlong_buffer=3",
    )
    rows, rollouts = _run(rl, "on_policy", "rl.steps_per_generation=1", "rl.beta=0", *extra)
    assert all("logp_gap" not in r for r in rows) and rows[0]["generation_s"] > 0
    assert rows[0]["reward_overlong"] < 0
    losses, norms = anchor(rl, rollouts, spg=1, beta=0.0, rloo=True, overlong=3)
    assert [r["loss"] for r in rows] == pytest.approx(losses, rel=1e-5, abs=1e-6)
    assert [r["grad_norm"] for r in rows] == pytest.approx(norms, rel=1e-4)


def test_the_built_in_gpts_cached_sampler_at_world_2_tensor_parallel_gives_the_one_process_numbers(tmp_path):
    """The built-in GPT samples with its own KV cache inside the tensor-parallel layout (heads
    split over 2 ranks, the mask over the cache's slots) and trains: the same completions token
    for token, losses and grad_norm (plain SGD) as one process; and as one process without the
    cache (the whole buffer rerun per token, SDPA's causal mask over the full sequence)."""
    root = REPO
    base = [
        "model.args={n_layer = 2, n_head = 4, d_model = 32, block_size = 32}",
        "data.name='prompts'",
        f"data.args={{path = '{root}/configs/rl/additions.jsonl', max_prompt_length = 8}}",
        "data.shuffle=false",
        "loss.name='grpo'",
        "rl.group_size=4",
        "rl.max_new_tokens=6",
        "rl.rewards=['paratrain.testing.rl_data:byte_mix']",
        "rl.check_logps=true",  # logp_gap: the cached sampler's log-probabilities against the trainer's
        "batch.global_batch_size=16",
        "batch.micro_batch_size=4",
        "run.steps=2",
        "run.progress=false",
        "metrics.plot=false",
        *plain_sgd(0.5),
    ]
    runs = {"w1": ([], 1), "w1_no_cache": (["rl.kv_cache=false"], 1), "tp2": (["parallel.tp=2"], 2)}
    got = {}
    for name, (extra, world) in runs.items():
        over = [*base, *extra, f"run.out_dir='{tmp_path / name}'"]
        if world == 1:
            paratrain.train(load_config(None, over))
        else:
            run_ranks(train_rank, world, over)
        with open(tmp_path / name / "rollouts.jsonl") as f:
            got[name] = (read_metrics(str(tmp_path / name)), [json.loads(line) for line in f])
    rows, rollouts = got["w1"]
    assert len({tuple(r["tokens"]) for r in rollouts}) > 1  # not one repeated completion
    for name in ("w1", "w1_no_cache", "tp2"):  # a few flipped tokens would hide a wrong mask; this would not
        assert all(r["logp_gap"] <= 1e-5 for r in got[name][0]), name
    for name in ("w1_no_cache", "tp2"):
        same_rollouts(got[name][1], rollouts)
        for key in ("loss", "grad_norm"):
            assert [r[key] for r in got[name][0]] == pytest.approx([r[key] for r in rows], rel=1e-5, abs=1e-7), key


@pytest.mark.slow
@pytest.mark.timeout(1500)  # six launches, each under run_ranks' own 240 s (which names a stuck rank)
def test_variants_and_sharded_layouts_give_the_one_process_numbers(rl):
    """dapo's token normaliser (a different split of tokens on every layout) on FSDP2 x tensor
    parallel at world 4 with top-k and top-p sampling and two epochs per generation round; the
    written-out anchor for dapo and dr_grpo; then a resume at world 2 with micro-batches of one
    (accumulation 4, the splits of trl#6024 and ms-swift#10117) from the world-4 checkpoint."""
    for loss_type in ("dapo", "dr_grpo"):
        rows, rollouts = _run(rl, f"anchor_{loss_type}", f"rl.loss_type='{loss_type}'", "rl.steps_per_generation=1")
        losses, norms = anchor(rl, rollouts, loss_type=loss_type, spg=1)
        assert [r["loss"] for r in rows] == pytest.approx(losses, rel=1e-5, abs=1e-6)
        assert [r["grad_norm"] for r in rows] == pytest.approx(norms, rel=1e-4)
    extra = (
        "rl.loss_type='dapo'",
        "rl.top_k=20",
        "rl.top_p=0.9",
        "rl.epochs_per_generation=2",
        "run.steps=8",
        "checkpoint.interval=4",
        "optim.lr=0.3",  # eight steps of lr 2 diverge (the KL's exp(ref - logp) overflows)
    )
    ref, ref_rollouts = _run(rl, "s1", *extra)
    rows, rollouts = _run(rl, "s4", *extra, "parallel.dp_shard=2", "parallel.tp=2", world=4)
    same_rollouts(rollouts, ref_rollouts)
    for key in ("loss", "grad_norm", "kl", "clip_ratio"):
        assert [r[key] for r in rows] == pytest.approx([r[key] for r in ref], rel=1e-4, abs=1e-6), key
    resumed = os.path.join(rl["root"], "s4")
    os.remove(os.path.join(resumed, "checkpoints", "step-8", ".metadata"))  # resume from step 4
    rows, rollouts = _run(
        rl, "s4", *extra, "parallel.dp_replicate=2", "batch.micro_batch_size=1", "checkpoint.resume='latest'", world=2
    )
    same_rollouts(rollouts, ref_rollouts)
    assert [r["loss"] for r in rows][-4:] == pytest.approx([r["loss"] for r in ref][-4:], rel=1e-4, abs=1e-6)


def _rows(n: int, lengths: list[int], seed: int = 0):
    """Random logits and training rows of ``n`` completions of lengths ``lengths``."""
    g = torch.Generator().manual_seed(seed)
    p, width, vocab = 3, max(lengths), 11
    prompts = torch.randint(0, vocab, (n, p), generator=g)
    tokens = torch.full((n, width), -1)
    for i, c in enumerate(lengths):
        tokens[i, :c] = torch.randint(0, vocab, (c,), generator=g)
    logits = torch.randn(n, p + width, vocab, generator=g, requires_grad=True)
    old = torch.randn(n, width, generator=g).clamp(max=0) - 1
    adv = torch.randn(n, generator=g)
    return prompts, tokens, logits, old, adv


@pytest.mark.parametrize("loss_type", RL_LOSS_TYPES)
def test_each_variant_is_its_papers_formula(loss_type):
    """The objective on a batch split in two micro-batches equals the variant's formula on the
    whole batch (Shao et al. 2024; Yu et al. 2025, DAPO; Liu et al. 2025, Dr. GRPO; verl's names)."""
    lengths = [3, 1, 4, 2, 4, 3]
    prompts, tokens, logits, old, adv = _rows(6, lengths)
    lengths_t = torch.tensor(lengths)
    inputs, target = training_rows(prompts, torch.full((6,), 3), tokens, old, adv, token_weights(loss_type, lengths_t))
    ref = old - 0.3
    target.ref[:, 2 : 2 + tokens.shape[1]] = torch.where(tokens >= 0, ref, 0.0).double()
    objective = PolicyGradientLoss(
        loss_type, epsilon=0.2, epsilon_high=0.28, beta=0.1, max_new_tokens=4, on_policy=False
    )
    halves = [Rollout(*(getattr(target, f.name)[a : a + 3] for f in fields(Rollout))) for a in (0, 3)]
    units = sum(int(objective.count(None, t)) for t in halves)
    objective.start(scale=1 / units, device=torch.device("cpu"))
    total = 0
    for part, t in zip(logits.split(3), halves, strict=True):
        total = total + objective.loss(part, t)
        objective.end_micro_batch()
    # written out: each completion's tokens scored at the positions before them
    terms, n_tokens = [], 0
    for i, c in enumerate(lengths):
        lp = logits[i, 2 : 2 + c].log_softmax(-1).gather(-1, tokens[i, :c, None])[:, 0]
        ratio = torch.exp(lp - old[i, :c])
        l = -torch.minimum(ratio * adv[i], ratio.clamp(0.8, 1.28) * adv[i])  # noqa: E741
        gap = ref[i, :c] - lp
        l = l + 0.1 * (torch.exp(gap) - gap - 1)  # noqa: E741
        terms.append(l)
        n_tokens += c
    by = {
        "grpo": sum(t.mean() for t in terms) / 6,
        "seq_mean_token_mean": sum(t.mean() for t in terms) / 6,
        "seq_mean_token_sum": sum(t.sum() for t in terms) / 6,
        "dapo": sum(t.sum() for t in terms) / n_tokens,
        "bnpo": sum(t.sum() for t in terms) / n_tokens,
        "token_mean": sum(t.sum() for t in terms) / n_tokens,
        "dr_grpo": sum(t.sum() for t in terms) / (6 * 4),
    }[loss_type]
    assert total.item() == pytest.approx(by.item(), rel=1e-5)
    (mine,) = torch.autograd.grad(total, logits)
    (theirs,) = torch.autograd.grad(by, logits)
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-7)
    assert objective.read(objective.sums().tolist(), units=units)["loss"] == pytest.approx(by.item(), rel=1e-5)


def test_advantages_are_trls():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 2.0, 2.0])
    adv, std = advantages(rewards, 4, scale="group")
    first = (rewards[:4] - rewards[:4].mean()) / (rewards[:4].std() + 1e-4)
    torch.testing.assert_close(adv[:4].float(), first)
    assert adv[4:].abs().max() == 0 and std[1] == 0  # a group that ties teaches nothing
    adv, _ = advantages(rewards, 4, scale="none")  # Dr. GRPO: centred, not scaled
    torch.testing.assert_close(adv[:4].float(), rewards[:4] - rewards[:4].mean())
    adv, _ = advantages(rewards, 4, scale="none", baseline="rloo")  # RLOO: the others' mean
    others = torch.tensor([(rewards[:4].sum() - r) / 3 for r in rewards[:4]])
    torch.testing.assert_close(adv[:4].float(), rewards[:4] - others)
    torch.testing.assert_close(adv[:4].float(), 4 / 3 * (rewards[:4] - rewards[:4].mean()))


def test_the_overlong_penalty_is_dapos():
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) with L_max = 8, L_cache = 4, from
    the completions' token ids as TRL passes them; and its buffer checked before the run."""
    from paratrain.config import ConfigError, RLConfig, validate_rl
    from paratrain.objectives.rl.rewards import Rewards

    rewards = Rewards(RLConfig(rewards=["overlong"], max_new_tokens=8, overlong_buffer=4))
    ids = [[1] * n for n in (2, 4, 5, 7, 8)]
    total, _ = rewards(["p"] * 5, ["c"] * 5, {"completion_ids": ids})
    assert total == [0.0, 0.0, -0.25, -0.75, -1.0]
    with pytest.raises(ConfigError, match="rl.overlong_buffer = 0 is not within"):
        validate_rl(RLConfig(rewards=["overlong"], max_new_tokens=8))


def test_top_k_and_top_p_keep_transformers_tokens():
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1)) * 3
    for k, p in ((5, 1.0), (0, 0.7), (10, 0.5), (0, 0.05)):
        mine = filtered_probs(logits, top_k=k, top_p=p) > 0
        theirs = logits
        if k:
            theirs = TopKLogitsWarper(k)(None, theirs)
        if p < 1:
            theirs = TopPLogitsWarper(p)(None, theirs)
        assert torch.equal(mine, theirs > float("-inf")), (k, p)


def test_inverse_cdf_draws_each_token_at_its_probability():
    probs = torch.tensor([[0.5, 0.0, 0.2, 0.3]])
    n = 1000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n  # an even grid over [0, 1)
    picked = pick(probs.expand(n, 4), u.float())
    assert torch.bincount(picked, minlength=4).tolist() == [500, 0, 200, 300]


def test_completions_are_keyed_by_the_sample_not_the_batch():
    """A completion's tokens depend on its prompt and key alone: the same in any batch, order or
    padding, and the G completions of one prompt differ."""
    from paratrain.models.gpt.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, n_layer=1, n_head=2, d_model=16, block_size=32)).eval()
    prompts = torch.tensor([[5, 6, 7, 0, 0], [9, 0, 0, 0, 0], [1, 2, 3, 4, 5]])
    lengths = torch.tensor([3, 1, 5])
    keys = completion_keys(torch.tensor([11, 22, 33]), 1)
    whole, logps, _ = sample(model, prompts, lengths, keys, max_new_tokens=6, temperature=1.0)
    order = torch.tensor([2, 0])
    part, part_logps, _ = sample(
        model, prompts[order, :], lengths[order], keys[order], max_new_tokens=6, temperature=1.0, stop=(999,)
    )
    assert torch.equal(part, whole[order])
    torch.testing.assert_close(part_logps, logps[order])
    group = completion_keys(torch.tensor([11]), 4)
    four, _, _ = sample(model, prompts[:1].expand(4, -1), lengths[:1].expand(4), group, max_new_tokens=6)
    assert len({tuple(t.tolist()) for t in four}) == 4


def test_a_drawn_stop_token_is_kept_in_the_tokens_the_lengths_and_the_loss():
    """The stop token ends a completion and belongs to it (TRL keeps the EOS the model drew): it
    is in the tokens, counted in the length and a target of the training row. The stop set is
    each row's third free-running token, certain to be drawn since the draws are keyed."""
    from paratrain.models.gpt.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, n_layer=1, n_head=2, d_model=16, block_size=32)).eval()
    prompts = torch.tensor([[5, 6, 7, 0, 0], [9, 0, 0, 0, 0], [1, 2, 3, 4, 5]])
    lengths = torch.tensor([3, 1, 5])
    keys = completion_keys(torch.tensor([11, 22, 33]), 1)
    free, free_logps, _ = sample(model, prompts, lengths, keys, max_new_tokens=6)
    stop = tuple(sorted({int(x) for x in free[:, 2]}))
    tokens, logps, count = sample(model, prompts, lengths, keys, max_new_tokens=6, stop=stop)
    ends = [next(t for t in range(6) if int(free[i, t]) in stop) + 1 for i in range(3)]  # each row's length
    assert count.tolist() == ends and max(ends) > 1
    for i, n in enumerate(ends):
        assert tokens[i, :n].tolist() == free[i, :n].tolist() and int(tokens[i, n - 1]) in stop
        assert (tokens[i, n:] == -1).all() and torch.equal(logps[i, :n], free_logps[i, :n])
    _, target = training_rows(prompts, lengths, tokens, logps, torch.ones(3), torch.ones(3))
    for i, n in enumerate(ends):  # the completion's tokens are the targets, the stop token among them
        k = int(lengths[i])
        assert target.tokens[i, k - 1 : k - 1 + n].tolist() == free[i, :n].tolist()
        assert (target.tokens[i, k - 1 + n :] == -1).all()


@pytest.mark.timeout(900)  # three CLI launches, each under paratrain_cli's own 240 s
def test_bad_rl_input_is_one_line(rl, tmp_path):
    config = tmp_path / "empty.toml"
    config.write_text("")
    cases = [
        (("batch.global_batch_size=6", "batch.micro_batch_size=2"), "whole groups of rl.group_size = 4"),
        (("rl.rewards=['paratrain.testing.rl_data:raises']",), "'paratrain.testing.rl_data:raises' raised KeyError"),
        ((f"rl.reference='{tmp_path}/none'",), f"rl.reference = '{tmp_path}/none' is not a local directory"),
    ]
    for i, (extra, expected) in enumerate(cases):
        sets = [a for o in _config(rl, f"bad{i}", *extra) for a in ("--set", o)]
        out = paratrain_cli("train", str(config), *sets)
        line = out.stderr.strip().splitlines()[-1]  # after the run's start-up lines
        assert out.returncode == 2 and expected in line and "Traceback" not in out.stderr, out.stderr[-2000:]


def test_a_reward_of_the_wrong_shape_is_one_line():
    from paratrain.config import ConfigError, RLConfig
    from paratrain.objectives.rl.rewards import Rewards

    raised = r"raised KeyError: 'solution' \(at \S*src/paratrain/testing/rl_data\.py:54\); fix it"  # the line inside it
    for fn, expected in (("wrong_length", "returned 1 rewards for 2 completions"), ("raises", raised)):
        rewards = Rewards(RLConfig(rewards=[f"paratrain.testing.rl_data:{fn}"]))
        with pytest.raises(ConfigError, match=expected):
            rewards(["1+1=", "2+2="], ["2", "4"], {"answer": ["2", "4"]})
    with pytest.raises(ConfigError, match="cannot import module 'nope'"):
        Rewards(RLConfig(rewards=["nope:fn"]))
    recipe = os.path.join(REPO, "configs/rl/rewards.py")
    mine = Rewards(RLConfig(rewards=[f"{recipe}:digits", "exact_match"], reward_weights=[0.5, 1.0]))
    total, columns = mine(["1+1=", "2+2="], ["2", "x4"], {"answer": ["2", "4"]})
    assert columns == [[1.0, 0.5], [1.0, 0.0]] and total == [1.5, 0.25]


@pytest.mark.parametrize("arch", [*ARCHS, "gpt"])
def test_the_kv_cache_samples_what_the_whole_buffer_samples(arch, tmp_path):
    """The sampler with a KV cache (one position per token, the prompts' padding masked) draws
    the tokens that rerunning the whole buffer draws, at log-probabilities within 1e-6: model.hf
    with transformers' DynamicCache, and the built-in GPT with its own KVCache."""
    from paratrain.config import ModelConfig
    from paratrain.models import build
    from paratrain.models.hf.weights import load_into, weight_files

    if arch == "gpt":
        torch.manual_seed(0)
        model, _ = build(
            ModelConfig(args={"n_layer": 2, "n_head": 4, "d_model": 32, "block_size": 32, "vocab_size": 256})
        )
    else:
        path = save_tiny(arch, str(tmp_path / arch), vocab_size=VOCAB, max_position_embeddings=512, seed=0)
        model, _ = build(ModelConfig(hf=path))
        load_into(model, files=weight_files(path), device=torch.device("cpu"))
    model.eval()
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([9, 4, 7, 1])
    prompts = torch.randint(0, 250, (4, 9), generator=g) * (torch.arange(9)[None] < lengths[:, None])
    keys = completion_keys(torch.tensor([5, 6]), 2)
    args = dict(max_new_tokens=8, temperature=TEMPERATURE, top_k=40, stop=(7,))
    cached, cached_logps, n = sample(model, prompts, lengths, keys, cached=True, **args)
    whole, whole_logps, m = sample(model, prompts, lengths, keys, cached=False, **args)
    assert torch.equal(cached, whole) and torch.equal(n, m)
    torch.testing.assert_close(cached_logps, whole_logps, rtol=0, atol=1e-6)
