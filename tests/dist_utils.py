"""Run a function on N gloo ranks on 127.0.0.1 (spawned processes, one thread each)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import signal
import socket
import subprocess
import sys
import time
import traceback

from paratrain.distributed.process_group import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker(fn, rank, world_size, port, q, args, kwargs):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch

    torch.set_num_threads(1)
    try:
        q.put((rank, True, fn(*args, **kwargs)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put((rank, False, traceback.format_exc()))


def run_ranks(fn, world_size: int, *args, timeout: float = 240, **kwargs) -> list:
    """Call ``fn(*args, **kwargs)`` on each of ``world_size`` ranks; returns their results by rank."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, q, args, kwargs)) for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world_size):
            rank, ok, payload = q.get(timeout=timeout)
            (results.__setitem__(rank, payload) if ok else errors.append(f"rank {rank}:\n{payload}"))
            if errors:
                break
    except queue.Empty:
        errors.append(f"timed out after {timeout}s waiting for ranks {sorted(set(range(world_size)) - set(results))}")
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 30)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]


def train_rank(overrides: list[str]) -> dict:
    """One rank of ``paratrain.train`` on the config made of ``overrides`` (for run_ranks)."""
    import paratrain

    return paratrain.train(paratrain.load_config(None, overrides))


def paratrain_cli(*args: str, timeout: float = 240, env: dict | None = None, cwd: str | None = None):
    """Run the `paratrain` CLI in a subprocess; returns CompletedProcess (text)."""
    full_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "src")]),
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    return subprocess.run(
        [sys.executable, "-m", "paratrain", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=cwd or REPO,
    )


def read_metrics(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# --- process trees and stores of real jobs (tests and benchmarks/elastic_recovery.py) ----------


def child_pids(pid: int) -> list[int]:
    """The direct children of ``pid`` (from /proc: torchrun starts its workers in sessions of their own)."""
    out = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return out


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    tree, i = [pid], 0
    while i < len(tree):
        tree += child_pids(tree[i])
        i += 1
    return tree


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (a whole "node" of a loopback job)."""
    for p in descendants(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def wait_listening(port: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until the first node's rendezvous store accepts connections. A fixed sleep is not enough
    under load: a second node that binds the port first hosts the store, and killing it ends the job."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"no rendezvous store on port {port} within {timeout} s (exit {proc.poll()})")
