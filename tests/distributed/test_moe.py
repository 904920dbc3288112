"""Mixture of experts in the built-in GPT (models/gpt/moe.py, docs/moe.md).

Anchors written here in plain PyTorch, not with the code under test: the MoE block's forward
against a per-token loop that runs every expert densely (float64), and the sequence-wise balance
loss against its formula (DeepSeek-V3 eqs. 17-20) on the same router probabilities. Then the
layouts: DDP, FSDP2 and accumulation at world 2 and 4 against one process under plain SGD
(language-model loss, auxiliary loss, grad_norm, tokens per expert, weights).
"""

from __future__ import annotations

import copy

import pytest
import torch

from paratrain.config import ConfigError
from paratrain.models.gpt import build_gpt
from paratrain.models.gpt.moe import MoE
from paratrain.objectives.moe import router_layers, take_router_stats
from paratrain.testing.moe_utils import MOE_GPT, D, assert_same_moe_run, make_moe, moe_runs


def reference_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Per token, every expert densely, in float64: out_t = sum over its top-k of w_i(t) E_i(x_t) (+ shared)."""
    ref = copy.deepcopy(moe).double()
    cfg = moe.cfg
    out = torch.zeros(x.shape, dtype=torch.float64)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            xt = x[b, t].double()
            probs = torch.softmax(ref.router.weight @ xt, dim=0)
            order = sorted(range(cfg.n_experts), key=lambda i: -float(probs[i].detach()))[: cfg.top_k]
            w = probs[order] / (probs[order].sum() if cfg.norm_topk else 1.0)
            dense = [expert(xt) for expert in ref.experts]  # every expert, used or not
            out[b, t] = sum(w[j] * dense[i] for j, i in enumerate(order))
            for shared in ref.shared_experts:
                out[b, t] += shared(xt)
    return out


def reference_balance_loss(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """weight x sum over sequences of sum_i f_i P_i, f_i = E/(kT) #tokens choosing i, P_i the mean probability."""
    cfg = moe.cfg
    total = torch.zeros((), dtype=torch.float64)
    for b in range(x.shape[0]):
        probs = torch.softmax(x[b].double() @ moe.router.weight.double().t(), dim=-1)  # (T, E)
        chosen = torch.zeros(cfg.n_experts, dtype=torch.float64)
        for t in range(x.shape[1]):
            for i in torch.argsort(probs[t], descending=True)[: cfg.top_k]:
                chosen[i] += 1
        f = chosen * cfg.n_experts / (cfg.top_k * x.shape[1])
        total += (f * probs.mean(dim=0)).sum()
    return cfg.aux_loss_weight * total


