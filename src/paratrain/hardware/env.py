"""``paratrain env``: what this machine (or every node of a job) offers, and what looks wrong.

Versions (Python, torch, CUDA, NCCL, gloo), GPUs with their memory and the GPU-to-GPU
topology (``nvidia-smi topo -m``), network interfaces, the environment variables that steer
NCCL, gloo, torch.distributed and the rendezvous, the rendezvous defaults, and each problem
found with its advice. Run with ``--nproc-per-node``/``--nnodes`` (as for ``train``) it starts a
job and compares the ranks (torch, CUDA and NCCL versions must match on every node).

The checks are pure functions of the collected facts (:func:`find_problems`,
:func:`compare_ranks`), so they are tested without the hardware they are about.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys

import torch
import torch.distributed as dist

from paratrain.distributed.json_collectives import all_gather_json
from paratrain.distributed.process_group import init_env_process_group
from paratrain.distributed.store_auth import BIND_ENV, SECRET_ENV, interface_of

VAR_PREFIXES = ("NCCL_", "TORCH_", "GLOO_", "MASTER_", "TORCHELASTIC_", "CUDA_", "PYTORCH_")
VAR_NAMES = (
    "OMP_NUM_THREADS",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NVIDIA_VISIBLE_DEVICES",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_JOB_ID",
)
RENDEZVOUS_DEFAULTS = {
    "MASTER_PORT (init_method env://, plain torchrun)": "29500",
    "torchrun --rdzv-endpoint port (c10d)": "29400",
    "torchrun --standalone": "c10d rendezvous on localhost, a free port",
    "paratrain train (one node)": "paratrain rendezvous (JSON + HMAC) on 127.0.0.1, a free port, a generated job secret",
    "paratrain train --nnodes N": "paratrain rendezvous at --rdzv-endpoint HOST:PORT, the same on every node;"
    " job secret from PARATRAIN_JOB_SECRET or --job-secret-file",
    "rendezvous join timeout": "900 s (torchrun --rdzv-conf join_timeout=...)",
    "collective timeout": "dist.timeout_s in the config (600 s by default)",
}


def _run(cmd: list[str], timeout: float = 10.0) -> str | None:
    if not shutil.which(cmd[0]):
        return None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def network_interfaces() -> list[dict]:
    """Interfaces with state and addresses (from /sys/class/net and `ip -o addr`, when present)."""
    names = []
    if os.path.isdir("/sys/class/net"):
        names = sorted(os.listdir("/sys/class/net"))
    else:
        try:
            names = sorted(n for _, n in socket.if_nameindex())
        except OSError:
            names = []
    addrs: dict[str, list[str]] = {}
    out = _run(["ip", "-o", "addr", "show"])
    for line in (out or "").splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2] in ("inet", "inet6"):
            addrs.setdefault(parts[1], []).append(parts[3])
    result = []
    for name in names:
        state = None
        try:
            with open(f"/sys/class/net/{name}/operstate") as f:
                state = f.read().strip()
        except OSError:
            pass
        kind = (
            "loopback"
            if name == "lo" or name.startswith("lo")
            else ("infiniband" if os.path.isdir(f"/sys/class/net/{name}/device/infiniband") else "ethernet/other")
        )
        result.append({"name": name, "state": state, "kind": kind, "addresses": addrs.get(name, [])})
    return result


def gpu_info() -> list[dict]:
    if not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        gpus.append(
            {
                "index": i,
                "name": p.name,
                "memory_gib": round(p.total_memory / 2**30, 2),
                "capability": f"{p.major}.{p.minor}",
                "multiprocessors": p.multi_processor_count,
            }
        )
    return gpus


def nccl_version() -> str | None:
    if not (torch.cuda.is_available() or torch.version.cuda) or not dist.is_nccl_available():
        return None
    try:
        v = torch.cuda.nccl.version()
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:  # noqa: BLE001 - a CUDA build without a usable NCCL
        return None


def collect() -> dict:
    """The facts of this process's machine (cheap, no process group needed)."""
    host = socket.gethostname()
    try:
        host_ip = socket.gethostbyname(host)
    except OSError:
        host_ip = None
    variables = {k: v for k, v in sorted(os.environ.items()) if k.startswith(VAR_PREFIXES) or k in VAR_NAMES}
    return {
        "host": host,
        "host_resolves_to": host_ip,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cuda_driver": _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
        "nccl": nccl_version(),
        "nccl_available": dist.is_nccl_available(),
        # gloo is compiled into torch and has no version of its own: torch's version names it.
        "gloo_available": dist.is_gloo_available(),
        "mpi_available": dist.is_mpi_available(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpus": gpu_info(),
        "gpu_topology": _run(["nvidia-smi", "topo", "-m"]),
        "interfaces": network_interfaces(),
        "variables": variables,
        "rendezvous_defaults": RENDEZVOUS_DEFAULTS,
        "listen": listen_plan(),
    }


def listen_plan() -> dict:
    """What this rank's stores and gloo/NCCL bootstrap listen on (docs/security.md).

    Inside a job the launcher has set it; outside, it is what a one-node `paratrain train` uses.
    """
    address = os.environ.get(BIND_ENV, "127.0.0.1")
    iface = interface_of(address)
    return {
        "address": address,
        "gloo_interface": os.environ.get("GLOO_SOCKET_IFNAME", iface),
        "nccl_interface": os.environ.get("NCCL_SOCKET_IFNAME", iface),
        "job_secret": "set" if os.environ.get(SECRET_ENV) else "not set",  # never its value
        "in_job": BIND_ENV in os.environ,
    }


# ----------------------------------------------------------------------------- checks (pure)


def _iface_matches(spec: str, names: list[str]) -> bool:
    """NCCL/gloo-style interface spec: comma list of prefixes; '^' excludes, '=' means exact."""
    spec = spec.strip()
    if spec.startswith("^"):
        return True  # an exclusion list always leaves the rest
    exact = spec.startswith("=")
    wanted = [w.strip() for w in spec.lstrip("=").split(",") if w.strip()]
    return any((n == w) if exact else n.startswith(w) for w in wanted for n in names)


def find_problems(info: dict, *, backend: str = "auto", nnodes: int = 1, nproc_per_node: int = 1) -> list[dict]:
    """Each problem in ``info`` (from :func:`collect`) as {"problem", "advice"}."""
    out = []
    var = info.get("variables", {})

    def add(problem: str, advice: str) -> None:
        out.append({"problem": problem, "advice": advice})

    cuda = info.get("cuda_available", False)
    effective = backend if backend != "auto" else ("nccl" if cuda else "gloo")
    up = [
        i
        for i in info.get("interfaces", [])
        if i["kind"] != "loopback"
        and i.get("state") in ("up", "unknown", None)
        and not i["name"].startswith(("docker", "veth", "virbr", "br-"))
    ]
    names = [i["name"] for i in info.get("interfaces", [])]
    if len(up) > 1:
        listed = ", ".join(i["name"] for i in up)
        if effective == "nccl" and "NCCL_SOCKET_IFNAME" not in var:
            add(
                f"several network interfaces are up ({listed}) and NCCL_SOCKET_IFNAME is not set",
                "NCCL may bootstrap over the wrong one (and hang across nodes); export NCCL_SOCKET_IFNAME=<the"
                " interface of the cluster network>, the same on every node",
            )
        if "GLOO_SOCKET_IFNAME" not in var:
            add(
                f"several network interfaces are up ({listed}) and GLOO_SOCKET_IFNAME is not set",
                "gloo binds to the interface the host name resolves to; export GLOO_SOCKET_IFNAME=<interface>"
                " when that is not the cluster network",
            )
    for key in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        if key in var and names and not _iface_matches(var[key], names):
            add(
                f"{key}={var[key]} matches no interface of this machine ({', '.join(names)})",
                f"set {key} to one of the names above (NCCL takes prefixes; '=' for an exact name)",
            )
    if var.get("NCCL_P2P_DISABLE", "0") not in ("0", ""):
        add(
            "NCCL_P2P_DISABLE is set: GPU peer-to-peer (NVLink/PCIe) is off",
            "intra-node collectives go through host memory, several times slower; unset it unless a"
            " driver/IOMMU problem forced it (then fix that: check `nvidia-smi topo -m` and ACS settings)",
        )
    if var.get("NCCL_SHM_DISABLE", "0") not in ("0", ""):
        add(
            "NCCL_SHM_DISABLE is set: shared-memory transport is off",
            "unset it unless needed (e.g. a too-small /dev/shm in a container: enlarge it with --shm-size)",
        )
    if var.get("NCCL_IB_DISABLE", "0") not in ("0", "") and (
        nnodes > 1 or any(i["kind"] == "infiniband" for i in info.get("interfaces", []))
    ):
        add(
            "NCCL_IB_DISABLE is set: InfiniBand/RoCE is off and inter-node traffic uses TCP sockets",
            "unset it to use the RDMA fabric (run `paratrain bench comm --nnodes ...` to compare)",
        )
    if cuda and effective == "gloo":
        add(
            "CUDA devices are visible but the backend is gloo",
            "gloo all-reduces GPU tensors through host memory; use dist.backend = 'nccl' (or 'auto') for GPU training",
        )
    if effective == "nccl" and not cuda:
        add("backend nccl but no CUDA device is visible", "use dist.backend = 'gloo' (or 'auto') on CPU")
    if effective == "nccl" and cuda and not info.get("nccl"):
        add("this torch build has no usable NCCL", "install a CUDA build of torch with NCCL, or use gloo")
    if "CUDA_VISIBLE_DEVICES" in var and var["CUDA_VISIBLE_DEVICES"].strip() == "":
        add("CUDA_VISIBLE_DEVICES is set but empty: no GPU is visible", "unset it or list the GPUs to use")
    n_gpus = len(info.get("gpus", []))
    if cuda and 0 < n_gpus < nproc_per_node:
        add(
            f"{nproc_per_node} processes per node but only {n_gpus} GPU(s) visible",
            "ranks would share GPUs (NCCL refuses two ranks on one GPU); use --nproc-per-node <= the GPU count",
        )
    ip = info.get("host_resolves_to")
    if nnodes > 1 and ip and ip.startswith("127.") and "GLOO_SOCKET_IFNAME" not in var:
        add(
            f"the host name {info.get('host')} resolves to {ip}, a loopback address",
            "other nodes cannot reach this node by name; fix /etc/hosts or export GLOO_SOCKET_IFNAME/"
            "NCCL_SOCKET_IFNAME, and pass a reachable --rdzv-endpoint",
        )
    if var.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "") == "0":
        add(
            "TORCH_NCCL_ASYNC_ERROR_HANDLING=0: a failed or stuck collective is never detected",
            "unset it so a hung rank ends the job after dist.timeout_s instead of hanging forever",
        )
    if var.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL":
        add(
            "TORCH_DISTRIBUTED_DEBUG=DETAIL checks every collective with an extra one",
            "keep it for debugging a hang or a shape mismatch; unset it for speed",
        )
    if var.get("CUDA_LAUNCH_BLOCKING", "0") not in ("0", ""):
        add(
            "CUDA_LAUNCH_BLOCKING is set: every kernel launch waits for the GPU",
            "a debugging switch that serialises the GPU; unset it for training",
        )
    if nproc_per_node > 1 and not cuda and "OMP_NUM_THREADS" in var:
        threads = int(var["OMP_NUM_THREADS"]) if var["OMP_NUM_THREADS"].isdigit() else 0
        cpus = info.get("cpu_count") or 0
        if threads * nproc_per_node > cpus > 0:
            add(
                f"OMP_NUM_THREADS={threads} x {nproc_per_node} processes > {cpus} CPUs",
                f"the processes oversubscribe the cores; set OMP_NUM_THREADS={max(1, cpus // nproc_per_node)}",
            )
    topo = info.get("gpu_topology") or ""
    if n_gpus > 1 and topo and not re.search(r"\bNV\d+\b", topo):
        add(
            "no NVLink between the GPUs in `nvidia-smi topo -m`",
            "GPU-to-GPU traffic crosses PCIe (or the CPU): prefer tensor parallelism only within NVLink"
            " groups and check intra-node bandwidth with `paratrain bench comm`",
        )
    return out


