"""The parallel build: a model's parallelisms and the step's context, made in one place.

Training (trainer.py), ``paratrain eval`` (launch/eval_worker.py) and the memory estimate
(batch/measure.py) all call :func:`build_parallel`, so the step the estimate prices is the step
that runs: the same loss-parallel decision, the same output layer handed to a chunked loss, the
same objectives bound to what the parallelisms made, the same ``StepContext``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from paratrain.build.frozen import Frozen, needs_initial
from paratrain.config import Config, ConfigError
from paratrain.data.sampler import rank_micro_batches
from paratrain.distributed.compile import run_eagerly
from paratrain.distributed.context_parallel import gather_sequence, global_indices
from paratrain.distributed.grad_compression import GradCompression, apply_grad_compression
from paratrain.distributed.parallel_dims import ParallelDims
from paratrain.distributed.parallelize import parallelize
from paratrain.distributed.pipeline_parallel import PipelineModel
from paratrain.distributed.tensor_parallel import loss_parallel_enabled
from paratrain.loss import Loss
from paratrain.models.batch_norm import NormLayout, check_groups, convert_batch_norm, has_batch_norm, norm_group
from paratrain.models.spec import ModelSpec
from paratrain.objectives import build_objectives
from paratrain.objectives.preference import CPGroup
from paratrain.objectives.registry import own_objective
from paratrain.observability.events import startup
from paratrain.precision import Precision
from paratrain.randomness import Draws, draws_in_forward, has_dropout, site_names
from paratrain.step import StepContext, to_device

log = logging.getLogger("paratrain")


def build_parallel_with_weights(
    cfg: Config, dims: ParallelDims, model: nn.Module, *, spec: ModelSpec, device: torch.device, **kwargs
) -> tuple[nn.Module, StepContext, GradCompression]:
    """:func:`build_parallel`, and the weights that arrive after the parallelisms
    (ModelSpec.materialize: a model built on the meta device, such as a ``model.hf`` with weights).
    Plain DDP broadcasts rank 0's parameters when it wraps the model, so there they are read
    before. Training and ``paratrain eval`` (whose checkpoint then overwrites them) both call this."""
    ddp_wraps = dims.dp_replicate > 1 and not dims.fsdp_enabled and dims.tp == 1
    weights = ", reading its weights" if spec.materialize is not None else ""
    log.info(startup(f"laying out the model: {dims.describe()}{weights}"))
    if spec.materialize is not None and ddp_wraps:
        spec.materialize(model, device=device)
    model, step_ctx, compression = build_parallel(cfg, dims, model, spec=spec, device=device, **kwargs)
    if spec.materialize is not None and not ddp_wraps:
        t0 = time.perf_counter()
        read = spec.materialize(model, device=device)
        log.info("weights: %.2fM elements read by this rank in %.2f s", (read or 0) / 1e6, time.perf_counter() - t0)
    return model, step_ctx, compression


def build_parallel(
    cfg: Config,
    dims: ParallelDims,
    model: nn.Module,
    *,
    spec: ModelSpec,
    device: torch.device,
    loss_fn: Loss,
    precision: Precision,
    items_per_sample: int | None = None,
    compile_enabled: bool | None = None,
    batch_norm_groups: bool = True,
) -> tuple[nn.Module, StepContext, GradCompression]:
    """Apply the parallelisms (distributed/parallelize.py) with the model's spec; the step's
    context with its objectives (paratrain/objectives), built from the whole model before the
    parallelisms and bound to what they made. ``items_per_sample``: the data path's static count.
    ``compile_enabled``: None follows ``train.compile`` (the memory estimate, on fake tensors,
    compiles nothing). ``batch_norm_groups`` False: the model's BatchNorm stays torch's (the
    memory estimate, on one rank)."""
    # Tensor parallel: the built-in cross-entropy can run on vocabulary-sharded logits (not under
    # pipeline parallel: the schedule's loss runs on plain, gathered logits).
    loss_parallel = loss_parallel_enabled(
        tp=dims.tp,
        requested=cfg.parallel.loss_parallel and dims.pp == 1,
        builtin_cross_entropy=loss_fn.plugin is not None and loss_fn.plugin.loss_parallel,
        user_plan=bool(cfg.parallel.tp_plan or cfg.parallel.tp_plan_factory),
        supported=spec.loss_parallel,
    )
    keyed = keyed_dropout_enabled(cfg, model)
    check_batch_math(cfg, dims, model, loss_fn, keyed=keyed)
    norm = batch_norm_layout(cfg, dims, model) if batch_norm_groups else None
    spec.hand_head_to(model, loss_fn, loss_parallel=loss_parallel)  # loss.chunk_size
    own = own_objective(cfg, loss_fn, dp_group=dims.group("dp"), cp=cp_group(dims))
    initial = copy.deepcopy(model) if needs_initial(cfg, own, loss_fn.plugin) else None
    vocab = getattr(getattr(model, spec.head_attr or "", None), "out_features", None)  # the output layer's, whole
    objectives = build_objectives(
        loss_fn,
        model,
        items_per_sample=items_per_sample,
        pipeline=dims.pp > 1,
        norm=norm,
        positions=rank_micro_batches,
        dp_rank=dims.local_rank_in("dp"),
        dp=dims.dp,
        dp_group=dims.group("dp"),
        own=own,
    )
    model = parallelize(
        model,
        dims,
        spec=spec,
        cfg=cfg.parallel,
        device=device,
        comm=cfg.comm,
        precision=cfg.precision,
        compile_enabled=cfg.train.compile if compile_enabled is None else compile_enabled,
        loss_parallel=loss_parallel,
        loss_owns_head=loss_fn.owns_head,
    )
    compression = apply_grad_compression(model, cfg=cfg.comm, seed=cfg.run.seed)
    for objective in objectives:  # a pipeline rank holds some of the model's modules
        objective.bind(model)
    world = Frozen(cfg, dims, model, initial, spec, device, precision, vocab, loss_fn.plugin)
    for objective in objectives:  # the frozen models and the pipeline each asked for (build/frozen.py)
        objective.attach(world)
    step_ctx = StepContext(
        objectives=objectives,
        device=device,
        dp=dims.dp,
        dp_group=dims.group("dp"),
        grad_clip=cfg.optim.grad_clip,
        precision=precision,
        loss_parallel=loss_parallel,
        # FSDP2's gradient sync policy (distributed/data_parallel.py): ZeRO-3 reduces every micro-batch.
        sync_each_micro_batch=cfg.parallel.reshard_after_forward,
        # With tp > 1 the step's reduce spans the world, so the SIGTERM flag it carries reaches
        # every tp peer too; the tp ranks after the first add zeros instead of a copy of the loss.
        loss_group=dims.group("pp_dp") if dims.tp == 1 else dist.group.WORLD,
        adds_loss=dims.local_rank_in("tp") == 0,
        cp=dims.cp,
        cp_rank=dims.local_rank_in("cp"),
        draw_sites=draw_sites(model) if keyed else None,
        norm_group=norm.group if norm is not None else 0,
        bitwise_grain=cfg.run.bitwise_grain if cfg.run.bitwise else 0,
    )
    return model, step_ctx, compression


def cp_group(dims: ParallelDims) -> CPGroup | None:
    """The context-parallel group of a preference loss's rows (objectives/preference.py)."""
    if dims.cp == 1:
        return None
    rank, group = dims.local_rank_in("cp"), dims.group("cp")
    return CPGroup(
        group,
        dims.cp,
        rank,
        functools.partial(global_indices, cp=dims.cp, rank=rank),
        functools.partial(gather_sequence, group=group),
    )


