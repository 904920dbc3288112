"""Checkpoint cost: paratrain's DCP save/load at world size 2 (sync and async) next to torch.save.

    python benchmarks/resilience/checkpoint.py [--config configs/main.toml] [--repeats 3] [--world 2]

Builds the GPT of the config (configs/main.toml: 4 layers, d_model 128), wraps it in DDP on
``--world`` gloo processes on this machine, takes one AdamW step so the optimiser state exists,
then times, each the median of ``--repeats``:

- sync save: ``Checkpointer.save`` (DCP shards + .metadata + config + sha256 manifest); training
  is blocked for all of it;
- async save: the part that blocks training (copying the state to CPU memory) and the time until
  the checkpoint is complete (manifest written) in the background, timed with no training step
  in between (a step there would add its own time to "until complete");
- load: ``Checkpointer.load`` (checksums, safe metadata, DCP read, set_state_dict);
- a training step with no save, and the step right after another async save started (it
  competes with the background writer for the CPU);
- the baseline: ``torch.save`` of the same full state dict (model + optimiser) from one process,
  and ``torch.load(weights_only=True)`` of it.

Figures on a shared 2-core CPU machine are noisy; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int, args, out_dir: str, q) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    import dataclasses

    from paratrain.checkpoint import Checkpointer, DataclassState, ModelState, OptimizerState
    from paratrain.config import CheckpointConfig, load_config, to_toml
    from paratrain.models import build_model
    from paratrain.optim import build_optimizer, build_scheduler
    from paratrain.trainer import TrainState

    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = load_config(args.config)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    n_params = sum(p.numel() for p in model.parameters())
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, total_steps=100)
    block = model.module.cfg.block_size if world > 1 else model.cfg.block_size
    x = torch.randint(0, 256, (args.batch, block), generator=torch.Generator().manual_seed(rank))

    def step() -> float:
        t0 = time.perf_counter()
        logits = model(x)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        return time.perf_counter() - t0

    step()
    state = TrainState(step=1, consumed_samples=args.batch * world)

    def checkpointer(async_save: bool) -> Checkpointer:
        ccfg = CheckpointConfig(dir=out_dir, keep=0, async_save=async_save, interval=1)
        return Checkpointer(
            ccfg,
            out_dir=out_dir,
            config_toml=to_toml(cfg),
            stateful={
                "model": ModelState(model),
                "optim": OptimizerState(model, optimizer),
                "scheduler": scheduler,
                "train_state": DataclassState(state),
            },
            train_state=state,
            layout={"dp_replicate": world},
            rank=rank,
            world_size=world,
            device=torch.device("cpu"),
            timeout_s=600,
        )

    res: dict[str, list[float]] = {
        k: []
        for k in (
            "step",
            "sync_save",
            "async_blocked",
            "async_total",
            "step_during_async",
            "load",
            "torch_save",
            "torch_load",
        )
    }
    sync, asyn = checkpointer(False), checkpointer(True)
    for i in range(args.repeats):
        res["step"].append(step())
        dist.barrier()
        t0 = time.perf_counter()
        sync.save(10 + i)
        res["sync_save"].append(time.perf_counter() - t0)
        dist.barrier()
        # Until complete: the async save alone (no training step in the interval, which would
        # add the step's own time to the figure).
        t0 = time.perf_counter()
        res["async_blocked"].append(asyn.save(100 + i))
        asyn.wait()
        dist.barrier()
        res["async_total"].append(time.perf_counter() - t0)
        # A training step while another async save runs in the background (it competes for CPU).
        asyn.save(200 + i)
        res["step_during_async"].append(step())
        asyn.wait()
        dist.barrier()
        t0 = time.perf_counter()
        sync.load(os.path.join(out_dir, f"step-{10 + i}"))
        res["load"].append(time.perf_counter() - t0)
        dist.barrier()
        if rank == 0:  # the baseline: one process writes the whole state dict with torch.save
            from torch.distributed.checkpoint.state_dict import get_state_dict

            msd, osd = get_state_dict(model, optimizer)
            path = os.path.join(out_dir, f"torch-{i}.pt")
            t0 = time.perf_counter()
            torch.save(
                {
                    "model": msd,
                    "optim": osd,
                    "scheduler": scheduler.state_dict(),
                    "train_state": dataclasses.asdict(state),
                },
                path,
            )
            res["torch_save"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            torch.load(path, weights_only=True)
            res["torch_load"].append(time.perf_counter() - t0)
        dist.barrier()
    sync.close()
    asyn.close()
    if rank == 0:
        ckpt = os.path.join(out_dir, f"step-{10}")
        size = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt))
        q.put(
            {
                "res": res,
                "params": n_params,
                "bytes": size,
                "torch_bytes": os.path.getsize(os.path.join(out_dir, "torch-0.pt")),
            }
        )
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/main.toml")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=8, help="samples per rank in the timed training step")
    args = p.parse_args()
    from paratrain.distributed.process_group import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, args.world, port, args, out_dir, q)) for r in range(args.world)]
        for proc in procs:
            proc.start()
        got = q.get(timeout=1800)
        for proc in procs:
            proc.join()
    res = {k: statistics.median(v) for k, v in got["res"].items()}
    base = res["torch_save"]
    print(
        f"GPT of {args.config}: {got['params'] / 1e6:.2f}M parameters; checkpoint {got['bytes'] / 2**20:.1f} MiB"
        f" (torch.save file {got['torch_bytes'] / 2**20:.1f} MiB); world {args.world}; median of {args.repeats}"
    )
    rows = [
        ("torch.save, 1 process (baseline)", base),
        (f"sync save, world {args.world} (training blocked)", res["sync_save"]),
        (f"async save, world {args.world}: training blocked", res["async_blocked"]),
        (f"async save, world {args.world}: until complete", res["async_total"]),
        ("torch.load(weights_only=True), 1 process", res["torch_load"]),
        (f"load (verify + safe DCP read), world {args.world}", res["load"]),
        ("training step, no save", res["step"]),
        ("training step right after an async save", res["step_during_async"]),
    ]
    print(f"| {'operation':<48} | {'seconds':>8} | {'x torch.save':>12} |")
    print(f"|{'-' * 50}|{'-' * 9}:|{'-' * 13}:|")
    for name, t in rows:
        print(f"| {name:<48} | {t:8.4f} | {t / base:12.2f} |")


if __name__ == "__main__":
    main()
