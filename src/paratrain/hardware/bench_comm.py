"""``paratrain bench comm``: collective bandwidth, checked results, and slow links.

Run on every process of a job (``python -m paratrain.hardware.bench_comm ...`` under torchrun; the CLI
starts it through :mod:`paratrain.launch.agent`). For each operation and message size (powers of
two): one run whose output is checked value by value, warm-up runs, then timed runs.

Definitions (nccl-tests, doc/PERFORMANCE.md). ``bytes`` is the size of the largest buffer on a
rank: the tensor for all_reduce and broadcast, the gathered output for all_gather, the input
for reduce_scatter, the send buffer for all_to_all, the message for send/recv. ``time`` is the
slowest rank's, per iteration (a collective is done when its last rank is). Then

    algbw = bytes / time
    busbw = algbw * factor, factor: all_reduce 2(n-1)/n; all_gather, reduce_scatter (n-1)/n;
            all_to_all (n-1)/n (each rank keeps 1/n of its buffer, sends the rest);
            broadcast 1; send_recv 1 (every rank sends and receives one message at once).

busbw is comparable to the link speed whatever the operation and world size: it is the bytes
each rank's busiest link carries, over the time (for a ring algorithm).

Values: rank r's element i is ``(r + 1) + (i mod 7)`` (exact small integers in fp32 and bf16),
so every expected output has a closed form; a wrong sum, a chunk in the wrong place or a
message from the wrong peer is an error that stops the benchmark, never a figure.

Slow links: every pair of ranks (all pairs up to 16 ranks; beyond, ring neighbours and the
rank half-way round) exchanges one message both ways, alone, and its time is compared with the
median of pairs of the same kind (inside a node, or across nodes, since those differ by
design). A pair, a rank or a node pair more than ``--slow-factor`` times slower is flagged.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from paratrain.config import ConfigError
from paratrain.distributed.json_collectives import all_gather_json
from paratrain.distributed.process_group import init_env_process_group
from paratrain.hardware.collectives import bandwidths, bus_factor
from paratrain.hardware.env import add_backend_argument
from paratrain.precision import DTYPES

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send_recv")
KIB, MIB = 1024, 1024 * 1024


class BenchError(RuntimeError):
    """A collective returned wrong values (or the benchmark could not run)."""


# ----------------------------------------------------------------------------- pure arithmetic


def read_comm_json(data) -> tuple[int, bool, list[tuple[str, int, float]]]:
    """The figures of a ``bench comm --json`` report (the reader beside its writer, :func:`main`):
    (world size, whether it spans nodes, ``[(op, bytes, median seconds), ...]``). KeyError,
    TypeError or ValueError when a field is missing or mangled; ``plan --calibrate`` reads it."""
    inter = len(set(data.get("nodes") or [None])) > 1
    rows = [(row["op"], int(row["bytes"]), float(row["time_s"])) for row in data["results"]]
    return int(data["world_size"]), inter, rows


def is_comm_report(data) -> bool:
    return isinstance(data, dict) and "results" in data


def default_sizes(min_bytes: int = 4 * KIB, max_bytes: int = 64 * MIB) -> list[int]:
    """Powers of two from min_bytes up to max_bytes (both rounded to powers of two)."""
    if min_bytes < 1 or max_bytes < min_bytes:
        raise ValueError(f"need 1 <= min_bytes <= max_bytes, got {min_bytes}, {max_bytes}")
    lo, hi = (min_bytes - 1).bit_length(), max_bytes.bit_length() - 1
    return [1 << k for k in range(lo, max(lo, hi) + 1)]


def numel_for(op: str, nbytes: int, n: int, element_size: int) -> int:
    """Elements of the largest buffer: a multiple of n where the op splits it into n chunks."""
    numel = max(1, nbytes // element_size)
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        numel = max(n, numel // n * n)
    return numel


def pattern(rank: int, numel: int, *, offset: int = 0, dtype=torch.float32) -> torch.Tensor:
    """Rank ``rank``'s input: element i is (rank + 1) + ((offset + i) mod 7)."""
    return ((torch.arange(offset, offset + numel) % 7) + (rank + 1)).to(dtype)


