"""Where an elastic job's recovery time goes: node death -> first step at the new world size.

    python benchmarks/resilience/elastic_recovery.py [--repeats 3] [--plot docs/elastic_recovery.png]
    python benchmarks/resilience/elastic_recovery.py --sigterm [--repeats 3]     # SIGTERM -> exit, the main job

Node death (the default): two one-process "nodes" on 127.0.0.1 (`paratrain train --nnodes 1:2
--max-restarts 3`, the same job as tests/e2e/test_resilience.py's elastic test: a tiny GPT slowed to
0.3 s per forward, a checkpoint every 2 steps). After the third step, node 2's whole process tree
is SIGKILLed; node 1 restarts its worker alone and finishes. The worker's events.jsonl
(src/paratrain/observability/events.py) and the kill time split the gap into

    detection   kill -> the surviving worker's collective fails (its `worker_failed` line)
    agent       detection -> the agent logs the failed worker ("failed (exitcode: 1)"): the
                worker's hang report and exit, and the agent's monitor interval
    rendezvous  agent -> the new worker process is created (the next round admits the surviving
                node: the dead node's keep-alives must lapse, then last_call_timeout with fewer
                than MAX nodes)
    restart     process creation -> process group ready (python + torch imports, init)
    build+load  process group ready -> checkpoint loaded (model, parallelisms, optimiser, DCP
                load; the load alone is `load_s`)
    first step  checkpoint loaded -> the first step at the new world size is done

under each of SETTINGS (torch elastic's default rendezvous timeouts, `--rdzv-conf
last_call_timeout=3`, and that with `keep_alive_interval=1`), alternating, `--repeats` times each. Prints the
median (min..max) of each phase and names the largest.

SIGTERM (`--sigterm`): `paratrain train configs/main.toml --nproc-per-node 2`, SIGTERM to the
launcher after the third step; prints the seconds to the synchronous checkpoint's manifest and
to the launcher's exit (which must be `checkpoint.exit_code_on_preempt`, 0).

Figures are wall-clock: run it on an otherwise idle machine, or say what else was running.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime

from paratrain.checkpoint import verify_checkpoint
from paratrain.distributed.process_group import free_port
from paratrain.observability.events import read_events
from paratrain.testing.dist_utils import kill_tree, wait_listening

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


GPT = "{n_layer = 2, n_head = 2, d_model = 32, block_size = 16, vocab_size = 32, forward_sleep_s = 0.3}"
JOB = [  # tests/e2e/test_resilience.py's elastic job (plain SGD)
    "model.factory='paratrain.testing.toy:gpt_slow'",
    f"model.args={GPT}",
    "data.factory='paratrain.testing.toy:toy_lm'",
    "data.args={n = 64, seq_len = 16, vocab = 32}",
    "batch.global_batch_size=8",
    "batch.micro_batch_size=4",
    "run.steps=8",
    "run.progress=false",
    "metrics.plot=false",
    "optim.name='sgd'",
    "optim.beta1=0.0",
    "optim.weight_decay=0.0",
    "optim.grad_clip=0.0",
    "optim.lr=0.5",
    "checkpoint.interval=2",
    "checkpoint.keep=0",
]
SETTINGS = {  # --rdzv-conf of both nodes (docs/resilience.md: rendezvous timeouts)
    "defaults": [],
    "last_call=3": ["--rdzv-conf", "last_call_timeout=3"],
    "last_call=3,keep_alive=1": ["--rdzv-conf", "last_call_timeout=3,keep_alive_interval=1"],
}
PHASES = ["detection", "agent", "rendezvous", "restart", "build+load", "first step"]


def env() -> dict:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "src")]),
        "OMP_NUM_THREADS": "1",
        "PARATRAIN_JOB_SECRET": "elastic-benchmark-secret",  # one secret shared by the nodes
    }


def start_node(out: str, port: int, rdzv: list[str], log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "paratrain", "train", "configs/debug.toml", "--nproc-per-node", "1"]
    cmd += ["--nnodes", "1:2", "--max-restarts", "3", "--rdzv-endpoint", f"127.0.0.1:{port}", *rdzv]
    cmd += [x for s in [*JOB, f"run.out_dir='{out}'"] for x in ("--set", s)]
    # A session of its own, so the node's whole tree (launcher, agent, worker) can be killed.
    return subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=log, stderr=log, start_new_session=True)


def rows(out: str) -> int:
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def wait_rows(out: str, n: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while rows(out) < n:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"no {n} metrics rows in {out} (exit {proc.poll()})")
        time.sleep(0.02)


# torch elastic's agent, in glog format (local time): the moment it saw the worker fail.
AGENT_FAILED = re.compile(r"^E(\d{4}) (\d\d:\d\d:\d\d\.\d+) \d+ \S+\] failed \(exitcode: ", re.M)


def agent_saw_failure(log: str, after: float) -> float:
    for mmdd, hms in AGENT_FAILED.findall(log):
        t = datetime.strptime(f"{datetime.now().year}{mmdd} {hms}", "%Y%m%d %H:%M:%S.%f").timestamp()
        if t >= after:
            return t
    raise RuntimeError("the agent's log has no failed worker after the kill")


def node_death(root: str, rdzv: list[str]) -> dict:
    """One run: kill node 2 after step 3; returns each phase's seconds (and the total)."""
    out, port = os.path.join(root, "run"), free_port()
    with open(os.path.join(root, "node1.log"), "w") as log1, open(os.path.join(root, "node2.log"), "w") as log2:
        first = start_node(out, port, rdzv, log1)
        wait_listening(port, first)  # node 1 hosts the rendezvous store: it must survive
        second = start_node(out, port, rdzv, log2)
        wait_rows(out, 3, first, timeout=300)
        t_kill = time.time()
        kill_tree(second.pid)
        second.wait()
        if first.wait(timeout=400) != 0:
            raise RuntimeError(f"node 1 exited {first.returncode}: see {root}/node1.log")
    events = read_events(out)
    failed = [e for e in events if e["event"] == "worker_failed" and e["time"] >= t_kill]
    starts = [e for e in events if e["event"] == "process_group_ready" and e["time"] > t_kill]
    if not failed or not starts:
        raise RuntimeError(f"no failure or no restart after the kill in {out}/events.jsonl")
    pid = starts[0]["pid"]
    new = {e["event"]: e for e in events if e["pid"] == pid}
    assert new["process_group_ready"]["world_size"] == 1, new
    with open(os.path.join(root, "node1.log")) as f:
        agent = agent_saw_failure(f.read(), after=t_kill)
    t = [
        t_kill,
        failed[0]["time"],
        agent,
        new["worker_start"]["time"],
        new["process_group_ready"]["time"],
        new["checkpoint_loaded"]["time"],
        new["first_step_done"]["time"],
    ]
    phases = {name: b - a for name, a, b in zip(PHASES, t, t[1:])}
    phases["total"] = t[-1] - t_kill
    phases["imports"] = new["train_called"]["time"] - new["worker_start"]["time"]
    phases["load_s"] = new["checkpoint_loaded"]["load_s"]
    phases["resumed_step"] = new["checkpoint_loaded"]["step"]
    return phases


