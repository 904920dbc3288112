"""Mixture of experts composed with pipeline and tensor parallelism, and FSDP2's mixed precision
with expert parallelism (docs/moe.md, "Composition"; issue 24).

Fast: the pieces alone (the stage's auxiliary loss riding its output's backward, the GPT's
tensor-parallel plan keeping MoE blocks replicated, the router totals of a stage's layers, the
preflight). Slow: whole runs under plain SGD against one process (``loss``, ``aux_loss``,
``grad_norm``, tokens per expert, the final weights) with pp 2 and tp 2 (with and without
sequence parallel) at world 2, pp 2 x ep 2 and tp 2 x ep 2 at world 4, and bf16 FSDP2 x ep 2
(dp 2 and 4) against bf16 and fp32 one-process runs, and train.compile = true against eager.
"""

from __future__ import annotations

import pytest
import torch

from paratrain.config import ConfigError
from paratrain.testing.moe_utils import MOE_GPT, assert_same_moe_run, moe_runs

# ------------------------------------------------------------------------------ fast: the pieces


def test_a_stage_aux_loss_joins_the_backward_of_its_output():
    """_AuxLoss: the output passes unchanged and its backward also differentiates the auxiliary
    loss, with gradient 1, as if it had been added to the loss (what an earlier pipeline stage,
    which has no loss of its own, needs)."""
    from paratrain.distributed.pipeline_parallel import _AuxLoss

    g = torch.Generator().manual_seed(0)
    x, w, cot = torch.randn(3, 4, generator=g), torch.randn(4, 4, generator=g), torch.randn(3, 4, generator=g)
    w.requires_grad_(True)
    aux = lambda: (x @ w).softmax(-1).pow(2).sum() * 0.3  # noqa: E731
    out = _AuxLoss.apply(torch.tanh(x @ w), aux())
    assert torch.equal(out, torch.tanh(x @ w))
    out.backward(cot)
    got = w.grad.clone()
    w.grad = None
    ((torch.tanh(x @ w) * cot).sum() + aux()).backward()
    torch.testing.assert_close(got, w.grad, rtol=1e-6, atol=1e-7)


def test_router_totals_of_a_stage_fill_their_own_rows():
    """Under pp a rank's router layers fill their rows of (all layers, experts); the step's
    reduce over the stages sums the rows (a stage with no MoE block contributes zeros)."""
    from paratrain.objectives.moe import BalanceLoss, RouterStats

    class Layer(torch.nn.Module):
        router_stats = None

    class Stages:  # a PipelineModel's parts: this rank's stage holds layers 1 and 3 of 4
        def __init__(self, *parts):
            self.parts = parts

    names = ["h.0.moe", "h.1.moe", "h.2.moe", "h.3.moe"]
    a, b = Layer(), Layer()
    stage = torch.nn.Module()
    stage.h = torch.nn.ModuleDict({"1": torch.nn.Module(), "3": torch.nn.Module()})
    stage.h["1"].moe, stage.h["3"].moe = a, b
    totals = BalanceLoss([Layer() for _ in names], names=names, shape=(4, 2))
    totals.bind(Stages(stage))
    totals.start(scale=0.5, device=torch.device("cpu"))
    for m, (c0, c1) in ((a, (1, 2)), (b, (3, 4))):
        m.router_stats = RouterStats(aux_sum=torch.tensor(float(c0)), tokens_per_expert=torch.tensor([c0, c1]))
    assert float(totals.loss(None, None)) == pytest.approx(0.5 * 4)
    assert totals.sums().tolist() == [4, 0, 0, 1, 2, 0, 0, 3, 4]
    empty = BalanceLoss([Layer() for _ in names], names=names, shape=(4, 2))
    empty.bind(Stages(torch.nn.Linear(1, 1)))
    empty.start(scale=1.0, device=torch.device("cpu"))
    assert empty.loss(None, None) is None and empty.sums().tolist() == [0.0] * 9
    assert empty.read([6.0, *range(8)], units=3) == {
        "aux_loss": 2.0,
        "tokens_per_expert": [[0, 1], [2, 3], [4, 5], [6, 7]],
    }


def test_the_gpt_tp_plan_keeps_moe_blocks_replicated():
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleInputOutput

    from paratrain.models.gpt.model import build_gpt
    from paratrain.models.gpt.parallel import gpt_tp_plan

    model = build_gpt(n_layer=2, n_head=2, d_model=32, vocab_size=32, moe={"n_experts": 4, "every": 2})
    plan = gpt_tp_plan(model, sequence_parallel=False, loss_parallel=False)
    assert "layers.0.mlp.fc_in" in plan and not any(k.startswith("layers.1.mlp") for k in plan)
    assert "layers.1.attn.q_proj" in plan  # the attention of a MoE block is split as usual
    sp = gpt_tp_plan(model, sequence_parallel=True, loss_parallel=False)
    assert type(sp["layers.0.mlp"]) is PrepareModuleInput
    assert type(sp["layers.1.mlp"]) is PrepareModuleInputOutput  # whole sequence in, own positions out


@pytest.mark.parametrize(
    "overrides,world",
    [
        (["parallel.pp=2"], 2),
        (["parallel.tp=2", "parallel.sequence_parallel=true"], 2),
        (["parallel.pp=2", "parallel.ep=2"], 4),
        (["parallel.tp=2", "parallel.dp_shard=2", "parallel.ep=2"], 4),
        (["parallel.dp_shard=2", "parallel.ep=2", "precision.dtype='bf16'"], 2),
        (["train.compile=true"], 2),
    ],
)
def test_moe_layouts_pass_the_preflight(overrides, world):
    import paratrain
    from paratrain.preflight import check_run

    check_run(paratrain.load_config(None, [*MOE_GPT, "batch.micro_batch_size=4", *overrides]), world)


