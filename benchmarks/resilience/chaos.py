"""Chaos that changes nothing: one elastic loopback job, a seeded schedule of faults, the same losses.

    python benchmarks/resilience/chaos.py [--seed 0] [--faults 4] [--out DIR]

One job as a cluster runs it: a standalone rendezvous server (`paratrain rendezvous serve`), two
one-process "nodes" (`paratrain train --nnodes 1:2 --max-restarts 20 --rdzv-conf is_host=false`,
each in a session of its own), a checkpoint every 2 steps, a data-loader worker per rank and an
MLflow `file:` store. The model is the test GPT slowed to ``--sleep`` s per forward
(src/paratrain/testing/toy.py:gpt_chaos), trained with plain SGD. A schedule drawn from ``--seed`` injects
``--faults`` faults, one after another, each once the job has recovered from the previous one and
trained ``2..3`` more steps:

    kill_worker        SIGKILL of one worker process (torch elastic restarts the group)
    preempt            SIGTERM to one node's launcher: every rank stops at the step they agree
                       on with a checkpoint and both nodes exit 0; the "scheduler" (this script)
                       starts both nodes again, which resume
    leave_join         one node's whole process tree SIGKILLed (the other goes on alone), then
                       a new node joins (the job grows back to two)
    damage_checkpoint  bytes of the newest checkpoint's largest file flipped on disk, then a
                       worker SIGKILLed: the restart must skip the damaged checkpoint
    enospc             the next checkpoint write of one rank fails with ENOSPC (its disk only)
    hang               one rank's next forward sleeps an hour: its peers' collectives time out
                       (dist.timeout_s = 10), the hang report names it, the group restarts

Then it checks what the issue asks: the losses and grad norms of the finished run equal the
uninterrupted single-process run's within 1e-5 (relative), every checkpoint folder left verifies
(manifest checksums), and MLflow holds one run, not one per restart. It prints, per fault, the
seconds from the injection to each milestone of the recovery that the workers' events.jsonl
records (docs/resilience.md): detection (the first worker_failed, or the launchers' exit after
a preemption), restart (a new worker process), load (checkpoint loaded) and first step (the first
optimiser step of the new workers), and the step resumed from. Exit code 0 only when every check
passed. The figures are wall-clock on a shared machine: rendezvous and timeouts dominate them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

from paratrain.checkpoint.manifest import MANIFEST, CheckpointInvalid, verify_checkpoint
from paratrain.observability.events import read_events
from paratrain.testing.dist_utils import descendants, kill_tree, plain_sgd, read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


FAULTS = ("kill_worker", "preempt", "leave_join", "damage_checkpoint", "enospc", "hang")
SERVED = ["--rdzv-conf", "last_call_timeout=3,keep_alive_interval=1,is_host=false"]
SECRET = "chaos-benchmark-secret"  # the one secret the nodes of the job share


def job(root: str, steps: int, sleep: float) -> list[str]:
    gpt = "n_layer = 2, n_head = 2, d_model = 32, block_size = 16, vocab_size = 32"
    return [
        "model.factory='paratrain.testing.toy:gpt_chaos'",
        f"model.args={{{gpt}, forward_sleep_s = {sleep}, chaos_dir = '{root}/chaos'}}",
        "data.factory='paratrain.testing.toy:toy_lm'",
        "data.args={n = 256, seq_len = 16, vocab = 32}",
        "data.workers=1",
        "batch.global_batch_size=8",
        "batch.micro_batch_size=4",
        f"run.steps={steps}",
        "run.progress=false",
        "metrics.plot=false",
        f"metrics.mlflow='file:{root}/mlruns'",
        *plain_sgd(0.5),
        "checkpoint.interval=2",
        "checkpoint.keep=0",
        "dist.timeout_s=10",
    ]


def env() -> dict:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "src")]),
        "OMP_NUM_THREADS": "1",
        "PARATRAIN_JOB_SECRET": SECRET,
        "MLFLOW_ALLOW_FILE_STORE": "true",
    }


def train_cmd(sets: list[str], *launcher: str) -> list[str]:
    cmd = [sys.executable, "-m", "paratrain", "train", "configs/debug.toml", "--nproc-per-node", "1", *launcher]
    return cmd + [x for s in sets for x in ("--set", s)]


class Job:
    """The server, the nodes (name -> process) and their logs under ``root``."""

    def __init__(self, root: str, sets: list[str]):
        self.root, self.sets, self.nodes, self.joined = root, sets, {}, 0
        self.out = os.path.join(root, "run")
        self.sets = [*sets, f"run.out_dir='{self.out}'"]
        os.makedirs(os.path.join(root, "chaos"), exist_ok=True)
        cmd = [sys.executable, "-m", "paratrain", "rendezvous", "serve", "--bind", "127.0.0.1", "--port", "0"]
        self.server = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, text=True)
        line = self.server.stdout.readline()
        if "serving on 127.0.0.1:" not in line:
            raise RuntimeError(f"the rendezvous server did not start: {line!r}")
        self.port = int(line.split("127.0.0.1:")[1].split()[0])

    def start(self, name: str) -> None:
        log = open(os.path.join(self.root, f"node-{name}.log"), "a")  # noqa: SIM115 - the node's lifetime
        launcher = ["--nnodes", "1:2", "--max-restarts", "20", "--rdzv-endpoint", f"127.0.0.1:{self.port}", *SERVED]
        self.nodes[name] = subprocess.Popen(
            train_cmd(self.sets, *launcher), cwd=ROOT, env=env(), stdout=log, stderr=log, start_new_session=True
        )

    def alive(self) -> list[str]:
        return [n for n, p in self.nodes.items() if p.poll() is None]

    def step(self) -> int:
        try:
            return max((r["step"] for r in read_metrics(self.out)), default=0)
        except (OSError, ValueError):  # not written yet, or a line being written
            return 0

    def wait_step(self, step: int, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while self.step() < step:
            if not self.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the job did not reach step {step} (nodes alive: {self.alive()}); see {self.root}")
            time.sleep(0.1)

    def worker(self, node: str) -> int:
        """The pid of a node's training worker (not its data-loader worker: that one's parent is a worker)."""
        tree = descendants(self.nodes[node].pid)
        workers = [p for p in tree if "paratrain.launch.worker" in _cmdline(p)]
        mains = [p for p in workers if _parent(p) not in workers]
        if not mains:
            raise RuntimeError(f"node {node} has no worker process now")
        return mains[0]

    def last_words(self, name: str) -> str:
        """The last lines of a node's log: why it exited, in the error that says it did."""
        with open(os.path.join(self.root, f"node-{name}.log"), errors="replace") as f:
            return "".join(f.readlines()[-5:])

    def close(self) -> None:
        for p in [*self.nodes.values(), self.server]:
            kill_tree(p.pid)
            p.wait()


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def newest_checkpoint(out: str) -> str | None:
    root = os.path.join(out, "checkpoints")
    done = [
        d for d in os.listdir(root) if re.fullmatch(r"step-\d+", d) and os.path.isfile(os.path.join(root, d, MANIFEST))
    ]
    return os.path.join(root, max(done, key=lambda d: int(d.split("-")[1]))) if done else None


