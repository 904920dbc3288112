"""run.bitwise's cost: the main job's step time with and without it, paired (issue 59).

    python benchmarks/overhead/bitwise_cost.py [--pairs 4] [--steps 20] [--nproc 2] [--grain 8] [--dp-shard 2]
    python benchmarks/overhead/bitwise_cost.py --merge-mb 64 [--nproc 2]

configs/main.toml (global batch 32, micro-batch 8: at world 2 two micro-batches per rank) run
as it is and with ``run.bitwise = true, run.bitwise_grain = GRAIN``, alternately, the order
swapped every pair. Each run's statistic is the median step time after 3 warm-up steps; the
pair's observation is bitwise / default, summarised as the median ratio and the 95% t-interval of the geometric mean
(src/paratrain/testing/paired.py). The target of the issue: at most 1.5. ``--dp-shard N``: both
variants under FSDP2 (``parallel.dp_shard = N``), the default one with FSDP2's reduce-scatter.

``--merge-mb M``: FSDP2's merge across ranks alone, on M MB of float32 gradients (8 tensors of
1024 rows) at world ``--nproc``: the gather (``merge_ranks``, then each rank's shard) against the
``all_to_all`` (``scatter_ranks``), both with the norm; the median of 10 timings each after 2
warm-ups, alternating; and each one's peak RSS from before the subtree's gradients are made
(VmHWM after a reset of it, a fresh process group per variant; rank 0).
"""

from __future__ import annotations

import argparse
import statistics
import sys

from keyed_dropout import paired_runs  # the same main-job runner (this folder is the script's sys.path[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--grain", type=int, default=8)
    ap.add_argument("--dp-shard", type=int, default=1, help="FSDP2 degree of both variants (1: DDP)")
    ap.add_argument("--merge-mb", type=float, default=0, help="time FSDP2's two merges alone on this many MB")
    args = ap.parse_args()
    if args.merge_mb:
        return merges(args.merge_mb, args.nproc)
    from paratrain.testing.paired import summary_line

    variants = {"bitwise": ["run.bitwise=true", f"run.bitwise_grain={args.grain}"], "default": []}
    common = [f"parallel.dp_shard={args.dp_shard}"] if args.dp_shard > 1 else []
    memory: dict = {}
    times = paired_runs(variants, common, pairs=args.pairs, steps=args.steps, nproc=args.nproc, memory=memory)
    ratios = [a / b for a, b in zip(times["bitwise"], times["default"])]
    layout = f"FSDP2 dp_shard {args.dp_shard}" if args.dp_shard > 1 else "DDP"
    print(f"main job, world {args.nproc} ({layout}), run.bitwise_grain {args.grain}, median step time per run")
    print(summary_line("bitwise / default step time", ratios))
    # Peak memory: rank 0's resident set over the run (summary.json max_memory_gib), which holds
    # the interpreter, torch and the data besides the step's tensors: a difference, not a ratio.
    gib = {name: statistics.median(v) for name, v in memory.items()}
    print(
        f"peak RSS of rank 0, median over runs: bitwise {gib['bitwise']:.3f} GiB, default {gib['default']:.3f} GiB,"
        f" difference {(gib['bitwise'] - gib['default']) * 1024:+.0f} MiB"
    )
    return 0


def merges(mb: float, nproc: int) -> int:
    from paratrain.testing.dist_utils import run_ranks

    rows = int(mb * 2**20 / 4 / 8 / 1024)
    timed = run_ranks(_merge_rank, nproc, rows, "both")
    peaks = {name: run_ranks(_merge_rank, nproc, rows, name)[0] for name in ("gather", "all_to_all")}
    print(f"FSDP2 merge of {8 * 1024 * rows * 4 / 2**20:.0f} MB at world {nproc}, median of 10 (rank 0):")
    for name in ("gather", "all_to_all"):
        print(
            f"  {name}: {timed[0][name] * 1e3:.1f} ms, peak RSS +{peaks[name] / 2**20:.0f} MB (the gradients' included)"
        )
    return 0


def _merge_rank(rows: int, which: str):
    import statistics
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from paratrain.distributed import bitwise

    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        shapes = [(1024, rows)] * 8
        params = [torch.nn.Parameter(distribute_tensor(torch.zeros(s), mesh, [Shard(0)])) for s in shapes]

        def make():
            return [torch.randn(s) for s in shapes]

        def gather(grads):
            grads = bitwise.merge_ranks(grads, group=None, dp=mesh.size())
            for p, g in zip(params, grads):
                p.grad = bitwise._shard_like(p, g)
            return bitwise._norm([bitwise.row_squares(g) for g in grads], torch.float32)

        def all_to_all(grads):
            return bitwise.scatter_ranks(grads, params, group=None, dp=mesh.size())

        fns = {"gather": gather, "all_to_all": all_to_all}
        if which != "both":
            # As in GrainTree.write_grads: the gather's caller holds the subtree, the all_to_all's
            # does not; the subtree itself (the M MB) is part of both peaks.
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # Linux: the peak RSS (VmHWM) starts again from the current RSS
            base = _vm("VmRSS")
            fns[which](make())
            return _vm("VmHWM") - base
        times = {name: [] for name in fns}
        for i in range(12):
            for name, fn in fns.items() if i % 2 else reversed(fns.items()):
                grads = make()
                dist.barrier()
                t0 = time.perf_counter()
                fn(grads)
                times[name].append(time.perf_counter() - t0)
                del grads
        return {name: statistics.median(t[2:]) for name, t in times.items()}
    finally:
        dist.destroy_process_group()


def _vm(field: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS: now; VmHWM: the peak)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


if __name__ == "__main__":
    sys.exit(main())
