"""train(): build -> parallelize -> loop -> close. The loop is explicit and short."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from paratrain.adaptive_batch import build_batch_adapter
from paratrain.batching import BatchPlan, GlobalBatchSampler, micro_batches, plan_batch, rank_slice
from paratrain.checkpoint import build_checkpointer, resume_spec, truncate_metrics
from paratrain.config import Config, ConfigError, to_dict, to_toml
from paratrain.data import build_dataset, dataset_builder
from paratrain.distributed.comm import apply_grad_compression, check_compression
from paratrain.distributed.hang import enable_flight_recorder, watch_collectives
from paratrain.distributed.parallel_dims import ParallelDims
from paratrain.distributed.parallelize import check_parallel_layout, parallelize
from paratrain.distributed.pipeline_parallel import PipelineModel, check_pp_layout_of, pipeline_train_step
from paratrain.distributed.process_group import DistContext, close_distributed, init_distributed
from paratrain.distributed.tensor_parallel import loss_parallel_enabled
from paratrain.loss import build_loss
from paratrain.metrics import MetricsWriter, plot_metrics, setup_logging, summarize
from paratrain.mfu import build_flops_per_token, mfu, resolve_peak_flops, seq_len_of
from paratrain.models import build_model, model_builder
from paratrain.optim import LRScaling, build_optimizer, build_scheduler
from paratrain.precision import build_precision, check_precision
from paratrain.profiling import build_profiler  # observe
from paratrain.rank_stats import build_rank_stats  # observe
from paratrain.step import train_step
from paratrain.trackers import build_trackers  # observe

log = logging.getLogger("paratrain")


def check_layout(cfg: Config, world_size: int, *, model: nn.Module | None = None) -> tuple[ParallelDims, BatchPlan]:
    """Every check that needs only the config and the world size: run before any process starts.

    ``model``: a model object passed to ``train`` instead of the config's builder (pipeline checks count its blocks).
    """
    model_builder(cfg.model)
    dataset_builder(cfg.data)
    dims = ParallelDims.from_config(cfg.parallel, world_size)
    check_compression(cfg.comm, dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, tp=dims.tp, pp=dims.pp)
    check_precision(cfg.precision, dp_shard=dims.dp_shard, tp=dims.tp, pp=dims.pp, compression=cfg.comm.compression)
    check_parallel_layout(dims, parallel=cfg.parallel, model=cfg.model)
    mbs = cfg.batch.micro_batch_size
    # 'auto' is resolved in the job (find_batch.py); until then the plan is the whole per-rank batch.
    plan = plan_batch(
        global_batch_size=cfg.batch.global_batch_size, micro_batch_size=0 if mbs == "auto" else mbs, dp=dims.dp
    )
    check_feature_combinations(cfg, dims)
    if dims.pp > 1:
        check_pp_layout_of(
            cfg,
            pp=dims.pp,
            micro_batch_size=plan.micro_batch_size,
            accum_steps=plan.accum_steps,
            dp_replicate=dims.dp_replicate,
            dp_shard=dims.dp_shard,
            model=model,
        )
    return dims, plan


def check_feature_combinations(cfg: Config, dims: ParallelDims) -> None:
    """Combinations of features this version cannot run exactly: refused, never run wrongly."""
    noise = (
        "batch.adaptive = true"
        if cfg.batch.adaptive
        else ("optim.lr_scaling = 'adascale'" if cfg.optim.lr_scaling == "adascale" else "")
    )
    if noise:
        # The gradient-noise probe reads each rank's gradient after its first micro-batch.
        if dims.pp > 1:
            raise ConfigError(
                f"{noise} cannot measure the gradient noise across pipeline stages; set parallel.pp = 1 or turn it off"
            )
        if dims.dp_shard > 1:
            raise ConfigError(
                f"{noise} needs each rank's own gradient, which FSDP2 (parallel.dp_shard ="
                f" {dims.dp_shard}) reduce-scatters or keeps unsharded; use parallel.dp_replicate"
            )
        if cfg.precision.dtype == "fp16":
            raise ConfigError(
                f"{noise} with precision.dtype = 'fp16' would read loss-scaled gradients; use precision.dtype = 'bf16'"
            )
    if dims.pp > 1:
        if cfg.batch.micro_batch_size == "auto":
            raise ConfigError(
                "batch.micro_batch_size = 'auto' cannot estimate a pipeline step yet;"
                " set batch.micro_batch_size to a number with parallel.pp > 1"
            )
        if cfg.checkpoint.interval or cfg.checkpoint.at_end or cfg.checkpoint.resume:
            # Stage state dicts are keyed by the local stage index, not by the model's names, so a
            # checkpoint could not be resharded to another layout or exported: refuse for now.
            raise ConfigError(
                "checkpoints are not supported with parallel.pp > 1 yet; set checkpoint.interval = 0,"
                " checkpoint.at_end = false and checkpoint.resume = ''"
            )
    block = cfg.data.args.get("block_size")
    if not cfg.model.factory and cfg.model.name == "gpt" and isinstance(block, int):
        from paratrain.models.gpt import GPTConfig

        context = cfg.model.args.get("block_size", GPTConfig.block_size)
        if block > context:
            raise ConfigError(
                f"data.args.block_size = {block} is longer than the model's context"
                f" model.args.block_size = {context}; make them equal"
            )


@dataclass
class TrainState:
    """What the loop carries from step to step (and what a checkpoint must restore)."""

    step: int = 0  # optimiser steps done
    consumed_samples: int = 0  # position in the sampler's stream
    global_batch_size: int = 0  # the current global batch (batch.adaptive grows it); 0 = not started
    grad_noise: dict = field(default_factory=dict)  # the noise-scale averages of batch.adaptive


def load_batches(dataset: Dataset, indices: list[int], micro_batch_size: int) -> list:
    return [default_collate([dataset[i] for i in mb]) for mb in micro_batches(indices, micro_batch_size)]


def train(
    cfg: Config, *, model: nn.Module | None = None, dataset: Dataset | None = None, loss: Callable | None = None
) -> dict:
    """Train per ``cfg`` in this process (one rank of the job); returns the run summary.

    ``model``/``dataset``/``loss`` replace the config's builders for users who make their own
    objects in Python; start the script with torchrun for several processes.
    """
    enable_flight_recorder()  # before the process group exists: hang reports name collectives
    ctx = init_distributed(cfg.dist)
    try:
        with watch_collectives(rank=ctx.rank, world_size=ctx.world_size, timeout_s=cfg.dist.timeout_s):
            return _train(cfg, ctx, model, dataset, loss)
    finally:
        close_distributed(ctx)


def _train(cfg: Config, ctx: DistContext, model, dataset, loss) -> dict:
    setup_logging(rank=ctx.rank, all_ranks=cfg.run.log_all_ranks)
    dims, plan = check_layout(cfg, ctx.world_size, model=model)
    dataset = dataset if dataset is not None else build_dataset(cfg.data)
    loss_fn = build_loss(cfg.loss, loss)
    # --- batch-size adjustment (find_batch.py): 'auto' resolves before any model exists, to the
    # same micro-batch on every rank; plan_batch then keeps the global batch.
    if cfg.batch.micro_batch_size == "auto":
        from paratrain.find_batch import resolve_auto_micro_batch

        plan = resolve_auto_micro_batch(cfg, dims=dims, device=ctx.device, model=model, dataset=dataset, loss=loss_fn)
    # ---
    torch.manual_seed(cfg.run.seed)  # the init is a function of the seed, the same on every rank
    model = model if model is not None else build_model(cfg.model)
    n_params = sum(p.numel() for p in model.parameters())
    data_info = getattr(dataset, "description", {"samples": len(dataset)})

    log.info("paratrain: world %d on %s | %s", ctx.world_size, ctx.device, dims.describe())
    log.info("batch: %s (per rank %d)", plan.describe(), plan.per_rank_batch_size)
    log.info("model: %.2fM parameters | data: %s", n_params / 1e6, json.dumps(data_info))

    # --- communication and hardware: precision, compile, gradient compression, MFU ---------
    precision = build_precision(cfg.precision, device=ctx.device, fsdp_enabled=dims.dp_shard > 1)
    flops_per_token = build_flops_per_token(model)  # from the whole model, before any split
    peak_flops, peak_source = resolve_peak_flops(cfg.hardware, device=ctx.device, dtype=cfg.precision.dtype)
    log.info(
        "precision: %s | MFU peak: %s",
        cfg.precision.dtype,
        f"{peak_flops:.3g} FLOP/s per device from {peak_source}" if peak_flops else f"unknown ({peak_source})",
    )
    # Tensor parallel: the built-in cross-entropy can run on vocabulary-sharded logits.
    loss_parallel = loss_parallel_enabled(
        # (not under pipeline parallel: the schedule's loss runs on plain, gathered logits)
        model,
        tp=dims.tp,
        requested=cfg.parallel.loss_parallel and dims.pp == 1,
        builtin_cross_entropy=loss is None and cfg.loss.name == "cross_entropy",
        user_plan=bool(cfg.parallel.tp_plan or cfg.parallel.tp_plan_factory),
    )
    model = parallelize(
        model,
        dims,
        cfg=cfg.parallel,
        device=ctx.device,
        comm=cfg.comm,
        precision=cfg.precision,
        compile_enabled=cfg.train.compile,
        loss_parallel=loss_parallel,
    )
    compression = apply_grad_compression(model, cfg=cfg.comm, seed=cfg.run.seed)
    # FSDP2's gradient sync policy (distributed/data_parallel.py): ZeRO-3 reduces every micro-batch.
    sync_each_micro_batch = cfg.parallel.reshard_after_forward
    # ----------------------------------------------------------------------------------------
    optimizer = build_optimizer(model, cfg.optim)
    # --- batch-size adjustment: lr scaling with the global batch, adaptive batch (adaptive_batch.py)
    state = TrainState(global_batch_size=plan.global_batch_size)
    lr_scaling = LRScaling(cfg.optim, global_batch_size=plan.global_batch_size, log=log.info)
    dp_rank, dp_group = dims.local_rank_in("dp"), dims.group("dp")
    adapter = build_batch_adapter(cfg.batch, lr_scaling=cfg.optim.lr_scaling, plan=plan, dp_group=dp_group)
    # ---
    scheduler = build_scheduler(optimizer, cfg.optim, total_steps=cfg.run.steps, scale=lr_scaling)
    sampler = GlobalBatchSampler(len(dataset), seed=cfg.run.seed, shuffle=cfg.data.shuffle)

    # --- checkpoints (paratrain.checkpoint): resume before the loop, save after steps --------
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
        stateful={"grad_scaler": precision.scaler},
    )
    resumed_from = ckpt.resume(*resume_spec(cfg.checkpoint))
    if resumed_from is not None and ctx.is_main:
        truncate_metrics(cfg.run.out_dir, resumed_from)  # rows after the checkpoint are redone
    # ------------------------------------------------------------------------------------------

    out_dir = cfg.run.out_dir
    if ctx.is_main:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "config.toml"), "w") as f:
            f.write(to_toml(cfg))
    writer = MetricsWriter(
        out_dir,
        enabled=ctx.is_main,
        total_steps=cfg.run.steps,
        progress=cfg.run.progress,
        trackers=build_trackers(cfg.metrics, out_dir=out_dir, config=to_dict(cfg)) if ctx.is_main else (),  # observe
        start_step=state.step,
    )
    rank_stats = build_rank_stats(  # observe
        cfg.metrics, rank=ctx.rank, world_size=ctx.world_size, device=ctx.device, model=model
    )
    profiler = build_profiler(cfg.profile, rank=ctx.rank, out_dir=out_dir, device=ctx.device)  # observe
    history: list[dict] = []
    # A restored TrainState (resume) carries the batch the adaptive mode had reached.
    if not cfg.batch.adaptive:  # the configured global batch holds, whatever a checkpoint had
        state.global_batch_size = plan.global_batch_size
    elif state.global_batch_size != plan.global_batch_size:
        plan = plan_batch(global_batch_size=state.global_batch_size, micro_batch_size=plan.micro_batch_size, dp=dims.dp)
        lr_scaling.update(global_batch_size=plan.global_batch_size)
    if adapter and state.grad_noise:
        adapter.load_state_dict(state.grad_noise)
    try:
        model.train()
        while state.step < cfg.run.steps and not (0 < cfg.run.max_samples <= state.consumed_samples):
            t0 = time.perf_counter()
            profiler.begin(state.step + 1)  # observe
            step_plan = plan  # the plan this step runs with (the adapter may change `plan` after it)
            indices = sampler.global_indices(state.consumed_samples, plan.global_batch_size)
            mine = rank_slice(indices, dp_rank=dp_rank, dp=dims.dp)
            mbs = adapter.micro_batch_size(plan) if adapter else plan.micro_batch_size
            batches = load_batches(dataset, mine, mbs)
            data_time = time.perf_counter() - t0  # observe
            lr = scheduler.get_last_lr()[0]
            if isinstance(model, PipelineModel):  # pipeline parallel: the schedule runs forward/backward
                result = pipeline_train_step(
                    model,
                    optimizer,
                    batches,
                    loss_fn=loss_fn,
                    dp=dims.dp,
                    dp_group=dp_group,
                    grad_clip=cfg.optim.grad_clip,
                    device=ctx.device,
                    precision=precision,
                )
            else:
                result = train_step(
                    model,
                    optimizer,
                    batches,
                    loss_fn=loss_fn,
                    dp=dims.dp,
                    dp_group=dp_group,
                    grad_clip=cfg.optim.grad_clip,
                    device=ctx.device,
                    precision=precision,
                    loss_parallel=loss_parallel,
                    sync_each_micro_batch=sync_each_micro_batch,
                    after_backward=adapter.probe(model, batches[0], loss_fn) if adapter else None,
                )
            state.step += 1
            state.consumed_samples += plan.global_batch_size
            noise_extra = {}
            if adapter:  # --- adaptive batch: next step's plan and lr scale, before the scheduler reads it
                plan = adapter.after_step(result=result, plan=plan, step=state.step)
                state.global_batch_size, state.grad_noise = plan.global_batch_size, adapter.state_dict()
                lr_scaling.update(global_batch_size=plan.global_batch_size, noise_scale=adapter.noise_samples)
                noise_extra = {"grad_noise_scale": adapter.noise_samples, "lr_scale": lr_scaling.factor}
            scheduler.step()
            dt = time.perf_counter() - t0
            row = {
                "step": state.step,
                "loss": result.loss,
                "lr": lr,
                "grad_norm": result.grad_norm,
                "global_batch_size": step_plan.global_batch_size,
                "micro_batch_size": mbs,
                "accum_steps": len(batches),
                "items": result.items,
                "tokens": result.tokens,
                "consumed_samples": state.consumed_samples,
                "epoch": sampler.epoch_of(state.consumed_samples - 1),
                "step_time_s": dt,
                "tokens_per_s": result.tokens / dt,
                "samples_per_s": step_plan.global_batch_size / dt,
                **noise_extra,
            }
            # --- communication and hardware: bytes sent, MFU, fp16 loss scale ----------------
            step_flops = flops_per_token(seq_len_of(batches[0][0])) * result.tokens
            row["model_flops_per_s"] = step_flops / dt
            if peak_flops:
                row["mfu"] = mfu(flops=step_flops, seconds=dt, peak_flops_per_device=peak_flops, devices=ctx.world_size)
            comm_bytes = compression.take_bytes()
            if comm_bytes is not None:
                row["comm_bytes"] = comm_bytes
            row.update(precision.metrics())
            # ------------------------------------------------------------------------------------
            blocked = ckpt.after_step(state.step)
            if blocked is not None:
                row["checkpoint_blocked_s"] = blocked
            profiler.end(state.step)  # observe (reads the CUDA peak before rank_stats resets it)
            row.update(rank_stats.row(step=state.step, step_time_s=dt, data_time_s=data_time))  # observe
            history.append(row)
            writer.log_step(row)
        ckpt.at_end(state.step)
    except BaseException as e:  # observe
        profiler.on_error(e, state.step + 1)  # observe
        writer.finish(None)  # observe: trackers mark the run failed
        raise
    finally:
        writer.close()
        ckpt.close()
        profiler.close()  # observe
        rank_stats.close()  # observe

    summary = summarize(history)
    summary.update(
        world_size=ctx.world_size,
        layout=dims.degrees(),
        batch={
            "global_batch_size": plan.global_batch_size,
            "micro_batch_size": plan.micro_batch_size,
            "accum_steps": plan.accum_steps,
            "dp": plan.dp,
        },
        model_parameters=n_params,
        data=data_info,
        torch_version=torch.__version__,
        resumed_from_step=resumed_from,
        checkpoint_blocked_s=ckpt.blocked_s,
    )
    if cfg.run.save_model:
        save_full_weights(model, os.path.join(out_dir, "model.safetensors"), is_main=ctx.is_main)
    writer.finish(summary)  # observe
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
    return summary


def save_full_weights(model: nn.Module, path: str, *, is_main: bool) -> None:
    """Gather the full (unsharded, unwrapped) weights and write them from rank 0."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # Every rank takes part: with sharded layouts this is a collective.
    if isinstance(model, PipelineModel):  # every stage's weights, gathered onto pp rank 0
        sd = model.full_state_dict()
    else:
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if is_main:
        save_file({k: v.contiguous() for k, v in sd.items()}, path)
