"""The process torchrun starts: ``torchrun ... -m paratrain.launch.worker CONFIG [--set section.key=value ...]``.

Parses the config and calls :func:`paratrain.trainer.train`; a bad config exits with code 2 and
one line. (``-m paratrain.train`` is kept as an alias: see train.py.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from paratrain.checkpoint import CheckpointSaveError
from paratrain.config import ConfigError, add_resume_argument, add_set_argument, load_config, resume_overrides
from paratrain.distributed.hang import CollectiveTimeout
from paratrain.distributed.process_group import run_then_exit
from paratrain.launch.agent import forget_preempted, report_preempted
from paratrain.trainer import train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paratrain.launch.worker", description=__doc__)
    parser.add_argument("config", help="TOML config file")
    add_set_argument(parser)
    add_resume_argument(parser)
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, [*args.overrides, *resume_overrides(args.resume)])
        forget_preempted()  # an earlier attempt's report (torchrun restarts) is not this one's
        summary = train(cfg)
        if summary.get("preempted_at_step") is not None and not report_preempted(cfg.checkpoint.exit_code_on_preempt):
            return cfg.checkpoint.exit_code_on_preempt  # plain torchrun: the workers' code is the job's
    except ConfigError as e:
        record_failure(str(e), exit_code=2)
        print(f"paratrain: error: {e}", file=sys.stderr)
        return 2
    except (CollectiveTimeout, CheckpointSaveError) as e:  # already explained: no traceback
        record_failure(str(e), exit_code=1)
        print(f"paratrain: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        record_failure(f"{type(e).__name__}: {e}", exit_code=1)
        raise
    return 0


def record_failure(line: str, *, exit_code: int) -> None:
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
        return
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
        pass


if __name__ == "__main__":
    run_then_exit(main)
