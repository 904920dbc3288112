"""What two served nodes print while their `paratrain rendezvous serve` is down (issue 39, item 4).

A server on loopback, two one-process nodes of an elastic job (`--rdzv-conf is_host=false`,
keep-alive every second, a slowed model so the job outlasts the outage); the server is
SIGKILLed after step 2 and started again on its port DOWN seconds later. Prints each node's exit
code, its number of stderr lines and the most frequent kinds of line (C++ stack frames counted
as `frame`).

    python benchmarks/resilience/rendezvous_outage_log.py [--down 20]

Measured here (2 shared cores, down 20 s): 294-315 lines per node before (209 `frame #N`, one
connect error with its trace at every keep-alive), 20-40 after (one C++ warning with its trace
when the dead connection is first used, "unreachable" and "reconnected", the job's own lines).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import tempfile
import time

from paratrain.distributed.process_group import free_port
from paratrain.testing.dist_utils import kill_tree
from paratrain.testing.resilience import GPT_ARGS, SERVED, start_node, start_server, wait_for_rows

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--down", type=float, default=20.0, help="seconds the server stays down")
    args = ap.parse_args()
    out = tempfile.mkdtemp(prefix="rdzv-outage-")
    port = free_port()
    server, _ = start_server(port)
    slower = [f"model.args={GPT_ARGS[:-1]}, forward_sleep_s = 1.0}}"]
    steps = int(args.down) + 12
    nodes = [start_node(out, port, slower, steps=steps, args=("--node-rank", str(r), *SERVED)) for r in (0, 1)]
    try:
        wait_for_rows(out, 2, nodes[0], timeout=240)
        server.kill()
        server.communicate()
        time.sleep(args.down)
        server, _ = start_server(port)
        errs = [n.communicate(timeout=600)[1] for n in nodes]
        print(f"exit codes {[n.returncode for n in nodes]}, server down {args.down:g} s")
        for i, err in enumerate(errs):
            lines = err.splitlines()
            kinds = collections.Counter(
                "frame" if line.startswith("frame #") else re.sub(r"[0-9.:]+", "N", line)[:100] for line in lines
            )
            print(f"node {i}: {len(lines)} lines")
            for kind, n in kinds.most_common(8):
                print(f"  {n:4d}  {kind}")
    finally:
        for p in [*nodes, server]:
            kill_tree(p.pid)
            p.communicate()
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
