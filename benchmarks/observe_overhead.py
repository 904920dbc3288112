"""Overhead of observability on the main job's step time: rank stats and trackers, world size 2.

Variants, run alternately in rounds (one run of each per round, the order rotated):
  base      paratrain before issue 13 (the checkout given by --base-src, default /work/main/src
            when it is that commit; pass any src/ without rank_stats.py)
  defaults  this tree with default settings (memory every step, rank stats every 50 steps)
  every1    rank stats gathered every step (the gather's cost, 50x the default rate)
  trackers  defaults + W&B offline + MLflow file store + TensorBoard
Prints, per variant, the median over rounds of each run's median step time (first steps left
out as warm-up) and the paired ratio to base within each round (median, min..max), and writes
benchmarks/observe_overhead.png.

    python benchmarks/observe_overhead.py [--rounds 3] [--steps 60] [--base-src /path/to/old/src]
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
REPO = os.path.dirname(HERE)
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
    args = p.parse_args()
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
        names = list(variants)
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
