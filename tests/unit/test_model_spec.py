"""ModelSpec: a factory may describe its model (blocks, TP plan, checks); a plain module gets the conventions."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from paratrain.config import ConfigError, load_config
from paratrain.distributed.activation_checkpoint import apply_ac
from paratrain.models import build
from paratrain.models.gpt import GPT_SPEC
from paratrain.models.spec import ModelSpec
from paratrain.preflight import check_run


class Stack(nn.Module):
    """Blocks in `blocks`, not `layers`: only its spec can say so."""

    def __init__(self, dim: int = 8, n: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.Linear(dim, dim)) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def stack_plan(model, *, sequence_parallel, loss_parallel):
    return {f"blocks.{i}.0": ColwiseParallel() for i in range(len(model.blocks))} | {
        f"blocks.{i}.1": RowwiseParallel() for i in range(len(model.blocks))
    }


def stack_spec(dim: int = 8, n: int = 3) -> ModelSpec:
    return ModelSpec(name="stack", build=lambda: Stack(dim, n), blocks_attr="blocks", tp_plan=stack_plan)


def plain_stack(dim: int = 8, n: int = 3) -> nn.Module:
    return Stack(dim, n)


def _cfg(factory: str, *sets: str):
    return load_config(None, [f"model.factory='tests.unit.test_model_spec:{factory}'", "model.args={}", *sets])


def test_a_factory_returning_a_spec_gives_the_model_and_its_spec():
    model, spec = build(_cfg("stack_spec").model)
    assert isinstance(model, Stack) and spec.blocks_attr == "blocks"
    assert [name for name, _ in spec.blocks(model)] == ["0", "1", "2"]
    model, spec = build(_cfg("plain_stack").model)
    assert spec.blocks_attr == "layers" and spec.tp_plan is None and spec.blocks(model) == []
    assert spec.flops_per_token(model)(1) == 6 * sum(p.numel() for p in model.parameters())


def test_activation_checkpointing_follows_the_specs_blocks():
    model, spec = build(_cfg("stack_spec").model)
    x = torch.randn(2, 8)
    want = model(x)
    apply_ac(model, mode="full", blocks_attr=spec.blocks_attr)
    assert all(isinstance(b, CheckpointWrapper) for b in model.blocks)
    torch.testing.assert_close(model(x), want)


def test_the_preflight_takes_the_tp_plan_and_blocks_from_the_spec():
    check_run(_cfg("stack_spec", "parallel.tp=2", "data.factory='paratrain.testing.toy:regression'"), 2)
    with pytest.raises(ConfigError, match="needs a tensor-parallel plan for model.factory"):
        check_run(_cfg("plain_stack", "parallel.tp=2", "data.factory='paratrain.testing.toy:regression'"), 2)
    with pytest.raises(ConfigError, match="blocks are in a 'layers'"):
        check_run(_cfg("plain_stack", "parallel.pp=2", "data.factory='paratrain.testing.toy:regression'"), 2)


def test_the_gpt_spec_checks_its_own_heads():
    with pytest.raises(ConfigError, match="does not divide model.args.n_head = 3"):
        GPT_SPEC.check_layout({"n_head": 3, "d_model": 48}, tp=2, sequence_parallel=False)


def test_plan_reads_blocks_through_the_spec():
    """`paratrain plan` counts a model's blocks as the trainer does, through its spec's blocks_attr
    (it once looked at `model.layers` whatever the spec said, so Stack had no blocks for it)."""
    from paratrain.plan.cost import ModelStats
    from paratrain.plan.enumerate import count_blocks, enumerate_layouts, meta_build
    from paratrain.plan.memory import MemoryModel

    cfg = _cfg("stack_spec", "data.factory='paratrain.testing.toy:regression'")
    model, spec = meta_build(cfg)
    assert spec.blocks_attr == "blocks" and count_blocks(model, spec) == 3
    stats = ModelStats.of(model, cfg, spec=spec)
    assert len(stats.block_params) == 3 and stats.block_tensors == 4 and stats.blocks_attr == "blocks"
    # each block: 2 x (8x8 + 8) parameters, 16 bytes each under AdamW (parameter, gradient, two moments)
    assert MemoryModel(cfg, model=model, n_blocks=3, spec=spec)._block_sizes() == [16 * 2 * (8 * 8 + 8)] * 3
    layouts, _ = enumerate_layouts(cfg, world_size=2, nproc_per_node=2)
    assert any(lay.pp == 2 for lay in layouts)


def test_a_pipeline_stage_gets_exactly_the_whole_models_options(monkeypatch):
    """parallelize hands each pipeline stage to itself with every option it was given: the spec,
    the config sections and the step's decisions (without loss_owns_head the last stage's chunked
    loss would read an FSDP2 shard of the output layer)."""
    from types import SimpleNamespace

    import paratrain.distributed.parallelize as par
    from paratrain.config import CommConfig, ParallelConfig, PrecisionConfig

    stage_fns = []
    monkeypatch.setattr(
        par, "apply_pp", lambda model, mesh, *, parallelize_stage, **kw: stage_fns.append(parallelize_stage)
    )
    options = dict(
        cfg=ParallelConfig(pp=2),
        device=torch.device("cpu"),
        spec=GPT_SPEC,
        comm=CommConfig(),
        precision=PrecisionConfig(),
        compile_enabled=True,
        loss_parallel=True,
        loss_owns_head=True,
    )
    dims = SimpleNamespace(pp=2, submesh=lambda name: None)
    par.parallelize(nn.Linear(2, 2), dims, **options)
    seen = []
    monkeypatch.setattr(par, "parallelize", lambda stage, d, **kw: seen.append((stage, d, kw)))
    stage = nn.Linear(2, 2)
    stage_fns[0](stage)
    assert seen == [(stage, dims, options)]