def test_moe_with_a_zero_bubble_schedule_is_one_line():
    import paratrain
    from paratrain.preflight import check_run

    cfg = paratrain.load_config(None, [*MOE_GPT, "parallel.pp=2", "parallel.pp_schedule='zbv'"])
    with pytest.raises(ConfigError, match="model.args.moe with parallel.pp_schedule = 'zbv' is not supported") as e:
        check_run(cfg, 2)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------ slow: whole runs

BF16 = "precision.dtype='bf16'"


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return moe_runs(
        tmp_path_factory.mktemp("moe_layouts_ref"),
        1,
        {"fp32": ["batch.micro_batch_size=8"], "bf16": ["batch.micro_batch_size=8", BF16]},
    )


def _check(runs: dict, ref: dict) -> None:
    assert ref["aux_loss"][0] > 0 and abs(ref["loss"][-1] - ref["loss"][0]) > 1e-3  # the weights move
    for name, got in runs.items():
        try:
            assert_same_moe_run(got, ref)
            assert set(got["params"]) == set(ref["params"])
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


@pytest.mark.slow
def test_moe_with_pp_and_tp_at_world_2_equals_one_process(tmp_path, references):
    runs = {
        # Each stage holds one MoE block: both stages' aux losses and tokens reach the step.
        "pp2_1f1b": ["parallel.pp=2", "parallel.pp_schedule='1f1b'", "batch.micro_batch_size=8"],
        "pp2_gpipe_acc2_ac": [
            "parallel.pp=2",
            "batch.micro_batch_size=4",
            "parallel.activation_checkpointing='full'",
        ],
        "tp2": ["parallel.tp=2", "batch.micro_batch_size=8"],
        "tp2_sp_acc2": ["parallel.tp=2", "parallel.sequence_parallel=true", "batch.micro_batch_size=4"],
    }
    _check(moe_runs(tmp_path, 2, runs), references["fp32"])


@pytest.mark.slow
def test_ep_with_pp_and_tp_at_world_4_equals_one_process(tmp_path, references):
    runs = {
        "pp2_ep2_ddp": ["parallel.pp=2", "parallel.ep=2", "batch.micro_batch_size=4"],
        "pp2_ep2_fsdp_acc2_ac": [
            "parallel.pp=2",
            "parallel.ep=2",
            "parallel.dp_shard=2",
            "batch.micro_batch_size=2",
            "parallel.activation_checkpointing='full'",
        ],
        "tp2_ep2_fsdp": ["parallel.tp=2", "parallel.ep=2", "parallel.dp_shard=2", "batch.micro_batch_size=4"],
        # FSDP2's replicate (DDP cannot hold DTensors) leaves the experts out, like DDP.
        "tp2_sp_ep2_replicate": [
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
            "parallel.ep=2",
            "parallel.dp_replicate=2",
            "batch.micro_batch_size=4",
        ],
    }
    _check(moe_runs(tmp_path, 4, runs), references["fp32"])


@pytest.mark.slow
def test_fsdp2_bf16_with_ep_equals_one_process_bf16(tmp_path, references):
    """The experts get FSDP2's mixed precision over ep_replicate (distributed/expert_parallel.py
    apply_expert_fsdp). bf16 rounds differently with the layout (FSDP2 casts the weights where
    one process autocasts the matmuls), so: close to one process in bf16 (2e-3) and loosely to
    fp32 (1e-2); fp32 itself exactly (1e-5)."""
    runs = moe_runs(
        tmp_path,
        2,
        {
            "ep2_fsdp_bf16": ["parallel.ep=2", "parallel.dp_shard=2", "batch.micro_batch_size=4", BF16],
            "ep2_fsdp": ["parallel.ep=2", "parallel.dp_shard=2", "batch.micro_batch_size=4"],
        },
    )
    # ep 2 of dp 4: each expert sharded over 2 ranks, its gradient reduce-scattered over them.
    runs |= moe_runs(
        tmp_path / "w4",
        4,
        {"ep2_fsdp4_bf16": ["parallel.ep=2", "parallel.dp_shard=4", "batch.micro_batch_size=2", BF16]},
    )
    _check({"ep2_fsdp": runs["ep2_fsdp"]}, references["fp32"])
    for name in ("ep2_fsdp_bf16", "ep2_fsdp4_bf16"):
        got = runs[name]
        for ref, rtol in ((references["bf16"], 2e-3), (references["fp32"], 1e-2)):
            for key in ("loss", "aux_loss", "grad_norm"):
                torch.testing.assert_close(
                    torch.tensor(got[key]),
                    torch.tensor(ref[key]),
                    rtol=rtol,
                    atol=0,
                    msg=lambda m: f"{name} {key}: {m}",
                )
        assert got["tokens"] == references["bf16"]["tokens"], name
    got = runs["ep2_fsdp_bf16"]
    # The bf16 run really is a different computation from fp32 (the cast reached the experts'
    # forward, or the weights it updates would be fp32's to the last bit).
    assert got["loss"] != runs["ep2_fsdp"]["loss"]


@pytest.mark.slow
def test_compiled_moe_equals_eager(tmp_path, references):
    """train.compile = true with MoE (ep = 1; ep > 1 stays refused): the compiled blocks (graph
    breaks at the data-dependent routing) give eager's losses, gradients and weights."""
    runs = moe_runs(tmp_path, 1, {"compile": ["batch.micro_batch_size=8", "train.compile=true"]})
    _check(runs, references["fp32"])