def make_input(op: str, rank: int, n: int, numel: int, dtype=torch.float32) -> torch.Tensor:
    """The input buffer of ``rank`` (for all_gather: its 1/n chunk)."""
    if op == "all_gather":
        return pattern(rank, numel // n, dtype=dtype)
    return pattern(rank, numel, dtype=dtype)


def expected_output(
    op: str, rank: int, n: int, numel: int, *, peer: int | None = None, root: int = 0, dtype=torch.float32
) -> torch.Tensor:
    """What ``rank`` must hold after ``op`` (for send_recv: the message from ``peer``)."""
    tri = n * (n + 1) // 2  # sum over ranks of (r + 1)
    if op == "all_reduce":
        return ((torch.arange(numel) % 7) * n + tri).to(dtype)
    if op == "broadcast":
        return pattern(root, numel, dtype=dtype)
    c = numel // n
    if op == "all_gather":
        return torch.cat([pattern(r, c, dtype=dtype) for r in range(n)])
    if op == "reduce_scatter":
        return ((torch.arange(rank * c, rank * c + c) % 7) * n + tri).to(dtype)
    if op == "all_to_all":
        # chunk s of the output is chunk `rank` of rank s's input
        return torch.cat([pattern(s, c, offset=rank * c, dtype=dtype) for s in range(n)])
    if op == "send_recv":
        if peer is None:
            raise ValueError("send_recv needs the peer that sent the message")
        return pattern(peer, numel, dtype=dtype)
    raise ValueError(f"unknown op {op!r}")


def check_result(op: str, out: torch.Tensor, expected: torch.Tensor, *, rank: int, nbytes: int) -> str | None:
    """None when ``out`` equals ``expected`` exactly, else a one-line description of the error."""
    out = out.detach().cpu().reshape(-1)
    if out.shape != expected.shape:
        return f"{op} {nbytes} B on rank {rank}: shape {tuple(out.shape)} != expected {tuple(expected.shape)}"
    bad = (out != expected).nonzero()
    if bad.numel() == 0:
        return None
    i = int(bad[0])
    return (
        f"{op} {nbytes} B on rank {rank}: wrong values at {bad.numel()} of {out.numel()} elements"
        f" (first at {i}: got {out[i].item()}, expected {expected[i].item()})"
    )


def time_stats(times: list[float]) -> dict:
    return {"time_s": statistics.median(times), "time_min_s": min(times), "time_max_s": max(times)}


def flag_slow(times: dict, factor: float) -> list:
    """Keys whose time exceeds ``factor`` x the median of all keys' times (needs >= 3 keys)."""
    if len(times) < 3:
        return []
    med = statistics.median(times.values())
    return [k for k, t in times.items() if t > factor * med]


def analyse_pairs(pair_times: dict[tuple[int, int], float], node_of: list, factor: float) -> dict:
    """Slow pairs, ranks and node pairs, each compared with its own kind (intra- or inter-node).

    ``pair_times[(a, b)]``: seconds of one exchange between ranks a < b; ``node_of[r]``: r's node.
    """
    flags = []

    def flag(what: str, kind: str, field: str, times: dict, value=lambda k: k) -> None:
        flags.extend(
            {
                "what": what,
                "kind": kind,
                field: value(k),
                "time_s": times[k],
                "median_s": statistics.median(times.values()),
            }
            for k in flag_slow(times, factor)
        )

    for kind in ("intra-node", "inter-node"):
        same = {p: t for p, t in pair_times.items() if (node_of[p[0]] == node_of[p[1]]) == (kind == "intra-node")}
        flag("pair", kind, "ranks", same, list)
        per_rank: dict[int, list[float]] = {}
        for (a, b), t in same.items():
            per_rank.setdefault(a, []).append(t)
            per_rank.setdefault(b, []).append(t)
        flag("rank", kind, "rank", {r: statistics.median(ts) for r, ts in per_rank.items()})
        if kind == "inter-node":
            per_node: dict[tuple, list[float]] = {}
            for (a, b), t in same.items():
                key = tuple(sorted((str(node_of[a]), str(node_of[b]))))
                per_node.setdefault(key, []).append(t)
            flag("node pair", kind, "nodes", {k: statistics.median(ts) for k, ts in per_node.items()}, list)
    return {"flags": flags}


def rank_pairs(n: int) -> list[tuple[int, int]]:
    """All pairs up to 16 ranks; beyond, ring neighbours and the rank half-way round."""
    if n <= 16:
        return [(a, b) for a in range(n) for b in range(a + 1, n)]
    pairs = {tuple(sorted((r, (r + 1) % n))) for r in range(n)} | {
        tuple(sorted((r, (r + n // 2) % n))) for r in range(n)
    }
    return sorted(pairs)


def format_row(row: dict) -> str:
    return (
        f"{row['op']:>14} {human_bytes(row['bytes']):>9} {row['time_s'] * 1e6:>11.1f} {row['time_min_s'] * 1e6:>11.1f}"
        f" {row['time_max_s'] * 1e6:>11.1f} {row['algbw_gbps']:>9.3f} {row['busbw_gbps']:>9.3f}"
    )


TABLE_HEADER = (
    f"{'op':>14} {'bytes':>9} {'median_us':>11} {'min_us':>11} {'max_us':>11} {'algbw':>9} {'busbw':>9}"
    "\n" + " " * 63 + "(GB/s)    (GB/s)"
)


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", KIB)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n}B"


# ----------------------------------------------------------------------------- running (needs a process group)


@dataclass
class Env:
    rank: int
    n: int
    device: torch.device
    dtype: torch.dtype

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _run_op(op: str, env: Env, inp: torch.Tensor, out: torch.Tensor | None, shift: int = 1) -> None:
    n, r = env.n, env.rank
    if op == "all_reduce":
        dist.all_reduce(inp)
    elif op == "broadcast":
        dist.broadcast(inp, src=0)
    elif op == "all_gather":  # *_single: the names torch 2.13 prefers over *_into_tensor / *_tensor
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, inp)
    elif op == "reduce_scatter":
        getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, inp)
    elif op == "all_to_all":
        dist.all_to_all_single(out, inp)
    elif op == "send_recv":
        ops = [dist.P2POp(dist.isend, inp, (r + shift) % n), dist.P2POp(dist.irecv, out, (r - shift) % n)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    else:
        raise ValueError(op)


def _buffers(op: str, env: Env, numel: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(input, output or None, the tensor that holds the result)."""
    inp = make_input(op, env.rank, env.n, numel, env.dtype).to(env.device)
    if op in ("all_reduce", "broadcast"):
        return inp, None, inp
    out_numel = numel // env.n if op == "reduce_scatter" else numel
    out = torch.empty(out_numel, dtype=env.dtype, device=env.device)
    return inp, out, out


def _agree_on_errors(env: Env, err: str | None) -> None:
    """Every rank raises if any rank's check failed (so no rank waits in a later collective)."""
    flag = torch.tensor([0.0 if err is None else 1.0], device=env.device)
    dist.all_reduce(flag)
    if err is not None:
        raise BenchError(err)
    if flag.item() > 0:
        raise BenchError("a collective returned wrong values on another rank (see its message)")


def measure(op: str, nbytes: int, env: Env, *, warmup: int, iters: int, run_op=_run_op) -> dict:
    """Check ``op`` once at ``nbytes``, then time it; returns one result row (same on every rank)."""
    esize = torch.empty((), dtype=env.dtype).element_size()
    numel = numel_for(op, nbytes, env.n, esize)
    inp, out, result = _buffers(op, env, numel)
    run_op(op, env, inp, out)
    env.sync()
    peer = (env.rank - 1) % env.n if op == "send_recv" else None
    exp = expected_output(op, env.rank, env.n, numel, peer=peer, dtype=env.dtype)
    _agree_on_errors(env, check_result(op, result, exp, rank=env.rank, nbytes=numel * esize))
    for _ in range(warmup):
        run_op(op, env, inp, out)
    env.sync()
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        run_op(op, env, inp, out)
        env.sync()
        times.append(time.perf_counter() - t0)
    slowest = torch.tensor(times, dtype=torch.float64, device=env.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    stats = time_stats(slowest.tolist())
    real_bytes = numel * esize
    algbw, busbw = bandwidths(op, real_bytes, stats["time_s"], env.n)
    return {
        "op": op,
        "bytes": real_bytes,
        **stats,
        "algbw_gbps": algbw,
        "busbw_gbps": busbw,
        "world_size": env.n,
        "dtype": str(env.dtype).replace("torch.", ""),
        "iters": iters,
        "checked": True,
    }


def measure_pairs(env: Env, nbytes: int, *, iters: int) -> dict[tuple[int, int], float]:
    """Median time of a two-way exchange of ``nbytes`` for each pair, one pair at a time."""
    esize = torch.empty((), dtype=env.dtype).element_size()
    numel = max(1, nbytes // esize)
    send = pattern(env.rank, numel, dtype=env.dtype).to(env.device)
    recv = torch.empty_like(send)
    pairs = rank_pairs(env.n)
    out = torch.zeros(len(pairs), dtype=torch.float64, device=env.device)
    for k, (a, b) in enumerate(pairs):
        dist.barrier()
        if env.rank in (a, b):
            peer = b if env.rank == a else a
            times = []
            for it in range(iters + 1):  # the first exchange sets up the connection: untimed, checked
                t0 = time.perf_counter()
                ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
                env.sync()
                times.append(time.perf_counter() - t0)
                if it == 0:
                    err = check_result(
                        "send_recv", recv, pattern(peer, numel, dtype=env.dtype), rank=env.rank, nbytes=numel * esize
                    )
                    if err:
                        raise BenchError(err)
            out[k] = statistics.median(times[1:])
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return {p: float(t) for p, t in zip(pairs, out.tolist())}


def node_names(device: torch.device) -> list[str]:
    """Each rank's node: torchrun's GROUP_RANK (the agent's index), else the host name."""
    me = f"node{os.environ['GROUP_RANK']}" if "GROUP_RANK" in os.environ else socket.gethostname()
    return all_gather_json(me, device=device)  # JSON, not a pickle (docs/security.md)


def plot_busbw(rows: list[dict], path: str, *, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for op in OPS:
        pts = sorted((r["bytes"], r["busbw_gbps"]) for r in rows if r["op"] == op)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, lw=1.2, label=op)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="message size (bytes)", ylabel="bus bandwidth (GB/s)", title=title or "paratrain bench comm")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    add_backend_argument(p, "process-group backend (auto: nccl on CUDA, else gloo)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {','.join(OPS)}")
    p.add_argument("--min-bytes", type=int, default=4 * KIB, help="smallest message (default 4 KiB)")
    p.add_argument("--max-bytes", type=int, default=64 * MIB, help="largest message (default 64 MiB)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per size (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations per size (default 5)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="element type (default fp32)")
    p.add_argument(
        "--pair-bytes",
        type=int,
        default=0,
        help="message size of the pairwise slow-link scan (default: min(max-bytes, 4 MiB)); -1 skips it",
    )
    p.add_argument(
        "--slow-factor",
        type=float,
        default=2.0,
        help="flag a pair/rank/node pair slower than this times the median of its kind (default 2)",
    )
    p.add_argument("--json", default="", help="write the results to this JSON file")
    p.add_argument("--plot", default="", help="write a PNG of bus bandwidth against size")


def worker_args(args: argparse.Namespace) -> list[str]:
    """The options of ``add_bench_arguments`` back as a command line, for the launched workers."""
    out = []
    for opt in (
        "backend",
        "ops",
        "min_bytes",
        "max_bytes",
        "iters",
        "warmup",
        "dtype",
        "pair_bytes",
        "slow_factor",
        "json",
        "plot",
    ):
        value = getattr(args, opt)
        if opt in ("json", "plot") and value:
            value = os.path.abspath(value)
        out += [f"--{opt.replace('_', '-')}", str(value)]
    return out


def validate_bench_args(args: argparse.Namespace) -> list[str]:
    """Check the options; returns the ops. Raises ConfigError (exit 2) with the fix."""

    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = [o for o in ops if o not in OPS]
    if unknown or not ops:
        raise ConfigError(f"--ops {args.ops!r}: unknown {unknown or 'none given'}; choose from {','.join(OPS)}")
    if args.min_bytes < 1 or args.max_bytes < args.min_bytes:
        raise ConfigError(f"--min-bytes {args.min_bytes} / --max-bytes {args.max_bytes}: need 1 <= min <= max")
    if args.iters < 1 or args.warmup < 0:
        raise ConfigError("--iters must be >= 1 and --warmup >= 0")
    if args.backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("--backend nccl needs CUDA devices; use --backend gloo on CPU")
    return ops


def run(args: argparse.Namespace) -> dict:
    """The benchmark on this rank (the process group must exist); returns the report on rank 0."""
    ops = validate_bench_args(args)
    rank, n = dist.get_rank(), dist.get_world_size()
    backend = dist.get_backend()
    if "nccl" in str(backend):
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    else:
        device = torch.device("cpu")
    env = Env(rank, n, device, DTYPES[args.dtype])
    main = rank == 0
    say = (lambda *a: print(*a, flush=True)) if main else (lambda *a: None)
    nodes = node_names(device)
    say(
        f"paratrain bench comm: world {n} ({len(set(nodes))} node(s)), backend {backend}, {args.dtype}, "
        f"{args.warmup} warm-up + {args.iters} timed iterations per size; every result is checked"
    )
    rows = []
    sizes = default_sizes(args.min_bytes, args.max_bytes)
    say(TABLE_HEADER)
    for op in ops:
        if op == "send_recv" and n == 1:
            say("send_recv: skipped (world size 1 has no peer)")
            continue
        for nbytes in sizes:
            row = measure(op, nbytes, env, warmup=args.warmup, iters=args.iters)
            rows.append(row)
            say(format_row(row))
    report = {
        "world_size": n,
        "nodes": nodes,
        "backend": str(backend),
        "dtype": args.dtype,
        "device": str(device),
        "torch": torch.__version__,
        "results": rows,
        "busbw_factors": {op: bus_factor(op, n) for op in OPS},
        "pairs": [],
        "flags": [],
    }
    pair_bytes = args.pair_bytes or min(args.max_bytes, 4 * MIB)
    if n > 1 and pair_bytes > 0:
        pairs = rank_pairs(n)
        say(f"slow-link scan: {len(pairs)} rank pair(s), {human_bytes(pair_bytes)} both ways, one pair at a time")
        pair_times = measure_pairs(env, pair_bytes, iters=max(3, min(args.iters, 10)))
        report["pairs"] = [
            {
                "ranks": [a, b],
                "nodes": [nodes[a], nodes[b]],
                "bytes": pair_bytes,
                "time_s": t,
                "algbw_gbps": 2 * pair_bytes / t / 1e9,
            }
            for (a, b), t in pair_times.items()
        ]
        report["flags"] = analyse_pairs(pair_times, nodes, args.slow_factor)["flags"]
        if main:
            for f in report["flags"]:
                who = f.get("ranks") or f.get("rank") if f["what"] != "node pair" else f["nodes"]
                say(
                    f"SLOW {f['what']} {who} ({f['kind']}): {f['time_s'] * 1e3:.2f} ms vs median"
                    f" {f['median_s'] * 1e3:.2f} ms; check its link/NIC/placement"
                )
            if not report["flags"]:
                say(f"no pair, rank or node pair slower than {args.slow_factor}x the median of its kind")
    if main:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
            say(f"wrote {args.json}")
        if args.plot and rows:
            plot_busbw(rows, args.plot, title=f"bench comm: world {n}, {backend}, {args.dtype}")
            say(f"wrote {args.plot}")
    return report


def main(argv: list[str] | None = None) -> int:
    """Worker entry: ``torchrun ... -m paratrain.hardware.bench_comm [options]``."""

    parser = argparse.ArgumentParser(prog="python -m paratrain.hardware.bench_comm", description=__doc__.split("\n")[0])
    add_bench_arguments(parser)
    args = parser.parse_args(argv)
    try:
        validate_bench_args(args)
        backend = args.backend
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        if "MASTER_ADDR" in os.environ:
            init_env_process_group(backend)  # the job's store bound to one address (docs/security.md)
        else:  # a lone process (python -m paratrain.hardware.bench_comm): world size 1
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        try:
            run(args)
        finally:
            dist.destroy_process_group()
    except ConfigError as e:
        print(f"paratrain: error: {e}", file=sys.stderr)
        return 2
    except BenchError as e:
        print(f"paratrain: error: bench comm: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
