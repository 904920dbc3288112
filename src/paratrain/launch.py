"""Start a job through torchrun's own launcher (torch.distributed.run and its elastic agent)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from paratrain.config import ConfigError


@dataclass(frozen=True)
class LaunchSpec:
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""
    max_restarts: int = 0

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def validate(self) -> None:
        if self.nproc_per_node < 1 or self.nnodes < 1:
            raise ConfigError("--nproc-per-node and --nnodes must be >= 1")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ConfigError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
        if self.max_restarts < 0:
            raise ConfigError("--max-restarts must be >= 0")


def torchrun_args(spec: LaunchSpec, module: str, module_args: list[str]) -> list[str]:
    args = [
        "--nproc-per-node",
        str(spec.nproc_per_node),
        "--nnodes",
        str(spec.nnodes),
        "--max-restarts",
        str(spec.max_restarts),
    ]
    if spec.rdzv_endpoint:
        # c10d rendezvous: ranks follow arrival order, --node-rank is only a hint to it.
        args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", spec.rdzv_endpoint, "--node-rank", str(spec.node_rank)]
    else:
        args += ["--standalone"]  # one node, rendezvous on a free local port
    return args + ["--module", module, *module_args]


def launch(spec: LaunchSpec, module: str, module_args: list[str]) -> int:
    """Run ``python -m module module_args`` on ``spec``'s processes; returns the exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    spec.validate()
    if spec.max_restarts > 0:
        # pytorch#135712: on torch 2.13 restarted workers often hang in init_process_group when
        # they share the agent's rendezvous TCP store; a store of their own avoids it.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    args = get_args_parser().parse_args(torchrun_args(spec, module, module_args))
    try:
        run(args)
    except ChildFailedError as e:
        print(f"paratrain: error: {failure_summary(e.failures)}", file=sys.stderr)
        # The cause decides: a bad config (2) stays 2 even when the agent then ends the others.
        return 2 if _exit_code(first_failure(e.failures)[1]) == 2 else 1
    return 0


def first_failure(failures: dict) -> tuple[int, object]:
    """The (global rank, ProcessFailure) that failed first.

    When one worker fails, torchrun's agent ends the others, whose last words are a "connection
    closed by peer" collective error: the cause is the earliest failure. Workers record the moment
    they failed (worker.record_failure); a worker without that record (killed by a signal, or
    ended by the agent) falls back to the elastic timestamp, the agent's own observation.
    """

    def when(item):
        rank, f = item
        recorded = _record(f).get("time")
        return (recorded if recorded is not None else float(f.timestamp), rank)

    return min(failures.items(), key=when)


def _record(f) -> dict:
    """What worker.record_failure left in the worker's error file ({} when nothing)."""
    data = f.error_file_data if isinstance(f.error_file_data, dict) else {}
    return data.get("paratrain", {}) if isinstance(data.get("paratrain"), dict) else {}


def _exit_code(f) -> int:
    # The code the worker was exiting with when it recorded its failure: the agent may have ended
    # it by a signal a moment later.
    return _record(f).get("exit_code", f.exitcode)


def failure_summary(failures: dict) -> str:
    """One line naming the first failure: its rank, exit code and own error line."""
    rank, f = first_failure(failures)
    line = _record(f).get("line") or (f.message if isinstance(f.message, str) else "")
    if not line or line.startswith("To enable traceback"):
        line = "see its log above"
    code = _exit_code(f)
    what = f"signal {f.signal_name()}" if code < 0 else f"exit code {code}"
    others = len(failures) - 1
    tail = f" ({others} other worker(s) stopped after it)" if others else ""
    return f"worker rank {rank} failed first ({what}): {line}{tail}"
