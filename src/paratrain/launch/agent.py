"""Start a job through torchrun's own launcher (torch.distributed.run and its elastic agent)."""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from paratrain.checkpoint.manifest import ELASTIC_ENV
from paratrain.config import Config, ConfigError, to_dict
from paratrain.distributed import rendezvous
from paratrain.distributed.store_auth import (
    BIND_ENV,
    SECRET_ENV,
    TamperedValue,
    interface_of,
    load_secret,
    new_secret,
    route_source,
)
from paratrain.observability.events import startup
from paratrain.preemption import EXIT_NOW, forward_to_children

# Set in the workers' environment by `paratrain train`: a folder of this node's launcher. A
# preempted worker leaves checkpoint.exit_code_on_preempt there and exits 0 (so the agent neither
# restarts nor reports it); the launcher returns that code. Every node's launcher learns it from
# its own workers: no shared disk, no rank 0 summary.json needed (a 0 from one node of a
# preempted job would tell the scheduler "done").
LAUNCHED_ENV = "PARATRAIN_LAUNCHER"
# glibc's malloc hands a freed block of 32 MiB or more back to the kernel (its dynamic mmap
# threshold stops there), so a CPU step's largest tensors (the logits, their gradient) fault
# their pages back in on every step: about 5,000 minor faults and 6 ms of a main-job step on
# this 2-core machine (docs/overhead.md, issue 58 item 4). Blocks under 256 MiB then stay in the
# heap, and up to 512 MiB of freed heap is kept, as torch's own CPU launcher keeps freed memory
# (torch.backends.xeon.run_cpu, with jemalloc). The workers get them unless the user set them.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(256 << 20), "MALLOC_TRIM_THRESHOLD_": str(512 << 20)}


def report_preempted(code: int) -> bool:
    """In a worker: leave ``code`` for this node's launcher; False when there is none (plain
    torchrun) or the note could not be written (then the worker's own exit code must say it)."""
    folder = os.environ.get(LAUNCHED_ENV)
    if not folder or not os.path.isdir(folder):
        return False
    try:
        with open(os.path.join(folder, f"preempted-rank-{os.environ.get('RANK', '0')}"), "w") as f:
            f.write(str(code))
    except OSError:
        return False
    return True


def forget_preempted() -> None:
    """In a worker, at its start: drop what an earlier attempt on this node reported, so a
    restart after a failed preempted save that then trains to the end returns 0. Safe: no worker
    of this attempt can report before all of them have joined the process group, after this."""
    folder = os.environ.get(LAUNCHED_ENV)
    if not folder or not os.path.isdir(folder):
        return
    for name in os.listdir(folder):
        with contextlib.suppress(OSError):
            os.remove(os.path.join(folder, name))


def preempted_code(folder: str) -> int | None:
    """The exit code this node's workers left after a preemption (None: not preempted)."""
    codes = []
    for name in os.listdir(folder):
        try:
            with open(os.path.join(folder, name)) as f:
                codes.append(int(f.read()))
        except (OSError, ValueError):
            continue
    return max(codes) if codes else None  # one config: the same code on every rank


def restore_environ(saved: dict[str, str]) -> None:
    """Make os.environ equal ``saved`` again (removing what was added since)."""
    for key in set(os.environ) - set(saved):
        del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


# Settings of the rendezvous (distributed/rendezvous.create_handler) a user may pass in --rdzv-conf.
RDZV_KEYS = (
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "heartbeat_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "read_timeout",
    "is_host",  # false on every node: the endpoint is a `paratrain rendezvous serve`, no node hosts it
)
_BOOLS = ("true", "false", "1", "0", "yes", "no")
_RDZV_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


