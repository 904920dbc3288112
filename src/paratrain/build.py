"""The parallel build: a model's parallelisms and the step's context, made in one place.

Training (trainer.py), ``paratrain eval`` (launch/eval_worker.py) and the memory estimate
(batch/measure.py) all call :func:`build_parallel`, so the step the estimate prices is the step
that runs: the same loss-parallel decision, the same output layer handed to a chunked loss, the
same objectives bound to what the parallelisms made, the same ``StepContext``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from paratrain.config import Config, ConfigError
from paratrain.data.sampler import collate_of, micro_batches, rank_micro_batches
from paratrain.distributed.compile import run_eagerly
from paratrain.distributed.context_parallel import gather_sequence, global_indices
from paratrain.distributed.grad_compression import GradCompression, apply_grad_compression
from paratrain.distributed.parallel_dims import ParallelDims
from paratrain.distributed.parallelize import parallelize
from paratrain.distributed.pipeline_parallel import PipelineModel, pipeline_forward_each
from paratrain.distributed.tensor_parallel import loss_parallel_enabled
from paratrain.loss import Loss
from paratrain.models import build
from paratrain.models.batch_norm import NormLayout, check_groups, convert_batch_norm, has_batch_norm, norm_group
from paratrain.models.hf.model import check_hf_dir
from paratrain.models.lora import adapters_disabled
from paratrain.models.spec import ModelSpec
from paratrain.objectives import DistillLoss, PreferenceLoss, build_objectives
from paratrain.objectives.policy_gradient import PolicyGradientLoss
from paratrain.objectives.preference import CPGroup
from paratrain.objectives.reference_store import ReferenceStore, fill
from paratrain.objectives.registry import own_objective, plugin_of
from paratrain.precision import Precision
from paratrain.randomness import draws_in_forward, has_dropout, site_names
from paratrain.step import StepContext, cp_local_batch, no_grad_forward, stage_inputs, to_device

log = logging.getLogger("paratrain")


def build_parallel_with_weights(
    cfg: Config, dims: ParallelDims, model: nn.Module, *, spec: ModelSpec, device: torch.device, **kwargs
) -> tuple[nn.Module, StepContext, GradCompression]:
    """:func:`build_parallel`, and the weights that arrive after the parallelisms
    (ModelSpec.materialize: a model built on the meta device, such as a ``model.hf`` with weights).
    Plain DDP broadcasts rank 0's parameters when it wraps the model, so there they are read
    before. Training and ``paratrain eval`` (whose checkpoint then overwrites them) both call this."""
    ddp_wraps = dims.dp_replicate > 1 and not dims.fsdp_enabled and dims.tp == 1
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
    # The initial policy as a preference loss's reference: the model as built, before any
    # parallelism (on the meta device when its weights arrive later: they are read for it too).
    needs_initial = uses_reference(own) and reference_kind(cfg) == "initial"
    initial = copy.deepcopy(model) if needs_initial else None
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
    if isinstance(own, PreferenceLoss) and isinstance(model, PipelineModel):
        # Under pp its loss is the schedule's, on the last stage; KTO's KL pass runs the policy forward.
        own.pipelined, own.pp_group = True, model.pp_group
        own.pipeline_policy = forward_through(model, device=device, precision=precision)
    if uses_reference(own):
        reference = preference_reference(cfg, dims, model, initial, spec=spec, device=device, precision=precision)
        if isinstance(model, PipelineModel):
            own.pipeline_reference = reference
        else:
            own.reference = reference
    if isinstance(own, DistillLoss):
        pipeline = model if isinstance(model, PipelineModel) else None
        own.pipelined = pipeline is not None  # under pp its loss is the schedule's, on the last stage
        own.teacher = distill_teacher(cfg, dims, device=device, vocab=vocab, pipeline=pipeline, precision=precision)
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


def distill_teacher(
    cfg: Config,
    dims: ParallelDims,
    *,
    device,
    vocab: int | None = None,
    pipeline: PipelineModel | None = None,
    precision: Precision | None = None,
):
    """``teacher(forward, k)`` for objectives/distill.py: micro-batch ``k``'s logits from the
    frozen teacher (``distill.teacher``), laid out like the student (``vocab``: the student's
    output size, which the teacher's must equal).

    Under pipeline parallel (``pipeline``: the student's PipelineModel) ``teacher(inputs)``
    instead, the logits of a piece's input rows on the last stage, where the loss runs: the
    teacher is not split into stages but held by the last stage's ranks, laid out as one more
    stage of theirs (parallelize applies the stage's own tp, cp and dp_shard sub-meshes, not the
    pipeline split): whole on each rank, split by tensor parallel, run on the cp chunks the stage
    holds with the ring attention, sharded by FSDP2 (HSDP). Those ranks run the same pieces in the
    same order, so the teacher's collectives pair up; the other stages hold none."""
    if pipeline is not None:
        if not pipeline.has_last:

            def nowhere(inputs):
                raise RuntimeError("the distillation teacher runs on the pipeline's last stage only")

            return nowhere
        teacher, spec = frozen_model(cfg, cfg.distill.teacher, "distill.teacher")
        check_teacher_vocab(teacher, spec, vocab)
        teacher._paratrain_pp_stage = True  # parallelize: lay it out as a stage, never split it
        teacher = frozen_like_policy(cfg, dims, teacher, spec=spec, device=device)
        where = [f"{k} {getattr(dims, k)}" for k in ("tp", "cp", "dp_shard") if getattr(dims, k) > 1]
        log.info(
            "distill: teacher %s (%s), frozen, on the last stage's ranks%s",
            cfg.distill.teacher,
            cfg.distill.divergence,
            f", split over their {' x '.join(where)}" if where else ", whole on each",
        )

        def rows(inputs):
            with torch.no_grad(), precision.autocast():
                return teacher(inputs)

        return rows
    teacher, spec = frozen_model(cfg, cfg.distill.teacher, "distill.teacher")
    check_teacher_vocab(teacher, spec, vocab)
    teacher = frozen_like_policy(cfg, dims, teacher, spec=spec, device=device)
    log.info("distill: teacher %s (%s), frozen, laid out like the student", cfg.distill.teacher, cfg.distill.divergence)
    return lambda forward, k: forward(k, teacher)


def check_teacher_vocab(teacher: nn.Module, spec: ModelSpec, vocab: int | None) -> None:
    """The teacher's output size must be the student's (``vocab``)."""
    theirs = getattr(getattr(teacher, spec.head_attr or "", None), "out_features", None)
    if vocab is not None and theirs is not None and theirs != vocab:
        raise ConfigError(
            f"distill.teacher has a vocabulary of {theirs} tokens and the student {vocab}; distil from a teacher"
            " of the student's tokenizer"
        )


def frozen_model(cfg: Config, path: str, key: str) -> tuple[nn.Module, ModelSpec]:
    """The transformers causal LM of ``path`` with its weights (no adapters), for a reference or a
    teacher: ``model.args`` override the run's own model's config.json, not another directory's."""
    check_hf_dir(path, key)
    lora_off = dataclasses.replace(cfg.model.lora, target_modules=[])
    args = cfg.model.args if os.path.abspath(path) == os.path.abspath(cfg.model.hf or "") else {}
    return build(dataclasses.replace(cfg.model, hf=path, args=args, hf_weights=True, lora=lora_off, head="lm"))


def uses_reference(own) -> bool:
    """The loss runs a reference model: a preference loss that compares with one, GRPO with ``rl.beta > 0``."""
    return isinstance(own, (PreferenceLoss, PolicyGradientLoss)) and own.uses_reference


def reference_key(cfg: Config) -> str:
    """The config key of the loss's reference (its plug-in's ``reference``: ``preference.reference``,
    ``rl.reference`` for GRPO)."""
    return plugin_of(cfg.loss).reference or "preference.reference"


def reference_kind(cfg: Config) -> str:
    """The loss's reference (:func:`reference_key`), its default resolved: the adapters off with
    LoRA, else the initial model."""
    section, key = reference_key(cfg).split(".")
    chosen = getattr(getattr(cfg, section), key)
    return chosen or ("adapters_off" if cfg.model.lora.enabled else "initial")


def preference_reference(
    cfg: Config,
    dims: ParallelDims,
    model: nn.Module,
    initial: nn.Module | None,
    *,
    spec: ModelSpec,
    device,
    precision: Precision | None = None,
):
    """``reference(forward, k)`` for objectives/preference.py and policy_gradient.py: micro-batch
    ``k``'s logits from the reference, laid out like the policy (``model``, parallelised).
    ``initial``: the policy as built, copied before the parallelisms (``preference.reference =
    'initial'``), of ``spec``.

    Under pipeline parallel (``model`` a PipelineModel) ``reference(batches, target, fn)`` instead:
    the rank's rows forward through the reference's own pipeline (its stages split like the
    policy's), or through the policy's with its adapters off, ``fn`` on each piece's output on
    the last stage (pipeline_parallel.pipeline_forward_each), where the pair loss runs."""
    kind = reference_kind(cfg)
    key = reference_key(cfg)
    pipelined = isinstance(model, PipelineModel)
    if kind == "adapters_off":
        if not cfg.model.lora.enabled:
            raise ConfigError(
                f"{key} = 'adapters_off' is the policy without its LoRA adapters; enable model.lora or"
                f" set {key} = 'initial' or a model directory"
            )
        if pipelined:
            return forward_through(model, device=device, precision=precision, around=lambda: adapters_disabled(model))

        def adapters_off(forward, k):
            with adapters_disabled(model):
                return forward(k)

        return adapters_off
    if kind == "initial":
        reference = initial
    else:
        reference, spec = frozen_model(cfg, kind, key)
    reference = frozen_like_policy(cfg, dims, reference, spec=spec, device=device)
    log.info("%s: %s, frozen, laid out like the policy", key, kind)
    if pipelined:
        return forward_through(reference, device=device, precision=precision)
    return lambda forward, k: forward(k, reference)


def forward_through(pipeline: PipelineModel, *, device, precision: Precision, around=contextlib.nullcontext):
    """``run(batches, target, fn)``: the rank's rows forward through ``pipeline`` (inside
    ``around()``: a LoRA policy's adapters off), ``fn(output, target piece)`` per piece on its
    last stage (pipeline_parallel.pipeline_forward_each): a preference loss's reference or KTO's
    KL pass under pp."""

    def run(batches, target, fn):
        with around():
            pipeline_forward_each(
                pipeline,
                batches,
                fn=fn,
                target=target,
                device=device,
                autocast=precision.autocast(),
                split_inputs=stage_inputs,
            )

    return run


def precompute_reference(
    cfg: Config, dims: ParallelDims, model: nn.Module, step_ctx: StepContext, *, dataset, sampler, evaluator, plan
):
    """``preference.precompute``: the reference's numbers of every row the run will read into the
    store (objectives/reference_store.py): the micro-batches of its ``run.steps`` global batches
    from ``sampler`` and of the ``evaluator``'s validation set, collated as the loader and the
    evaluator collate them (so each row has the width the per-step reference would see), computed
    over the data-parallel ranks; then the reference model is dropped and each step looks its
    rows up."""
    own = step_ctx.objectives[0]
    if not (cfg.preference.precompute and isinstance(own, PreferenceLoss) and own.uses_reference):
        return
    path = cfg.preference.store or os.path.join(cfg.run.out_dir, "reference_store")
    store = ReferenceStore(path, reference_identity(cfg))
    micro = plan.micro_batch_size
    samples = cfg.run.steps * plan.global_batch_size  # batch.adaptive is refused with a preference loss
    if cfg.run.max_samples > 0:
        samples = min(samples, -(-cfg.run.max_samples // plan.global_batch_size) * plan.global_batch_size)
    # The stream in micro-batches: the same groups whatever dp and accumulation (data/sampler.py).
    stream = [[i for _, i in sampler.global_samples(p, micro)] for p in range(0, samples, micro)]
    walks = [(functools.partial(load_rows, dataset), stream, plan.accum_steps)]
    if evaluator is not None:
        indices = list(range(len(evaluator.dataset)))  # its filled-up end too: the evaluator reads it
        val = micro_batches(indices, evaluator.plan.micro_batch_size)
        walks.append((functools.partial(load_rows, evaluator.dataset), val, evaluator.plan.accum_steps))
    t0 = time.perf_counter()
    pipelined = isinstance(model, PipelineModel)  # the reference's pipeline; every rank gets the values
    computed, pairs = fill(
        store,
        walks,
        reference=own.reference,
        pipeline=own.pipeline_reference,
        holds=model.has_last if pipelined else True,
        share_group=dist.group.WORLD if pipelined else None,
        forward_of=lambda batches: no_grad_forward(model, batches, step_ctx, None),
        cut=lambda batches: [cp_local_batch(x, t, step_ctx) for x, t in batches],
        cp=own.cp,
        dp_rank=dims.local_rank_in("dp"),
        dp=dims.dp,
        dp_group=dims.group("dp"),
        device=step_ctx.device,
        is_main=dist.get_rank() == 0 if dist.is_initialized() else True,
    )
    log.info(
        "preference: reference of %d row(s) computed in %.1f s, %d found in %s",
        computed,
        time.perf_counter() - t0,
        pairs - computed,
        path,
    )
    own.store, own.reference, own.pipeline_reference = store, None, None  # the reference goes with its last holder


def load_rows(dataset, indices: list[int]):
    """One micro-batch of ``dataset`` collated as the loader collates it (data/loader.py)."""
    return collate_of(dataset)([dataset[i] for i in indices])


def reference_identity(cfg: Config) -> dict:
    """What the reference's numbers depend on besides the pair: its model and how it runs."""
    kind = reference_kind(cfg)
    path = cfg.model.hf if kind in ("initial", "adapters_off") else kind
    weights = []
    if path and os.path.isdir(path):
        for name in sorted(os.listdir(path)):
            if name.endswith((".safetensors", ".json")):
                st = os.stat(os.path.join(path, name))
                weights.append([name, st.st_size, st.st_mtime_ns])
    return {
        "reference": kind,
        "model": os.path.abspath(path) if path else cfg.model.factory or cfg.model.name,
        "files": weights,
        "args": cfg.model.args,
        "seed": cfg.run.seed if kind == "initial" else None,  # a model without weights: the seed's init
        "precision": cfg.precision.dtype,
        "keys": 3,  # the pair's own tokens and positions and the row's width (reference_store.row_keys)
    }


def frozen_like_policy(cfg: Config, dims: ParallelDims, model: nn.Module, *, spec: ModelSpec, device) -> nn.Module:
    """A frozen model with the policy's sharding (FSDP2, HSDP, tensor parallel) and its weights;
    under plain data parallel a whole copy per rank (DDP has no gradient of it to reduce)."""
    model.requires_grad_(False)
    sharded = dims.fsdp_enabled or dims.tp > 1 or dims.pp > 1  # pp: this rank's stages of it
    if spec.materialize is not None and not sharded:
        spec.materialize(model, device=device)
    if sharded:
        model = parallelize(
            model,
            dims,
            spec=spec,
            cfg=cfg.parallel,
            device=device,
            comm=cfg.comm,
            precision=cfg.precision,
            compile_enabled=False,
            loss_parallel=False,
            loss_owns_head=False,
        )
        if spec.materialize is not None:
            spec.materialize(model, device=device)
    else:
        model = model.to(device)
    return model.eval()


def batch_norm_layout(cfg: Config, dims: ParallelDims, model: nn.Module) -> NormLayout | None:
    """The model's BatchNorm layers converted to groups of ``batch.norm_group`` samples
    (models/batch_norm.py), before the parallelisms wrap them; None when it has none."""
    if not has_batch_norm(model) or cfg.batch.norm_group == 0:  # 0: torch's own BatchNorm, layout-dependent
        return None
    layout = NormLayout(
        group=norm_group(cfg.batch.norm_group, cfg.batch.global_batch_size),
        dp_rank=dims.local_rank_in("dp"),
        dp=dims.dp,
    )
    converted = convert_batch_norm(model, layout)
    log.info("batch norm: %d layer(s) over groups of %d samples (batch.norm_group)", len(converted), layout.group)
    return layout


def check_batch_math(cfg: Config, dims: ParallelDims, model: nn.Module, loss_fn: Loss, *, keyed: bool) -> None:
    """The layouts a model's BatchNorm and a loss over the whole global batch do not cover yet,
    refused in one line each (docs/batch-math.md)."""
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


def keyed_dropout_enabled(cfg: Config, model: nn.Module, *, draws: str | None = None) -> bool:
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
    log.info("random draws: the forward draws (%s): keyed by the sample (docs/randomness.md)", draws)
    return dataclasses.replace(step_ctx, draw_sites=draw_sites(model))


def draw_sites(model: nn.Module) -> dict[int, str]:
    """The keyed draws' site names: each pipeline stage's part keeps the whole model's names."""
    names: dict[int, str] = {}
    for part in model.parts if isinstance(model, PipelineModel) else [model]:
        names.update(site_names(part))
    return names
