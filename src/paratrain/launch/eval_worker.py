"""`paratrain eval CONFIG --checkpoint PATH`: a checkpoint's validation loss at any world size.

The process torchrun starts (``python -m paratrain.launch.eval_worker CONFIG --checkpoint PATH --result
FILE``): it builds the model and the layout exactly as training does (build.py build_parallel),
loads the checkpoint's model weights with the checkpointer (DCP reshards them to this layout:
any world size and layout, pipeline stages included: a pipeline checkpoint holds the model's own
names), and evaluates the validation set of the config's [data] and [eval] sections
(evaluate.py). Rank 0 writes the result as JSON to FILE for the launcher to print.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from paratrain.build import build_parallel_with_weights
from paratrain.checkpoint import Checkpointer, DataclassState, ModelState
from paratrain.config import Config, ConfigError, load_config, to_toml
from paratrain.data.datasets import build_val_dataset
from paratrain.distributed.process_group import close_distributed, init_distributed, run_then_exit
from paratrain.evaluate import Evaluator
from paratrain.launch.worker import stop_with_launcher
from paratrain.models import build
from paratrain.models.lora import is_adapter_param
from paratrain.objectives.registry import build_loss, builtin_of
from paratrain.observability.metrics import setup_logging
from paratrain.precision import build_precision
from paratrain.preflight import check_eval, check_run
from paratrain.trainer import TrainState, val_pad_target


def check_eval_args(cfg: Config, checkpoint: str) -> None:
    """Refuse what cannot be evaluated before any process starts (the checkpointer checks the rest)."""
    plugin = builtin_of(cfg.loss)
    if plugin is not None and plugin.rows == "prompts":
        # Its data set is prompts, without a split: left to the worker, the model was built and the
        # checkpoint loaded before "data.name has no `split` argument", which names no fix.
        raise ConfigError(
            f"paratrain eval: loss.name = {cfg.loss.name!r} has no validation loss yet (its rewards are logged every"
            " step in the run's metrics.jsonl: docs/grpo.md)"
        )
    if checkpoint and checkpoint != "latest" and not os.path.isdir(checkpoint):
        raise ConfigError(f"--checkpoint {checkpoint}: no such checkpoint folder; pass a step-N folder or 'latest'")


def eval_checkpoint(cfg: Config, checkpoint: str) -> dict:
    """One rank of `paratrain eval`: the validation loss of ``checkpoint`` (every rank returns it);
    ``checkpoint`` "" evaluates the model as configured (its ``model.hf`` weights, or its init)."""
    ctx = init_distributed(cfg.dist)
    ended = False
    try:
        setup_logging(rank=ctx.rank, all_ranks=cfg.run.log_all_ranks)
        dims, plan = check_run(cfg, ctx.world_size)
        eval_plan = check_eval(cfg, dims, plan)
        torch.manual_seed(cfg.run.seed)
        model, spec = build(cfg.model)
        precision = build_precision(cfg.precision, device=ctx.device, fsdp_enabled=dims.fsdp_enabled)
        loss_fn = build_loss(cfg.loss, None)
        model, step_ctx, _ = build_parallel_with_weights(
            cfg, dims, model, spec=spec, device=ctx.device, loss_fn=loss_fn, precision=precision
        )
        step = 0 if not checkpoint else resume_model(cfg, checkpoint, model=model, dims=dims, ctx=ctx)
        val_set = build_val_dataset(
            cfg.data,
            cfg.eval.samples,
            multiple_of=eval_plan.global_batch_size,
            pad_target=val_pad_target(cfg, loss_fn.plugin),
        )
        evaluator = Evaluator(val_set, eval_plan, dp_rank=dims.local_rank_in("dp"))
        val_loss = evaluator(model, step_ctx)
        result = {
            "checkpoint": checkpoint or None,
            "step": step,
            "val_loss": val_loss,
            **{f"val_{k}": v for k, v in evaluator.last_metrics.items()},  # info_nce: recall@1, MRR
            "val_items": evaluator.last_items,
            "samples": evaluator.samples,
            "world_size": ctx.world_size,
            "layout": dims.degrees(),
            "eval_time_s": evaluator.last_time_s,
        }
        ended = True
        return result
    finally:
        # The model (DDP) goes before the process group: its Reducer must not hold the group's
        # last reference (a deadlock in torch's destructors, see close_distributed).
        model = step_ctx = None
        close_distributed(ctx, barrier=ended)


def resume_model(cfg: Config, checkpoint: str, *, model, dims, ctx) -> int:
    """Load the model of ``checkpoint`` into ``model`` (any layout: DCP reshards); its step."""
    state = TrainState()
    # The model and the step only: the checkpointer verifies the files and reshards (DCP).
    ckpt = Checkpointer(
        cfg.checkpoint,
        out_dir=cfg.run.out_dir,
        config_toml=to_toml(cfg),
        # A LoRA run's checkpoints hold its adapters only; the base is the one built and loaded above.
        stateful={
            "model": ModelState(model, keep=is_adapter_param if cfg.model.lora.enabled else None),
            "train_state": DataclassState(state),
        },
        train_state=state,
        layout=dims.degrees(),
        rank=ctx.rank,
        world_size=ctx.world_size,
        device=ctx.device,
        timeout_s=cfg.dist.timeout_s,
        # Not "resume ... or start a new run.out_dir": eval resumes nothing and writes no run.
        mismatch_fix=(
            "evaluate it with the config that wrote it (its config.toml is in the checkpoint folder),"
            " or pass --checkpoint a checkpoint of this config's model"
        ),
    )
    # Evaluating reads a checkpoint and continues no trajectory: newer checkpoints are not at risk,
    # and a config that differs from the run's (run.steps, the data to evaluate) breaks none.
    ckpt._warn_newer = lambda path: None
    ckpt._warn_config_changes = lambda path: None
    try:
        step = ckpt.resume(checkpoint)
    finally:
        ckpt.close()
    if step is None:
        raise ConfigError(f"--checkpoint latest: no complete checkpoint in {ckpt.root}; pass a step-N folder")
    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paratrain.launch.eval_worker", description=__doc__)
    parser.add_argument("config", help="TOML config file")
    parser.add_argument("--checkpoint", default="")
    parser.add_argument("--result", default="", help="rank 0 writes the result here (JSON)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = parser.parse_args(argv)
    try:
        result = eval_checkpoint(load_config(args.config, args.overrides), args.checkpoint)
    except ConfigError as e:
        print(f"paratrain: error: {e}", file=sys.stderr)
        return 2
    if args.result and int(os.environ.get("RANK", "0")) == 0:
        with open(args.result, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by paratrain's launcher or torchrun
        stop_with_launcher()
    run_then_exit(main)