@pytest.mark.parametrize(
    "kw", [{}, {"norm_topk": False}, {"n_shared_experts": 1, "top_k": 1}], ids=["norm", "no-norm", "shared"]
)
def test_moe_forward_and_balance_loss_equal_the_per_token_reference(kw):
    moe = make_moe(**kw)
    x = torch.randn(3, 5, D)
    out = moe(x)
    stats = take_router_stats(router_layers(moe))
    torch.testing.assert_close(out.double(), reference_moe(moe, x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats[0].aux_sum.double(), reference_balance_loss(moe, x), rtol=1e-5, atol=1e-7)
    assert int(stats[0].tokens_per_expert.sum()) == 3 * 5 * moe.cfg.top_k


def test_balance_loss_is_transformers_switch_loss_per_sequence_over_top_k():
    """Anchor to code we did not write: transformers' load_balancing_loss_func (Switch eqs. 4-6,
    f and P over all the rows it is given) on one sequence is top_k x ours; on a batch, ours is
    its per-sequence value summed over the sequences, which its batch-level value is not."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    moe = make_moe()
    e, k, w = moe.cfg.n_experts, moe.cfg.top_k, moe.cfg.aux_loss_weight
    x = torch.randn(3, 7, D)
    moe(x)
    ours = take_router_stats([moe])[0].aux_sum.detach()
    with torch.no_grad():
        logits = x @ moe.router.weight.t()  # (B, T, E)
    per_sequence = [load_balancing_loss_func((row,), e, k) for row in logits]
    torch.testing.assert_close(ours, w / k * sum(per_sequence), rtol=1e-5, atol=0)
    batch_level = load_balancing_loss_func((logits.reshape(-1, e),), e, k)
    assert abs(float(w / k * 3 * batch_level - ours)) > 1e-4  # a different function of the batch


def test_moe_output_and_loss_do_not_depend_on_how_sequences_are_grouped():
    """What the exactness rests on: split a batch of sequences anywhere, each token's output is
    the same and the balance-loss sums add up to the whole batch's, gradients included."""
    moe = make_moe()
    x = torch.randn(4, 6, D)
    whole = moe(x)
    aux_whole = take_router_stats([moe])[0].aux_sum
    grads_whole = torch.autograd.grad(aux_whole + whole.square().sum(), list(moe.parameters()))
    parts, aux_parts, grads_parts = [], 0, None
    for chunk in x.split([1, 3]):
        y = moe(chunk)
        aux = take_router_stats([moe])[0].aux_sum
        g = torch.autograd.grad(aux + y.square().sum(), list(moe.parameters()))
        grads_parts = g if grads_parts is None else [a + b for a, b in zip(grads_parts, g)]
        parts.append(y)
        aux_parts = aux_parts + aux
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(aux_parts, aux_whole, rtol=1e-6, atol=0)
    for a, b in zip(grads_parts, grads_whole):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_flops_per_token_count_the_active_experts_only():
    """MFU's FLOPs: top_k = 1 of 4 experts is the dense GPT plus the router (d_model x n_experts per layer)."""
    from paratrain.models.gpt.model import gpt_flops

    args = dict(n_layer=2, n_head=2, d_model=D, block_size=8, vocab_size=32)
    dense = gpt_flops(build_gpt(**args))(8)
    moe = gpt_flops(build_gpt(**args, moe={"n_experts": 4, "top_k": 1}))(8)
    assert moe - dense == 6 * 2 * D * 4


def test_memory_estimates_route_balanced_without_values():
    """paratrain plan / find-batch run the model on fake or meta tensors, which have no values to
    route by: each expert then gets an equal share of the (token, slot) pairs, each pair once."""
    from paratrain.models.gpt.moe import _balanced

    pairs = [p for e in range(3) for p in zip(*(t.tolist() for t in _balanced(e, 7, 2, 3, "cpu")))]
    assert sorted(pairs) == [(t, s) for t in range(7) for s in range(2)]
    with torch.device("meta"):
        moe = make_moe()
        out = moe(torch.randn(2, 5, D))
    assert out.shape == (2, 5, D) and out.device.type == "meta"


def test_a_gpt_with_moe_every_second_block():
    model = build_gpt(n_layer=4, n_head=2, d_model=D, block_size=8, vocab_size=32, moe={"n_experts": 4, "every": 2})
    assert [type(b.mlp).__name__ for b in model.layers.values()] == ["MLP", "MoE", "MLP", "MoE"]
    model(torch.randint(0, 32, (2, 8)))
    assert len(take_router_stats(router_layers(model))) == 2


@pytest.mark.parametrize(
    "moe,match",
    [
        ({"n_experts": 2, "top_k": 3}, "model.args.moe.top_k = 3 is more than n_experts = 2"),
        ({"n_experts": 0}, "model.args.moe.n_experts = 0 must be an integer >= 1"),
        ({"n_expert": 4}, "model.args.moe.n_expert is unknown"),
        ({"aux_loss_weight": -1}, "model.args.moe.aux_loss_weight = -1 must be a number >= 0"),
        ({"every": 0}, "model.args.moe.every = 0"),
        ({"n_shared_experts": -1}, "model.args.moe.n_shared_experts = -1"),
    ],
)
def test_bad_moe_config_is_one_line(moe, match):
    with pytest.raises(ConfigError, match=match) as e:
        build_gpt(moe=moe)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "override,key",
    [
        (["optim.lr_scaling='adascale'"], "optim.lr_scaling = 'adascale'"),
    ],
)
def test_moe_refuses_what_is_not_built_yet(override, key):
    import paratrain
    from paratrain.preflight import check_run

    cfg = paratrain.load_config(None, [*MOE_GPT, *override])
    with pytest.raises(ConfigError, match=f"model.args.moe with {key} is not supported yet"):
        check_run(cfg, 2)


# ------------------------------------------------------------------------------ layouts


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_ref")
    return moe_runs(
        tmp,
        1,
        {
            "ref": ["batch.micro_batch_size=8"],
            "acc4": ["batch.micro_batch_size=2"],
            # The recompute runs the router again in backward: the step has taken its stats by then.
            "acc2_ac": ["batch.micro_batch_size=4", "parallel.activation_checkpointing='full'"],
        },
    )


@pytest.mark.slow
def test_moe_layouts_at_world_2_equal_one_process(tmp_path, moe_reference):
    ref = moe_reference["ref"]
    assert ref["aux_loss"][0] > 0 and abs(ref["loss"][-1] - ref["loss"][0]) > 1e-3  # the weights move
    assert_same_moe_run(moe_reference["acc4"], ref)
    assert_same_moe_run(moe_reference["acc2_ac"], ref)
    runs = moe_runs(
        tmp_path,
        2,
        {
            "ddp_acc2": ["batch.micro_batch_size=2"],
            "fsdp_acc2": ["parallel.dp_shard=2", "batch.micro_batch_size=2"],
            "fsdp_zero2_acc4": [
                "parallel.dp_shard=2",
                "parallel.reshard_after_forward=false",
                "batch.micro_batch_size=1",
            ],
        },
    )
    for name, got in runs.items():
        try:
            assert_same_moe_run(got, ref)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


