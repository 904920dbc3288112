"""``paratrain bench compute``: the two ceilings of one device, measured the same way.

- Matrix multiply: ``C = A @ B`` with square n x n matrices at the training dtype, 2 n^3 FLOPs
  each. This measured peak, not the datasheet's, is what MFU is best compared with (datasheet
  peaks assume clocks and shapes a real step rarely gets).
- Memory copy: ``dst.copy_(src)`` of a large buffer; ``memcpy_gbps`` is bytes copied per second
  (each byte is read once and written once, so the memory traffic is twice that). It is the
  limit of any collective between processes of one machine: a loopback all-reduce can move data
  no faster than memory copies it.

Each figure is the median of ``--runs`` timed runs, after a warm-up; min and max are kept.
On CUDA the runs are timed with CUDA events around several back-to-back operations.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

from paratrain.config import ConfigError
from paratrain.precision import DTYPES

MIB = 1024 * 1024


def matmul_flops(n: int) -> float:
    return 2.0 * n**3


def _timed(fn, device: torch.device, *, inner: int) -> float:
    """Seconds per call of fn, over ``inner`` back-to-back calls."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3 / inner
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def bench_matmul(device: torch.device, dtype: str, *, n: int, runs: int, inner: int) -> dict:
    if device.type == "cuda":
        # Let fp32 use TF32 tensor cores, as training with fp32 on an Ampere+ GPU normally does.
        torch.backends.cuda.matmul.allow_tf32 = True
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device=device, dtype=DTYPES[dtype])
    b = torch.randn(n, n, generator=g).to(device=device, dtype=DTYPES[dtype])
    c = torch.empty(n, n, device=device, dtype=DTYPES[dtype])
    fn = lambda: torch.matmul(a, b, out=c)  # noqa: E731
    _timed(fn, device, inner=max(1, inner // 2))  # warm-up: kernels chosen, clocks up
    secs = [_timed(fn, device, inner=inner) for _ in range(runs)]
    flops = [matmul_flops(n) / s for s in secs]
    st = _stats(flops)
    return {
        "device_type": device.type,
        "dtype": dtype,
        "n": n,
        "flops_per_s": st["median"],
        "flops_per_s_min": st["min"],
        "flops_per_s_max": st["max"],
        "runs": runs,
        "inner": inner,
    }


def bench_memcpy(device: torch.device, *, nbytes: int, runs: int, inner: int) -> dict:
    src = torch.ones(nbytes // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    fn = lambda: dst.copy_(src)  # noqa: E731
    _timed(fn, device, inner=max(1, inner // 2))
    secs = [_timed(fn, device, inner=inner) for _ in range(runs)]
    gbps = [src.numel() * 4 / s / 1e9 for s in secs]
    st = _stats(gbps)
    return {
        "device_type": device.type,
        "bytes": src.numel() * 4,
        "memcpy_gbps": st["median"],
        "memcpy_gbps_min": st["min"],
        "memcpy_gbps_max": st["max"],
        "memory_traffic_gbps": 2 * st["median"],
        "runs": runs,
        "inner": inner,
    }


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def run_compute_bench(
    *, device: torch.device, dtypes: list[str], n: int, copy_bytes: int, runs: int, inner: int, say=print
) -> dict:
    """Both benchmarks on ``device``; returns the report (also the JSON file's content)."""
    threads = torch.get_num_threads()
    say(
        f"paratrain bench compute: {device} ({device_name(device)}), {threads} CPU thread(s), "
        f"median of {runs} runs x {inner} ops"
    )
    report = {
        "device": str(device),
        "device_type": device.type,
        "device_name": device_name(device),
        "torch": torch.__version__,
        "cpu_threads": threads,
        "matmul": [],
        "memcpy": None,
    }
    for dtype in dtypes:
        if device.type == "cuda" and dtype == "bf16" and not torch.cuda.is_bf16_supported():
            say(f"matmul {dtype}: not supported on this GPU, skipped")
            continue
        row = bench_matmul(device, dtype, n=n, runs=runs, inner=inner)
        report["matmul"].append(row)
        say(
            f"matmul {dtype:>4} n={n}: {row['flops_per_s'] / 1e12:.3f} TFLOP/s "
            f"(min {row['flops_per_s_min'] / 1e12:.3f}, max {row['flops_per_s_max'] / 1e12:.3f})"
        )
    report["memcpy"] = bench_memcpy(device, nbytes=copy_bytes, runs=runs, inner=inner)
    m = report["memcpy"]
    say(
        f"memcpy {copy_bytes // MIB} MiB: {m['memcpy_gbps']:.2f} GB/s copied "
        f"(min {m['memcpy_gbps_min']:.2f}, max {m['memcpy_gbps_max']:.2f}; memory traffic {m['memory_traffic_gbps']:.2f} GB/s)"
    )
    return report


def read_compute_json(data) -> tuple[list[tuple[str, str, float]], float | None]:
    """The figures of a ``bench compute --json`` report (the reader beside its writer,
    :func:`run_compute_bench`): ``[(device_type, dtype, matmul FLOP/s), ...]`` and the memory
    traffic in GB/s (None without a memcpy row). KeyError, TypeError or ValueError when a field is
    missing or mangled; ``hardware.compute_bench`` (MFU) and ``plan --calibrate`` read it."""
    rows = [(row.get("device_type"), row["dtype"], float(row["flops_per_s"])) for row in data["matmul"]]
    memcpy = data.get("memcpy")
    return rows, (float(memcpy["memory_traffic_gbps"]) if memcpy else None)


def is_compute_report(data) -> bool:
    return isinstance(data, dict) and "matmul" in data


def add_compute_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--dtype",
        default="",
        help="comma-separated training dtypes among fp32,bf16,fp16 (default: bf16 on CUDA, fp32 on CPU)",
    )
    p.add_argument("--n", type=int, default=0, help="matrix size (default 8192 on CUDA, 1024 on CPU)")
    p.add_argument("--copy-mib", type=int, default=0, help="copy buffer in MiB (default 1024 on CUDA, 256 on CPU)")
    p.add_argument("--runs", type=int, default=7, help="timed runs; the median is reported (default 7)")
    p.add_argument("--inner", type=int, default=0, help="operations per timed run (default 20 on CUDA, 3 on CPU)")
    p.add_argument("--json", default="", help="write the report here (hardware.compute_bench reads it for MFU)")


def compute_main(args: argparse.Namespace) -> int:

    want = args.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda but no CUDA device is visible; use --device cpu")
    device = torch.device(want, torch.cuda.current_device()) if want == "cuda" else torch.device("cpu")
    cuda = device.type == "cuda"
    dtypes = [d.strip() for d in (args.dtype or ("bf16" if cuda else "fp32")).split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        raise ConfigError(f"--dtype {args.dtype!r}: unknown {bad}; choose from fp32,bf16,fp16")
    if min(args.runs, args.n, args.copy_mib, args.inner) < 0 or args.runs < 1:
        raise ConfigError("--runs must be >= 1 and --n/--copy-mib/--inner >= 0")
    report = run_compute_bench(
        device=device,
        dtypes=dtypes,
        n=args.n or (8192 if cuda else 1024),
        copy_bytes=(args.copy_mib or (1024 if cuda else 256)) * MIB,
        runs=args.runs,
        inner=args.inner or (20 if cuda else 3),
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m paratrain.hardware.bench_compute", description=__doc__.split("\n")[0]
    )
    add_compute_arguments(parser)
    sys.exit(compute_main(parser.parse_args()))
