"""run.bitwise's cost: the main job's step time with and without it, paired (issue 59).

    python benchmarks/overhead/bitwise_cost.py [--pairs 4] [--steps 20] [--nproc 2] [--grain 8] [--dp-shard 2]

configs/main.toml (global batch 32, micro-batch 8: at world 2 two micro-batches per rank) run
as it is and with ``run.bitwise = true, run.bitwise_grain = GRAIN``, alternately, the order
swapped every pair. Each run's statistic is the median step time after 3 warm-up steps; the
pair's observation is bitwise / default, summarised as the median ratio and the 95% t-interval of the geometric mean
(src/paratrain/testing/paired.py). The target of the issue: at most 1.5. ``--dp-shard N``: both
variants under FSDP2 (``parallel.dp_shard = N``), the default one with FSDP2's reduce-scatter.
"""

from __future__ import annotations

import argparse
import sys

from keyed_dropout import paired_runs  # the same main-job runner (this folder is the script's sys.path[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--grain", type=int, default=8)
    ap.add_argument("--dp-shard", type=int, default=1, help="FSDP2 degree of both variants (1: DDP)")
    args = ap.parse_args()
    from paratrain.testing.paired import summary_line

    variants = {"bitwise": ["run.bitwise=true", f"run.bitwise_grain={args.grain}"], "default": []}
    common = [f"parallel.dp_shard={args.dp_shard}"] if args.dp_shard > 1 else []
    times = paired_runs(variants, common, pairs=args.pairs, steps=args.steps, nproc=args.nproc)
    ratios = [a / b for a, b in zip(times["bitwise"], times["default"])]
    layout = f"FSDP2 dp_shard {args.dp_shard}" if args.dp_shard > 1 else "DDP"
    print(f"main job, world {args.nproc} ({layout}), run.bitwise_grain {args.grain}, median step time per run")
    print(summary_line("bitwise / default step time", ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
