"""Start a job through torchrun's own launcher (torch.distributed.run and its elastic agent)."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from paratrain.config import ConfigError
from paratrain.distributed import rendezvous
from paratrain.distributed.store_auth import BIND_ENV, SECRET_ENV, interface_of, load_secret, new_secret, route_source


@dataclass(frozen=True)
class LaunchSpec:
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""
    max_restarts: int = 0
    job_secret_file: str = ""
    bind: str = ""  # address this node listens on (multi-node); "" = the one that reaches the rendezvous

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
        if self.nnodes == 1 and self.bind and self.bind not in ("127.0.0.1", "::1", "localhost"):
            raise ConfigError(f"--bind {self.bind}: a one-node job listens on loopback only; drop --bind")

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1 or bool(self.rdzv_endpoint)

    def bind_addr(self) -> str:
        """What this node's stores and gloo/NCCL bootstrap listen on: loopback for one node, else one address."""
        if not self.multi_node:
            return "127.0.0.1"
        if self.bind:
            return self.bind
        host = self.rdzv_endpoint.rsplit(":", 1)[0].strip("[]")
        try:
            return route_source(host)
        except OSError as e:
            raise ConfigError(
                f"--rdzv-endpoint {self.rdzv_endpoint}: cannot find the local address that reaches it ({e});"
                " pass --bind ADDR"
            ) from None


def torchrun_args(spec: LaunchSpec, module: str, module_args: list[str], *, bind: str = "127.0.0.1") -> list[str]:
    args = [
        "--nproc-per-node",
        str(spec.nproc_per_node),
        "--nnodes",
        str(spec.nnodes),
        "--max-restarts",
        str(spec.max_restarts),
    ]
    # The paratrain backend (distributed/rendezvous.py): torch's dynamic rendezvous with JSON +
    # HMAC state instead of c10d's pickle, and stores bound to `bind` instead of all interfaces.
    args += ["--rdzv-backend", rendezvous.NAME, "--local-addr", bind, "--rdzv-conf", f"bind_addr={bind}"]
    if spec.rdzv_endpoint:
        # Ranks follow arrival order, --node-rank is only a hint to the rendezvous.
        args += ["--rdzv-endpoint", spec.rdzv_endpoint, "--node-rank", str(spec.node_rank)]
    else:
        # What --standalone does (a rendezvous on a free local port), on loopback only.
        args += ["--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id", str(uuid.uuid4())]
    return args + ["--module", module, *module_args]


def prepare_node(spec: LaunchSpec) -> tuple[str, Callable[[], None]]:
    """Give the agent (in-process) and its workers (their environment) the job secret and the listen
    address; returns the address and a function that restores this process's environment."""
    secret = load_secret(spec.job_secret_file, required=spec.multi_node) or new_secret()
    bind = spec.bind_addr()
    rendezvous.register()
    rendezvous.set_agent_secret(secret)
    # Workers sign their store values with the secret; paratrain never logs or prints it.
    env = {SECRET_ENV: secret, BIND_ENV: bind}
    iface = interface_of(bind)
    if iface:
        # gloo's and NCCL's bootstrap listen on the address of this interface, not the host name's.
        env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", iface)
        env["NCCL_SOCKET_IFNAME"] = os.environ.get("NCCL_SOCKET_IFNAME", iface)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)

    def restore() -> None:
        rendezvous.set_agent_secret(None)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    return bind, restore


def launch(spec: LaunchSpec, module: str, module_args: list[str]) -> int:
    """Run ``python -m module module_args`` on ``spec``'s processes; returns the exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import get_args_parser, run

    spec.validate()
    bind, restore_env = prepare_node(spec)
    if spec.max_restarts > 0:
        # pytorch#135712: on torch 2.13 restarted workers often hang in init_process_group when
        # they share the agent's rendezvous TCP store; a store of their own avoids it.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    args = get_args_parser().parse_args(torchrun_args(spec, module, module_args, bind=bind))
    try:
        run(args)
    except RendezvousError as e:
        # e.g. a node with the wrong job secret: one line, no traceback.
        print(f"paratrain: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    except ChildFailedError as e:
        print(f"paratrain: error: {failure_summary(e.failures)}", file=sys.stderr)
        # The cause decides: a bad config (2) stays 2 even when the agent then ends the others.
        return 2 if _exit_code(first_failure(e.failures)[1]) == 2 else 1
    finally:
        restore_env()  # a later launch in this process (verify runs two) starts from a clean slate
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
        # The elastic timestamp is int(time.time()) of when the agent looked: the failure lies in
        # [ts, ts + 1), so compare its upper bound, or a worker the agent ended (in the same second)
        # could look earlier than the recorded cause.
        return (recorded if recorded is not None else f.timestamp + 1.0, rank)

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
