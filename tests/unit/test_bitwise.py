"""run.bitwise's preflight (docs/bitwise.md): the layouts its tree covers, one line for the others;
and the tree itself: the binary counter on one rank is the pairwise tree over the grains."""

from __future__ import annotations

import pytest
import torch

from paratrain.config import ConfigError, load_config
from paratrain.distributed.bitwise import GrainTree
from paratrain.preflight import check_run

BASE = ["batch.global_batch_size=16", "run.steps=1", "run.bitwise=true", "run.bitwise_grain=2"]


def check(*sets: str, world: int = 2):
    return check_run(load_config(None, [*BASE, *sets]), world)


def test_accepts_ddp_fsdp_hsdp_and_accumulation():
    check("batch.micro_batch_size=2", world=2)
    check("batch.micro_batch_size=4", world=4)
    check("batch.micro_batch_size=2", "parallel.dp_shard=2", world=2)
    check("batch.micro_batch_size=2", "parallel.dp_shard=2", "parallel.dp_replicate=2", world=4)
    # objectives with their own terms per row, and the gradient cache (tests/distributed/test_bitwise.py)
    for loss in (
        ["loss.name='preference'"],
        ["loss.name='preference'", "preference.loss_type='kto'"],
        ["loss.name='info_nce'"],
    ):
        check("batch.micro_batch_size=2", *loss, world=2)


@pytest.mark.parametrize(
    "sets,world,match",
    [
        (["run.bitwise_grain=0"], 2, "needs run.bitwise_grain"),
        (["batch.global_batch_size=12", "batch.micro_batch_size=2"], 2, r"grains per rank \(6 rows"),
        (["batch.micro_batch_size=4", "run.bitwise_grain=3"], 2, "must divide batch.micro_batch_size = 4"),
        (["batch.global_batch_size=12", "batch.micro_batch_size=2"], 3, "powers of two"),
        (["parallel.dp_shard=2", "precision.dtype='bf16'"], 2, "parallel.dp_shard = 2 and precision.dtype = 'bf16'"),
        (["optim.implementation='fused'"], 2, "optim.implementation = 'fused'"),
        (["batch.micro_batch_size=4", "eval.micro_batch_size=1"], 2, "must divide eval.micro_batch_size = 1"),
        (["parallel.tp=2"], 2, "parallel.tp = 2"),
        (["batch.micro_batch_size='auto'"], 2, "micro_batch_size = 'auto'"),
        (["loss.name='grpo'", "data.name='prompts'"], 2, "loss.name = 'grpo'"),
        (["loss.name='preference'", "preference.precompute=true"], 2, "preference.precompute = true"),
        (["train.compile=true"], 2, "train.compile"),
    ],
)
def test_refusals_name_the_fix(sets, world, match):
    with pytest.raises(ConfigError, match=match) as e:
        check(*sets, world=world)
    assert "\n" not in str(e.value)


def test_counter_is_the_pairwise_tree():
    # 4 grains of one parameter: the counter must give (g0 + g1) + (g2 + g3), not ((g0 + g1) + g2) + g3.
    p = torch.nn.Parameter(torch.zeros(()))
    model = torch.nn.Module()
    model.p = p
    tree = GrainTree(model)
    grads = [torch.tensor(v) for v in (1.0, 1e8, -1e8, 1.0)]  # float32: 1e8 + 1 rounds to 1e8
    for g in grads:
        p.grad = g.clone()
        tree.push()
    tree.write_grads(group=None, dp=1)
    assert p.grad.item() == (grads[0] + grads[1] + (grads[2] + grads[3])).item() == 0.0
    assert ((grads[0] + grads[1]) + grads[2] + grads[3]).item() == 1.0  # the sequential order differs


