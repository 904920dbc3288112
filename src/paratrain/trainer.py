"""train(): build -> loop -> finish. The loop is explicit and fits on one screen.

``build`` makes every object of the run from the config (model and its spec, parallelisms,
optimiser, sampler, checkpointer, metrics writer) and resumes; ``loop`` runs the optimiser steps;
``finish`` writes the summary, the plot and the final weights. A ``Run`` is only the bag of what
``build`` made (no methods): the loop reads like nanoGPT's.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.data import Dataset

from paratrain.batch.adaptive import BatchAdapter, build_batch_adapter
from paratrain.batch.auto import resolve_auto_micro_batch
from paratrain.batch.lr_scaling import LRScaling
from paratrain.batch.plan import BatchPlan, replan_batch
from paratrain.build import build_parallel_with_weights, key_detected_draws
from paratrain.build.frozen import precompute_reference
from paratrain.checkpoint import Checkpointer, build_checkpointer, resume_spec
from paratrain.checkpoint.export import save_full_weights
from paratrain.checkpoint.manifest import clear_run_outputs
from paratrain.config import Config, ConfigError, LossConfig, to_dict, to_toml
from paratrain.data.datasets import build_dataset, build_val_dataset, static_items_per_sample, tensor_items_per_sample
from paratrain.data.loader import BatchSource, StepLoader
from paratrain.data.sampler import GlobalBatchSampler
from paratrain.distributed.grad_compression import GradCompression
from paratrain.distributed.hang import enable_flight_recorder, watch_collectives
from paratrain.distributed.json_collectives import broadcast_json
from paratrain.distributed.parallel_dims import ParallelDims
from paratrain.distributed.process_group import DistContext, close_distributed, init_distributed
from paratrain.evaluate import Evaluator, eval_due
from paratrain.models import build, lora_base, spec_of, with_lora
from paratrain.models.hf import export_hf
from paratrain.models.lora import is_adapter_param, trainable_parameters
from paratrain.objectives.registry import Plugin, build_loss
from paratrain.observability.events import EventLog, process_start_time, startup
from paratrain.observability.metrics import (
    MetricsWriter,
    RowHistory,
    plot_metrics,
    setup_logging,
    summarize,
    truncate_metrics,
)
from paratrain.observability.mfu import mfu, resolve_peak_flops, seq_len_of
from paratrain.observability.profiler import Profiler, build_profiler
from paratrain.observability.rank_stats import RankStats, build_rank_stats
from paratrain.observability.trackers import build_trackers
from paratrain.optim import build_optimizer, build_scheduler
from paratrain.precision import Precision, build_precision
from paratrain.preemption import Preemption
from paratrain.preflight import check_eval, check_run
from paratrain.preflight.memory import check_memory
from paratrain.preflight.probe import first_micro_batch, layout_probe
from paratrain.preflight.shared import check_shared_folders, shared_folders
from paratrain.randomness import draws_random
from paratrain.step import StepContext, StepResult, no_grad_forward, train_step

log = logging.getLogger("paratrain")


@dataclass
class TrainState:
    """What the loop carries from step to step (and what a checkpoint must restore)."""

    step: int = 0  # optimiser steps done
    consumed_samples: int = 0  # position in the sampler's stream
    global_batch_size: int = 0  # the current global batch (batch.adaptive grows it); 0 = not started
    grad_noise: dict = field(default_factory=dict)  # the noise-scale averages of batch.adaptive
    # [step, world_size] each time the run (re)started at a new world size (elastic --nnodes MIN:MAX)
    world_sizes: list = field(default_factory=list)
    # tracker name -> its run id (W&B, MLflow), so that a resumed run continues those runs
    tracker_runs: dict = field(default_factory=dict)


@dataclass
class Run:
    """Everything ``build`` made for the loop (plain data, no behaviour)."""

    ctx: DistContext
    dims: ParallelDims
    plan: BatchPlan  # the batch plan of the next step
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    step_ctx: StepContext
    dataset: Dataset
    sampler: GlobalBatchSampler
    loader: StepLoader  # this rank's micro-batches of a step, prefetched by data.workers processes
    evaluator: Evaluator | None  # the validation loss ([eval]); None when off
    state: TrainState
    lr_scaling: LRScaling
    adapter: BatchAdapter | None
    precision: Precision
    compression: GradCompression
    ckpt: Checkpointer
    preemption: Preemption  # SIGTERM: stop after the step every rank agrees on, with a checkpoint
    events: EventLog  # events.jsonl: a few wall-clock milestones per start (observability/events.py)
    writer: MetricsWriter
    rank_stats: RankStats  # per-rank memory and times, stragglers (observability/rank_stats.py)
    profiler: Profiler  # torch.profiler traces of [profile] steps (observability/profiler.py)
    flops_per_token: Callable[[int], float]
    peak_flops: float | None
    n_params: int
    data_info: dict
    resumed_from: int | None
    # The step's batches (trainer.loop): the loader, or the loss's plug-in's own (objectives/registry.py)
    source: BatchSource


def _what(obj) -> str:
    return f"the class {obj.__name__}" if isinstance(obj, type) else type(obj).__name__


def check_train_arguments(cfg, *, model, dataset, loss) -> None:
    """The objects passed to :func:`train`, checked before any process group exists: one line naming
    the argument and what it takes (a class for an instance was an AttributeError deep in the
    build, a string loss "the model fails on half of the first micro-batch")."""
    if not isinstance(cfg, Config):
        raise ConfigError(
            f"paratrain.train takes a Config, not {_what(cfg)}; make one with paratrain.load_config(path, overrides)"
        )
    if model is not None and not isinstance(model, nn.Module):
        raise ConfigError(f"paratrain.train(model=...) takes a torch.nn.Module instance, not {_what(model)}")
    if dataset is not None and (
        isinstance(dataset, type) or not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"))
    ):
        raise ConfigError(
            f"paratrain.train(dataset=...) takes a map-style dataset (an instance with __len__ and __getitem__),"
            f" not {_what(dataset)}"
        )
    if loss is not None and (isinstance(loss, type) or not (isinstance(loss, Plugin) or callable(loss))):
        raise ConfigError(
            "paratrain.train(loss=...) takes a function (output, target) -> (sum_of_item_losses, item_count)"
            f" or a Plugin (docs/objectives.md), not {_what(loss)}"
        )


def train(
    cfg: Config, *, model: nn.Module | None = None, dataset: Dataset | None = None, loss: Callable | None = None
) -> dict:
    """Train per ``cfg`` in this process (one rank of the job); returns the run summary.

    ``model``/``dataset``/``loss`` replace the config's builders for users who make their own
    objects in Python; start the script with torchrun for several processes.
    """
    called = time.time()
    check_train_arguments(cfg, model=model, dataset=dataset, loss=loss)
    enable_flight_recorder()  # before the process group exists: hang reports name collectives
    ctx = init_distributed(cfg.dist)
    try:  # before anything is written or resumed: one folder every node sees (preflight/shared.py)
        check_shared_folders(shared_folders(cfg), rank=ctx.rank, world_size=ctx.world_size, device=ctx.device)
    except ConfigError:
        close_distributed(ctx, barrier=False)
        raise
    # A few wall-clock lines per start (observability/events.py): where an elastic restart's seconds go.
    events = EventLog(cfg.run.out_dir, rank=ctx.rank, world_size=ctx.world_size)
    events.record("worker_start", t=process_start_time())
    events.record("train_called", t=called)
    events.record("process_group_ready")
    run, ended = None, False
    try:
        with watch_collectives(rank=ctx.rank, world_size=ctx.world_size, timeout_s=cfg.dist.timeout_s):
            run = build_run(cfg, ctx, model=model, dataset=dataset, loss=loss, events=events)
            try:
                if cfg.run.probe:
                    log.info(startup("layout probe: the first micro-batch whole and split in two"))
                if cfg.run.keyed_random:  # draws no dropout rate announced (noise, stochastic depth) keyed too
                    first = first_micro_batch(run, seed=cfg.run.seed)[0]
                    run.step_ctx = key_detected_draws(cfg, run.dims, run.model, run.step_ctx, first)
                layout_probe(run, run_cfg=cfg.run)  # before the first step: a layout-dependent model stops here
                log.info(
                    startup(f"first step{' (torch.compile compiles each block first)' if cfg.train.compile else ''}")
                )
                history = loop(cfg, run)
            except BaseException as e:
                events.record(
                    "worker_failed", error=(str(e).strip().splitlines() or [""])[0][:300], type=type(e).__name__
                )
                run.profiler.on_error(e, run.state.step + 1)  # CUDA: a memory snapshot of an OOM
                run.writer.finish(None)  # trackers mark the run failed
                raise
            finally:
                run.writer.close()
                run.loader.close()
                run.ckpt.close()
                run.preemption.close()
                run.profiler.close()
                run.rank_stats.close()
            summary = finish(cfg, run, history)
        ended = True  # every rank got here: the heartbeat is stopped and joined (watch_collectives)
        return summary
    finally:
        # The DDP modules go before the process group: their Reducer must not hold its last
        # reference (a deadlock in torch's destructors, see close_distributed).
        run = None
        close_distributed(ctx, barrier=ended)


def loop(cfg: Config, run: Run) -> RowHistory:
    """The optimiser steps: sample, step, adapt the batch, schedule the lr, log, checkpoint."""
    # Only the fields the summary and plot read, not every row's dict (memory flat over long runs).
    state, plan, history = run.state, run.plan, RowHistory()
    run.model.train()
    while not finished(cfg, state):
        t0 = time.perf_counter()
        run.profiler.begin(state.step + 1)
        keyed = run.step_ctx.draw_sites is not None  # keyed dropout: the rows' keys (paratrain/randomness.py)
        at = (state.step, state.consumed_samples, plan.global_batch_size, plan.micro_batch_size)
        batches, keys = run.source.for_step(*at, keyed=keyed)
        data_time = time.perf_counter() - t0
        lr = run.scheduler.get_last_lr()[0]
        probe = run.adapter.probe(run.model, batches[0], run.step_ctx.loss_fn) if run.adapter else None
        result = train_step(
            run.model, run.optimizer, batches, run.step_ctx,
            after_backward=probe, stop_flag=run.preemption.requested, keys=keys,
        )  # fmt: skip
        state.consumed_samples += run.source.consumed_after(state.step, plan.global_batch_size)
        state.step += 1
        row = metrics_row(run, result, plan=plan, lr=lr, seq_len=seq_len_of(batches[0][0]), t0=t0)
        row.update(run.source.metrics)
        if run.evaluator and eval_due(state.step, interval=cfg.eval.interval, last=finished(cfg, state)):
            row.update(validate(run))
        plan = adapt_batch(run, result, plan, row)
        run.scheduler.step()
        run.profiler.end(state.step)  # reads the CUDA peak before rank_stats resets it
        log_step(run, row, history, data_time=data_time)
        # A source may allow stops at some steps only (GRPO: between generation rounds, whose
        # completions are not checkpointed).
        if run.preemption.should_stop(state.step, agreed=result.stop and run.source.between_rounds(state.step)):
            break
    # Preempted: a synchronous checkpoint of the step every rank stopped after, whatever the config says.
    run.ckpt.at_end(state.step, force=run.preemption.stopped_at_step is not None)
    run.plan = plan
    return history


def adapt_batch(run: Run, result: StepResult, plan: BatchPlan, row: dict) -> BatchPlan:
    """Adaptive batch (batch/adaptive.py): the next step's plan and lr scale, before the scheduler reads it."""
    if not run.adapter:
        return plan
    state = run.state
    plan = run.adapter.after_step(result=result, step=state.step)
    state.global_batch_size, state.grad_noise = plan.global_batch_size, run.adapter.state_dict()
    run.lr_scaling.update(global_batch_size=plan.global_batch_size, noise_scale=run.adapter.noise_samples)
    row.update(grad_noise_scale=run.adapter.noise_samples, lr_scale=run.lr_scaling.factor)
    return plan


