"""What the preemption check costs: one ``all_reduce(MAX)`` of one float on a gloo group per step.

Spawns WORLD gloo ranks on 127.0.0.1 (one thread each) and times, in alternating rounds, the
check ``Preemption.should_stop`` (the collective) against a round without it (the bare loop), so
both see the same machine load. Prints the median per-check time and a bootstrap 95% interval
of the paired difference; compare it with a step's time (metrics.jsonl ``step_time_s``) to
choose ``checkpoint.preempt_check_steps``.

    PYTHONPATH=src python benchmarks/preempt_overhead.py [--world 2] [--rounds 20] [--checks 200]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, ROOT)

from tests.dist_utils import run_ranks  # noqa: E402


def rank_main(rounds: int, checks: int) -> list[tuple[float, float]]:
    """(seconds per check with the collective, seconds per iteration without) for each round."""
    import torch.distributed as dist

    from paratrain.preemption import Preemption

    dist.init_process_group("gloo")
    p = Preemption(grace_s=0, check_steps=1, world_size=dist.get_world_size(), timeout_s=60)
    out = []
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        for step in range(1, checks + 1):
            p.should_stop(step)
        with_check = (time.perf_counter() - t0) / checks
        dist.barrier()
        t0 = time.perf_counter()
        for step in range(1, checks + 1):
            pass
        without = (time.perf_counter() - t0) / checks
        out.append((with_check, without))
    p.close()
    dist.destroy_process_group()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--checks", type=int, default=200)
    args = ap.parse_args()
    rows = run_ranks(rank_main, args.world, args.rounds, args.checks)[0]  # rank 0's view
    diffs = [a - b for a, b in rows]
    boot = sorted(statistics.median(random.choices(diffs, k=len(diffs))) for _ in range(2000))
    print(f"world {args.world}, {args.rounds} rounds x {args.checks} checks (gloo, loopback)")
    print(f"  per check, median: {statistics.median(a for a, _ in rows) * 1e6:.1f} us")
    print(f"  paired extra over the bare loop: median {statistics.median(diffs) * 1e6:.1f} us,")
    print(f"  95% bootstrap interval [{boot[50] * 1e6:.1f}, {boot[1949] * 1e6:.1f}] us")


if __name__ == "__main__":
    main()