def compare_ranks(infos: list[dict]) -> list[dict]:
    """Problems across the ranks of a job: versions that must match everywhere."""
    out = []
    for key, what in (("torch", "torch"), ("cuda_build", "CUDA (torch build)"), ("nccl", "NCCL"), ("python", "Python")):
        seen: dict = {}
        for rank, info in enumerate(infos):
            seen.setdefault(str(info.get(key)), []).append(rank)
        if len(seen) > 1:
            detail = "; ".join(f"{v} on ranks {_ranges(r)}" for v, r in seen.items())
            out.append(
                {
                    "problem": f"mismatched {what} versions across ranks: {detail}",
                    "advice": "install the same environment (same torch wheel) on every node; mixed versions"
                    " can hang or corrupt collectives",
                }
            )
    return out


def _ranges(ranks: list[int]) -> str:
    return ",".join(map(str, ranks)) if len(ranks) <= 6 else f"{ranks[0]}..{ranks[-1]} ({len(ranks)})"


# ----------------------------------------------------------------------------- output


def format_report(info: dict, problems: list[dict], *, ranks: list[dict] | None = None) -> str:
    lines = [
        f"paratrain env on {info['host']} ({info['platform']})",
        f"  python {info['python']} | torch {info['torch']} | CUDA build {info['cuda_build']}"
        f" (available: {info['cuda_available']}, driver {info['cuda_driver']}) | NCCL {info['nccl']}"
        f" | gloo {'available (bundled with torch ' + info['torch'] + ')' if info['gloo_available'] else 'missing'}"
        f" | MPI {'yes' if info['mpi_available'] else 'no'}",
        f"  CPUs {info['cpu_count']} | torch threads {info['torch_threads']}",
    ]
    lines.append("GPUs:" if info["gpus"] else "GPUs: none visible")
    for g in info["gpus"]:
        lines.append(
            f"  [{g['index']}] {g['name']} {g['memory_gib']} GiB, compute {g['capability']}, {g['multiprocessors']} SMs"
        )
    if info["gpu_topology"]:
        lines.append("GPU topology (nvidia-smi topo -m):")
        lines += ["  " + ln for ln in info["gpu_topology"].splitlines()]
    lines.append("network interfaces:")
    for i in info["interfaces"]:
        lines.append(f"  {i['name']:<12} {str(i['state']):<8} {i['kind']:<15} {' '.join(i['addresses'])}")
    lines.append(f"  host name {info['host']} resolves to {info['host_resolves_to']}")
    lines.append("variables (NCCL_*, TORCH_*, GLOO_*, MASTER_*, CUDA_*, OMP_NUM_THREADS, ...):")
    lines += [f"  {k}={v}" for k, v in info["variables"].items()] or ["  (none set)"]
    listen = info.get("listen")
    if listen:
        lines.append(
            (
                "listening (this job): "
                if listen["in_job"]
                else "listening (a one-node job; several nodes: --bind or the"
            )
            + ("" if listen["in_job"] else " address that reaches --rdzv-endpoint): ")
            + f"stores on {listen['address']}, gloo on {listen['gloo_interface']}, NCCL on {listen['nccl_interface']},"
            f" job secret {listen['job_secret']}"
        )
    lines.append("rendezvous defaults:")
    lines += [f"  {k}: {v}" for k, v in info["rendezvous_defaults"].items()]
    if ranks:
        lines.append(f"ranks ({len(ranks)}):")
        for r, ri in enumerate(ranks):
            lines.append(
                f"  rank {r}: {ri['host']} torch {ri['torch']} CUDA {ri['cuda_build']} NCCL {ri['nccl']}"
                f" GPUs {len(ri['gpus'])}"
                + (
                    f" | listens on {ri['listen']['address']} (gloo {ri['listen']['gloo_interface']})"
                    if "listen" in ri
                    else ""
                )
            )
    lines.append(f"problems found: {len(problems)}")
    for p in problems:
        lines.append(f"  ! {p['problem']}\n      -> {p['advice']}")
    return "\n".join(lines)


