"""`paratrain plan` and `find-batch --estimate` on a mixture of experts: ep enumerated, the
all_to_all priced, the experts' memory per rank (docs/moe.md, docs/plan.md). No processes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from paratrain.config import load_config
from paratrain.distributed.expert_parallel import ExpertGroup
from paratrain.distributed.parallel_dims import ParallelDims
from paratrain.models.gpt.model import build_gpt
from paratrain.models.gpt.moe import MoE
from paratrain.plan import get_profile
from paratrain.plan.cost import ModelStats, moe_all_to_all_bytes, step_cost
from paratrain.plan.enumerate import Layout, enumerate_layouts, meta_model
from paratrain.plan.memory import MemoryModel, estimate_layout_peak
from paratrain.preflight import check_run
from tests.test_moe import MOE_GPT

MIB = 1 << 20
ARGS = dict(n_layer=2, n_head=2, d_model=32, block_size=16, vocab_size=32)
MOE = dict(n_experts=4, top_k=2, n_shared_experts=1, aux_loss_weight=0.1)


def moe_cfg(*extra: str):
    return load_config(None, [*MOE_GPT, *extra])


def test_plan_enumerates_ep_and_prices_the_all_to_all():
    """ep divides the experts and dp; the layouts offered pass the trainer's preflight (ep with tp
    or pp is refused there, so never offered), their --set lines select them, and only ep > 1 pays
    the ep_comm term: the all_to_alls by hand plus the experts' gradient all-reduce."""
    cfg = moe_cfg()
    layouts, refused = enumerate_layouts(cfg, world_size=4, nproc_per_node=4)
    assert {lay.ep for lay in layouts} == {1, 2, 4}
    for lay in {dataclasses.replace(lay, micro_batch_size=1, activation_checkpointing="none") for lay in layouts}:
        check_run(lay.apply(cfg), 4)  # what the preflight refuses (today ep with tp or pp) is never offered
    assert refused
    lay = next(lay for lay in layouts if lay.ep == 2 and lay.dp_replicate == 4)
    assert " e2 " in lay.short()
    check_run(lay.apply(cfg), 4)
    assert load_config(None, [*MOE_GPT, *lay.set_lines()]).parallel == lay.apply(cfg).parallel

    stats = ModelStats.of(meta_model(cfg), cfg)
    assert stats.moe_layers == 2 and stats.top_k == 2 and stats.n_experts == 4
    # The FLOPs of a block count the active experts only (top_k of n_experts, as MFU's).
    expert = stats.expert_params // (stats.moe_layers * stats.n_experts)
    assert stats.block_flops[0] == pytest.approx(6.0 * (stats.block_params[0] - 2 * expert) + 12.0 * 32 * 16, rel=1e-12)
    hw = dataclasses.replace(get_profile("h100-sxm"), overlap=0.0)

    def cost(**kw):
        return step_cost(Layout(4, 1, 1, 1, 2, **kw), cfg=cfg, stats=stats, hw=hw, ranks_per_node=8)

    one, two, four = cost(ep=1), cost(ep=2), cost(ep=4)
    assert one.terms["ep_comm"] == 0 and two.terms["ep_comm"] > 0 and four.terms["ep_comm"] > 0
    # By hand at ep 2: per micro-batch (2 rows of 16) and MoE layer, forward the counts, dispatch
    # and combine, backward dispatch and combine; then the local experts' fp32 gradients all-reduced
    # over the 2 ranks holding them.
    a2a = lambda n, ep: hw.collective_s("all_to_all", n, ep, inter=False)  # noqa: E731
    pairs = 2 * 16 * 2 * 32
    want = 2 * (a2a(4 * 8, 2) + 4 * a2a(pairs * 4, 2)) + hw.collective_s(
        "all_reduce", stats.expert_params / 2 * 4, 2, inter=False
    )
    torch.testing.assert_close(two.terms["ep_comm"], want, rtol=1e-12, atol=0)
    # The experts leave DDP: its all-reduce moves only the other parameters.
    assert two.terms["dp_grad_reduce"] < one.terms["dp_grad_reduce"]
    # Full checkpointing exchanges the forward's tokens again.
    assert cost(ep=2, activation_checkpointing="full").terms["ep_comm"] > two.terms["ep_comm"]


