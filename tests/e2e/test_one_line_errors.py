"""An error raised in a worker reaches the user as one line: the launcher's, naming the first failure."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from paratrain.launch import worker
from paratrain.launch.agent import LAUNCHED_ENV, _TorchFailureEcho
from paratrain.testing.dist_utils import error_lines


@pytest.mark.parametrize(
    ("launched", "recorded", "restarts", "printed"),
    [
        (True, True, (0, 0), False),  # paratrain's launcher prints the line from the record
        (True, True, (3, 3), False),  # the last attempt of a job with restarts
        (True, True, (3, 1), True),  # torch elastic restarts the workers: show why
        (True, False, (0, 0), True),  # no record: the launcher would only say "see its log"
        (False, True, (0, 0), True),  # plain torchrun
    ],
)
def test_a_worker_prints_its_error_only_when_no_launcher_will(
    tmp_path, monkeypatch, capsys, launched, recorded, restarts, printed
):
    for k in (LAUNCHED_ENV, "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(k, raising=False)
    if launched:
        monkeypatch.setenv(LAUNCHED_ENV, str(tmp_path))
    if recorded:
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", str(restarts[0]))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restarts[1]))
    worker.report_failure("model.lora.target_modules = ['x'] matches no layer", exit_code=2)
    err = capsys.readouterr().err
    assert err == ("paratrain: error: model.lora.target_modules = ['x'] matches no layer\n" if printed else "")
    if recorded:
        assert "matches no layer" in (tmp_path / "error.json").read_text()


def test_torchs_echo_of_a_failure_is_dropped_while_launching(caplog):
    torch_log = logging.getLogger(_TorchFailureEcho.LOGGER)
    caplog.set_level(logging.WARNING, logger=_TorchFailureEcho.LOGGER)
    quiet = _TorchFailureEcho()
    quiet.install()
    try:
        torch_log.error("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", 2, 0, 1, "python")
        torch_log.warning("Sending process %s closing signal %s", 12, "SIGTERM")
        torch_log.warning("Unable to shutdown process %s via %s, forcefully exiting via %s", 12, "SIGTERM", "SIGKILL")
    finally:
        quiet.remove()
    torch_log.error("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", 2, 0, 1, "python")
    assert [r.getMessage().split(" ")[0] for r in caplog.records] == ["Unable", "failed"]


@pytest.mark.timeout(180)
def test_a_bad_lora_target_in_two_workers_is_one_line(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("[data]\nargs = { max_bytes = 20_000 }\n")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "paratrain",
            "train",
            str(config),
            "--nproc-per-node",
            "2",
            "--set",
            f"run.out_dir={tmp_path}",
            "--set",
            "model.args={n_layer = 1, n_head = 2, d_model = 16}",
            "--set",
            "model.lora.target_modules=['qkv']",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=170,
    )
    assert proc.returncode == 2, proc.stderr
    lines = error_lines(proc.stderr)  # the start-up lines say what happened before; the error is one line
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("paratrain: error: worker rank") and "matches no layer" in lines[0], lines
