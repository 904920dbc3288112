"""The benchmarks' job runner: one launcher job to its end, a hung one killed and run again."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

from paratrain.testing.dist_utils import REPO


def run_job(cmd: list[str], *, timeout_s: float = 300, tries: int = 2, out_dir: str | None = None) -> None:
    """Run one job to its end. A job past ``timeout_s`` (a gloo rendezvous or teardown that
    never returns; seen once in 16 baseline runs) is killed with its whole process group and
    run again from a fresh ``out_dir``, said on stderr: a hang is not a timing, and a re-run of
    the same job is."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "src"), REPO])}
    for attempt in range(1, tries + 1):
        if out_dir and os.path.exists(out_dir):
            shutil.rmtree(out_dir)  # never a resume of the killed run
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            _, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            print(
                f"benchmark run hung past {timeout_s:.0f} s (try {attempt}/{tries}), killed: {' '.join(cmd)}",
                file=sys.stderr,
            )
            continue
        if proc.returncode:
            sys.exit(f"benchmark run failed: {' '.join(cmd)}\n{err[-3000:]}")
        return
    sys.exit(f"benchmark run hung {tries} times: {' '.join(cmd)}")