def batch_norm_layout(cfg: Config, dims: ParallelDims, model: nn.Module) -> NormLayout | None:
    """The model's BatchNorm layers converted to groups of ``batch.norm_group`` samples
    (models/batch_norm.py), before the parallelisms wrap them; None when it has none."""
    if not has_batch_norm(model) or cfg.batch.norm_group == 0:  # 0: torch's own BatchNorm, layout-dependent
        return None
    layout = NormLayout(
        group=norm_group(cfg.batch.norm_group, cfg.batch.global_batch_size),
        dp_rank=dims.local_rank_in("dp"),
        dp=dims.dp,
        ordered=cfg.run.bitwise,
    )
    converted = convert_batch_norm(model, layout)
    log.info("batch norm: %d layer(s) over groups of %d samples (batch.norm_group)", len(converted), layout.group)
    return layout


def check_batch_math(cfg: Config, dims: ParallelDims, model: nn.Module, loss_fn: Loss, *, keyed: bool) -> None:
    """The layouts a model's BatchNorm and a loss over the whole global batch do not cover yet,
    refused in one line each (docs/batch-math.md)."""
    if cfg.run.bitwise and has_batch_norm(model):  # found on the built model, like the rows below
        group = norm_group(cfg.batch.norm_group, cfg.batch.global_batch_size)
        if not group:
            raise ConfigError(
                "run.bitwise = true does not run torch's own BatchNorm (batch.norm_group = 0: its statistics are sums"
                " over each forward's rows, whatever the layout); set batch.norm_group to a divisor of"
                f" run.bitwise_grain = {cfg.run.bitwise_grain} (docs/bitwise.md)"
            )
        if cfg.run.bitwise_grain % group:
            raise ConfigError(
                f"run.bitwise = true needs whole BatchNorm groups in each grain: batch.norm_group = {group} does not"
                f" divide run.bitwise_grain = {cfg.run.bitwise_grain}; set one so (docs/bitwise.md)"
            )
    bn = has_batch_norm(model) and cfg.batch.norm_group > 0
    if bn:  # found on the built model (a loss over the batch is refused from the config: preflight/support.py)
        for degree in ("pp", "tp", "cp", "ep"):
            if getattr(dims, degree, 1) > 1:
                raise ConfigError(
                    f"a BatchNorm model runs on data parallel (DDP, FSDP2) and accumulation only, not with"
                    f" parallel.{degree} = {getattr(dims, degree)}; set parallel.{degree} = 1 (docs/batch-math.md)"
                )
    if bn:
        group = norm_group(cfg.batch.norm_group, cfg.batch.global_batch_size)
        micro = cfg.batch.micro_batch_size
        # 'auto' picks among the micro-batches that hold whole groups (batch/search.py): the group is one
        micro = (micro or cfg.batch.global_batch_size // dims.dp) if isinstance(micro, int) else group
        why = check_groups(
            group=group, global_batch_size=cfg.batch.global_batch_size, micro_batch_size=micro, dp=dims.dp
        )
        if why is not None:
            raise ConfigError(why)
    if loss_fn.over_batch:
        if has_dropout(model) and not keyed:
            raise ConfigError(
                f"loss {loss_fn.name!r} runs each micro-batch twice (the gradient cache) and the model's dropout must"
                " draw the same masks both times: set run.keyed_random = true"
            )


def keyed_dropout_enabled(cfg: Config, model: nn.Module, *, draws: Draws | None = None) -> bool:
    """Whether the step keys the model's random draws by the sample (paratrain/randomness.py):
    run.keyed_random and a model that draws (``draws`` names a draw seen in a forward,
    randomness.draws_in_forward; None asks randomness.has_dropout)."""
    return cfg.run.keyed_random and (draws is not None or has_dropout(model))


def key_detected_draws(cfg: Config, dims: ParallelDims, model: nn.Module, step_ctx: StepContext, inputs) -> StepContext:
    """The step's context keyed for the draws a forward of ``inputs`` (the first micro-batch)
    makes when no dropout rate announced them (noise, per-sample stochastic depth): run once
    before the first step. The keyed path costs a few percent of a step (a torch-function mode
    over every op), so a model that draws nothing does not take it."""
    # Not under pipeline parallel (a stage's forward is not the model's) nor context parallel (the
    # model takes its part of each row, which the step cuts): there dropout rates alone decide.
    if step_ctx.draw_sites is not None or not cfg.run.keyed_random or isinstance(model, PipelineModel) or dims.cp > 1:
        return step_ctx
    inner = model.module if isinstance(model, DistributedDataParallel) else model  # DDP's forward syncs buffers
    with run_eagerly(inner):
        draws = draws_in_forward(inner, to_device(inputs, step_ctx.device))
    if draws is None or not keyed_dropout_enabled(cfg, model, draws=draws):
        return step_ctx
    log.info("random draws: %s (docs/randomness.md)", draws)  # "keyed" only when each draw is (randomness.Draws)
    return dataclasses.replace(step_ctx, draw_sites=draw_sites(model))


def draw_sites(model: nn.Module) -> dict[int, str]:
    """The keyed draws' site names: each pipeline stage's part keeps the whole model's names."""
    names: dict[int, str] = {}
    for part in model.parts if isinstance(model, PipelineModel) else [model]:
        names.update(site_names(part))
    return names
