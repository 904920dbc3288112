"""`paratrain bench comm` at world size 2 on this machine, next to its memory-copy bandwidth.

Two processes of one machine exchange data through memory (gloo: sockets on loopback, i.e.
kernel copies), so no collective between them can beat a memory copy: `memcpy_gbps` (bytes
copied per second by one thread, as one rank has) is the physical ceiling of a loopback
all-reduce's bus bandwidth. Prints, for each operation at the largest size, busbw next to that
ceiling and their ratio, then a last line `ratio all_reduce busbw / memcpy: X`.

    python benchmarks/parallel/comm_vs_memcpy.py [--max-bytes 67108864] [--iters 10] [--plot docs/bench_comm_world2.png]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-bytes", type=int, default=64 * 2**20)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--backend", default="gloo")
    p.add_argument("--plot", default="", help="also write the busbw plot here")
    p.add_argument("--json", default="", help="also write the comm report here")
    args = p.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "src"), REPO])}
    with tempfile.TemporaryDirectory() as tmp:
        js = args.json or os.path.join(tmp, "comm.json")
        cmd = [
            sys.executable,
            "-m",
            "paratrain",
            "bench",
            "comm",
            "--nproc-per-node",
            "2",
            "--backend",
            args.backend,
            "--max-bytes",
            str(args.max_bytes),
            "--iters",
            str(args.iters),
            "--json",
            js,
        ]
        if args.plot:
            cmd += ["--plot", args.plot]
        res = subprocess.run(cmd, cwd=REPO, env=env, text=True, stdout=sys.stdout, stderr=subprocess.PIPE)
        if res.returncode:
            sys.exit(f"bench comm failed:\n{res.stderr[-3000:]}")
        with open(js) as f:
            report = json.load(f)

    import torch

    from paratrain.hardware.bench_compute import bench_memcpy

    torch.set_num_threads(1)  # one rank's copy: each gloo rank runs on one thread here
    mem = bench_memcpy(torch.device("cpu"), nbytes=args.max_bytes, runs=7, inner=3)
    ceiling = mem["memcpy_gbps"]
    print(
        f"\nmemcpy {args.max_bytes // 2**20} MiB, 1 thread: {ceiling:.2f} GB/s copied "
        f"(min {mem['memcpy_gbps_min']:.2f}, max {mem['memcpy_gbps_max']:.2f})"
    )
    print(f"\n{'op':>14} {'bytes':>10} {'busbw GB/s':>11} {'memcpy GB/s':>12} {'busbw/memcpy':>13}")
    ratios = {}
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send_recv"):
        rows = [r for r in report["results"] if r["op"] == op]
        if not rows:
            continue
        top = max(rows, key=lambda r: r["bytes"])
        ratios[op] = top["busbw_gbps"] / ceiling
        print(f"{op:>14} {top['bytes']:>10} {top['busbw_gbps']:>11.3f} {ceiling:>12.2f} {ratios[op]:>13.3f}")
    print(
        json.dumps(
            {
                "memcpy_gbps": ceiling,
                "busbw_over_memcpy": ratios,
                "world_size": report["world_size"],
                "backend": report["backend"],
                "max_bytes": args.max_bytes,
            }
        )
    )
    print(f"ratio all_reduce busbw / memcpy: {ratios.get('all_reduce', float('nan')):.3f}")


if __name__ == "__main__":
    main()
