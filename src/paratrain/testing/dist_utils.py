"""Run a function on N gloo ranks on 127.0.0.1 (spawned processes, one thread each)."""

from __future__ import annotations

import contextlib
import faulthandler
import json
import multiprocessing as mp
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback

from paratrain.config import plain_sgd  # noqa: F401 - the tests' name for it
from paratrain.distributed.process_group import free_port

# The repository root (src/paratrain/testing/ sits three levels below it in the editable install the
# tests and benchmarks run from): the working directory of the CLI runs they start.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _worker(fn, rank, world_size, port, q, stacks_file, args, kwargs):
    # On SIGUSR1 (the parent timed out waiting for this rank) every thread's Python stack goes to
    # a file the parent reads: faulthandler writes from the signal handler without taking the GIL,
    # so it works even when a deadlocked thread holds the GIL.
    stacks = open(stacks_file, "w")  # noqa: SIM115 - open until os._exit
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    # A crash (SIGSEGV, SIGABRT, ...) writes every thread's Python stack to the same file, which the
    # parent shows for a rank that died by a signal: a bare exit code -11 names no line.
    faulthandler.enable(file=stacks, all_threads=True)
    _die_with_parent()
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
        result = (rank, True, fn(*args, **kwargs))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        result = (rank, False, traceback.format_exc())
    q.put(result)
    # The result is out: exit without the interpreter's teardown, whose destructors (torch's
    # process groups, pytorch#56297) can block, and report nothing the parent does not know.
    q.close()
    q.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _die_with_parent() -> None:
    """Linux: SIGKILL this rank when the process that spawned it dies. A pytest killed by
    `timeout` or a CI step's end otherwise leaves its ranks running (three were found at 7% CPU
    each, 1 h 45 min after their test, loading every later run)."""
    if sys.platform.startswith("linux"):
        import ctypes  # here: Linux only

        PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _stacks(proc, rank: int, stacks_file: str) -> str:
    """What a stuck rank is doing: faulthandler's Python stacks, and py-spy's native ones if installed."""
    with contextlib.suppress(ProcessLookupError):  # it may have ended meanwhile
        os.kill(proc.pid, signal.SIGUSR1)
    out = []
    py_spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if py_spy:
        try:
            r = subprocess.run(
                [py_spy, "dump", "--native", "--pid", str(proc.pid)], capture_output=True, text=True, timeout=60
            )
            out.append(f"py-spy dump --native (rank {rank}):\n{r.stdout}{r.stderr}")
        except (OSError, subprocess.TimeoutExpired) as e:
            out.append(f"py-spy dump failed: {e}")
    time.sleep(1)  # faulthandler writes from the signal handler, at once
    with open(stacks_file) as f:
        out.insert(0, f"Python stacks of rank {rank} (pid {proc.pid}):\n{f.read()}")
    return "\n".join(out)


def run_ranks(fn, world_size: int, *args, timeout: float = 240, **kwargs) -> list:
    """Call ``fn(*args, **kwargs)`` on each of ``world_size`` ranks; returns their results by rank.

    On a timeout the error holds the stacks of the ranks still running and every rank's exit code.
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="run_ranks-")
    files = [os.path.join(tmp, f"stacks-{r}.txt") for r in range(world_size)]
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, q, files[r], args, kwargs))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results, errors = {}, []
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size and not errors:
            try:
                rank, ok, payload = q.get(timeout=1)
            except queue.Empty:
                # A rank killed by a signal never reports: say so now, not after the whole timeout.
                crashed = {r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)}
                if crashed:
                    errors.append(f"ranks {sorted(crashed)} died without a result")
                elif time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(results))
                    errors.append(f"timed out after {timeout}s waiting for ranks {missing}")
                continue
            (results.__setitem__(rank, payload) if ok else errors.append(f"rank {rank}:\n{payload}"))
    finally:
        for r, p in enumerate(procs):
            p.join(timeout=5 if errors else 30)
            if p.is_alive():
                if errors:  # stuck, or left behind by a failed rank: what it was doing
                    errors.append(_stacks(p, r, files[r]))
                p.kill()
                p.join()
            elif p.exitcode is not None and p.exitcode < 0:  # killed by a signal: faulthandler's stacks
                with open(files[r]) as f:
                    errors.append(f"rank {r} was killed by signal {-p.exitcode}; its stacks:\n{f.read()}")
        shutil.rmtree(tmp, ignore_errors=True)
    if errors:
        codes = ", ".join(f"rank {r}: {p.exitcode}" for r, p in enumerate(procs))
        raise AssertionError("\n".join(errors) + f"\nexit codes (negative: killed by that signal): {codes}")
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


def error_lines(output: str) -> list[str]:
    """A command's output without its start-up lines ("start  3.1s ...": what happened before,
    observability/events.py): a bad input leaves exactly one line here."""
    return [line for line in output.splitlines() if line.strip() and not line.startswith("start ")]


def sgd_step(model, loss, lr: float) -> tuple[float, float]:
    """One plain-SGD step of a plain PyTorch ``model`` on ``loss``, written out (the anchors of
    tests/distributed/test_preference.py, test_distill.py): (loss, gradient norm) as paratrain logs them."""
    import torch  # here: this module imports no torch at the top (spawned ranks import it themselves)

    model.zero_grad()
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    return float(loss.detach()), norm


def read_metrics(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# --- process trees and stores of real jobs (tests and benchmarks/resilience/elastic_recovery.py) ----------


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


def worker_pids(pid: int) -> list[int]:
    """The training workers among ``pid``'s children (a launcher also starts the rendezvous
    store's front, distributed/store_front.py)."""
    out = []
    for child in child_pids(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"paratrain.launch.worker" in f.read():
                    out.append(child)
        except OSError:
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


def train_layouts(runs: dict, root: str) -> dict:
    import torch.distributed as dist

    import paratrain

    dist.init_process_group("gloo")
    out = {}
    try:
        for name, overrides in runs.items():
            summary = paratrain.train(paratrain.load_config(None, [*overrides, f"run.out_dir='{root}/{name}'"]))
            out[name] = summary["losses"]
    finally:
        dist.destroy_process_group()
    return out


def eval_rank(overrides: list[str], checkpoint: str) -> dict:
    """One rank of `paratrain eval` (for run_ranks)."""
    from paratrain.config import load_config
    from paratrain.launch.eval_worker import eval_checkpoint

    return eval_checkpoint(load_config(None, overrides), checkpoint)