def sigterm_exit(root: str) -> dict:
    """`paratrain train configs/main.toml` on 2 processes, SIGTERM to the launcher after step 3."""
    out = os.path.join(root, "main")
    os.makedirs(root, exist_ok=True)
    cmd = [sys.executable, "-m", "paratrain", "train", "configs/main.toml", "--nproc-per-node", "2"]
    cmd += ["--set", f"run.out_dir='{out}'", "--set", "run.progress=false", "--set", "metrics.plot=false"]
    with open(os.path.join(root, "main.log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=log, stderr=log)
        wait_rows(out, 3, proc, timeout=600)
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=600)
        t_exit = time.time()
    with open(os.path.join(out, "summary.json")) as f:
        step = json.load(f)["preempted_at_step"]
    path = os.path.join(out, "checkpoints", f"step-{step}")
    verify_checkpoint(path)
    if rc != 0:
        raise RuntimeError(f"exit {rc}, not checkpoint.exit_code_on_preempt = 0: see {root}/main.log")
    manifest = os.path.getmtime(os.path.join(path, "manifest.json"))
    return {"to checkpoint": manifest - t0, "to exit": t_exit - t0, "steps after the signal": step - 3}


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f} ({min(values):.2f}..{max(values):.2f})"


def print_table(results: dict[str, list[dict]], columns: list[str]) -> None:
    width = max(len(c) for c in columns) + 2
    print(f"{'phase [s]':<{width}}" + "".join(f"{name:>26}" for name in results))
    for c in columns:
        print(f"{c:<{width}}" + "".join(f"{spread([r[c] for r in runs]):>26}" for runs in results.values()))


def plot(results: dict[str, list[dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 2.4 + 0.5 * len(results)))
    for y, (name, runs) in enumerate(results.items()):
        left = 0.0
        for i, phase in enumerate(PHASES):
            width = statistics.median(r[phase] for r in runs)
            ax.barh(y, width, left=left, color=f"C{i}", label=phase if y == 0 else None)
            left += width
    ax.set_yticks(range(len(results)), list(results))
    ax.set_xlabel(f"seconds from SIGKILL of node 2 (median of {len(next(iter(results.values())))} runs per phase)")
    ax.set_title("node death -> first step alone, loopback, 2 shared CPU cores")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sigterm", action="store_true", help="measure SIGTERM -> exit of the main job instead")
    parser.add_argument("--plot", default="", help="write a bar chart of the median phases here")
    parser.add_argument("--json", default="", help="write every run's figures here")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--keep", default="", help="keep the runs' folders and logs here (default: a temporary one)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        if args.keep:
            tmp = args.keep
        if args.sigterm:
            runs = []
            for i in range(args.repeats):
                runs.append(sigterm_exit(os.path.join(tmp, f"sigterm{i}")))
                print(f"repeat {i + 1}/{args.repeats}: {runs[-1]}", flush=True)
            results = {"SIGTERM, configs/main.toml, 2 processes": runs}
            print_table(results, ["to checkpoint", "to exit", "steps after the signal"])
        else:
            results = {name: [] for name in args.settings}
            for i in range(args.repeats):
                order = list(results) if i % 2 == 0 else list(reversed(results))  # alternate
                for name in order:
                    root = os.path.join(tmp, f"{i}-{name.replace('=', '').replace(',', '-')}")
                    os.makedirs(root)
                    results[name].append(node_death(root, SETTINGS[name]))
                    print(f"repeat {i + 1}/{args.repeats} {name}: {json.dumps(results[name][-1])}", flush=True)
            print_table(results, [*PHASES, "total", "imports", "load_s"])
            for name, runs in results.items():
                top = max(PHASES, key=lambda p: statistics.median(r[p] for r in runs))
                print(f"{name}: the largest phase is {top}")
            if args.plot:
                plot(results, args.plot)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