@pytest.mark.parametrize("shape", [(33, 17), (4, 3, 5, 5), (7,)])
def test_row_squares_of_shards_are_the_whole_gradients(shape):
    # The norm's premise (FSDP2's all_to_all merge): each row's sum of squares is the same bits in
    # the whole gradient and in every dp's shards (torch.chunk's along dim 0, some of them empty).
    from paratrain.distributed.bitwise import _shard_rows, row_squares

    g = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 10
    for dp in (2, 4, 8):
        cuts = _shard_rows(shape[0], dp)
        shards = [g[sum(cuts[:j]) : sum(cuts[: j + 1])].clone() for j in range(dp)]
        assert [len(s) for s in torch.chunk(g, dp)] == [c for c in cuts if c]
        assert torch.equal(torch.cat([row_squares(s) for s in shards]), row_squares(g))


@pytest.mark.parametrize(
    "sets,match",
    [
        (["batch.norm_group=0"], "torch's own BatchNorm"),
        (["batch.norm_group=4", "run.bitwise_grain=2"], "batch.norm_group = 4 does not divide run.bitwise_grain = 2"),
    ],
)
def test_batch_norm_needs_whole_groups_in_a_grain(sets, match):
    # Group BatchNorm with whole groups in each grain is accepted (tests/distributed/test_bitwise.py);
    # torch's own BatchNorm and groups wider than the grain are refused when the model is built.
    from paratrain.build import check_batch_math
    from paratrain.loss import mse_loss
    from paratrain.testing.toy import bn_cnn

    model = bn_cnn()
    cfg = load_config(None, [*BASE, "batch.micro_batch_size=4", "batch.norm_group=2"])
    dims, _ = check_run(cfg, 2)
    check_batch_math(cfg, dims, model, mse_loss(cfg.loss), keyed=True)  # groups of 2 in grains of 2
    cfg = load_config(None, [*BASE, "batch.micro_batch_size=4", *sets])
    with pytest.raises(ConfigError, match=match) as e:
        check_batch_math(cfg, dims, model, mse_loss(cfg.loss), keyed=True)
    assert "\n" not in str(e.value)


def _running_mean(dp: int, grains: int, grain: int, stats: torch.Tensor) -> torch.Tensor:
    """Group BatchNorm's running mean after one step whose groups (of 1 sample, float64) have the
    means ``stats``, over ``dp`` simulated ranks of ``grains`` grains each: every rank's
    NormStatistics sums, added as the step's reduce, then read on rank 0."""
    from paratrain.models.batch_norm import GroupBatchNorm, NormLayout
    from paratrain.objectives.batch_norm import NormStatistics

    ranks = []
    for r in range(dp):
        m = GroupBatchNorm(torch.nn.BatchNorm1d(1, dtype=torch.float64), NormLayout(1, r, dp, ordered=True))
        objective = NormStatistics(m.layout)
        objective.bind(torch.nn.Sequential(m))
        objective.start(scale=1.0, device=torch.device("cpu"))
        objective.before_micro_batches(None, [(torch.zeros(grain, 1), None)] * grains)
        for k in range(grains):
            at = (r * grains + k) * grain
            m.pending.append((stats[at : at + grain, None], torch.ones(grain, 1, dtype=torch.float64), True))
            objective.loss(None, None)
        ranks.append((m, objective))
    reduced = torch.stack([objective.sums() for _, objective in ranks]).sum(0).tolist()
    ranks[0][1].read(reduced, units=len(stats))
    return ranks[0][0].running_mean


def test_batch_norm_running_statistics_are_added_in_global_group_order():
    # The update's float64 terms (momentum 0.1: coefficients 0.1 x 0.9^k) add in one order on every
    # layout: one process with one grain, with 8 grains, and 2 or 4 ranks (a rank's partial sums
    # added in the reduce would round otherwise: the fault this catches).
    stats = torch.randn(64, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 1e3
    ref = _running_mean(1, 1, 64, stats)
    for dp, grains, grain in ((1, 8, 8), (2, 4, 8), (4, 2, 8), (4, 16, 1)):
        assert torch.equal(_running_mean(dp, grains, grain, stats), ref), (dp, grains, grain)
