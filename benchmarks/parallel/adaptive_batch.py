"""Fixed small batch vs fixed large batch vs the adaptive batch, at the same sample budget.

The main job's model and data (configs/main.toml), one process. All three runs use the same
peak lr tuned at the main job's batch of 32, scaled with `optim.lr_scaling` (sqrt by default)
to their batch, a constant schedule after a short warmup (the adaptive run's step count is not
known in advance, so a step-based decay would not be comparable), and stop at the same number of
samples (`run.max_samples`). Prints final losses and optimiser steps side by side and writes a
plot of loss against samples.

    PYTHONPATH=src python benchmarks/parallel/adaptive_batch.py [--samples 8192] [--small 8] [--large 64]

The "final loss" is the mean training loss over the last 10% of the samples: with a budget below
one epoch of the corpus these batches were never seen before, so it is a held-out loss.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import paratrain
from paratrain.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(name: str, out_root: str, samples: int, overrides: list[str]) -> dict:
    out_dir = os.path.join(out_root, name)
    cfg = load_config(
        os.path.join(ROOT, "configs", "main.toml"),
        [
            f"run.out_dir='{out_dir}'",
            "run.steps=1000000",
            f"run.max_samples={samples}",
            "run.progress=false",
            "run.save_model=false",
            "metrics.plot=false",
            "optim.schedule='constant'",
            "optim.warmup_steps=5",
            *overrides,
        ],
    )
    t0 = time.perf_counter()
    paratrain.train(cfg)
    wall = time.perf_counter() - t0
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    tail = [r for r in rows if r["consumed_samples"] > 0.9 * samples]
    final = sum(r["loss"] * r["global_batch_size"] for r in tail) / sum(r["global_batch_size"] for r in tail)
    return {
        "name": name,
        "rows": rows,
        "final_loss": final,
        "steps": len(rows),
        "samples": rows[-1]["consumed_samples"],
        "final_batch": rows[-1]["global_batch_size"],
        "wall_s": wall,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=8192, help="sample budget of each run")
    ap.add_argument("--small", type=int, default=8, help="fixed small global batch (and the adaptive start)")
    ap.add_argument("--large", type=int, default=64, help="fixed large global batch (and the adaptive maximum)")
    ap.add_argument("--micro", type=int, default=8, help="micro-batch size of every run")
    ap.add_argument("--lr-scaling", default="sqrt", choices=["none", "linear", "sqrt", "adascale"])
    ap.add_argument("--adapt-every", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_adaptive"), help="run directories")
    ap.add_argument("--plot", default=os.path.join(ROOT, "docs", "adaptive_batch.png"))
    args = ap.parse_args()

    common = [f"optim.lr_scaling='{args.lr_scaling}'", "optim.reference_batch_size=32"]
    micro = lambda b: f"batch.micro_batch_size={min(args.micro, b)}"  # noqa: E731
    runs = [
        run(
            f"fixed_{args.small}",
            args.out,
            args.samples,
            [*common, f"batch.global_batch_size={args.small}", micro(args.small)],
        ),
        run(
            f"fixed_{args.large}",
            args.out,
            args.samples,
            [*common, f"batch.global_batch_size={args.large}", micro(args.large)],
        ),
        run(
            f"adaptive_{args.small}-{args.large}",
            args.out,
            args.samples,
            [
                *common,
                f"batch.global_batch_size={args.small}",
                micro(args.small),
                "batch.adaptive=true",
                f"batch.max_global_batch_size={args.large}",
                f"batch.adapt_every={args.adapt_every}",
            ],
        ),
    ]

    print(
        f"\nsample budget {args.samples}, lr 2e-3 at batch 32 scaled by '{args.lr_scaling}', micro-batch {args.micro}"
    )
    print(f"{'run':<16} {'final loss':>10} {'opt steps':>9} {'samples':>8} {'final batch':>11} {'wall s':>8}")
    for r in runs:
        print(
            f"{r['name']:<16} {r['final_loss']:>10.4f} {r['steps']:>9d} {r['samples']:>8d} {r['final_batch']:>11d}"
            f" {r['wall_s']:>8.1f}"
        )
    adaptive = runs[2]["rows"]
    noise = [(r["consumed_samples"], r["grad_noise_scale"]) for r in adaptive if r.get("grad_noise_scale") is not None]
    if noise:
        print(
            f"adaptive: gradient noise scale {noise[0][1]:.0f} -> {noise[-1][1]:.0f} samples;"
            f" batch {adaptive[0]['global_batch_size']} -> {adaptive[-1]['global_batch_size']}"
        )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for r in runs:
        xs = [row["consumed_samples"] for row in r["rows"]]
        ys, ema = [], None
        for row in r["rows"]:  # smoothed per sample, so runs with different batches compare
            w = min(1.0, row["global_batch_size"] / 256)
            ema = row["loss"] if ema is None else (1 - w) * ema + w * row["loss"]
            ys.append(ema)
        ax1.plot(xs, ys, lw=1.3, label=f"{r['name']} ({r['steps']} steps)")
        ax2.plot(xs, [row["global_batch_size"] for row in r["rows"]], lw=1.3, label=r["name"])
    if noise:
        ax2.plot(
            [n[0] for n in noise], [n[1] for n in noise], lw=0.8, ls=":", color="gray", label="noise scale (adaptive)"
        )
    ax1.set(xlabel="samples", ylabel="training loss (smoothed)", title="loss vs samples, same budget")
    ax2.set(xlabel="samples", ylabel="samples", yscale="log", title="global batch")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
    print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
