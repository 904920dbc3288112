"""What the checkpoint, resilience, preemption, resize, security and rendezvous tests share: the
toy GPT job they run (in-process ranks or `paratrain train` subprocesses), elastic "nodes" on
loopback, a rendezvous server, and waiting for a job's metrics rows."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

from paratrain.testing.dist_utils import REPO, plain_sgd, read_metrics, run_ranks, train_rank

GPT_ARGS = "{n_layer = 2, n_head = 2, d_model = 32, block_size = 16, vocab_size = 32}"


TOY = [
    f"model.args={GPT_ARGS}",
    "data.factory='paratrain.testing.toy:toy_lm'",
    "data.args={n = 64, seq_len = 16, vocab = 32}",
    "batch.global_batch_size=8",
    "batch.micro_batch_size=4",  # accumulation 2 on 1 rank, 1 on 2 ranks (and forwards = steps there)
    "run.steps=6",
    "run.progress=false",
    "metrics.plot=false",
    "optim.lr=3e-3",
    "optim.warmup_steps=2",
    "checkpoint.interval=3",
    "checkpoint.at_end=true",
    "checkpoint.keep=0",
]


def checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (model and optimiser state), read in one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from paratrain.checkpoint import load_metadata, safe_planner, safe_reader

    md = load_metadata(path)
    sd = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in md.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata) and k.startswith(("model.", "optim."))
    }
    dcp.load(sd, storage_reader=safe_reader(path), planner=safe_planner(flatten_state_dict=False), no_dist=True)
    return sd


SGD = plain_sgd(0.5)


def run(out: str, world: int, extra: list[str] = ()) -> list[dict]:
    """Train on `world` gloo ranks; returns metrics.jsonl's rows."""
    run_ranks(train_rank, world, [*TOY, *SGD, f"run.out_dir='{out}'", *extra])
    return read_metrics(out)


def column(rows: list[dict], key: str) -> torch.Tensor:
    return torch.tensor([r[key] for r in rows], dtype=torch.float64)


SLOW = [
    "model.factory='paratrain.testing.toy:gpt_slow'",
    f"model.args={GPT_ARGS[:-1]}, forward_sleep_s = 0.3}}",
]


def wait_for_rows(out: str, n: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    path = os.path.join(out, "metrics.jsonl")
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.exists(path) and len(read_metrics(out)) >= n:
            return
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"no {n} metrics rows within {timeout} s: {proc.communicate()[1][-2000:]}")


ELASTIC = ["--nnodes", "1:2", "--max-restarts", "3", "--rdzv-conf", "last_call_timeout=3,keep_alive_interval=1"]


def start_node(out: str, port: int, extra: list[str], steps: int = 8, args: tuple[str, ...] = ()) -> subprocess.Popen:
    """One "node" of an elastic job: `paratrain train --nproc-per-node 1 --nnodes 1:2` in its own
    process group (so its whole tree can be killed at once); ``args``: more launcher options."""
    sets = [*[a for a in TOY if not a.startswith(("model.", "run.steps"))], *SLOW, f"run.steps={steps}"]
    sets += [*SGD, f"run.out_dir='{out}'", "checkpoint.interval=2", *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "src")]), "OMP_NUM_THREADS": "1"}
    env["PARATRAIN_JOB_SECRET"] = "elastic-test-secret"  # one secret shared by the nodes
    cmd = [sys.executable, "-m", "paratrain", "train", "configs/debug.toml", "--nproc-per-node", "1", *ELASTIC]
    cmd += ["--rdzv-endpoint", f"127.0.0.1:{port}", *args, *[x for s in sets for x in ("--set", s)]]
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def start_job(out_dir, steps: int, *extra: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "paratrain", "train", "configs/debug.toml", *extra]
        + ["--set", f"run.steps={steps}", "--set", "run.progress=false", "--set", f"run.out_dir='{out_dir}'"],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, so the test can end exactly this job
    )


def metric_lines(out_dir) -> int:
    try:
        return len(read_metrics(str(out_dir)))
    except (OSError, ValueError):
        return 0


# The launcher options of a node of a job whose rendezvous a server hosts (ELASTIC's timeouts).
SERVED = ("--rdzv-conf", "last_call_timeout=3,keep_alive_interval=1,is_host=false")


def start_server(port: int = 0) -> tuple[subprocess.Popen, int]:
    """`paratrain rendezvous serve` on loopback; returns it and its port once it printed its ready line."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "src")])}
    cmd = [sys.executable, "-m", "paratrain", "rendezvous", "serve", "--bind", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # the server prints it once it listens (or exits: "")
    assert line.startswith("paratrain rendezvous: serving on 127.0.0.1:"), (line, proc.stderr.read())
    return proc, int(line.split("127.0.0.1:")[1].split()[0])


def assert_same_losses(out: str, want: list[dict]) -> None:
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, len(want) + 1))
    assert rows[0]["world_size"] == 2 and rows[-1]["world_size"] == 1
    torch.testing.assert_close(column(rows, "loss"), column(want, "loss"), rtol=1e-5, atol=0)
    torch.testing.assert_close(column(rows, "grad_norm"), column(want, "grad_norm"), rtol=1e-5, atol=0)
