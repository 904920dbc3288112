"""The frozen models of a run, in one place (issue 54): a loss's reference (the initial policy,
the policy with its LoRA adapters off, or a model directory), a distillation teacher, and the
reference's precomputed store, each laid out like the policy (pipelined or not, sharded or not).

An objective asks for them by name (``Objective.frozen``) and takes them in ``attach(world)``
from :class:`Frozen`, which the parallel build (build/__init__.py) makes once the policy is laid
out: the build knows no concrete objective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from paratrain.config import Config, ConfigError
from paratrain.data.sampler import collate_of, micro_batches
from paratrain.distributed.parallel_dims import ParallelDims
from paratrain.distributed.parallelize import parallelize
from paratrain.distributed.pipeline_parallel import PipelineModel, pipeline_forward_each
from paratrain.models import build
from paratrain.models.hf.model import check_hf_dir
from paratrain.models.hf.weights import weight_files
from paratrain.models.lora import adapters_disabled
from paratrain.models.spec import ModelSpec
from paratrain.objectives.reference_store import ReferenceStore, fill
from paratrain.objectives.registry import Plugin
from paratrain.precision import Precision
from paratrain.step import StepContext, cp_local_batch, no_grad_forward, stage_inputs

log = logging.getLogger("paratrain")


@dataclasses.dataclass
class Frozen:
    """The ``world`` an objective's ``attach`` reads (objectives/base.py): the laid-out policy and
    the frozen models it may ask for, each built when asked. ``initial``: the policy as built,
    copied before the parallelisms (only when a reference was asked for, see
    :func:`needs_initial`); ``vocab``: the policy's output size, which a teacher's must equal;
    ``plugin``: the run's loss (named or passed to train()), whose ``reference`` key is read."""

    cfg: Config
    dims: ParallelDims
    model: nn.Module
    initial: nn.Module | None
    spec: ModelSpec
    device: torch.device
    precision: Precision
    vocab: int | None
    plugin: Plugin

    @property
    def pipeline(self) -> PipelineModel | None:
        return self.model if isinstance(self.model, PipelineModel) else None

    def reference(self):
        return preference_reference(
            self.cfg,
            self.dims,
            self.model,
            self.initial,
            plugin=self.plugin,
            spec=self.spec,
            device=self.device,
            precision=self.precision,
        )

    def teacher(self):
        return distill_teacher(
            self.cfg, self.dims, device=self.device, vocab=self.vocab, pipeline=self.pipeline, precision=self.precision
        )

    def policy_forward(self):
        return forward_through(self.model, device=self.device, precision=self.precision)


def needs_initial(cfg: Config, objective, plugin: Plugin) -> bool:
    """Whether ``objective`` asks for a reference that is the initial policy: the model as built
    is then copied before any parallelism (on the meta device when its weights arrive later:
    they are read for it too)."""
    return objective is not None and "reference" in objective.frozen and reference_kind(cfg, plugin) == "initial"


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
    if not weight_files(path):
        # Named here: the build's own line names model.hf_weights, which is the policy's key and
        # whose 'false' would not help (a frozen model is read, never drawn from the seed).
        raise ConfigError(
            f"{key} = {path!r} has no *.safetensors weights, and a frozen model is read, never initialised;"
            " pass a directory with weights (e.g. a finished run's hf/ folder or `paratrain export RUN --hf DIR`)"
        )
    lora_off = dataclasses.replace(cfg.model.lora, target_modules=[])
    args = cfg.model.args if os.path.abspath(path) == os.path.abspath(cfg.model.hf or "") else {}
    return build(dataclasses.replace(cfg.model, hf=path, args=args, hf_weights=True, lora=lora_off, head="lm"))


def reference_key(plugin: Plugin) -> str:
    """The config key of the loss's reference (its plug-in's ``reference``: ``preference.reference``,
    ``rl.reference`` for GRPO). ``plugin``: the run's, named by loss.name or passed to train()
    (loss.name then does not name it: a passed plug-in's rl.reference was read from preference.reference)."""
    return plugin.reference or "preference.reference"


def reference_kind(cfg: Config, plugin: Plugin) -> str:
    """The loss's reference (:func:`reference_key`), its default resolved: the adapters off with
    LoRA, else the initial model."""
    section, key = reference_key(plugin).split(".")
    chosen = getattr(getattr(cfg, section), key)
    return chosen or ("adapters_off" if cfg.model.lora.enabled else "initial")


def preference_reference(
    cfg: Config,
    dims: ParallelDims,
    model: nn.Module,
    initial: nn.Module | None,
    *,
    plugin: Plugin,
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
    kind = reference_kind(cfg, plugin)
    key = reference_key(plugin)
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
    cfg: Config,
    dims: ParallelDims,
    model: nn.Module,
    step_ctx: StepContext,
    *,
    plugin: Plugin,
    dataset,
    sampler,
    evaluator,
    plan,
):
    """``preference.precompute``: the reference's numbers of every row the run will read into the
    store (objectives/reference_store.py): the micro-batches of its ``run.steps`` global batches
    from ``sampler`` and of the ``evaluator``'s validation set, collated as the loader and the
    evaluator collate them (so each row has the width the per-step reference would see), computed
    over the data-parallel ranks; then the reference model is dropped and each step looks its
    rows up."""
    own = step_ctx.objectives[0]
    # The preference losses' reference only (GRPO's changes with the rollouts: rl.reference).
    if not (
        cfg.preference.precompute and "reference" in own.frozen and reference_key(plugin) == "preference.reference"
    ):
        return
    path = cfg.preference.store or os.path.join(cfg.run.out_dir, "reference_store")
    store = ReferenceStore(path, reference_identity(cfg, plugin))
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


def reference_identity(cfg: Config, plugin: Plugin) -> dict:
    """What the reference's numbers depend on besides the pair: its model and how it runs."""
    kind = reference_kind(cfg, plugin)
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
        "keys": 3,  # the pair's own tokens and positions, the row's width, its images (reference_store.row_keys)
    }


def frozen_like_policy(cfg: Config, dims: ParallelDims, model: nn.Module, *, spec: ModelSpec, device) -> nn.Module:
    """A frozen model with the policy's sharding (FSDP2, HSDP, tensor parallel) and its weights;
    under plain data parallel a whole copy per rank (DDP has no gradient of it to reduce)."""
    model.requires_grad_(False)
    sharded = dims.fsdp_enabled or dims.tp > 1 or dims.pp > 1  # pp: this rank's stages of it
    # The initial copy of a policy DDP wraps was taken after its weights were read (build/__init__.py):
    # nothing left on the meta device to read, and the weights' built tensors (a vision tower's
    # position ids, models/hf/vision.py) were already spent on the policy.
    on_meta = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    if spec.materialize is not None and not sharded and on_meta:
        spec.materialize(model, device=device)
    if sharded:
        # Not compiled, no loss: parallelize's defaults (compile off, no loss parallel, no head handed to a loss).
        model = parallelize(
            model, dims, spec=spec, cfg=cfg.parallel, device=device, comm=cfg.comm, precision=cfg.precision
        )
        if spec.materialize is not None:
            spec.materialize(model, device=device)
    else:
        model = model.to(device)
    return model.eval()
