"""What each thing paratrain adds to a data-parallel step costs, measured on a plain DDP loop.

Variants, each a fresh 2-process gloo job on this machine (the flight recorder can only be
switched on before the process group exists), the same tiny GPT (configs/debug.toml), data and
steps:

- ``plain``: a hand-written DDP loop (DDP's built-in bucket all-reduce);
- ``python_hook``: the same with the Python all-reduce comm hook paratrain used to register
  for ``comm.compression = "none"`` (torch's ``allreduce_hook`` through a byte-counting group);
- ``flight_recorder``: ``TORCH_FR_BUFFER_SIZE=256`` (every collective recorded, hang.py);
- ``heartbeat``: paratrain's heartbeat thread (hang.py), at its real interval, plus the flight
  recorder it reads; the time of one beat is also printed (its cost per step is that time
  divided by the interval);
- ``count_allreduce``: one more tiny all-reduce and host read per step, the global item count
  the exact loss normalisation needs before the first backward (step.py).

Each round runs every variant once, the order rotating between rounds; each variant's median
step time (first steps left out) is paired with ``plain`` of the same round, and the script
prints every paired ratio and the median ratio with a 95% CI (src/paratrain/testing/paired.py).

``--interleaved``: the Python hook alone, measured more tightly: one job holds two DDP copies
of the model, one with the hook and one without, and alternates their steps, so each pair of
steps shares the machine's state of that moment.

    python benchmarks/overhead/hot_path.py [--rounds 5] [--steps 40]
    python benchmarks/overhead/hot_path.py --interleaved [--steps 200]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

from paratrain.testing.paired import summary_line

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
VARIANTS = ["plain", "python_hook", "flight_recorder", "heartbeat", "count_allreduce"]
WARMUP = 5


def worker(rank: int, variant: str, port: int, steps: int, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    if variant in ("flight_recorder", "heartbeat"):
        os.environ["TORCH_FR_BUFFER_SIZE"] = "256"
    else:
        os.environ.pop("TORCH_FR_BUFFER_SIZE", None)
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from paratrain.config import load_config
    from paratrain.data.datasets import build_dataset
    from paratrain.distributed.grad_compression import CountingGroup
    from paratrain.distributed.hang import HangWatch
    from paratrain.models import build_model

    torch.set_num_threads(1)
    cfg = load_config(os.path.join(REPO, "configs", "debug.toml"), [])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(build_model(cfg.model), bucket_cap_mb=cfg.comm.bucket_mb, gradient_as_bucket_view=True)
    if variant == "python_hook":
        model.register_comm_hook(CountingGroup(model.process_group), default_hooks.allreduce_hook)
    watch, beat_s = None, None
    if variant == "heartbeat":
        store = dist.distributed_c10d._get_default_store()
        watch = HangWatch(store, rank=rank, world_size=2, timeout_s=cfg.dist.timeout_s).start()
        t0 = time.perf_counter()
        watch.beat()
        beat_s = (time.perf_counter() - t0, watch.interval_s)
    data = build_dataset(cfg.data)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    per_rank, mbs = cfg.batch.global_batch_size // 2, cfg.batch.micro_batch_size
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        idx = torch.randint(0, len(data), (cfg.batch.global_batch_size,), generator=g).tolist()
        mine = idx[rank * per_rank : (rank + 1) * per_rank]
        batches = [mine[k : k + mbs] for k in range(0, per_rank, mbs)]
        if variant == "count_allreduce":
            count = torch.tensor([float(sum((data[i][1] != -100).sum() for i in mine))], dtype=torch.float64)
            dist.all_reduce(count)
            count.item()
        for k, b in enumerate(batches):
            x, y = (torch.stack(t) for t in zip(*(data[i] for i in b)))
            with model.no_sync() if k < len(batches) - 1 else torch.enable_grad():
                logits = model(x)
                (F.cross_entropy(logits.flatten(0, 1), y.flatten()) / len(batches)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    if watch is not None:
        watch.stop()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        q.put((statistics.median(times[WARMUP:]), beat_s))


def interleaved_worker(rank: int, variant: str, port: int, steps: int, q) -> None:
    """Two DDP copies, with and without the Python all-reduce hook, stepping alternately."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from paratrain.config import load_config
    from paratrain.distributed.grad_compression import CountingGroup
    from paratrain.models import build_model

    torch.set_num_threads(1)
    cfg = load_config(os.path.join(REPO, "configs", "debug.toml"), [])
    dist.init_process_group("gloo")
    models = {}
    for name in ("plain", "python_hook"):
        torch.manual_seed(0)
        models[name] = DDP(build_model(cfg.model), bucket_cap_mb=cfg.comm.bucket_mb, gradient_as_bucket_view=True)
    models["python_hook"].register_comm_hook(
        CountingGroup(models["python_hook"].process_group), default_hooks.allreduce_hook
    )
    opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-3) for n, m in models.items()}
    x = torch.randint(0, 256, (cfg.batch.micro_batch_size, cfg.model.args["block_size"]))
    times = {n: [] for n in models}
    for i in range(steps):
        order = ("plain", "python_hook") if i % 2 == 0 else ("python_hook", "plain")
        for n in order:
            dist.barrier()
            t0 = time.perf_counter()
            F.cross_entropy(models[n](x).flatten(0, 1), x.flatten()).backward()
            opts[n].step()
            opts[n].zero_grad(set_to_none=True)
            times[n].append(time.perf_counter() - t0)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        q.put((times["python_hook"][WARMUP:], times["plain"][WARMUP:]))


def run_job(variant: str, steps: int, target=worker):
    from paratrain.distributed.process_group import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, variant, port, steps, q)) for r in range(2)]
    for p in procs:
        p.start()
    result = q.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--interleaved", action="store_true", help="the Python hook only, steps alternating in one job")
    args = p.parse_args()
    if args.interleaved:
        hook, plain = run_job("interleaved", args.steps, target=interleaved_worker)
        ratios = [a / b for a, b in zip(hook, plain)]
        print(
            f"step (forward, backward, all-reduce, AdamW), median: plain DDP {statistics.median(plain) * 1e3:.2f} ms,"
            f" with the Python hook {statistics.median(hook) * 1e3:.2f} ms"
        )
        print(summary_line(f"python_hook/plain, {len(ratios)} interleaved step pairs", ratios))
        return
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    beats = []
    for r in range(args.rounds):
        order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
        for v in order:
            t, beat = run_job(v, args.steps)
            times[v].append(t)
            if beat:
                beats.append(beat)
        print(
            f"round {r + 1}/{args.rounds}: " + ", ".join(f"{v} {times[v][-1] * 1e3:.2f} ms" for v in VARIANTS),
            flush=True,
        )
    print(f"\nmedian step time, plain DDP: {statistics.median(times['plain']) * 1e3:.2f} ms ({args.steps} steps/job)")
    for v in VARIANTS[1:]:
        ratios = [a / b for a, b in zip(times[v], times["plain"])]
        print(f"{v:>16}: paired ratios " + " ".join(f"{x:.3f}" for x in ratios))
        print(" " * 18 + summary_line(f"{v}/plain", ratios))
    if beats:
        beat, interval = statistics.median(b[0] for b in beats), beats[0][1]
        print(f"one heartbeat: {beat * 1e3:.2f} ms every {interval:.0f} s = {beat / interval * 1e6:.1f} us per second")


if __name__ == "__main__":
    main()