@dataclass(frozen=True)
class LaunchSpec:
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""
    max_restarts: int = 0
    job_secret_file: str = ""
    bind: str = ""  # address this node listens on (multi-node); "" = the one that reaches the rendezvous
    max_nnodes: int = 0  # elastic (--nnodes MIN:MAX): MAX; 0 = nnodes (a fixed node count)
    rdzv_conf: str = ""  # more rendezvous settings, "key=value,..." (timeouts: docs/resilience.md)
    rdzv_id: str = ""  # the job's key on the rendezvous store; "" = rendezvous.default_rdzv_id (from the config)

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def validate(self) -> None:
        if self.nproc_per_node < 1 or self.nnodes < 1:
            raise ConfigError("--nproc-per-node and --nnodes must be >= 1")
        if max(self.nnodes, self.max_nnodes) > 1 and not self.rdzv_endpoint:
            raise ConfigError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
        if self.max_nnodes > self.nnodes and self.max_restarts < 1:
            # A membership change restarts the workers: each one spends a restart.
            raise ConfigError(
                f"--nnodes {self.nnodes}:{self.max_nnodes} needs --max-restarts >= 1 (each node lost or"
                " joined restarts the workers); e.g. --max-restarts 10"
            )
        if self.rdzv_endpoint:
            check_endpoint(self.rdzv_endpoint)
        for item in filter(None, self.rdzv_conf.split(",")):
            key, eq, value = item.partition("=")
            if not eq or key.strip() not in RDZV_KEYS:
                raise ConfigError(
                    f"--rdzv-conf {self.rdzv_conf}: {item!r} is not KEY=VALUE with KEY one of {', '.join(RDZV_KEYS)}"
                )
            if key.strip() == "is_host" and value.strip().lower() not in _BOOLS:
                raise ConfigError(f"--rdzv-conf {self.rdzv_conf}: is_host={value} is not true or false")
        if self.max_restarts < 0:
            raise ConfigError("--max-restarts must be >= 0")
        if self.rdzv_id and not _RDZV_ID.fullmatch(self.rdzv_id):
            raise ConfigError(
                f"--rdzv-id {self.rdzv_id!r}: use 1 to 64 letters, digits, '.', '_' or '-' (e.g. the scheduler's job id)"
            )
        if self.nnodes == 1 and self.bind and self.bind not in ("127.0.0.1", "::1", "localhost"):
            raise ConfigError(f"--bind {self.bind}: a one-node job listens on loopback only; drop --bind")

    @property
    def multi_node(self) -> bool:
        return max(self.nnodes, self.max_nnodes) > 1 or bool(self.rdzv_endpoint)

    @property
    def nnodes_arg(self) -> str:
        """torchrun's --nnodes: N, or MIN:MAX for an elastic job."""
        return f"{self.nnodes}:{self.max_nnodes}" if self.max_nnodes > self.nnodes else str(self.nnodes)

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


def check_endpoint(endpoint: str) -> None:
    """--rdzv-endpoint HOST:PORT ([v6]:PORT), port 0..65535: torch's own ValueError is a traceback."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(
            f"--rdzv-endpoint {endpoint}: expected HOST:PORT with a port within 0..65535 (e.g. node0:29500)"
        )


def torchrun_args(
    spec: LaunchSpec, module: str, module_args: list[str], *, bind: str = "127.0.0.1", job: Config | None = None
) -> list[str]:
    """torchrun's arguments; ``job``: a training job's config (its rendezvous id and identity, multi-node)."""
    args = [
        "--nproc-per-node",
        str(spec.nproc_per_node),
        "--nnodes",
        spec.nnodes_arg,
        "--max-restarts",
        str(spec.max_restarts),
    ]
    # The paratrain backend (distributed/rendezvous.py): torch's dynamic rendezvous with JSON +
    # HMAC state instead of c10d's pickle, and stores bound to `bind` instead of all interfaces.
    fingerprint = rendezvous.job_fingerprint(to_dict(job)) if job is not None else ""
    conf = ",".join(filter(None, [f"bind_addr={bind}", fingerprint and f"job={fingerprint}", spec.rdzv_conf]))
    if spec.rdzv_endpoint and spec.node_rank != 0 and "is_host" not in spec.rdzv_conf:
        # Who hosts the rendezvous store is decided, not raced: the node with --node-rank 0 (on
        # the endpoint's machine); the others are clients. `is_host=false` everywhere: a server.
        conf += ",is_host=false"
    args += ["--rdzv-backend", rendezvous.NAME, "--local-addr", bind, "--rdzv-conf", conf]
    if spec.rdzv_endpoint:
        # Ranks follow arrival order, --node-rank is only a hint to the rendezvous. The id is the
        # job's key on the store: one server serves many jobs, each under its own id.
        args += ["--rdzv-endpoint", spec.rdzv_endpoint, "--node-rank", str(spec.node_rank)]
        args += ["--rdzv-id", spec.rdzv_id or rendezvous.default_rdzv_id(fingerprint)]
    else:
        # What --standalone does (a rendezvous on a free local port), on loopback only.
        args += ["--rdzv-endpoint", "127.0.0.1:0", "--rdzv-id", str(uuid.uuid4())]
    # SIGTERM is the launcher's own (forward_sigterm): torchrun's agent would answer it by
    # terminating the workers and SIGKILLing them 30 s later, before they can save.
    # The agent still SIGTERMs the workers when one failed (before a restart, or to end the job);
    # they take it for a preemption, so a worker stuck in a step would keep the default 30 s
    # before the SIGKILL: 5 s is enough for one whose peers are gone to see its collective fail.
    args += ["--signals-to-handle", "SIGINT,SIGHUP,SIGQUIT"]
    if _torchrun_has("--shutdown-timeout"):  # torch >= 2.12; 2.10 and 2.11 keep their 30 s
        args += ["--shutdown-timeout", "5"]
    return args + ["--module", module, *module_args]


def _torchrun_has(option: str) -> bool:
    """Whether this torch's torchrun takes ``option`` (pyproject allows torch >= 2.10)."""
    from torch.distributed.run import get_args_parser

    return option in get_args_parser()._option_string_actions