def log_step(run: Run, row: dict, history: RowHistory, *, data_time: float) -> None:
    """The step's rank statistics, its checkpoint, then its metrics row."""
    step = run.state.step
    row.update(run.rank_stats.row(step=step, step_time_s=row["step_time_s"], data_time_s=data_time))
    # No collective between step N's checkpoint and its metrics row: one there (rank_stats'
    # all-gather) fails when a peer is lost after the save, and the resumed run would have
    # checkpoint step-N without row N.
    blocked = run.ckpt.after_step(step)
    if blocked is not None:
        row["checkpoint_blocked_s"] = blocked
    history.append(row)
    run.writer.log_step(row)
    if len(history) == 1:
        run.events.record("first_step_done", step=step)


def validate(run: Run) -> dict:
    """The validation loss now (evaluate.py); its forwards are not the step's time (rank_stats)."""
    with run.rank_stats.excluded():
        val_loss = run.evaluator(run.model, run.step_ctx)
    extra = {f"val_{k}": v for k, v in run.evaluator.last_metrics.items()}  # info_nce: recall@1, MRR
    return {
        "val_loss": val_loss,
        **extra,
        "val_items": run.evaluator.last_items,
        "val_time_s": run.evaluator.last_time_s,
    }


def val_pad_target(cfg: Config, plugin: Plugin) -> int | None:
    """The target that fills up the validation set's last batch (data/__init__.py): the ignore
    index, for a loss whose sum and count it adds nothing to (the plug-in's ``pads_with_ignore``:
    the built-in cross-entropy, distillation, a pair's: a row of ignored targets holds no pair);
    None (round down to whole batches) for any other loss, whose count we do not know."""
    return cfg.loss.ignore_index if plugin.pads_with_ignore else None