def recovered(out: str, since: float, *, world_size: int | None = None, timeout: float = 600) -> dict:
    """The milestones of the first restart after ``since`` (events.jsonl), once its first step is done."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        events = [e for e in read_events(out) if e["time"] > since]
        done = [
            e
            for e in events
            if e["event"] == "first_step_done" and (world_size is None or e["world_size"] == world_size)
        ]
        if done:
            new = {e["event"]: e for e in events if e["pid"] == done[0]["pid"]}
            failed = [e["time"] for e in events if e["event"] == "worker_failed"]
            starts = [e["time"] for e in events if e["event"] == "worker_start"]  # the process creation
            return {
                "detection": min(failed) - since if failed else None,
                "restart": min(starts) - since if starts else None,
                "load": new["checkpoint_loaded"]["time"] - since if "checkpoint_loaded" in new else None,
                "first step": done[0]["time"] - since,
                "resumed": new.get("checkpoint_loaded", {}).get("step"),
                "world": done[0]["world_size"],
            }
        time.sleep(0.2)
    raise RuntimeError(f"no recovery within {timeout} s after the fault")


def inject(job: Job, kind: str, rng: random.Random) -> list[tuple[str, dict]]:
    """Inject one fault, wait for the recovery; returns (label, timings) rows."""
    node = rng.choice(job.alive())
    rank = rng.randrange(2)
    t0 = time.time()
    if kind == "kill_worker":
        os.kill(job.worker(node), signal.SIGKILL)
        return [(f"kill_worker ({node})", recovered(job.out, t0))]
    if kind == "preempt":
        os.kill(job.nodes[node].pid, signal.SIGTERM)
        for name in list(job.nodes):
            rc = job.nodes[name].wait(timeout=600)
            if rc != 0:
                raise RuntimeError(
                    f"node {name} exited {rc} after the preemption, not 0; see {job.root}; its log ends:\n"
                    + job.last_words(name)
                )
        t_exit = time.time()
        for name in list(job.nodes):  # the scheduler requeues the job: both nodes start again
            job.start(name)
        row = recovered(job.out, t0)
        row["detection"] = t_exit - t0
        return [(f"preempt ({node})", row)]
    if kind == "leave_join":
        kill_tree(job.nodes[node].pid)
        job.nodes.pop(node).wait()
        left = recovered(job.out, t0, world_size=1)
        job.joined += 1
        t1 = time.time()
        job.start(f"join{job.joined}")
        return [(f"leave ({node})", left), ("join", recovered(job.out, t1, world_size=2))]
    if kind == "damage_checkpoint":
        path = newest_checkpoint(job.out)
        files = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".distcp")]
        victim = max(files, key=os.path.getsize)
        with open(victim, "r+b") as f:  # flip 16 bytes in the middle: the sha256 in the manifest differs
            f.seek(os.path.getsize(victim) // 2)
            data = f.read(16)
            f.seek(-len(data), os.SEEK_CUR)
            f.write(bytes(b ^ 0xFF for b in data))
        os.kill(job.worker(node), signal.SIGKILL)
        row = recovered(job.out, t0)
        damaged = int(os.path.basename(path).split("-")[1])
        if row["resumed"] is not None and row["resumed"] >= damaged:
            raise RuntimeError(f"resumed from step {row['resumed']}, the damaged checkpoint {path}")
        return [(f"damage step-{damaged} + kill ({node})", row)]
    world = len(job.alive())
    rank %= world
    open(os.path.join(job.root, "chaos", f"{'enospc' if kind == 'enospc' else 'hang'}-rank{rank}"), "w").close()
    return [(f"{kind} (rank {rank})", recovered(job.out, t0))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0, help="the fault schedule's seed (default 0)")
    p.add_argument("--faults", type=int, default=4, help="faults to inject (default 4)")
    p.add_argument("--sleep", type=float, default=0.3, help="seconds each forward is slowed by (default 0.3)")
    p.add_argument(
        "--schedule", default="", help="comma-separated faults instead of a drawn schedule (e.g. preempt,hang)"
    )
    p.add_argument("--out", default="", help="where the job writes (default: a temporary folder)")
    args = p.parse_args()
    if args.faults < 1:
        p.error("--faults must be >= 1")
    rng = random.Random(args.seed)
    # Each kind once before any repeats, in a seeded order.
    schedule = [k for _ in range(-(-args.faults // len(FAULTS))) for k in rng.sample(FAULTS, len(FAULTS))]
    schedule = schedule[: args.faults]
    if args.schedule:
        schedule = args.schedule.split(",")
        unknown = sorted(set(schedule) - set(FAULTS))
        if unknown:
            p.error(f"--schedule: unknown faults {unknown}; choose from {', '.join(FAULTS)}")
    gaps = [rng.randint(2, 3) for _ in schedule]
    steps = 3 + sum(gaps) + 3 * len(schedule) + 3
    root = args.out or tempfile.mkdtemp(prefix="paratrain-chaos-")
    os.makedirs(root, exist_ok=True)
    print(f"chaos: seed {args.seed}, {steps} steps, faults: {', '.join(schedule)}; in {root}", flush=True)

    # The uninterrupted run: one process, no fault (forwards not slowed: the math is the same).
    ref_out = os.path.join(root, "reference")
    ref_sets = [*job(root, steps, 0.0), f"run.out_dir='{ref_out}'", "metrics.mlflow=''"]
    with open(os.path.join(root, "reference.log"), "w") as log:
        subprocess.run(train_cmd(ref_sets), cwd=ROOT, env=env(), stdout=log, stderr=log, check=True)
    want = read_metrics(ref_out)
    print(f"reference: {len(want)} steps", flush=True)

    chaos = Job(root, job(root, steps, args.sleep))
    rows: list[tuple[str, dict]] = []
    try:
        chaos.start("a")
        chaos.start("b")
        at = 1
        for kind, gap in zip(schedule, gaps):
            at = max(at, chaos.step()) + gap
            chaos.wait_step(at)
            print(f"step {chaos.step()}: {kind}", flush=True)
            for label, row in inject(chaos, kind, rng):
                rows.append((label, row))
                print(f"  {label}: recovered in {row['first step']:.1f} s (resumed from {row['resumed']})", flush=True)
        for name, proc in chaos.nodes.items():
            rc = proc.wait(timeout=900)
            if rc != 0:
                raise RuntimeError(f"node {name} exited {rc}; its log ends:\n{chaos.last_words(name)}")
    finally:
        chaos.close()

    got = read_metrics(chaos.out)
    failures = []
    if [r["step"] for r in got] != [r["step"] for r in want]:
        failures.append(f"steps {[r['step'] for r in got]} != {[r['step'] for r in want]}")
    else:
        for key in ("loss", "grad_norm"):
            worst = max(abs(a[key] - b[key]) / abs(b[key]) for a, b in zip(got, want))
            print(f"{key}: largest relative difference to the uninterrupted run {worst:.2e}")
            if worst > 1e-5:
                failures.append(f"{key} differs by {worst:.2e} (relative) > 1e-5")
    ckpt_root = os.path.join(chaos.out, "checkpoints")
    folders = sorted(os.listdir(ckpt_root), key=lambda d: int(d.split("-")[1].split(".")[0]))
    for d in folders:
        try:
            verify_checkpoint(os.path.join(ckpt_root, d))
        except CheckpointInvalid as e:
            failures.append(str(e))
    print(f"checkpoints: {len(folders)} folders, {len(folders) - sum('checkpoint' in f for f in failures)} verified")
    from mlflow import MlflowClient  # only the final check needs it

    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # MLflow 3 reads its file store only when asked

    client = MlflowClient(tracking_uri=f"file:{root}/mlruns")
    runs = client.search_runs([client.get_experiment_by_name("paratrain").experiment_id])
    print(f"mlflow: {len(runs)} run(s), status {[r.info.status for r in runs]}")
    if len(runs) != 1:
        failures.append(f"MLflow holds {len(runs)} runs, not one")

    cols = ["detection", "restart", "load", "first step"]
    width = max(len(label) for label, _ in rows) + 2
    print(f"\n{'fault':<{width}}" + "".join(f"{c:>12}" for c in cols) + f"{'resumed':>9}{'world':>7}")
    for label, row in rows:
        cells = "".join(f"{row[c]:12.1f}" if row[c] is not None else f"{'-':>12}" for c in cols)
        print(f"{label:<{width}}{cells}{row['resumed']!s:>9}{row['world']:>7}")
    print("seconds from the injection; 'resumed': the checkpoint's step the new workers loaded")
    with open(os.path.join(root, "chaos.json"), "w") as f:
        json.dump({"seed": args.seed, "schedule": schedule, "rows": rows, "failures": failures}, f, indent=1)
    if failures:
        print("FAILED: " + "; ".join(failures))
        return 1
    print(f"chaos: {len(rows)} recoveries, the same losses, every checkpoint intact, one MLflow run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