def prepare_node(spec: LaunchSpec) -> tuple[str, Callable[[], None]]:
    """Give the agent (in-process) and its workers (their environment) the job secret and the listen
    address; returns the address and a function that restores this process's environment."""
    secret = load_secret(spec.job_secret_file, required=spec.multi_node) or new_secret()
    bind = spec.bind_addr()
    rendezvous.register()
    rendezvous.set_agent_secret(secret)
    # Workers sign their store values with the secret; paratrain never logs or prints it.
    env = {SECRET_ENV: secret, BIND_ENV: bind, **{k: os.environ.get(k, v) for k, v in MALLOC_ENV.items()}}
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


# Workers whose ``main(argv)`` a job of one process runs in the launcher's own process (run_here).
IN_PROCESS = ("paratrain.launch.worker", "paratrain.launch.eval_worker")


def launch(spec: LaunchSpec, module: str, module_args: list[str], *, job: Config | None = None) -> int:
    """Run ``python -m module module_args`` on ``spec``'s processes; returns the exit code
    (``checkpoint.exit_code_on_preempt`` when the workers stopped on SIGTERM with a checkpoint).
    ``job``: a training job's config, which gives a multi-node job its rendezvous id (unless
    ``spec.rdzv_id``) and tells its nodes apart from another job's on a shared server.
    A job of one process with nothing for torch elastic's agent to do runs here (run_here).

    The caller's environment is restored afterwards: torchrun's ``run()`` sets variables in this
    process for its workers (TORCHELASTIC_SIGNALS_TO_HANDLE, OMP_NUM_THREADS), and so does this
    function; a later launch or a run in the same process (verify runs two) must not inherit them.
    """
    spec.validate()
    if module in IN_PROCESS and alone(spec):
        return run_here(module, module_args)
    saved_env = dict(os.environ)
    reports = tempfile.mkdtemp(prefix="paratrain-launch-")  # this node's workers report a preemption here
    try:
        code = _launch(spec, module, module_args, reports=reports, job=job)
        preempted = preempted_code(reports)
        return preempted if code == 0 and preempted is not None else code
    finally:
        shutil.rmtree(reports, ignore_errors=True)
        restore_environ(saved_env)


def alone(spec: LaunchSpec) -> bool:
    """One process on one node, never restarted: the agent would only start it and wait."""
    return spec.world_size == 1 and max(spec.nnodes, spec.max_nnodes) == 1 and spec.max_restarts == 0


def run_here(module: str, module_args: list[str]) -> int:
    """``module``'s ``main(module_args)`` in this process, as the job's only rank.

    A second process would import torch, transformers and the trainer again after the launcher
    has: 5 to 6 s of a tiny SFT run's 17 s to its first step on a loaded 2-core CPU, where TRL's
    one process took 14 (benchmarks/peers/startup_vs_trl.py, docs/sft.md "Start-up against
    TRL"). The rank takes no address from the environment: without MASTER_ADDR a lone process
    joins a group of one on an in-memory store (process_group.init_distributed): no port is
    opened and nothing a shell or Slurm exported (RANK, MASTER_ADDR, SLURM_PROCID) reaches it.
    What the agent adds for one process is not needed: SIGTERM reaches the trainer's own handler
    (preemption.py), and its error line is printed by the worker itself (worker.report_failure).
    The environment is restored afterwards, as launch does.
    """
    print(startup("checks passed; running in this process"), file=sys.stderr)  # train, eval, verify alike
    saved = dict(os.environ)
    for key in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "SLURM_PROCID", LAUNCHED_ENV):
        os.environ.pop(key, None)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK="0")
    try:
        return importlib.import_module(module).main(module_args)
    except SystemExit as e:  # the worker's argparse
        return e.code if isinstance(e.code, int) else 1
    except Exception as e:  # a bug: its traceback, then the launcher's one line, as after a worker's
        traceback.print_exc()
        print(f"paratrain: error: the run failed: {type(e).__name__}: {e}".splitlines()[0], file=sys.stderr)
        return 1
    finally:
        restore_environ(saved)


