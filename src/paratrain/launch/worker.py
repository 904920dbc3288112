"""The process torchrun starts: ``torchrun ... -m paratrain.launch.worker CONFIG [--set section.key=value ...]``.

Parses the config and calls :func:`paratrain.trainer.train`; a bad config exits with code 2 and
one line. (``-m paratrain.train`` is kept as an alias: see train.py.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time

import torch

from paratrain.checkpoint import CheckpointSaveError
from paratrain.config import ConfigError, add_resume_argument, add_set_argument, load_config, resume_overrides
from paratrain.distributed.hang import CollectiveTimeout
from paratrain.distributed.process_group import run_then_exit
from paratrain.launch.agent import LAUNCHED_ENV, forget_preempted, report_preempted
from paratrain.observability.events import STARTED_AT, startup
from paratrain.observability.metrics import MetricsWriteError
from paratrain.trainer import train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paratrain.launch.worker", description=__doc__)
    parser.add_argument("config", help="TOML config file")
    add_set_argument(parser)
    add_resume_argument(parser)
    args = parser.parse_args(argv)
    # Under paratrain's launcher (it set the command's start), before the logger exists (trainer.build_run).
    if os.environ.get("RANK", "0") == "0" and STARTED_AT in os.environ:
        print(startup("torch and the trainer imported; joining the process group"), file=sys.stderr, flush=True)
    try:
        cfg = load_config(args.config, [*args.overrides, *resume_overrides(args.resume, args.overrides)])
        world = int(os.environ.get("WORLD_SIZE", "1"))
        threads = cpu_threads(cfg.dist.cpu_threads, world_size=world, bitwise=cfg.run.bitwise)
        if threads:
            torch.set_num_threads(threads)
        forget_preempted()  # an earlier attempt's report (torchrun restarts) is not this one's
        summary = train(cfg)
        if summary.get("preempted_at_step") is not None and not report_preempted(cfg.checkpoint.exit_code_on_preempt):
            return cfg.checkpoint.exit_code_on_preempt  # plain torchrun: the workers' code is the job's
    except ConfigError as e:
        report_failure(str(e), exit_code=2)
        return 2
    except (CollectiveTimeout, CheckpointSaveError, MetricsWriteError) as e:  # already explained: no traceback
        report_failure(str(e), exit_code=1)
        return 1
    except Exception as e:
        record_failure(f"{type(e).__name__}: {e}", exit_code=1)
        raise
    return 0


def cpu_threads(setting: int, *, world_size: int, bitwise: bool = False) -> int | None:
    """The intra-op CPU threads of each process of a job: ``dist.cpu_threads`` when set, else 1
    when the job has more than one process and None (torch's default, one per core) for one.

    A function of the config and the job's world size only, never of the node's shape: torchrun
    sets ``OMP_NUM_THREADS=1`` only on a node of more than one process, so two one-process nodes
    ran with more threads than one two-process node, and CPU matmuls split over another number
    of threads round differently (1.45e-4 relative by step 200 of the debug config).
    """
    if setting > 0:
        return setting
    # run.bitwise: one thread on every layout, one process's included (docs/bitwise.md).
    return 1 if world_size > 1 or bitwise else None


def report_failure(line: str, *, exit_code: int) -> None:
    """Print ``paratrain: error: LINE`` unless paratrain's launcher will print it for us.

    Under ``paratrain train`` the launcher prints one line naming the first failure, read from
    the record this leaves (record_failure); the worker's own copy would make two of the same
    line. It still prints when there is no launcher (plain torchrun, a test), when the record
    could not be written, and when torch elastic will restart the workers after this attempt
    (the launcher prints only at the end, and the cause of a restart must be seen).
    """
    recorded = record_failure(line, exit_code=exit_code)
    restarts_left = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) - int(
        os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    )
    if not (recorded and os.environ.get(LAUNCHED_ENV) and restarts_left <= 0):
        print(f"paratrain: error: {line}", file=sys.stderr)


def record_failure(line: str, *, exit_code: int) -> bool:
    """Leave this worker's error line and the moment it failed where torch elastic's agent reads it.

    torchrun gives each worker an error file (``TORCHELASTIC_ERROR_FILE``) and the agent hands its
    contents to the launcher in ``ProcessFailure.error_file_data``. The launcher names the earliest
    failure: when one rank fails, the others die of it a moment later ("connection closed by
    peer"), so the cause is the first one, not the rank the agent happens to list first. The
    elastic format's own timestamp has whole seconds; ``paratrain.time`` is precise. The exit
    code is recorded too: the agent may end this worker by a signal before it exits on its own.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    now = time.time()
    first_line = (line.strip().splitlines() or [""])[0][:1000]
    data = {
        "message": {"message": first_line, "extraInfo": {"py_callstack": "", "timestamp": str(int(now))}},
        "paratrain": {"time": now, "line": first_line, "exit_code": exit_code},
    }
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:  # reporting must never hide the error itself
        return False
    return True


def stop_with_launcher(poll_s: float = 1.0) -> None:
    """End this worker within seconds of its launcher's death: a worker orphaned by a SIGKILLed
    launcher would otherwise train on for minutes, holding its device.

    torch elastic starts each worker in a session of its own, so a signal to the launcher's
    process group never reaches it. Two guards: Linux's parent-death signal (``prctl
    PR_SET_PDEATHSIG``: the kernel sends SIGKILL when the parent dies, even while this process
    is stuck in C code holding the GIL), and a daemon thread that watches the parent's pid
    (other systems, or a parent that died before the prctl took effect: then the pid changed).
    """
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        pr_set_pdeathsig = 1
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        print(f"paratrain: error: the launcher (pid {parent}) is gone; this worker stops", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="paratrain-launcher-watch", daemon=True).start()


if __name__ == "__main__":
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun or paratrain's launcher
        stop_with_launcher()
    run_then_exit(main)
