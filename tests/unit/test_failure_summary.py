"""The launcher's last line names the first failure (its rank and its own error line)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from paratrain.launch.agent import failure_summary, first_failure
from paratrain.launch.worker import record_failure


def _failure(
    tmp_path, monkeypatch, *, local_rank: int, line: str | None, exitcode: int = 1, at: float = 0.0, recorded: int = 1
):
    path = tmp_path / f"error_{local_rank}.json"
    if line is not None:  # what worker.record_failure leaves in torchrun's per-worker error file
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
        monkeypatch.setattr("paratrain.launch.worker.time", SimpleNamespace(time=lambda: at))
        record_failure(line, exit_code=recorded)
    return ProcessFailure(local_rank=local_rank, pid=100 + local_rank, exitcode=exitcode, error_file=str(path))


def test_the_summary_names_the_earliest_failure_not_the_lowest_rank(tmp_path, monkeypatch):
    victim = _failure(
        tmp_path, monkeypatch, local_rank=0, line="DistBackendError: Connection closed by peer", at=time.time() - 0.5
    )
    cause = _failure(
        tmp_path, monkeypatch, local_rank=1, line="the loss returned item count 16 but ...", at=time.time() - 0.8
    )
    killed = _failure(tmp_path, monkeypatch, local_rank=2, line=None, exitcode=-15)  # ended by the agent
    failures = {0: victim, 1: cause, 2: killed}
    assert first_failure(failures)[0] == 1
    line = failure_summary(failures)
    assert line.startswith("worker rank 1 failed first (exit code 1): the loss returned item count 16"), line
    assert "2 other worker(s)" in line


def test_a_lone_failure_without_a_record_gives_what_torch_knows(tmp_path, monkeypatch):
    line = failure_summary({3: _failure(tmp_path, monkeypatch, local_rank=0, line=None, exitcode=-9)})
    assert line == "worker rank 3 failed first (signal SIGKILL): Signal 9 (SIGKILL) received by PID 100"


def test_a_cause_ended_by_the_agent_after_recording_keeps_its_exit_code(tmp_path, monkeypatch):
    """The first rank recorded its ConfigError (exit 2); the agent SIGTERMed it before it exited."""
    cause = _failure(tmp_path, monkeypatch, local_rank=1, line="bad count", exitcode=-15, recorded=2, at=time.time())
    other = _failure(tmp_path, monkeypatch, local_rank=0, line="bad count", exitcode=2, recorded=2, at=time.time() + 1)
    assert failure_summary({0: other, 1: cause}) == (
        "worker rank 1 failed first (exit code 2): bad count (1 other worker(s) stopped after it)"
    )
