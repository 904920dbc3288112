"""Each process's intra-op CPU threads are a function of the config and the world size, not of the node's shape."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from paratrain.config import ConfigError, load_config
from paratrain.distributed.process_group import free_port
from paratrain.launch import worker
from paratrain.testing.dist_utils import REPO, read_metrics


def test_the_thread_rule():
    assert worker.cpu_threads(0, world_size=1) is None  # torch's default for a one-process job
    assert worker.cpu_threads(0, world_size=2) == 1
    assert worker.cpu_threads(0, world_size=8) == 1
    assert worker.cpu_threads(3, world_size=1) == 3
    assert worker.cpu_threads(3, world_size=8) == 3
    with pytest.raises(ConfigError, match="dist.cpu_threads = -1 must be >= 0"):
        load_config(None, ["dist.cpu_threads=-1"])


@pytest.mark.parametrize("omp", [None, "1", "4"])  # torchrun sets 1 only on a node of several processes
def test_a_one_process_node_of_a_two_process_job_runs_one_thread(tmp_path, monkeypatch, omp):
    seen = []
    monkeypatch.setattr(worker, "train", lambda cfg: seen.append(torch.get_num_threads()) or {})
    monkeypatch.setenv("WORLD_SIZE", "2")
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    config = tmp_path / "c.toml"
    config.write_text("")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # what a one-process node of torchrun gets on a 2-core machine
        assert worker.main([str(config)]) == 0
        assert worker.main([str(config), "--set", "dist.cpu_threads=2"]) == 0
    finally:
        torch.set_num_threads(before)
    assert seen == [1, 2]


def _train(out, *launch: str, env: dict, sets: tuple[str, ...] = ()) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "paratrain", "train", "configs/debug.toml", *launch]
    for s in (f"run.out_dir='{out}'", "run.steps=16", "run.progress=false", "metrics.plot=false", *sets):
        cmd += ["--set", s]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_one_process_nodes_equal_one_two_process_node_bitwise(tmp_path):
    """The layout of issue 39 item 9: world 2 as one node of two processes, and as two nodes of one
    (loopback). With the threads a function of the config the losses are bitwise equal; a
    one-process node that runs 2 threads (what torchrun left it, here dist.cpu_threads=2) drifts."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "src")])}
    env.pop("OMP_NUM_THREADS", None)
    env["PARATRAIN_JOB_SECRET"] = "threads-test-secret"

    def two_nodes(out, *sets: str) -> list[dict]:
        port = free_port()
        launch = ("--nproc-per-node", "1", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}")
        nodes = [_train(out, *launch, "--node-rank", str(r), env=env, sets=sets) for r in (0, 1)]
        logs = [n.communicate(timeout=400)[0] for n in nodes]
        assert [n.returncode for n in nodes] == [0, 0], "\n".join(log[-2000:] for log in logs)
        return read_metrics(out)

    one = _train(tmp_path / "one", "--nproc-per-node", "2", env=env)
    log = one.communicate(timeout=400)[0]
    assert one.returncode == 0, log[-2000:]
    want = [r["loss"] for r in read_metrics(tmp_path / "one")]
    assert [r["loss"] for r in two_nodes(tmp_path / "two")] == want
    drifted = [r["loss"] for r in two_nodes(tmp_path / "two-threads", "dist.cpu_threads=2")]
    assert drifted != want  # the check above would see a node shape that changes the threads