@pytest.mark.slow
def test_moe_layouts_at_world_4_equal_one_process(tmp_path, moe_reference):
    runs = moe_runs(
        tmp_path,
        4,
        {
            "ddp_acc2": ["batch.micro_batch_size=1"],
            "fsdp4": ["parallel.dp_shard=4", "batch.micro_batch_size=2"],
            "hsdp_2x2_acc2": ["parallel.dp_replicate=2", "parallel.dp_shard=2", "batch.micro_batch_size=1"],
        },
    )
    for name, got in runs.items():
        try:
            assert_same_moe_run(got, moe_reference["ref"])
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


def test_the_step_adds_the_aux_loss_over_the_global_sequence_count():
    """Fast, the step alone: four micro-batches of 2 sequences give one micro-batch of 8's loss,
    aux_loss, grad_norm and tokens per expert, and the aux term is really differentiated."""
    from paratrain.config import LossConfig
    from paratrain.objectives import build_objectives
    from paratrain.objectives.registry import build_loss
    from paratrain.step import StepContext, train_step

    torch.manual_seed(0)
    x = torch.randint(0, 32, (8, 9))
    results = {}
    for micro, weight in ((8, 0.1), (2, 0.1), (8, 0.0)):
        torch.manual_seed(0)
        args = dict(n_layer=2, n_head=2, d_model=D, block_size=8, vocab_size=32)
        model = build_gpt(**args, moe={"n_experts": 4, "top_k": 2, "aux_loss_weight": weight})
        ctx = StepContext(objectives=build_objectives(build_loss(LossConfig()), model), device=torch.device("cpu"))
        batches = [(c[:, :-1], c[:, 1:]) for c in x.split(micro)]
        results[micro, weight] = train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, ctx)
    ref, acc, unweighted = results[8, 0.1], results[2, 0.1], results[8, 0.0]
    assert ref.extras["aux_loss"] > 0 and unweighted.extras["aux_loss"] == 0
    torch.testing.assert_close(acc.extras["aux_loss"], ref.extras["aux_loss"], rtol=1e-6, atol=0)
    torch.testing.assert_close(acc.loss, ref.loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(acc.grad_norm, ref.grad_norm, rtol=1e-5, atol=0)
    tokens = ref.extras["tokens_per_expert"]
    assert acc.extras["tokens_per_expert"] == tokens and sum(tokens[0]) == 8 * 8 * 2
    assert unweighted.loss == ref.loss and abs(unweighted.grad_norm - ref.grad_norm) > 1e-6


@pytest.mark.slow
def test_moe_accumulation_on_one_process_equals_one_micro_batch(tmp_path):
    """Fast: the step adds each micro-batch's auxiliary sum over the global sequence count and
    logs it: four micro-batches of 2 give one micro-batch of 8's losses, grad_norm and counts."""
    two = ["run.steps=1"]
    runs = moe_runs(tmp_path, 1, {"mb8": ["batch.micro_batch_size=8", *two], "mb2": ["batch.micro_batch_size=2", *two]})
    assert runs["mb8"]["aux_loss"][0] > 0
    assert_same_moe_run(runs["mb2"], runs["mb8"])


@pytest.mark.slow
def test_moe_resumes_at_another_layout(tmp_path):
    """A checkpoint of one process at step 2 resumed by FSDP2 on 2 ranks: steps 3-4 as uninterrupted."""
    ckpt = ["run.steps=4", "checkpoint.interval=2", "checkpoint.keep=0"]
    ref = moe_runs(tmp_path / "w1", 1, {"ref": ["batch.micro_batch_size=8", *ckpt]})["ref"]
    src = tmp_path / "w1" / "ref" / "checkpoints" / "step-2"
    resume = [*ckpt, f"checkpoint.resume='{src}'", "parallel.dp_shard=2", "batch.micro_batch_size=2"]
    got = moe_runs(tmp_path / "w2", 2, {"resumed": resume})["resumed"]
    for key in ("loss", "aux_loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(ref[key][2:]), rtol=1e-5, atol=0)
    assert got["tokens"] == ref["tokens"][2:]


def test_router_metrics_of_a_step():
    from paratrain.objectives import BalanceLoss
    from paratrain.step import StepResult

    extras = {"aux_loss": 0.25, "tokens_per_expert": [[2, 6], [4, 4]]}
    result = StepResult(loss=3.0, items=10, grad_norm=1.0, tokens=10, extras=extras)
    assert BalanceLoss(()).metrics(result.extras) == {
        "aux_loss": 0.25,
        "expert_tokens_min": 2,
        "expert_tokens_max": 6,
        "expert_imbalance": 1.5,  # the worst layer's max / mean: 6 / 4
    }
