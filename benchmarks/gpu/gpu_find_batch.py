"""On one CUDA GPU: the real out-of-memory search next to the fake-tensor estimate, same layout.

A ~124M-parameter GPT (12 layers, d_model 768, 12 heads, context 1024, vocabulary 24576, untied
output layer: 123.6M parameters), fp32 AdamW, one process. Both searches use the device's whole
memory as the budget and `batch.memory_margin` (10%), over the divisors of the per-rank batch
(--global-batch, default 480, which has many divisors):

1. trial: real steps at growing micro-batch sizes; an out-of-memory error (the allocator is
   capped at 90% of the device) marks a size as too large;
2. estimate: the same step on fake tensors under MemTracker, nothing allocated.

It prints both tables, then the micro-batch each found and its peak bytes, and the estimate's
error at the size the trials chose. Run it alone on the GPU:

    PYTHONPATH=src python benchmarks/gpu/gpu_find_batch.py [--global-batch 480] [--block-size 1024]

On a machine without CUDA it says so and exits with code 0 (nothing to measure).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--global-batch", type=int, default=480)
    ap.add_argument("--block-size", type=int, default=1024)
    ap.add_argument("--max-trials", type=int, default=12)
    ap.add_argument(
        "--dry-run-cpu",
        action="store_true",
        help="check this script on CPU: a tiny GPT, MemTracker on real tensors as the 'trial', 2 MiB budget",
    )
    args = ap.parse_args()

    import torch

    dry = args.dry_run_cpu
    if not torch.cuda.is_available() and not dry:
        print(
            "gpu_find_batch.py needs a CUDA device (the real out-of-memory search cannot run on CPU);"
            " nothing measured. For a CPU plan use: paratrain find-batch CONFIG --memory-gib G"
        )
        return 0

    from paratrain.batch.auto import find_micro_batch
    from paratrain.batch.measure import StepRunner, estimate_peak
    from paratrain.batch.search import GIB
    from paratrain.config import load_config
    from paratrain.preflight import check_run

    T = 32 if dry else args.block_size
    model = "n_layer = 2, n_head = 2, d_model = 32" if dry else "n_layer = 12, n_head = 12, d_model = 768"
    cfg = load_config(
        None,
        [
            f"model.args={{{model}, block_size = {T}, vocab_size = {256 if dry else 24576}}}",
            f"data.args={{block_size = {T}, max_bytes = {200_000 if dry else 4_000_000}}}",
            f"batch.global_batch_size={args.global_batch}",
            "batch.micro_batch_size='auto'",
            f"dist.device='{'cpu' if dry else 'cuda'}'",
            *(["batch.memory_gib=0.002"] if dry else []),
        ],
    )
    dims, _ = check_run(cfg, 1)
    if dry:
        device = torch.device("cpu")
        print("dry run on CPU: tiny GPT, 2 MiB budget")
    else:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        print(
            f"device: {torch.cuda.get_device_name(device)}, {torch.cuda.get_device_properties(device).total_memory / GIB:.1f} GiB;"
            f" torch {torch.__version__}"
        )

    t0 = time.perf_counter()
    real = find_micro_batch(cfg, dims, device=device, method="trial", max_trials=args.max_trials, agree=False)
    t_real = time.perf_counter() - t0
    print(real.table(), f"\n  ({t_real:.0f} s)\n")

    t0 = time.perf_counter()
    try:
        est = find_micro_batch(cfg, dims, device=device, method="estimate", max_trials=args.max_trials, agree=False)
        est_device = device.type
    except Exception as e:  # noqa: BLE001 - fall back and say why
        print(f"estimate on fake CUDA tensors failed ({type(e).__name__}: {e}); estimating on fake CPU tensors")
        est = find_micro_batch(
            cfg, dims, device=torch.device("cpu"), method="estimate", max_trials=args.max_trials, agree=False
        )
        est_device = "cpu"
    t_est = time.perf_counter() - t0
    print(est.table(), f"\n  ({t_est:.0f} s)\n")

    n_params = 0
    with torch.device("meta"):
        from paratrain.models import build_model

        n_params = sum(p.numel() for p in build_model(cfg.model).parameters())
    summary = {
        "params": n_params,
        "block_size": T,
        "global_batch": args.global_batch,
        "real": {"micro_batch_size": real.micro_batch_size, "peak_bytes": real.peak_bytes, "seconds": round(t_real, 1)},
        "estimate": {
            "micro_batch_size": est.micro_batch_size,
            "peak_bytes": est.peak_bytes,
            "device": est_device,
            "seconds": round(t_est, 1),
        },
    }
    if real.micro_batch_size:
        # The estimate at the size the real search chose, against the measured peak there.
        at = next((t.peak_bytes for t in est.trials if t.micro_batch_size == real.micro_batch_size), None)
        if at is None:
            runner = StepRunner(cfg, dims, device=device if est_device == "cuda" else torch.device("cpu"))
            at = estimate_peak(runner, real.micro_batch_size)
        summary["estimate_at_real_choice"] = {"peak_bytes": at, "relative_error": round(at / real.peak_bytes - 1, 4)}
    print(f"{params_line(n_params)}; per-rank batch {args.global_batch}, context {T}")
    print(f"real OOM search : micro_batch_size {real.micro_batch_size}, peak {fmt(real.peak_bytes)}")
    print(
        f"fake estimate   : micro_batch_size {est.micro_batch_size}, peak {fmt(est.peak_bytes)} (fake {est_device} tensors)"
    )
    if "estimate_at_real_choice" in summary:
        e = summary["estimate_at_real_choice"]
        print(
            f"estimate at micro_batch_size {real.micro_batch_size}: {fmt(e['peak_bytes'])}"
            f" ({e['relative_error'] * 100:+.1f}% vs measured)"
        )
    print(json.dumps(summary))
    return 0


def fmt(b: int | None) -> str:
    return "n/a" if b is None else f"{b} bytes ({b / 2**30:.2f} GiB)"


def params_line(n: int) -> str:
    return f"GPT {n / 1e6:.1f}M parameters, fp32 AdamW"


if __name__ == "__main__":
    sys.exit(main())
