"""`paratrain eval CONFIG --checkpoint PATH`: a checkpoint's validation loss at any world size.

The process torchrun starts (``python -m paratrain.eval_run CONFIG --checkpoint PATH --result
FILE``): it builds the model and the layout exactly as training does (trainer.build_parallel),
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

from paratrain.checkpoint import Checkpointer, DataclassState, ModelState
from paratrain.config import Config, ConfigError, load_config, to_toml
from paratrain.data import build_val_dataset
from paratrain.distributed.process_group import close_distributed, init_distributed, run_then_exit
from paratrain.evaluate import Evaluator
from paratrain.layout import check_eval, check_layout
from paratrain.loss import build_loss
from paratrain.metrics import setup_logging
from paratrain.models import build
from paratrain.precision import build_precision
from paratrain.trainer import TrainState, build_parallel_with_weights


def check_eval_args(checkpoint: str) -> None:
    """Refuse what cannot be evaluated before any process starts (the checkpointer checks the rest)."""
    if checkpoint != "latest" and not os.path.isdir(checkpoint):
        raise ConfigError(f"--checkpoint {checkpoint}: no such checkpoint folder; pass a step-N folder or 'latest'")


def eval_checkpoint(cfg: Config, checkpoint: str) -> dict:
    """One rank of `paratrain eval`: the validation loss of ``checkpoint`` (every rank returns it)."""
    ctx = init_distributed(cfg.dist)
    ended = False
    try:
        setup_logging(rank=ctx.rank, all_ranks=cfg.run.log_all_ranks)
        dims, plan = check_layout(cfg, ctx.world_size)
        eval_plan = check_eval(cfg, dims, plan)
        torch.manual_seed(cfg.run.seed)
        model, spec = build(cfg.model)
        precision = build_precision(cfg.precision, device=ctx.device, fsdp_enabled=dims.dp_shard > 1)
        model, step_ctx, _ = build_parallel_with_weights(
            cfg,
            dims,
            model,
            spec=spec,
            device=ctx.device,
            loss_fn=build_loss(cfg.loss, None),
            precision=precision,
            user_loss=False,
        )
        state = TrainState()
        # The model and the step only: the checkpointer verifies the files and reshards (DCP).
        ckpt = Checkpointer(
            cfg.checkpoint,
            out_dir=cfg.run.out_dir,
            config_toml=to_toml(cfg),
            stateful={"model": ModelState(model), "train_state": DataclassState(state)},
            train_state=state,
            layout=dims.degrees(),
            rank=ctx.rank,
            world_size=ctx.world_size,
            device=ctx.device,
            timeout_s=cfg.dist.timeout_s,
        )
        try:
            step = ckpt.resume(checkpoint)
        finally:
            ckpt.close()
        if step is None:
            raise ConfigError(f"--checkpoint latest: no complete checkpoint in {ckpt.root}; pass a step-N folder")
        val_set = build_val_dataset(cfg.data, cfg.eval.samples, multiple_of=eval_plan.global_batch_size)
        evaluator = Evaluator(val_set, eval_plan, dp_rank=dims.local_rank_in("dp"))
        val_loss = evaluator(model, step_ctx)
        result = {
            "checkpoint": checkpoint,
            "step": step,
            "val_loss": val_loss,
            "samples": len(val_set),
            "world_size": ctx.world_size,
            "layout": dims.degrees(),
            "eval_time_s": evaluator.last_time_s,
        }
        ended = True
        return result
    finally:
        # The model (DDP) goes before the process group: its Reducer must not hold the group's
        # last reference (a deadlock in torch's destructors, see close_distributed).
        model = step_ctx = ckpt = None
        close_distributed(ctx, barrier=ended)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paratrain.eval_run", description=__doc__)
    parser.add_argument("config", help="TOML config file")
    parser.add_argument("--checkpoint", required=True)
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
    run_then_exit(main)