def static_item_count(dataset: Dataset, loss_cfg: LossConfig, plugin: Plugin) -> int | None:
    """The dataset's static count (data/datasets.py) when the loss's plug-in counts from the
    targets alone (``static_count``: mse, every element; cross-entropy with a negative ignore
    index, which a class id never is, every element not equal to it). A user loss counts its own
    way, so its items are counted and reduced as before."""
    if not plugin.static_count(loss_cfg):
        return None
    declared = static_items_per_sample(dataset)
    if declared is not None:
        return declared
    return tensor_items_per_sample(dataset, ignore_index=loss_cfg.ignore_index if plugin.ignores else None)


def finished(cfg: Config, state: TrainState) -> bool:
    return state.step >= cfg.run.steps or 0 < cfg.run.max_samples <= state.consumed_samples


def metrics_row(run: Run, result: StepResult, *, plan: BatchPlan, lr: float, seq_len: int, t0: float) -> dict:
    """One metrics.jsonl row for the step just done (rank 0 writes it)."""
    dt = time.perf_counter() - t0
    state = run.state
    row = {
        "step": state.step,
        "loss": result.loss,
        "lr": lr,
        "grad_norm": result.grad_norm,
        "global_batch_size": plan.global_batch_size,
        "micro_batch_size": plan.micro_batch_size,
        "accum_steps": plan.accum_steps,
        "world_size": run.ctx.world_size,
        "items": result.items,
        "tokens": result.tokens,
        # Token inputs: the targets of the loss (a fine-tuning corpus masks prompts and padding);
        # a loss over pairs or completions counts those, in "items" alone.
        **(
            {"trainable_tokens": result.items}
            if seq_len > 1 and run.step_ctx.objectives[0].counts_target_tokens
            else {}
        ),
        "consumed_samples": state.consumed_samples,
        "epoch": run.sampler.epoch_of(state.consumed_samples - 1),
        "step_time_s": dt,
        # Wall clock at this row: consecutive rows' difference is the whole loop iteration,
        # logging, rank stats and checkpoint checks included (step_time_s ends here).
        "time": time.time(),
        "tokens_per_s": result.tokens / dt,
        "samples_per_s": plan.global_batch_size / dt,
    }
    # Communication and hardware: model FLOPs and MFU, bytes sent, fp16 loss scale.
    step_flops = run.flops_per_token(seq_len) * result.tokens
    if result.attention_square is not None:
        # Packed documents attend within themselves: the attention term (linear in the sequence
        # length, flops_per_token = a + b x seq_len) is credited per document, not per row.
        per_token = run.flops_per_token(0)
        step_flops = per_token * result.tokens + (run.flops_per_token(1) - per_token) * result.attention_square
    row["model_flops_per_s"] = step_flops / dt
    if run.peak_flops:
        row["mfu"] = mfu(flops=step_flops, seconds=dt, peak_flops_per_device=run.peak_flops, devices=run.ctx.world_size)
    comm_bytes = run.compression.take_bytes()
    if comm_bytes is not None:
        row["comm_bytes"] = comm_bytes
    row.update(run.precision.metrics())
    for objective in run.step_ctx.objectives:  # e.g. a mixture of experts' aux_loss, tokens per expert
        row.update(objective.metrics(result.extras))
    return row