def add_backend_argument(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto", help=help)


def add_env_arguments(p: argparse.ArgumentParser) -> None:
    add_backend_argument(p, "the backend the job will use (checks that depend on it)")
    p.add_argument(
        "--json", nargs="?", const="-", default="", help="write the report as JSON to FILE (or to stdout with no FILE)"
    )


def env_worker_args(args: argparse.Namespace) -> list[str]:
    out = ["--backend", args.backend, "--nnodes", str(args.nnodes), "--nproc-per-node", str(args.nproc_per_node)]
    if args.json:
        out += ["--json", args.json if args.json == "-" else os.path.abspath(args.json)]
    return out


def build_report(*, backend: str, nnodes: int, nproc_per_node: int, ranks: list[dict] | None = None) -> dict:
    info = collect() if ranks is None else ranks[0]
    problems = find_problems(info, backend=backend, nnodes=nnodes, nproc_per_node=nproc_per_node)
    if ranks:
        # The machine checks once per node (its first rank), then what must match across ranks.
        seen = {(info["host"], info["variables"].get("GROUP_RANK"))}
        for other in ranks[1:]:
            node = (other["host"], other["variables"].get("GROUP_RANK"))
            if node not in seen:
                seen.add(node)
                for p in find_problems(other, backend=backend, nnodes=nnodes, nproc_per_node=nproc_per_node):
                    problems.append({**p, "problem": f"[{node[0]} node {node[1]}] {p['problem']}"})
        problems += compare_ranks(ranks)
    return {"info": info, "problems": problems, "ranks": ranks or []}


def emit(report: dict, json_target: str) -> None:
    if json_target == "-":
        print(json.dumps(report, indent=2))
        return
    print(format_report(report["info"], report["problems"], ranks=report["ranks"] or None))
    if json_target:
        with open(json_target, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {json_target}")


def env_main(args: argparse.Namespace) -> int:
    """One process: this machine's report."""
    emit(
        build_report(
            backend=args.backend, nnodes=getattr(args, "nnodes", 1), nproc_per_node=getattr(args, "nproc_per_node", 1)
        ),
        args.json,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Worker: ``torchrun ... -m paratrain.hardware.env``; every rank collects, rank 0 compares and prints."""
    parser = argparse.ArgumentParser(prog="python -m paratrain.hardware.env")
    add_env_arguments(parser)
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--nproc-per-node", type=int, default=1)
    args = parser.parse_args(argv)
    if "MASTER_ADDR" not in os.environ:
        return env_main(args)
    # gloo, whatever the job's backend: only Python objects travel, and a broken NCCL setup must
    # not stop the tool that diagnoses it.
    init_env_process_group("gloo")  # the job's store bound to one address (docs/security.md)
    try:
        ranks = all_gather_json(collect())  # JSON, not a pickle (docs/security.md)
        if dist.get_rank() == 0:
            emit(
                build_report(backend=args.backend, nnodes=args.nnodes, nproc_per_node=args.nproc_per_node, ranks=ranks),
                args.json,
            )
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
