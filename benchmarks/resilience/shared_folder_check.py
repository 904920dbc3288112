"""What the start-up check of one shared run.out_dir costs (preflight/shared.py, issue 55 item 2).

Spawns WORLD gloo ranks on 127.0.0.1 that share one folder and times ``check_shared_folders``
(rank 0 writes a file, a broadcast, every rank reads it, an all-gather, the file removed) REPEAT
times; prints rank 0's median and largest time. The check runs once per start of a job.

    PYTHONPATH=src python benchmarks/resilience/shared_folder_check.py [--world 2] [--repeat 50]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from paratrain.testing.dist_utils import run_ranks


def _time_checks(folder: str, repeat: int) -> list[float]:
    from paratrain.config import DistConfig
    from paratrain.distributed.process_group import init_distributed
    from paratrain.preflight.shared import check_shared_folders

    ctx = init_distributed(DistConfig())
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        check_shared_folders({"run.out_dir": folder}, rank=ctx.rank, world_size=ctx.world_size, device=ctx.device)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--repeat", type=int, default=50)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        times = run_ranks(_time_checks, args.world, folder, args.repeat)[0]
    print(
        f"shared-folder check, world {args.world}, {args.repeat} checks: median {statistics.median(times) * 1e3:.2f} ms,"
        f" largest {max(times) * 1e3:.2f} ms (rank 0)"
    )


if __name__ == "__main__":
    main()