def build_run(cfg: Config, ctx: DistContext, *, model, dataset, loss, events: EventLog) -> Run:
    """Make every object of the run from ``cfg`` (user objects replace the config's builders), resume."""
    setup_logging(rank=ctx.rank, all_ranks=cfg.run.log_all_ranks)
    log.info(startup(f"process group of {ctx.world_size} ready; checking the config, reading the data"))
    dims, plan = check_run(cfg, ctx.world_size, model=model, loss=loss)
    # Objects passed to train() (not the config's builders, made below) cannot reach a separate
    # process, so only they stop 'auto' from estimating a sharded layout in one.
    user_objects = [name for name, obj in (("model", model), ("dataset", dataset), ("loss", loss)) if obj is not None]
    if cfg.data.name == "prompts" and cfg.model.hf and "tokenizer" not in cfg.data.args:
        cfg.data.args = {**cfg.data.args, "tokenizer": cfg.model.hf}  # the model's own tokenizer
    dataset = dataset if dataset is not None else build_dataset(cfg.data)
    loss_fn = build_loss(cfg.loss, loss)
    check_pairs(cfg, dataset, loss_fn.plugin)
    # Batch-size adjustment (batch/): 'auto' resolves before any model exists, to the same
    # micro-batch on every rank; plan_batch then keeps the global batch.
    if cfg.batch.micro_batch_size == "auto":
        plan = resolve_auto_micro_batch(
            cfg, dims=dims, device=ctx.device, model=model, dataset=dataset, loss=loss_fn, user_objects=user_objects
        )
    model, spec, base, n_params = build_model(cfg, ctx, dims, plan, model=model, dataset=dataset)

    # Communication and hardware: precision, MFU, the parallelisms, gradient compression.
    precision = build_precision(cfg.precision, device=ctx.device, fsdp_enabled=dims.fsdp_enabled)
    flops_per_token = spec.flops_per_token(model)  # from the whole model, before any split
    peak_flops = peak_flops_of(cfg, ctx)
    # A plain token stream knows its global item count: the step skips the count's all-reduce.
    items_per_sample = static_item_count(dataset, cfg.loss, loss_fn.plugin)
    model, step_ctx, compression = build_parallel_with_weights(
        cfg,
        dims,
        model,
        spec=spec,
        device=ctx.device,
        loss_fn=loss_fn,
        precision=precision,
        items_per_sample=items_per_sample,
    )

    if cfg.comm.compression != "none":  # said at start, like every other choice that changes the step
        log.info("comm: gradient compression %s (%s)", cfg.comm.compression, compression_where(compression, dims))

    optimizer, state, lr_scaling, adapter, scheduler = build_optimization(cfg, dims, plan, model)
    sampler = GlobalBatchSampler(len(dataset), seed=cfg.run.seed, shuffle=cfg.data.shuffle)
    loader = StepLoader(
        dataset,
        sampler,
        dp_rank=dims.local_rank_in("dp"),
        dp=dims.dp,
        workers=cfg.data.workers,
        prefetch=cfg.data.prefetch,
        pin_memory=ctx.device.type == "cuda",  # then the step copies with non_blocking=True
        seed=cfg.run.seed,
        # A dataset's own draws (augmentation) keyed by the sample; paratrain's token datasets draw none.
        keyed_seed=cfg.run.seed if cfg.run.keyed_random and draws_random(dataset) else None,
        norm_group=step_ctx.norm_group,  # BatchNorm groups wider than a micro-batch span ranks
    )
    # Where the step's batches come from: the step loader, or the plug-in's own (GRPO's rollouts).
    source = loss_fn.plugin.source(
        cfg,
        model=model,
        step_ctx=step_ctx,
        loader=loader,
        dataset=dataset,
        dims=dims,
        is_main=ctx.is_main,
        forward_of=lambda batches, keys: no_grad_forward(model, batches, step_ctx, keys),
    )
    evaluator = build_evaluator(cfg, dims, plan, loss_fn.plugin)

    # preference.precompute: the reference's numbers of the rows the run reads (objectives/reference_store.py).
    precompute_reference(
        cfg,
        dims,
        model,
        step_ctx,
        plugin=loss_fn.plugin,
        dataset=dataset,
        sampler=sampler,
        evaluator=evaluator,
        plan=plan,
    )

    # Checkpoints (paratrain.checkpoint): resume before the loop, save after steps.
    ckpt = build_checkpointer(
        cfg,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        state=state,
        layout=dims.degrees(),
        rank=ctx.rank,
        world_size=ctx.world_size,
        device=ctx.device,
        stateful={"grad_scaler": precision.scaler, "powersgd": compression.checkpoint},
        base=base,
        model_keys=is_adapter_param if cfg.model.lora.enabled else None,
    )
    preemption = Preemption(grace_s=cfg.checkpoint.preempt_grace_s)
    plan, resumed_from = resume(
        cfg, ctx, ckpt, plan, state=state, lr_scaling=lr_scaling, adapter=adapter, events=events
    )
    writer = build_writer(cfg, ctx, state, resumed_from, [p for o in step_ctx.objectives for p in o.watched])
    return Run(
        ctx=ctx,
        dims=dims,
        plan=plan,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        step_ctx=step_ctx,
        dataset=dataset,
        sampler=sampler,
        loader=loader,
        evaluator=evaluator,
        state=state,
        lr_scaling=lr_scaling,
        adapter=adapter,
        precision=precision,
        compression=compression,
        ckpt=ckpt,
        preemption=preemption,
        events=events,
        writer=writer,
        rank_stats=build_rank_stats(
            cfg.metrics, rank=ctx.rank, world_size=ctx.world_size, device=ctx.device, model=model
        ),
        profiler=build_profiler(cfg.profile, rank=ctx.rank, out_dir=cfg.run.out_dir, device=ctx.device),
        flops_per_token=flops_per_token,
        peak_flops=peak_flops,
        n_params=n_params,  # of the whole model, before any parallelism
        data_info=getattr(dataset, "description", {"samples": len(dataset)}),
        resumed_from=resumed_from,
        source=source,
    )


