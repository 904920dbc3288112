"""Overhead of observability on the main job's step time: rank stats and trackers, world size 2.

Variants, run alternately in rounds (one run of each per round, the order rotated):
  base      paratrain before issue 13 (the checkout given by --base-src, default /work/main/src
            when it is that commit; pass any src/ without rank_stats.py)
  defaults  this tree with default settings (memory every step, rank stats every 50 steps)
  every1    rank stats gathered every step (the gather's cost, 50x the default rate)
  trackers  defaults + W&B offline + MLflow file store + TensorBoard
Prints, per variant, the median over rounds of each run's median step time (first steps left
out as warm-up) and the paired ratio to base within each round (median, min..max), and writes
benchmarks/overhead/observe_overhead.png.

On a shared machine the run-to-run noise of whole jobs (10-20 %) hides a 1 % effect, so
`--micro` times the added work itself, in process, many repetitions: the per-row memory read
and forward hooks, the rank-stats all-gather on 2 gloo ranks, and each tracker's `log(row)`;
it prints the median cost per step and that cost as a share of a given step time
(`--step-ms`, e.g. the base median printed by the end-to-end mode).

    python benchmarks/overhead/observe_overhead.py [--rounds 3] [--steps 60] [--base-src /path/to/old/src]
    python benchmarks/overhead/observe_overhead.py --micro [--step-ms 630]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
WARMUP = 5


def run_variant(src: str, out: str, overrides: list[str], *, config: str, nproc: int, env_extra: dict) -> float:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([src, REPO]),
        "WANDB_SILENT": "true",
        **env_extra,
    }
    sets = [f"run.out_dir='{out}'", "run.progress=false", "metrics.plot=false", "run.save_model=false", *overrides]
    cmd = [sys.executable, "-m", "paratrain", "train", config, "--nproc-per-node", str(nproc)]
    cmd += [a for o in sets for a in ("--set", o)]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    if res.returncode:
        sys.exit(f"benchmark run failed: {' '.join(cmd)}\n{res.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return statistics.median([json.loads(line)["step_time_s"] for line in f][WARMUP:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--config", default="configs/main.toml")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--base-src", default="/work/main/src", help="src/ of paratrain without issue 13")
    p.add_argument("--png", default=os.path.join(HERE, "observe_overhead.png"))
    p.add_argument("--only", default="", help="comma-separated subset of the variants (base is always run)")
    p.add_argument("--micro", action="store_true", help="time the added work in process (see above)")
    p.add_argument("--step-ms", type=float, default=0.0, help="--micro: the main job's step time to compare with")
    args = p.parse_args()
    if args.micro:
        micro(args.step_ms)
        return
    if os.path.exists(os.path.join(args.base_src, "paratrain", "rank_stats.py")):
        sys.exit(f"--base-src {args.base_src} already has rank_stats.py; pass a checkout from before issue 13")
    src = os.path.join(REPO, "src")
    steps = [f"run.steps={args.steps}"]
    with tempfile.TemporaryDirectory() as tmp:
        variants = {
            "base": (args.base_src, steps, {}),
            "defaults": (src, steps, {}),
            "every1": (src, [*steps, "metrics.rank_stats_every=1"], {}),
            "trackers": (
                src,
                [
                    *steps,
                    "metrics.wandb=true",
                    "metrics.wandb_mode='offline'",
                    f"metrics.mlflow='file:{tmp}/mlruns'",
                    "metrics.tensorboard=true",
                ],
                {"WANDB_DIR": tmp},
            ),
        }
        names = ["base", *[n for n in variants if n != "base" and (not args.only or n in args.only.split(","))]]
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]  # rotate: no variant always first
            for n in order:
                s, o, e = variants[n]
                t = run_variant(s, os.path.join(tmp, f"{n}{r}"), o, config=args.config, nproc=args.nproc, env_extra=e)
                times[n].append(t)
                print(f"round {r + 1}/{args.rounds} {n:9s} median step {t * 1e3:.2f} ms", flush=True)
    print(f"\n{args.nproc} ranks, {args.steps} steps/run, {args.rounds} rounds; per-run median step time")
    for n in names:
        ratios = [t / b for t, b in zip(times[n], times["base"])]
        print(
            f"{n:9s} median {statistics.median(times[n]) * 1e3:8.2f} ms   vs base (paired per round):"
            f" median {100 * (statistics.median(ratios) - 1):+.2f}%  range {100 * (min(ratios) - 1):+.2f}%"
            f" .. {100 * (max(ratios) - 1):+.2f}%"
        )
    plot(times, args.png)
    print(f"plot: {args.png}")


ROW = {  # a metrics row as the main job writes it (2 ranks, a gathered step)
    "step": 1,
    **{k: 1.0 for k in ("loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "samples_per_s")},
    **{k: 1.0 for k in ("model_flops_per_s", "mfu", "comm_bytes", "memory_gib", "straggle_ratio")},
    **{k: 8 for k in ("global_batch_size", "micro_batch_size", "accum_steps", "items", "tokens")},
    **{k: [1.0, 1.0] for k in ("rank_step_time_s", "rank_data_time_s", "rank_local_time_s", "rank_memory_gib")},
}


def _timed(fn, n: int) -> float:
    """Median seconds of one call over n calls."""
    import time

    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _rank_stats_worker(rank: int, port: int, n: int, q) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from paratrain.config import MetricsConfig
    from paratrain.observability.rank_stats import RankStats

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    cpu = torch.device("cpu")
    model, x = nn.Linear(4, 4), torch.randn(2, 4)
    never = RankStats(MetricsConfig(rank_stats_every=10**9), rank=rank, world_size=2, device=cpu, model=nn.Linear(1, 1))
    every = RankStats(MetricsConfig(rank_stats_every=1), rank=rank, world_size=2, device=cpu, model=nn.Linear(1, 1))
    row_local = _timed(lambda: never.row(step=1, step_time_s=0.1, data_time_s=0.01), n)
    row_gather = _timed(lambda: every.row(step=1, step_time_s=0.1, data_time_s=0.01), n)
    fwd_plain = _timed(lambda: model(x), n)
    hooked = RankStats(MetricsConfig(), rank=rank, world_size=2, device=cpu, model=model)
    fwd_hooked = _timed(lambda: model(x), n)
    hooked.close()
    dist.destroy_process_group()
    q.put((rank, row_local, row_gather, fwd_hooked - fwd_plain))


def micro(step_ms: float, n: int = 2000) -> None:
    import multiprocessing as mp

    from paratrain.distributed.process_group import free_port

    ctx = mp.get_context("spawn")
    q, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank_stats_worker, args=(r, port, n, q)) for r in range(2)]
    for p_ in procs:
        p_.start()
    res = dict((r, rest) for r, *rest in (q.get(timeout=300) for _ in procs))
    for p_ in procs:
        p_.join()
    row_local, row_gather, hook = res[0]
    per_step = {
        "memory read + forward-timer take (every step)": row_local,
        "forward hooks (per forward)": max(hook, 0.0),
        "rank-stats all-gather, 2 gloo ranks (per gathered step)": row_gather - row_local,
    }
    default_cost = row_local + max(hook, 0.0) + (row_gather - row_local) / 50
    print(f"median over {n} calls, rank 0:")
    for k, v in per_step.items():
        print(f"  {k:58s} {v * 1e6:9.1f} us")
    print(f"  {'defaults, per step (gather amortised over 50 steps)':58s} {default_cost * 1e6:9.1f} us")

    import tempfile

    from paratrain.config import MetricsConfig
    from paratrain.observability.trackers import build_trackers

    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update(WANDB_DIR=tmp, WANDB_SILENT="true")
        cfg = MetricsConfig(wandb=True, wandb_mode="offline", mlflow=f"file:{tmp}/mlruns", tensorboard=True)
        trackers = build_trackers(cfg, out_dir=tmp, config={"run": {"steps": n}})
        step = iter(range(1, 10**9))
        tracker_cost = 0.0
        for t in trackers:
            c = _timed(lambda t=t: t.log({**ROW, "step": next(step)}), 500)
            tracker_cost += c
            print(f"  tracker {t.name:50s} {c * 1e6:9.1f} us per row")
        for t in trackers:
            t.finish({"final_loss": 1.0})
    if step_ms:
        print(f"as a share of a {step_ms:.0f} ms step: defaults {100 * default_cost / (step_ms / 1e3):.4f}%,")
        print(f"  defaults + all three trackers {100 * (default_cost + tracker_cost) / (step_ms / 1e3):.4f}%")


def plot(times: dict[str, list[float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for i, (n, ts) in enumerate(times.items()):
        ax.scatter([i] * len(ts), [t * 1e3 for t in ts], s=18, label=n)
        ax.hlines(statistics.median(ts) * 1e3, i - 0.25, i + 0.25, color="k")
    ax.set_xticks(range(len(times)), list(times))
    ax.set(ylabel="median step time per run (ms)", title="observability overhead (dots: runs, bars: medians)")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
