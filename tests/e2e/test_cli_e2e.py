"""End to end through the CLI and torchrun's launcher (multi-process, gloo on 127.0.0.1)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from paratrain.distributed.process_group import free_port
from paratrain.testing.dist_utils import REPO, paratrain_cli, read_metrics

REQUIRED = {
    "step",
    "loss",
    "lr",
    "grad_norm",
    "global_batch_size",
    "micro_batch_size",
    "accum_steps",
    "tokens",
    "step_time_s",
    "tokens_per_s",
    "samples_per_s",
}


def test_train_debug_two_processes_writes_every_output(tmp_path):
    out = tmp_path / "run"
    res = paratrain_cli(
        "train",
        "configs/debug.toml",
        "--nproc-per-node",
        "2",
        "--set",
        f"run.out_dir='{out}'",
        "--set",
        "metrics.tensorboard=true",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    # A line per start-up phase, in order, each with the seconds since the command, before the
    # first step (issue 60: a loaded machine printed nothing for 50 s).
    lines = res.stderr.splitlines()
    phases = (
        "checks passed; starting 2 worker process(es)",
        "torch and the trainer imported",
        "process group of 2 ready",
        "building the model",
        "laying out the model",
        "layout probe:",
        "first step",
    )
    at = [next((i for i, line in enumerate(lines) if line.startswith("start ") and p in line), -1) for p in phases]
    first_step = next(i for i, line in enumerate(lines) if line.startswith("step 1/"))
    assert -1 not in at and at == sorted(at) and at[-1] < first_step, res.stderr
    for name in ("config.toml", "metrics.jsonl", "summary.json", "metrics.png", "model.safetensors"):
        assert (out / name).stat().st_size > 0, name
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(out / "tensorboard"))
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert REQUIRED <= rows[0].keys()
    assert rows[0]["global_batch_size"] == 8 and rows[0]["accum_steps"] == 2 and rows[0]["tokens"] == 8 * 32
    assert rows[-1]["loss"] < rows[0]["loss"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and len(summary["data"]["sha256"]) == 64
    assert summary["data"]["bytes"] == 200_000
    # The resolved config is a loadable config, and the weights load into a plain model.
    from paratrain.config import load_config
    from paratrain.models import build_model

    model = build_model(load_config(out / "config.toml").model)
    model.load_state_dict(load_file(out / "model.safetensors"))
    # generate samples from the trained model.
    gen = paratrain_cli("generate", str(out), "--prompt", "def ", "--max-new-tokens", "20")
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("def ") and len(gen.stdout) > 4


@pytest.mark.slow  # > 10 s: make test keeps a margin under 10 minutes
def test_user_factories_and_mse_train(tmp_path):
    out = tmp_path / "user"
    res = paratrain_cli(
        "train",
        "configs/debug.toml",
        "--nproc-per-node",
        "2",
        "--set",
        f"run.out_dir='{out}'",
        "--set",
        "model.factory='paratrain.testing.toy:mlp'",
        "--set",
        "model.args={dim = 8, hidden = 16}",
        "--set",
        "data.factory='paratrain.testing.toy:regression'",
        "--set",
        "data.args={n = 64}",
        "--set",
        "loss.name='mse'",
        "--set",
        "run.steps=20",
        "--set",
        "optim.lr=0.01",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = read_metrics(out)
    assert len(rows) == 20 and rows[-1]["loss"] < 0.5 * rows[0]["loss"]
    assert rows[0]["tokens"] == 8  # non-token inputs count one per sample


def test_torchrun_module_entry_point(tmp_path):
    """`torchrun ... -m paratrain.train CONFIG` works like `paratrain train`."""
    out = tmp_path / "torchrun"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "src")])}
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "paratrain.train",
            "configs/debug.toml",
            "--set",
            f"run.out_dir='{out}'",
            "--set",
            "run.steps=3",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=240,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(read_metrics(out)) == 3


def _wait_for_rendezvous_state(port: int, key: str, host_node: subprocess.Popen, timeout: float = 120) -> None:
    """Until the first node has written a rendezvous state under a key starting with ``key`` into
    the store it hosts on ``port`` (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and host_node.poll() is None:
        try:
            store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=2))
            keys = [k for k in store.list_keys() if k.startswith(key)]  # the job's id is its config's
            if keys and not store.get(keys[0]).startswith(b"paratrain:no-state"):
                return
        except (RuntimeError, TimeoutError):
            pass
        time.sleep(0.3)
    raise AssertionError(f"no rendezvous state on 127.0.0.1:{port} within {timeout}s")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_nodes_on_one_machine_match_one_node(tmp_path):
    """Two nodes with a shared job secret train as one; a third with a wrong secret is refused, the job unaffected."""
    common = ["--set", "run.steps=4", "--set", "run.progress=false"]
    one = tmp_path / "one"
    res = paratrain_cli(
        "train", "configs/debug.toml", "--nproc-per-node", "2", "--set", f"run.out_dir='{one}'", *common
    )
    assert res.returncode == 0, res.stderr[-3000:]
    two = tmp_path / "two"
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "src")]), "OMP_NUM_THREADS": "1"}
    secret_file = tmp_path / "secret"
    secret_file.write_text("the-job-secret\n")

    def node(rank: int, *secret: str, out_dir=two) -> subprocess.Popen:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "paratrain",
                "train",
                "configs/debug.toml",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--node-rank",
                str(rank),
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                *secret,
                "--set",
                f"run.out_dir='{out_dir}'",
                *common,
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    # The secret reaches node 0 in a file and node 1 in the environment (the two ways schedulers deliver it).
    procs = [node(0, "--job-secret-file", str(secret_file))]
    _wait_for_rendezvous_state(port, "paratrain.rendezvous.", procs[0])
    # A node with a wrong secret arrives while the job gathers: refused with one line, nothing written.
    env["PARATRAIN_JOB_SECRET"] = "a-wrong-secret"
    intruder = node(1, out_dir=tmp_path / "three").communicate(timeout=120)[0]
    env["PARATRAIN_JOB_SECRET"] = "the-job-secret"
    procs.append(node(1))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outs)
    refusals = [line for line in intruder.splitlines() if line.startswith("paratrain: error:")]
    assert len(refusals) == 1 and "refused to join the rendezvous" in refusals[0], intruder[-3000:]
    assert not (tmp_path / "three").exists()
    a, b = read_metrics(one), read_metrics(two)
    torch.testing.assert_close(
        torch.tensor([r["loss"] for r in b]), torch.tensor([r["loss"] for r in a]), rtol=1e-6, atol=0
    )
    torch.testing.assert_close(
        torch.tensor([r["grad_norm"] for r in b]), torch.tensor([r["grad_norm"] for r in a]), rtol=1e-6, atol=0
    )