def _launch(spec: LaunchSpec, module: str, module_args: list[str], *, reports: str, job: Config | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import get_args_parser, run

    bind, restore_env = prepare_node(spec)
    if spec.nproc_per_node > 1:
        # What torchrun would set (with a banner): the workers set their threads from the config
        # (worker.cpu_threads, dist.cpu_threads), the same on every node shape.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    if spec.max_restarts > 0 or spec.max_nnodes > spec.nnodes:
        # pytorch#135712: on torch 2.13 restarted workers often hang in init_process_group when
        # they share the agent's rendezvous TCP store; a store of their own avoids it.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    args = get_args_parser().parse_args(torchrun_args(spec, module, module_args, bind=bind, job=job))
    # After every check of the launcher: a refused job is its one error line and nothing else.
    print(startup(f"checks passed; starting {spec.nproc_per_node} worker process(es) on this node"), file=sys.stderr)
    terms = []

    def forward_sigterm(signum, frame) -> None:
        # Preemption (preemption.py): the workers stop after an agreed step, save and exit;
        # the agent then sees them succeed. Before any worker exists there is nothing to save.
        terms.append(time.monotonic())
        if not forward_to_children(signum):
            raise SignalException("SIGTERM before the workers started", sigval=signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, forward_sigterm)
    quiet = _TorchFailureEcho()
    quiet.install()
    os.environ[LAUNCHED_ENV] = reports
    if spec.max_nnodes > spec.nnodes:
        os.environ[ELASTIC_ENV] = "1"  # every (re)start resumes the newest checkpoint (resume_spec)
    try:
        run(args)
    except SignalException:
        print("paratrain: error: SIGTERM before the workers started; nothing to save", file=sys.stderr)
        return EXIT_NOW
    except RendezvousError as e:
        # e.g. a node with the wrong job secret: one line, no traceback.
        # Some carry no message (RendezvousClosedError): their type is the line then.
        print(f"paratrain: error: {(str(e).strip().splitlines() or [type(e).__name__])[0]}", file=sys.stderr)
        # A store value refused (forged, or replayed from another launch) is a refusal: 2, and
        # starting again as is meets the same peer (issue 55, item 1).
        return 2 if isinstance(e, TamperedValue) else 1
    except ChildFailedError as e:
        print(f"paratrain: error: {failure_summary(e.failures)}", file=sys.stderr)
        if terms:  # ended by SIGTERM (a second one, or the grace period ran out)
            return EXIT_NOW
        # The cause decides: a bad config (2) stays 2 even when the agent then ends the others.
        return 2 if _exit_code(first_failure(e.failures)[1]) == 2 else 1
    finally:
        quiet.remove()
        signal.signal(signal.SIGTERM, previous)
        restore_env()  # the agent's job secret (the environment is restored by launch)
    return 0


class _TorchFailureEcho(logging.Filter):
    """Drops torch elastic's own lines about a failure the launcher reports in its one line.

    When a worker fails, torch's process context logs ``failed (exitcode: N) local_rank: ...``
    and ``Sending process PID closing signal SIGTERM`` for each worker it ends; the launcher's
    line (failure_summary) names the first failure, its exit code or signal, its own error line
    and how many workers stopped after it. Everything else torch logs (a worker that would not
    exit, a restart of the worker group) still shows.
    """

    LOGGER = "torch.distributed.elastic.multiprocessing.api"
    ECHOES = ("failed (exitcode:", "Closing process ", "Sending process ")

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(self.ECHOES))

    def install(self) -> None:
        logging.getLogger(self.LOGGER).addFilter(self)

    def remove(self) -> None:
        logging.getLogger(self.LOGGER).removeFilter(self)


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
