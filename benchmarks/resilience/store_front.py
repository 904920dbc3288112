"""What the bounded store front costs a store round trip (distributed/store_front.py).

    python benchmarks/resilience/store_front.py [--ops 2000] [--repeats 7]

One server (``store_auth.serve_bounded`` on 127.0.0.1), two clients: one through the front (the
public port, what every node's agent uses for the rendezvous), one straight to the server's
loopback port. Each repeat times ``--ops`` set + get pairs on each client, in alternating order;
prints the median time per pair of each and the median of the paired differences (front - direct).
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import timedelta

import torch.distributed as dist

from paratrain.distributed.store_auth import serve_bounded


def _pairs(store: dist.TCPStore, ops: int) -> float:
    t = time.perf_counter()
    for _ in range(ops):
        store.set("k", "v")
        store.get("k")
    return (time.perf_counter() - t) / ops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    server = serve_bounded("127.0.0.1", 0, timedelta(seconds=30))
    try:
        front = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
        direct = dist.TCPStore("127.0.0.1", server.server.port, is_master=False, timeout=timedelta(seconds=30))
        _pairs(front, 200), _pairs(direct, 200)  # warm up
        f, d = [], []
        for r in range(a.repeats):
            order = [(front, f), (direct, d)][:: 1 if r % 2 == 0 else -1]
            for store, out in order:
                out.append(_pairs(store, a.ops))
        diff = statistics.median(x - y for x, y in zip(f, d, strict=True))
        print(
            f"set+get, {a.ops} pairs x {a.repeats}: through the front {statistics.median(f) * 1e6:.0f} us,"
            f" direct {statistics.median(d) * 1e6:.0f} us, difference {diff * 1e6:+.0f} us per pair"
        )
    finally:
        server.close()


if __name__ == "__main__":
    main()