def test_all_to_all_bytes_formula_is_the_benchmarks():
    """benchmarks/moe_ep.py measured 4.06 MiB (ep 2) and 5.99 MiB (ep 4) sent per rank in one
    forward (2048 tokens, top 2, d_model 256, fp32) against this formula's 4.00 and 6.00."""
    fwd2, bwd2 = moe_all_to_all_bytes(tokens=2048, top_k=2, d_model=256, ep=2)
    fwd4, _ = moe_all_to_all_bytes(tokens=2048, top_k=2, d_model=256, ep=4)
    assert (fwd2 / MIB, fwd4 / MIB, bwd2) == (4.0, 6.0, fwd2)
    assert moe_all_to_all_bytes(tokens=2048, top_k=2, d_model=256, ep=1) == (0.0, 0.0)


def test_expert_memory_per_rank_matches_the_built_model():
    """The planner's states per rank (fp32 weights, gradients, AdamW's two moments) equal those
    of the parameters a built MoE GPT keeps on a rank after enable_expert_parallel."""
    cfg = moe_cfg("optim.name='adamw'")
    memory = MemoryModel(cfg, model=meta_model(cfg), n_blocks=2)
    ddp1, ddp2, fsdp4_ep2 = Layout(2, 1, 1, 1, 2, ep=1), Layout(2, 1, 1, 1, 2, ep=2), Layout(1, 4, 1, 1, 2, ep=2)

    torch.manual_seed(0)
    model = build_gpt(**ARGS, moe=MOE)
    whole = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for m in model.modules() if isinstance(m, MoE) for p in m.experts.parameters())
    for rank in (0, 1):
        torch.manual_seed(0)
        model = build_gpt(**ARGS, moe=MOE)
        local = [
            p
            for m in model.modules()
            if isinstance(m, MoE)
            for p in m.enable_expert_parallel(ExpertGroup(None, rank, 2, None, 2))
        ]
        held = sum(p.numel() for p in model.parameters())
        assert sum(p.numel() for p in local) == experts // 2
        assert memory.lower_bound(ddp2) == 16 * held  # 4 + 4 + 8 bytes per parameter
        # FSDP2 over 4 ranks shards the rest; the two experts of the rank stay whole.
        assert memory.lower_bound(fsdp4_ep2) == 16 * ((whole - experts) / 4 + sum(p.numel() for p in local))
    assert memory.lower_bound(ddp1) == 16 * whole


@pytest.mark.slow  # two fake-tensor estimates, about 15 s on the shared machine
def test_fake_tensor_estimate_at_ep_2_holds_half_the_experts():
    """The fake-tensor estimate (batch/measure.py) at ep 2 differs from ep 1 by the experts a DDP
    rank no longer holds (and their DDP bucket), plus the dispatch's receive buffers."""
    cfg = moe_cfg("optim.name='adamw'")
    memory = MemoryModel(cfg, model=meta_model(cfg), n_blocks=2)
    ddp1, ddp2 = Layout(2, 1, 1, 1, 2, ep=1), Layout(2, 1, 1, 1, 2, ep=2)
    experts = sum(
        p.numel() for m in build_gpt(**ARGS, moe=MOE).modules() if isinstance(m, MoE) for p in m.experts.parameters()
    )

    # The fake-tensor estimate (batch/measure.py): DDP at ep 2 holds half the experts' states and
    # leaves their gradients out of DDP's buckets; the dispatch receives 2 rows x 16 tokens x top 2
    # pairs of d_model 32 and their outputs, float32.
    def peak(lay):
        dims = ParallelDims(2, 1, 1, 1, 2, ep=lay.ep)
        return estimate_layout_peak(lay.apply(cfg), dims, 2, dataset=memory.dataset)

    buckets = 4 * experts  # accumulation (per-rank batch 4, micro-batch 2): the whole bucket is extra
    want = -16 * experts // 2 - buckets + 2 * (2 * 16 * 2 * 32 * 4)
    assert peak(ddp2) - peak(ddp1) == want
