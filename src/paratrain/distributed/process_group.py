"""Start and stop the process group: ranks from torchrun, Slurm, or a single process."""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import gc
import logging
import os
import random
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from paratrain.config import ConfigError, DistConfig
from paratrain.distributed.store_auth import BIND_ENV, bound_tcp_store, is_loopback


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    owns_group: bool  # we created the process group, so we destroy it

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _slurm_to_torch_env() -> None:
    """Under `srun` (SLURM_* set, no torchrun variables) take the ranks from Slurm."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ or "SLURM_NTASKS" not in os.environ:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    if "MASTER_ADDR" not in os.environ:
        # The first host of the step's node list; `scontrol show hostnames` would expand ranges,
        # but a plain host or the first of a comma list covers the common cases without it.
        nodes = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_NODELIST") or "127.0.0.1"
        first = nodes.split(",")[0]
        if "[" in first:
            prefix, _, rest = first.partition("[")
            first = prefix + rest.split("-")[0].split(",")[0].rstrip("]")
        os.environ["MASTER_ADDR"] = first
    os.environ.setdefault("MASTER_PORT", str(29500 + int(os.environ.get("SLURM_JOB_ID", "0")) % 1000))


def resolve_device(cfg: DistConfig, local_rank: int) -> torch.device:
    want = cfg.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("dist.device = 'cuda' but no CUDA device is visible; use dist.device = 'cpu'")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_backend(cfg: DistConfig, device: torch.device) -> str:
    if cfg.backend == "nccl" and device.type != "cuda":
        raise ConfigError("dist.backend = 'nccl' needs CUDA devices; use dist.backend = 'gloo' on CPU")
    if cfg.backend == "gloo" or device.type == "cpu":
        return "gloo"
    # nccl for the device tensors and gloo for CPU-side collectives (object lists, checkpoints).
    return "cpu:gloo,cuda:nccl"


def init_distributed(cfg: DistConfig) -> DistContext:
    """Join (or create) the default process group for this process."""
    _slurm_to_torch_env()
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        return DistContext(rank, world, local_rank, resolve_device(cfg, local_rank), owns_group=False)
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = resolve_device(cfg, local_rank)
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    backend = resolve_backend(cfg, device)
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world,
            timeout=timeout,
            store=bound_job_store(rank, world, timeout),
            device_id=device if device.type == "cuda" else None,
        )
    else:
        if world != 1:
            raise ConfigError("WORLD_SIZE > 1 without MASTER_ADDR; start the job with `paratrain train` or torchrun")
        # A lone process (plain `python script.py`): a private in-memory store is all it needs.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistContext(rank, world, local_rank, device, owns_group=True)


def bound_job_store(rank: int, world: int, timeout: datetime.timedelta) -> dist.Store | None:
    """The job's store as env:// makes it, but rank 0 listens on MASTER_ADDR's address only.

    torch's env:// rank 0 hosts a TCPStore on all interfaces. Under our launcher with the agent
    store shared (TORCHELASTIC_USE_AGENT_STORE) the agent hosts it, already bound (see
    distributed/rendezvous.py); else rank 0 hosts it here on $PARATRAIN_BIND_ADDR (set by the
    launcher) or on the address MASTER_ADDR names. None: let torch do it (an address not ours).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    host, port = os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", "29500"))
    if rank == 0:
        bind = os.environ.get(BIND_ENV) or _master_bind_addr(
            host, multi_node=world != int(os.environ.get("LOCAL_WORLD_SIZE", world))
        )
        if bind is None:
            return None
        try:
            store = bound_tcp_store(host, port, bind_addr=bind, timeout=timeout, world_size=world)
        except OSError:
            return None
    else:
        store = dist.TCPStore(host, port, world, False, timeout)
    # What init_process_group does to the store it makes for env:// (keys apart from other users).
    return dist.PrefixStore("default_pg", store)


