"""Rendezvous cost: the paratrain backend (JSON + HMAC, bound stores) next to torch's c10d backend.

    python benchmarks/resilience/rendezvous.py [--repeats 9] [--plot docs/rendezvous.png]

Two figures, each measured for both backends in alternating order (c10d first on even
repeats, paratrain first on odd ones), on 127.0.0.1:

- rendezvous time: from creating the handlers until every node has returned from
  ``next_rendezvous`` (torch's ``DynamicRendezvousHandler`` for both; each node is an agent
  thread of this process with its own handler, as torchrun's agent has one), for 1 and 2 nodes.
  It includes the protocol's own waits (a random 0-0.3 s start delay, 1 s polls while waiting
  for peers), which both backends share;
- one state read: ``get_state`` + the ``pickle.loads`` torch's state holder applies, on a state of
  8 nodes: what each keep-alive and each poll costs (c10d: base64 + pickle of a peer's bytes;
  paratrain: HMAC check + JSON decode + a local pickle when the value changed, a comparison
  with the last verified value when it did not, as on most keep-alives).

Prints the median of each and the median of the paired differences (paratrain - c10d) with
its bootstrap 95% interval.
"""

from __future__ import annotations

import argparse
import pickle
import random
import statistics
import sys
import threading
import time
import uuid
from datetime import UTC, datetime

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from paratrain.distributed import rendezvous
from paratrain.distributed.process_group import free_port


def rendezvous_seconds(backend: str, nodes: int) -> float:
    port, run_id = free_port(), str(uuid.uuid4())
    done, errors = [], []

    def agent() -> None:
        try:
            params = RendezvousParameters(
                backend, f"127.0.0.1:{port}", run_id, nodes, nodes, local_addr="127.0.0.1", join_timeout="60"
            )
            handler = get_rendezvous_handler(params)
            handler.next_rendezvous()
            done.append(handler)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=agent) for _ in range(nodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    elapsed = time.perf_counter() - t0
    if errors or len(done) != nodes:
        raise RuntimeError(f"{backend} rendezvous of {nodes} failed: {errors}")
    for h in done:
        h.shutdown()
    return elapsed


def _state(n: int) -> _RendezvousState:
    s = _RendezvousState()
    nodes = [_NodeDesc(f"node{i}.cluster", 1000 + i, 0) for i in range(n)]
    s.participants = {d: i for i, d in enumerate(nodes)}
    s.last_heartbeats = dict.fromkeys(nodes, datetime.now(UTC))
    s.complete, s.round = True, 1
    return s


def state_read_seconds(backend: str, iters: int = 2000, *, changed: bool = False) -> float:
    store = dist.HashStore()
    b = (
        C10dRendezvousBackend(store, "bench")
        if backend == "c10d"
        else rendezvous.ParatrainRendezvousBackend(store, "bench", secret="k" * 64, endpoint="local")
    )
    b.set_state(pickle.dumps(_state(8)))
    t0 = time.perf_counter()
    for _ in range(iters):
        if changed and backend != "c10d":
            b._last_raw = None  # as if a peer had written a new state: check and decode it again
        bits, _ = b.get_state()
        pickle.loads(bits)
    return (time.perf_counter() - t0) / iters


def paired(a: list[float], b: list[float], rng: random.Random) -> tuple[float, float, float]:
    """Median of b - a and its bootstrap 95% interval."""
    d = [y - x for x, y in zip(a, b)]
    boots = sorted(statistics.median(rng.choices(d, k=len(d))) for _ in range(2000))
    return statistics.median(d), boots[50], boots[1949]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--plot", default="", help="write a box plot of the rendezvous times to this PNG")
    args = p.parse_args()
    rendezvous.register()
    rendezvous.set_agent_secret("k" * 64)
    rng = random.Random(0)
    results: dict[str, dict[str, list[float]]] = {}
    for what, fn, scale, unit in [
        ("rendezvous, 1 node", lambda b: rendezvous_seconds(b, 1), 1.0, "s"),
        ("rendezvous, 2 nodes", lambda b: rendezvous_seconds(b, 2), 1.0, "s"),
        ("one state read (8 nodes, unchanged)", state_read_seconds, 1e6, "us"),
        ("one state read (8 nodes, changed)", lambda b: state_read_seconds(b, changed=True), 1e6, "us"),
    ]:
        times: dict[str, list[float]] = {"c10d": [], rendezvous.NAME: []}
        for i in range(args.repeats):
            order = ["c10d", rendezvous.NAME] if i % 2 == 0 else [rendezvous.NAME, "c10d"]
            for b in order:
                times[b].append(fn(b) * scale)
            print(f"  {what} repeat {i + 1}/{args.repeats}", file=sys.stderr, flush=True)
        med, lo, hi = paired(times["c10d"], times[rendezvous.NAME], rng)
        print(
            f"{what}: c10d median {statistics.median(times['c10d']):.3f} {unit}, paratrain median"
            f" {statistics.median(times[rendezvous.NAME]):.3f} {unit}; paired difference (paratrain - c10d)"
            f" median {med:+.3f} {unit}, 95% CI [{lo:+.3f}, {hi:+.3f}] ({args.repeats} alternating pairs)"
        )
        results[what] = times
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 4, figsize=(14, 3.5))
        for ax, (what, times) in zip(axes, results.items()):
            ax.boxplot([times["c10d"], times[rendezvous.NAME]], tick_labels=["torch c10d", "paratrain"])
            ax.set_title(what, fontsize=9)
            ax.set_ylabel("microseconds" if "read" in what else "seconds")
        fig.suptitle(f"rendezvous on 127.0.0.1, {args.repeats} alternating pairs")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
