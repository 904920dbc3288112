"""The launcher leaves its caller's process as it found it: a `paratrain train` run inside a
Python process (a notebook, a test, `paratrain verify`) restores the environment, and a following
multi-process run in the same process works."""

from __future__ import annotations

import os

import pytest

from paratrain.cli import main
from paratrain.launch.agent import LAUNCHED_ENV, forget_preempted, preempted_code, report_preempted
from paratrain.testing.dist_utils import REPO, read_metrics

SETS = [
    "run.steps=2",
    "run.progress=false",
    "run.save_model=false",
    "metrics.plot=false",
    "data.args={block_size=32,max_bytes=20000}",
]


def train_here(out: str, *args: str) -> int:
    sets = [*SETS, f"run.out_dir='{out}'"]
    return main(["train", os.path.join(REPO, "configs", "debug.toml"), *args, *[x for s in sets for x in ("--set", s)]])


@pytest.mark.slow  # > 10 s: make test keeps a margin under 10 minutes
def test_launch_restores_the_environment_and_a_second_launch_works(tmp_path):
    before = dict(os.environ)
    assert train_here(str(tmp_path / "one")) == 0
    # torchrun's run() sets TORCHELASTIC_SIGNALS_TO_HANDLE (and OMP_NUM_THREADS for several
    # workers) in the launching process; the launcher set the job secret and its own markers.
    assert dict(os.environ) == before
    assert train_here(str(tmp_path / "two"), "--nproc-per-node", "2") == 0
    assert dict(os.environ) == before
    assert [r["world_size"] for r in read_metrics(str(tmp_path / "two"))] == [2, 2]


def test_a_preemption_report_reaches_the_launcher_and_a_restart_forgets_it(tmp_path, monkeypatch):
    """A preempted worker leaves exit_code_on_preempt in its node launcher's folder; a worker of
    a later attempt (torchrun restart) drops it at its start; plain torchrun has no folder."""
    monkeypatch.setenv(LAUNCHED_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    assert preempted_code(str(tmp_path)) is None
    assert report_preempted(3) and preempted_code(str(tmp_path)) == 3
    forget_preempted()
    assert preempted_code(str(tmp_path)) is None
    monkeypatch.delenv(LAUNCHED_ENV)
    assert not report_preempted(3)  # the worker's own exit code must say it
