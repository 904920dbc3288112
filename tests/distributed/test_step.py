"""step.eval_step: forward only, the same loss/count code as the training step, summed over ranks.

Checked against the single-process reference on the whole global batch: plain model on 1 and 2
data-parallel ranks, and the pipeline (pp = 2, the schedule's eval()).
"""

from __future__ import annotations

import pytest
import torch

from paratrain.config import DistConfig, LossConfig, ParallelConfig
from paratrain.data.sampler import load_batches, rank_slice
from paratrain.distributed.parallel_dims import ParallelDims
from paratrain.distributed.parallelize import parallelize
from paratrain.distributed.process_group import close_distributed, init_distributed
from paratrain.models.gpt import GPT_SPEC, build_gpt
from paratrain.objectives import build_objectives
from paratrain.objectives.registry import build_loss
from paratrain.step import StepContext, eval_step
from paratrain.testing.dist_utils import run_ranks
from paratrain.testing.toy import toy_lm

GPT_ARGS = dict(n_layer=4, n_head=2, d_model=32, block_size=16, vocab_size=32)


def _reference(n: int = 16) -> tuple[float, int]:
    torch.manual_seed(0)
    model = build_gpt(**GPT_ARGS)
    data = toy_lm(n=n, seq_len=16, vocab=32)
    x, y = load_batches(data, list(range(n)), n)[0]
    with torch.no_grad():
        s, c = build_loss(LossConfig())(model(x), y)
    return float(s), int(c)


def _eval_rank(pp: int, dp: int, micro: int) -> tuple[float, int]:

    ctx = init_distributed(DistConfig())
    try:
        torch.manual_seed(0)
        model = build_gpt(**GPT_ARGS)
        cfg = ParallelConfig(pp=pp, dp_replicate=dp, pp_schedule="gpipe")
        dims = ParallelDims.from_config(cfg, ctx.world_size)
        model = parallelize(model, dims, cfg=cfg, device=ctx.device, spec=GPT_SPEC)
        data = toy_lm(n=16, seq_len=16, vocab=32)
        mine = rank_slice(list(range(16)), dp_rank=dims.local_rank_in("dp"), dp=dims.dp)
        step_ctx = StepContext(
            objectives=build_objectives(build_loss(LossConfig())),
            device=ctx.device,
            dp=dims.dp,
            dp_group=dims.group("dp"),
        )
        return eval_step(model, load_batches(data, mine, micro), step_ctx)
    finally:
        close_distributed(ctx)


def test_eval_step_matches_the_reference_on_one_process():
    want_sum, want_items = _reference()
    torch.manual_seed(0)
    model = build_gpt(**GPT_ARGS)
    batches = load_batches(toy_lm(n=16, seq_len=16, vocab=32), list(range(16)), 4)  # 4 micro-batches
    loss_sum, items = eval_step(
        model, batches, StepContext(objectives=build_objectives(build_loss(LossConfig())), device=torch.device("cpu"))
    )
    assert items == want_items
    torch.testing.assert_close(loss_sum, want_sum, rtol=1e-6, atol=0)


# pp2 is slow: tests/distributed/test_validation.py evaluates a pipeline run's checkpoint on the fast path.
@pytest.mark.parametrize("pp,dp", [(1, 2), pytest.param(2, 1, marks=pytest.mark.slow)], ids=["dp2", "pp2"])
def test_eval_step_across_ranks_matches_the_reference(pp, dp):
    want_sum, want_items = _reference()
    for loss_sum, items in run_ranks(_eval_rank, pp * dp, pp, dp, 4, timeout=120):
        assert items == want_items
        torch.testing.assert_close(loss_sum, want_sum, rtol=1e-5, atol=0)
