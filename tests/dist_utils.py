"""Run a function on N gloo ranks on 127.0.0.1 (spawned processes, one thread each)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import subprocess
import sys
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