def _master_bind_addr(host: str, *, multi_node: bool) -> str | None:
    """The address MASTER_ADDR names on this machine; None if only a loopback one and other nodes must reach it.

    A host name can resolve locally to 127.0.1.1 (Debian's /etc/hosts) while other nodes reach it
    through DNS: binding to loopback then would lock them out, so torch's default is kept.
    """
    try:
        addrs = [a[4][0] for a in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)]
    except OSError:
        return None
    if not multi_node:
        return addrs[0]
    return next((a for a in addrs if not is_loopback(a)), None)


def init_env_process_group(backend: str, timeout: datetime.timedelta = datetime.timedelta(minutes=10)) -> None:
    """``init_process_group(backend)`` from torchrun's variables, with the job's store bound (see above)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        backend, rank=rank, world_size=world, timeout=timeout, store=bound_job_store(rank, world, timeout)
    )


def close_distributed(ctx: DistContext, *, barrier: bool = True) -> None:
    """Leave the process group we made, in an order that cannot deadlock in torch's destructors.

    Call it after dropping the run's DDP modules. A gloo group's destructor joins its worker
    threads, and a worker thread that is still freeing a finished collective (its tensors, its
    thread-local state) needs the GIL to drop their Python objects. When the group's last
    reference goes away in a holder that keeps the GIL (DDP's ``Reducer``, torch's native group
    registry), both wait on each other forever (pytorch#56297; caught here in a stuck rank:
    ``Reducer::~Reducer -> ~ProcessGroupGloo -> thread::join`` against ``~AsyncAllreduceWork ->
    decref_pyobject -> gil_scoped_acquire``). So the last references are ours, Python
    ``ProcessGroup`` objects, whose deallocation releases the GIL (pytorch#154976).

    ``barrier``: wait for every rank first (all are done with the group and the job's store,
    which rank 0 hosts in its process, before any leaves). False on a failure, where a peer may
    never arrive.
    """
    if not (ctx.owns_group and dist.is_initialized()):
        return
    gc.collect()  # a DDP module in a reference cycle is freed now, while the group still lives
    if barrier and ctx.world_size > 1:
        dist.barrier()
    groups = list(dist.distributed_c10d._world.pg_map)  # kept past destroy: the last references
    dist.destroy_process_group()
    del groups  # the groups' destructors run here, without the GIL


def run_then_exit(main: Callable[[], int | None]) -> NoReturn:
    """A worker process's last act: ``main()``, then an exit that runs no destructors.

    Whatever the run leaves (a group a traceback still holds, gloo's threads, a store) would be
    destroyed by the interpreter's exit, where torch's destructors can block forever
    (pytorch#56297, see close_distributed). The process ends anyway: its output and logs are
    flushed, then ``os._exit`` with ``main``'s code (what ``sys.exit(main())`` would exit with).
    """
    # A crash in native code (SIGSEGV, SIGABRT) prints every thread's Python stack to stderr,
    # which torchrun keeps per worker: an exit code -11 alone names no line.
    faulthandler.enable(all_threads=True)
    try:
        code = main()
    except SystemExit as e:  # argparse, or sys.exit inside main
        code = e.code
    except BaseException:  # noqa: BLE001 - printed as the interpreter would, exit code 1
        sys.excepthook(*sys.exc_info())
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code or 0)


def free_port() -> int:
    """A TCP port free on every address, drawn below the kernel's ephemeral range.

    A port the kernel hands out for ``bind(("127.0.0.1", 0))`` comes from the ephemeral range,
    from which it also picks every client connection's local port: between this call and the
    store's bind, a connection elsewhere on the machine can take it (EADDRINUSE in a CI run where
    a test opened 2000 connections beside the others, issue 55). Below the range no client
    connection lands; the draw is random per call (not the ``random`` module's state, which a
    test may seed) and checked by binding the wildcard address."""
    low = _ephemeral_low()
    draw = random.SystemRandom()
    for _ in range(100):
        port = draw.randrange(max(1024, low - 16384), low)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # a crowded range: the kernel's own pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
