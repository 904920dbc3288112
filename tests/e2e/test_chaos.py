"""benchmarks/resilience/chaos.py with a fixed seed: three faults on one elastic loopback job behind a
rendezvous server (a preemption and its requeue, a full disk on one rank, a worker SIGKILLed),
and the finished run equals the uninterrupted one; every checkpoint intact, one MLflow run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from paratrain.testing.dist_utils import REPO

pytest.importorskip("mlflow")


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_three_faults_change_nothing(tmp_path):
    cmd = [sys.executable, "benchmarks/resilience/chaos.py", "--seed", "1", "--faults", "3", "--out", str(tmp_path)]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1400)
    out = res.stdout
    assert res.returncode == 0, out[-3000:] + res.stderr[-3000:]
    assert "faults: preempt, enospc, kill_worker" in out
    assert "chaos: 3 recoveries, the same losses, every checkpoint intact, one MLflow run" in out
    print(out[out.index("fault ") :])
    assert os.path.isfile(tmp_path / "chaos.json")
