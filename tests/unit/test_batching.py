"""Batch arithmetic, ParallelDims validation and the global-batch sampler (no process group)."""

from __future__ import annotations

import pytest

from paratrain.batch.plan import plan_batch
from paratrain.config import ConfigError, OptimConfig, ParallelConfig
from paratrain.data.sampler import GlobalBatchSampler, micro_batches, rank_slice
from paratrain.distributed.parallel_dims import ParallelDims
from paratrain.optim import lr_factor


@pytest.mark.parametrize("g,m,dp,accum", [(32, 8, 2, 2), (32, 0, 2, 1), (8, 1, 4, 2), (12, 3, 1, 4)])
def test_plan_batch(g, m, dp, accum):
    plan = plan_batch(global_batch_size=g, micro_batch_size=m, dp=dp)
    assert plan.accum_steps == accum
    assert plan.micro_batch_size * plan.accum_steps * plan.dp == g
    assert str(g) in plan.describe() and f"accum_steps {accum}" in plan.describe()


def test_plan_batch_errors_print_every_term():
    with pytest.raises(ConfigError, match=r"global_batch_size = 30 is not divisible by micro_batch_size 4 x dp 2 = 8"):
        plan_batch(global_batch_size=30, micro_batch_size=4, dp=2)
    with pytest.raises(ConfigError, match="not divisible by dp = 4"):
        plan_batch(global_batch_size=6, micro_batch_size=1, dp=4)


def test_parallel_dims():
    dims = ParallelDims.from_config(ParallelConfig(), 4)
    assert (dims.dp_replicate, dims.dp) == (4, 4)
    dims = ParallelDims.from_config(ParallelConfig(dp_shard=2, tp=2), 8)
    assert dims.dp_replicate == 2 and dims.dp == 4
    with pytest.raises(ConfigError, match=r"dp_replicate 2 x dp_shard 1 x tp 2 x pp 1 = 4 != world size 2"):
        ParallelDims.from_config(ParallelConfig(dp_replicate=2, tp=2), 2)
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by dp_shard 1 x tp 4 x pp 1 = 4"):
        ParallelDims.from_config(ParallelConfig(tp=4), 6)


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_rank_slices_partition_the_global_batch(dp):
    sampler = GlobalBatchSampler(100, seed=5)
    for step in range(30):  # crosses several epochs
        batch = sampler.global_indices(step * 16, 16)
        slices = [rank_slice(batch, dp_rank=r, dp=dp) for r in range(dp)]
        flat = [i for s in slices for i in s]
        assert flat == batch  # disjoint, and their union is the global batch, in order
        for s in slices:
            mbs = micro_batches(s, 2)
            assert [i for mb in mbs for i in mb] == s and all(len(mb) == 2 for mb in mbs)


def test_sampler_deterministic_and_epoch_exact():
    a, b = GlobalBatchSampler(50, seed=1), GlobalBatchSampler(50, seed=1)
    assert a.global_indices(37, 20) == b.global_indices(37, 20)
    assert GlobalBatchSampler(50, seed=2).global_indices(0, 50) != a.global_indices(0, 50)
    # Batches of changing sizes read the stream without skipping or repeating within an epoch.
    pos, seen = 0, []
    for size in (3, 7, 5, 11, 9, 15):
        seen += a.global_indices(pos, size)
        pos += size
    assert sorted(seen[:50]) == list(range(50))
    assert seen == a.global_indices(0, pos)
    assert a.epoch_of(49) == 0 and a.epoch_of(50) == 1
    assert GlobalBatchSampler(5, seed=0, shuffle=False).global_indices(3, 4) == [3, 4, 0, 1]


def test_lr_schedule():
    cfg = OptimConfig(warmup_steps=4, min_lr_ratio=0.1, schedule="cosine")
    f = [lr_factor(s, cfg=cfg, total_steps=20) for s in range(20)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert f[4] == pytest.approx(1.0) and all(x >= y for x, y in zip(f[4:], f[5:]))
    assert lr_factor(20, cfg=cfg, total_steps=20) == pytest.approx(0.1)