def peak_flops_of(cfg: Config, ctx: DistContext) -> float | None:
    """The device's peak FLOP/s for MFU (hardware/), logged with the precision."""
    peak_flops, peak_source = resolve_peak_flops(cfg.hardware, device=ctx.device, dtype=cfg.precision.dtype)
    log.info(
        "precision: %s | MFU peak: %s",
        cfg.precision.dtype,
        f"{peak_flops:.3g} FLOP/s per device from {peak_source}" if peak_flops else f"unknown ({peak_source})",
    )
    return peak_flops


def build_model(cfg: Config, ctx: DistContext, dims, plan: BatchPlan, *, model, dataset):
    """The model (the user's, with the config's adapters, or the config's), its spec, a LoRA run's
    frozen base (hashed whole before any parallelism: its checkpoints hold adapters only) and its
    parameter count."""
    log.info(startup("building the model" + (f" of {cfg.model.hf}" if cfg.model.hf and model is None else "")))
    if model is None:  # before the model's first allocation (a model passed in has made its own)
        check_memory(cfg, dims, device=ctx.device)
    torch.manual_seed(cfg.run.seed)  # the init is a function of the seed, the same on every rank
    if model is not None:
        spec = spec_of(cfg.model, model)
        model = with_lora(model, cfg.model, spec)  # the adapters build() gives the config's models
    else:
        model, spec = build(cfg.model)
    n_params = sum(p.numel() for p in model.parameters())
    data_info = getattr(dataset, "description", {"samples": len(dataset)})
    log.info("paratrain: world %d on %s | %s", ctx.world_size, ctx.device, dims.describe())
    log.info("batch: %s (per rank %d)", plan.describe(), plan.per_rank_batch_size)
    log.info("model: %.2fM parameters | data: %s", n_params / 1e6, json.dumps(data_info))
    base = None
    if cfg.model.lora.enabled:
        trainable, _ = trainable_parameters(model)
        log.info("lora: %d trainable parameters (%.3f%%), the rest frozen", trainable, 100 * trainable / n_params)
        base = lora_base(cfg.model, model) if ctx.is_main else None
    return model, spec, base, n_params


