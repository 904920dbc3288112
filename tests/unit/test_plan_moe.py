"""`paratrain plan` and `find-batch --estimate` on a mixture of experts, the built-in GPT's and
transformers' (model.hf: Qwen3-MoE, Mixtral): ep enumerated, the all_to_all priced, the active
experts' FLOPs, the experts' memory per rank (docs/moe.md, docs/plan.md). No processes."""

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
from paratrain.plan.enumerate import Layout, enumerate_layouts, meta_build, meta_model
from paratrain.plan.memory import MemoryModel, estimate_layout_peak
from paratrain.preflight import check_run
from paratrain.testing.hf_models import MOE_ARCHS, save_tiny
from paratrain.testing.moe_utils import MOE_GPT

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
    """benchmarks/parallel/moe_ep.py measured 4.06 MiB (ep 2) and 5.99 MiB (ep 4) sent per rank in one
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
        # FSDP2 over 4 ranks shards the rest, and the rank's two experts over the 4 / 2 ranks of
        # its ep_replicate group (distributed/expert_parallel.py apply_expert_fsdp).
        assert memory.lower_bound(fsdp4_ep2) == 16 * ((whole - experts) / 4 + sum(p.numel() for p in local) / 2)
        # HSDP 2 x 2: the rest sharded 2 ways, the experts still over their 2 ep_replicate ranks.
        hsdp = Layout(2, 2, 1, 1, 2, ep=2)
        assert memory.lower_bound(hsdp) == 16 * ((whole - experts) / 2 + sum(p.numel() for p in local) / 2)
    assert memory.lower_bound(ddp1) == 16 * whole


def test_fake_tensor_estimate_corrects_the_experts_states_at_ep_with_fsdp2():
    """``StepRunner.expert_parallel_bytes`` (the estimate runs the experts as at ep = 1, sharded
    over dp_shard): under plain FSDP2 a rank's ``1/ep`` of the experts sharded over ``dp / ep``
    ranks is the same ``1/dp`` share, only the dispatch's buffers are added; under HSDP 2 x 2 the
    replicas share the experts out too (1/4 instead of 1/2); under DDP a rank holds 1/ep whole."""
    from paratrain.batch.measure import MoEShape, StepRunner

    cfg = moe_cfg("optim.name='adamw'", "batch.global_batch_size=8")
    experts, buffers = 1000, 2 * (2 * 16) * 2 * 32 * 4  # micro-batch 2 of 16 tokens, top 2, d_model 32

    def correction(dims):
        runner = StepRunner(cfg, dims, device=torch.device("cpu"))
        runner.moe = MoEShape(experts, 2, 32)
        return runner.expert_parallel_bytes(2, 16)

    assert correction(ParallelDims(1, 4, 1, 1, 4, ep=2)) == buffers
    assert correction(ParallelDims(2, 2, 1, 1, 4, ep=2)) == int(16 * experts * (1 / 4 - 1 / 2) + buffers)
    assert correction(ParallelDims(4, 1, 1, 1, 4, ep=2)) == int(16 * experts * (1 / 2 - 1) + buffers)
    assert correction(ParallelDims(1, 4, 1, 1, 4, ep=1)) == 0


def hf_moe_cfg(tmp_path, arch: str, *extra: str):
    src = save_tiny(arch, str(tmp_path / arch), weights=False)  # the planner builds on meta: no weights
    data = ["data.factory='paratrain.testing.toy:toy_lm'", "data.args={n = 64, seq_len = 16, vocab = 128}"]
    return load_config(None, [f"model.hf='{src}'", *data, "batch.global_batch_size=8", *extra])


@pytest.mark.parametrize("arch", sorted(MOE_ARCHS))
def test_plan_prices_an_hf_moe_by_its_active_experts_and_enumerates_ep(tmp_path, arch):
    """A model.hf mixture of experts is priced as one, not as a dense model: its spec's
    expert_layers name the sparse layers (Qwen3-MoE: every second one; Mixtral: all), their 4
    experts and top 2; each block's FLOPs count its active parameters, which sum to
    models/hf/moe.py ``active_params`` with the rest; counted from transformers' own parameter
    names. ep is enumerated (each offered layout passes the preflight), only ep > 1 pays ep_comm,
    and a DDP rank at ep 2 holds half the experts' states."""
    pytest.importorskip("transformers")
    from paratrain.models.hf.moe import active_params

    cfg = hf_moe_cfg(tmp_path, arch, "optim.name='adamw'")
    model, spec = meta_build(cfg)
    stats = ModelStats.of(model, cfg, spec=spec)
    config = model.config
    n_layers, every = config.num_hidden_layers, getattr(config, "decoder_sparse_step", 1)
    sparse = [i for i in range(n_layers) if (i + 1) % every == 0]
    assert (stats.moe_layers, stats.n_experts, stats.top_k) == (len(sparse), 4, config.num_experts_per_tok)
    # transformers' names: model.layers.<i>.mlp.experts.* are the routed experts of layer i.
    names = dict(model.named_parameters())
    experts_of = [sum(p.numel() for n, p in names.items() if f"layers.{i}.mlp.experts." in n) for i in range(n_layers)]
    assert [i for i in range(n_layers) if experts_of[i]] == sparse
    assert stats.expert_params == sum(experts_of)
    attention = 12.0 * stats.attention_width * stats.seq_len  # per block (PaLM's, as MFU's)
    active = [stats.block_params[i] - experts_of[i] * (4 - 2) / 4 for i in range(n_layers)]
    assert stats.block_flops == pytest.approx([6.0 * a + attention for a in active], rel=1e-12)
    rest = stats.total_params - sum(stats.block_params)
    assert sum(active) + rest == active_params(model) < stats.total_params

    layouts, _ = enumerate_layouts(cfg, world_size=4, nproc_per_node=4)
    assert {lay.ep for lay in layouts} == {1, 2, 4}
    for lay in {dataclasses.replace(lay, micro_batch_size=2, activation_checkpointing="none") for lay in layouts}:
        check_run(lay.apply(cfg), 4)
    hw = dataclasses.replace(get_profile("h100-sxm"), overlap=0.0)
    one, two = (step_cost(Layout(4, 1, 1, 1, 2, ep=ep), cfg=cfg, stats=stats, hw=hw, ranks_per_node=8) for ep in (1, 2))
    assert one.terms["ep_comm"] == 0 < two.terms["ep_comm"]
    memory = MemoryModel(cfg, model=model, n_blocks=n_layers, spec=spec)
    half = 16 * stats.expert_params / 2  # fp32 weights, gradients and AdamW's two moments
    assert memory.lower_bound(Layout(2, 1, 1, 1, 2, ep=1)) - memory.lower_bound(Layout(2, 1, 1, 1, 2, ep=2)) == half


def test_fake_tensor_estimate_of_an_hf_moe_matches_its_real_step(tmp_path):
    """find-batch's estimate (``micro_batch_size = "auto"``, ``--estimate``, the planner) runs a
    model.hf mixture of experts (transformers' grouped_mm experts: torch's fake kernel takes bf16
    only, so a float32 estimate raised): within 5% of MemTracker's peak of the same step on real
    tensors (the dense models' estimates are 2-3% above it too)."""
    pytest.importorskip("transformers")
    from paratrain.batch.measure import StepRunner, estimate_peak, measure_peak

    src = save_tiny("qwen3_moe", str(tmp_path / "src"))
    data = ["data.factory='paratrain.testing.toy:toy_lm'", "data.args={n = 64, seq_len = 16, vocab = 128}"]
    cfg = load_config(None, [f"model.hf='{src}'", *data, "batch.global_batch_size=8"])
    dims = ParallelDims(1, 1, 1, 1, 1)
    fake = estimate_peak(StepRunner(cfg, dims, device=torch.device("cpu")), 2)
    real = measure_peak(StepRunner(cfg, dims, device=torch.device("cpu")), 2)
    assert abs(fake - real) <= 0.05 * real, (fake, real)


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