def build_optimization(cfg: Config, dims, plan: BatchPlan, model: nn.Module):
    """The optimiser, the train state, the lr scaling, the adaptive batch (or None), the schedule."""
    optimizer = build_optimizer(model, cfg.optim, bitwise=cfg.run.bitwise)
    state = TrainState(global_batch_size=plan.global_batch_size)
    lr_scaling = LRScaling(cfg.optim, global_batch_size=plan.global_batch_size, log=log.info)
    adapter = build_batch_adapter(cfg.batch, lr_scaling=cfg.optim.lr_scaling, plan=plan, dp_group=dims.group("dp"))
    if adapter is not None and cfg.batch.adaptive:
        log.info(
            "adaptive batch: global batch %d, grown by accumulation up to %d while the gradient noise scale"
            " exceeds it (decided every %d steps)",
            plan.global_batch_size,
            adapter.max_global,
            cfg.batch.adapt_every,
        )
    scheduler = build_scheduler(optimizer, cfg.optim, total_steps=cfg.run.steps, scale=lr_scaling)
    return optimizer, state, lr_scaling, adapter, scheduler


def build_evaluator(cfg: Config, dims, plan: BatchPlan, plugin: Plugin) -> Evaluator | None:
    """The validation loss ([eval]), or None when eval.interval = 0."""
    if not cfg.eval.interval:
        return None
    eval_plan = check_eval(cfg, dims, plan)
    val_set = build_val_dataset(
        cfg.data,
        cfg.eval.samples,
        multiple_of=eval_plan.global_batch_size,
        pad_target=val_pad_target(cfg, plugin),
    )
    evaluator = Evaluator(val_set, eval_plan, dp_rank=dims.local_rank_in("dp"))
    log.info("validation: %d samples every %d steps (%s)", evaluator.samples, cfg.eval.interval, eval_plan.describe())
    return evaluator


def resume(
    cfg: Config,
    ctx: DistContext,
    ckpt: Checkpointer,
    plan: BatchPlan,
    *,
    state: TrainState,
    lr_scaling,
    adapter,
    events,
):
    """Resume from the checkpoint the config names (if any): the plan of the first step after it,
    and the step resumed from (None: a fresh start). A new world size is logged and recorded."""
    t0 = time.perf_counter()
    resumed_from = ckpt.resume(*resume_spec(cfg.checkpoint))
    events.record("checkpoint_loaded", step=resumed_from, load_s=time.perf_counter() - t0)
    if resumed_from is not None and ctx.is_main:
        truncate_metrics(cfg.run.out_dir, resumed_from)  # rows after the checkpoint are redone
    plan = resumed_plan(cfg, plan, state=state, lr_scaling=lr_scaling, adapter=adapter)
    if not state.world_sizes or state.world_sizes[-1][1] != ctx.world_size:
        if state.world_sizes:  # resumed (an elastic restart, or by hand) on another number of ranks
            log.warning(
                "world size %d -> %d at step %d: %s",
                state.world_sizes[-1][1],
                ctx.world_size,
                state.step,
                plan.describe(),
            )
        state.world_sizes = [*state.world_sizes, [state.step, ctx.world_size]]
    return plan, resumed_from


def build_writer(
    cfg: Config, ctx: DistContext, state: TrainState, resumed_from: int | None, watched: list[str]
) -> MetricsWriter:
    """The run's outputs (rank 0): config.toml, the trackers (their run ids in every rank's
    state), metrics.jsonl's writer (``watched``: the objectives' console values)."""
    if ctx.is_main:
        if cfg.run.overwrite and resumed_from is None:  # `train --overwrite`: the old run goes first
            clear_run_outputs(cfg.run.out_dir, cfg.checkpoint.dir)
        os.makedirs(cfg.run.out_dir, exist_ok=True)
        with open(os.path.join(cfg.run.out_dir, "config.toml"), "w") as f:
            f.write(to_toml(cfg))
    trackers = (
        build_trackers(
            cfg.metrics, out_dir=cfg.run.out_dir, config=to_dict(cfg), resume=state.tracker_runs, start_step=state.step
        )
        if ctx.is_main
        else ()
    )
    if cfg.metrics.wandb or cfg.metrics.mlflow:  # every rank's checkpointed TrainState holds rank 0's run ids
        runs = {t.name: t.run_id for t in trackers if t.run_id}
        state.tracker_runs = broadcast_json(runs, device=ctx.device) if ctx.world_size > 1 else runs
    return MetricsWriter(
        cfg.run.out_dir,
        enabled=ctx.is_main,
        total_steps=cfg.run.steps,
        progress=cfg.run.progress,
        trackers=trackers,
        start_step=state.step,
        watched=watched,
    )


def check_pairs(cfg: Config, dataset, plugin: Plugin) -> None:
    """The data the loss's plug-in trains on (its ``rows``): a preference corpus (a pair per row,
    data/preference.py) goes with a loss over pairs, and a loss over pairs with such a corpus;
    prompts with a loss that generates: one line each instead of a shape error inside the step."""
    if plugin.rows == "prompts" and not getattr(dataset, "prompts_of_rows", False):
        raise ConfigError(
            f"loss.name = {cfg.loss.name!r} generates from prompts: set data.name = 'prompts' (docs/grpo.md)"
        )
    pairs = bool(getattr(dataset, "pairs_of_rows", False))
    over_pairs = plugin.rows == "pairs"
    if pairs and not over_pairs:
        raise ConfigError(
            f"data.args.path is a preference corpus (a pair per row) but loss.name = {cfg.loss.name!r}; set loss.name"
            " = 'preference' (or 'reward' with model.head = 'score'), or prepare the data with another --format"
        )
    if over_pairs and not pairs:
        raise ConfigError(
            f"loss.name = {cfg.loss.name!r} trains on pairs: point data.args.path at a corpus made by"
            " `paratrain prepare --format preference` (or 'unpaired' for KTO)"
        )
    if not (pairs and over_pairs):
        return
    # KTO's unpaired rows (data/preference.py ``labels``) and the pair losses' pairs do not mix:
    # said here, before the model is built, and in the direction that is wrong (the step's own
    # check, objectives/preference.py, spoke of an unpaired corpus when the corpus held pairs).
    unpaired = bool(getattr(dataset, "labels", False))
    kto = plugin.unpaired(cfg)
    if unpaired and not kto:
        raise ConfigError(
            "data.args.path is an unpaired corpus (prepare --format unpaired: an example and its label per row),"
            " which only loss.name = 'preference' with preference.loss_type = 'kto' trains; set it, or prepare"
            " pairs with --format preference"
        )
    if kto and not unpaired:
        raise ConfigError(
            "preference.loss_type = 'kto' trains on unpaired examples, but data.args.path holds pairs (prepare"
            " --format preference); prepare the data with --format unpaired, or set another preference.loss_type"
        )


def resumed_plan(
    cfg: Config, plan: BatchPlan, *, state: TrainState, lr_scaling: LRScaling, adapter: BatchAdapter | None
) -> BatchPlan:
    """The plan of the first step after a (possible) resume."""
    # A restored TrainState carries the batch the adaptive mode had reached.
    if not cfg.batch.adaptive:  # the configured global batch holds, whatever a checkpoint had
        state.global_batch_size = plan.global_batch_size
    elif state.global_batch_size != plan.global_batch_size:
        plan = replan_batch(
            global_batch_size=state.global_batch_size, micro_batch_size=plan.micro_batch_size, dp=plan.dp
        )
        lr_scaling.update(global_batch_size=plan.global_batch_size)
    if adapter:
        if state.grad_noise:
            adapter.load_state_dict(state.grad_noise)
        plan = adapter.start(plan)

    return plan


def compression_where(compression: GradCompression, dims) -> str:
    """Where comm.compression acts at this layout, for the start-up line."""
    if compression.counter is not None:
        return "a DDP comm hook on the gradient all-reduce"
    if dims.fsdp_enabled:
        return "FSDP2's reduce-scatter dtype"
    return "no effect at this layout: no data-parallel gradient reduce"


def save_lora_adapter(sd: dict, cfg: Config, out_dir: str) -> None:
    """A LoRA run's result as PEFT's adapter directory (``out_dir/adapter``), beside the full
    weights in model.safetensors, so that what the last line names is there (docs/lora.md)."""
    from paratrain.models.lora_export import export_peft  # peft: only LoRA runs import it

    adapter = os.path.join(out_dir, "adapter")
    adapters = {k: v for k, v in sd.items() if is_adapter_param(k)}
    # The frozen rest: written beside the adapter when model.hf has no weights (lora_export.peft_base_path).
    base = {k: v for k, v in sd.items() if k not in adapters}
    export_peft(adapters, model_cfg=cfg.model, out_dir=adapter, base_weights=base)
    merge = f"; merged into the base: paratrain export {out_dir} --hf DIR --merge" if cfg.model.hf else ""
    log.info("lora: the adapters in %s (PEFT: PeftModel.from_pretrained(base, DIR))%s", adapter, merge)


def finish(cfg: Config, run: Run, history: RowHistory) -> dict:
    """Summary, plot and final weights; returns the summary."""
    out_dir, ctx, plan = cfg.run.out_dir, run.ctx, run.plan
    summary = summarize(history)
    summary.update(
        world_size=ctx.world_size,
        layout=run.dims.degrees(),
        batch={
            "global_batch_size": plan.global_batch_size,
            "micro_batch_size": plan.micro_batch_size,
            "accum_steps": plan.accum_steps,
            "dp": plan.dp,
        },
        model_parameters=run.n_params,
        data=run.data_info,
        torch_version=torch.__version__,
        resumed_from_step=run.resumed_from,
        checkpoint_blocked_s=run.ckpt.blocked_s,
        preempted_at_step=run.preemption.stopped_at_step,
        world_size_changes=[{"step": s, "world_size": w} for s, w in run.state.world_sizes],
    )
    if cfg.run.save_model and run.preemption.stopped_at_step is None:  # a preempted run is not done
        sd = save_full_weights(run.model, os.path.join(out_dir, "model.safetensors"), is_main=ctx.is_main)
        if cfg.model.hf and ctx.is_main and not cfg.model.lora.enabled:  # the transformers format too
            export_hf(sd, model_cfg=cfg.model, out_dir=os.path.join(out_dir, "hf"))
        elif cfg.model.lora.enabled and ctx.is_main:
            save_lora_adapter(sd, cfg, out_dir)
    run.writer.finish(summary)  # trackers get the summary and close
    if ctx.is_main:
        with open(os.path.join(out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        if cfg.metrics.plot and history:
            plot_metrics(history, os.path.join(out_dir, "metrics.png"))
        if history:
            log.info(
                "done: %d steps, loss %.4f -> %.4f, %.0f tokens/s (median); outputs in %s",
                summary["steps"],
                summary["first_loss"],
                summary["final_loss"],
                summary["median_tokens_per_s"],
                out_dir,
            )
        else:  # resumed at or past run.steps: nothing to train, said rather than silent
            log.info(
                "done: 0 steps (resumed at step %d, run.steps = %d: nothing left; raise run.steps to train on);"
                " outputs in %s",
                run.state.step,
                cfg.run.steps,
                out_dir,
            )
    return summary
