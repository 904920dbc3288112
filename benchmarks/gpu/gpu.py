"""One prepared GPU benchmark: the device's ceilings, then a ~124M-parameter GPT's MFU.

1. `paratrain bench compute` on the GPU: bf16 matmul FLOP/s (8192^3) and memory-copy bandwidth.
2. The built-in GPT at GPT-2-small shape (n_layer 12, n_head 12, d_model 768, block_size 1024,
   vocab 50304: GPT-2's 50257 padded to a multiple of 64; 124M parameters) trained by
   paratrain's own loop (`paratrain.train`) on one GPU, with precision.dtype = "bf16"
   (autocast, fp32 master weights), train.compile = true and SDPA restricted to the flash
   kernel, on random tokens (synthetic data: the speed does not depend on the text), for a
   fixed number of steps.
3. Prints tokens/s and MFU (median over the steps after the first ones, which include
   compilation) against the data-sheet dense bf16 peak of the GPU (the convention of PaLM,
   torchtitan and Megatron; paratrain.observability.mfu.DATASHEET_BF16_FLOPS) and, as a second figure,
   against the best matmul throughput measured in step 1 (its maximum, not its median); whether
   torch.compile really compiled (dynamo's counters: graphs, graph breaks), then ONE JSON line.

Target: MFU >= 45% on an H100/H200-class GPU. Takes about 2-4 minutes there (most of it
torch.compile). On a machine without CUDA it says so and exits with code 2, measuring nothing.

    python benchmarks/gpu/gpu.py [--steps 40] [--micro-batch 16] [--accum 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

WARMUP_STEPS = 8  # compile and allocator warm-up: left out of the medians


class RandomTokens:
    """(input, target) pairs of random token ids, a pure function of (seed, index)."""

    def __init__(self, n: int, block_size: int, vocab: int, seed: int = 0):
        self.n, self.block_size, self.vocab, self.seed = n, block_size, vocab, seed
        self.description = {"name": "random_tokens", "samples": n, "block_size": block_size, "vocab": vocab}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        import torch

        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        seq = torch.randint(0, self.vocab, (self.block_size + 1,), generator=g)
        return seq[:-1], seq[1:]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="optimiser steps (default 40)")
    p.add_argument("--micro-batch", type=int, default=16, help="sequences per forward/backward (default 16)")
    p.add_argument("--accum", type=int, default=4, help="micro-batches per step (default 4: 65,536 tokens)")
    p.add_argument("--vocab", type=int, default=50304, help="vocabulary size (default 50304)")
    p.add_argument("--no-compile", action="store_true", help="run eagerly (for comparison)")
    p.add_argument(
        "--smoke-cpu",
        action="store_true",
        help="check this script's plumbing on CPU with a tiny GPT (no figures worth reading)",
    )
    args = p.parse_args()

    import torch

    if not torch.cuda.is_available() and not args.smoke_cpu:
        print("benchmarks/gpu/gpu.py needs a CUDA GPU and none is visible here; nothing was measured.", file=sys.stderr)
        print(json.dumps({"skipped": "no CUDA device", "torch": torch.__version__}))
        return 2

    import paratrain
    from paratrain.hardware.bench_compute import run_compute_bench

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    t_start = time.perf_counter()
    smoke = args.smoke_cpu
    device = torch.device("cpu") if smoke else torch.device("cuda", 0)
    name = "CPU (smoke test)" if smoke else torch.cuda.get_device_name(device)
    print(f"== 1. bench compute on {name}", flush=True)
    compute = run_compute_bench(
        device=device,
        dtypes=["bf16"],
        n=256 if smoke else 8192,
        copy_bytes=(16 if smoke else 1024) * 2**20,
        runs=3 if smoke else 7,
        inner=2 if smoke else 20,
    )
    from torch._dynamo.utils import counters

    from paratrain.observability.mfu import datasheet_peak_flops

    measured_max = compute["matmul"][0]["flops_per_s_max"]
    datasheet = None if smoke else datasheet_peak_flops(name, "bf16")
    peak = datasheet or measured_max  # what the metrics rows' mfu is computed against

    block, gbs = (64 if smoke else 1024), args.micro_batch * args.accum
    shape = "n_layer = 2, n_head = 2, d_model = 64" if smoke else "n_layer = 12, n_head = 12, d_model = 768"
    print(
        f"\n== 2. GPT 124M-shape (12 x 768, T {block}, vocab {args.vocab}), bf16, "
        f"compile {not args.no_compile}, SDPA flash, {args.steps} steps of {gbs} x {block} tokens",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as out:
        overrides = [
            f"run.out_dir='{out}'",
            f"run.steps={args.steps}",
            "run.seed=0",
            "run.progress=false",
            "run.save_model=false",
            "metrics.plot=false",
            f"model.args={{{shape}, block_size = {block}, vocab_size = {args.vocab}, bias = false}}",
            f"batch.global_batch_size={gbs}",
            f"batch.micro_batch_size={args.micro_batch}",
            "optim.lr=6e-4",
            "optim.warmup_steps=10",
            "optim.weight_decay=0.1",
            "precision.dtype='bf16'",
            f"train.compile={'false' if args.no_compile else 'true'}",
            f"hardware.peak_flops={peak}",
            f"dist.device='{device.type}'",
        ]
        cfg = paratrain.load_config(None, overrides)
        data = RandomTokens(gbs * args.steps, block, args.vocab)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        counters.clear()
        with sdpa_kernel(
            SDPBackend.MATH if smoke else SDPBackend.FLASH_ATTENTION
        ):  # fail loudly rather than fall back to the math kernel
            summary = paratrain.train(cfg, dataset=data)
        # paratrain falls back to eager (with a warning) where compilation does not work: say which
        # happened. Graphs include distributed/compile.py's probe (one); the blocks share one graph.
        graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
        compiled = (not args.no_compile) and graphs >= 2
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    steady = rows[WARMUP_STEPS:] if len(rows) > WARMUP_STEPS + 2 else rows[len(rows) // 2 :]
    tok_s = statistics.median(r["tokens_per_s"] for r in steady)
    tflops = statistics.median(r["model_flops_per_s"] for r in steady) / 1e12
    mfu = tflops * 1e12 / datasheet if datasheet else None
    mfu_measured = tflops * 1e12 / measured_max
    ds = f"{datasheet / 1e12:.0f} TFLOP/s (data sheet)" if datasheet else "unknown for this device"
    print(
        f"\nbf16 peak: {ds} | matmul measured: max {measured_max / 1e12:.1f} TFLOP/s"
        f" | memcpy {compute['memcpy']['memcpy_gbps']:.0f} GB/s"
    )
    print(f"compile: {'yes' if compiled else 'NO (eager)'} ({graphs} graphs incl. the probe, {breaks} graph breaks)")
    print(
        f"GPT: {tok_s:,.0f} tokens/s, {tflops:.1f} model TFLOP/s, MFU "
        + (f"{100 * mfu:.1f}% of the data-sheet peak, " if mfu else "")
        + f"{100 * mfu_measured:.1f}% of the measured matmul max"
        f" (median of steps {len(rows) - len(steady) + 1}..{len(rows)}); loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}"
    )
    print(
        json.dumps(
            {
                "gpu": name,
                "torch": torch.__version__,
                "datasheet_bf16_tflops": datasheet / 1e12 if datasheet else None,
                "matmul_bf16_tflops_max": measured_max / 1e12,
                "matmul_bf16_tflops_median": compute["matmul"][0]["flops_per_s"] / 1e12,
                "memcpy_gbps": compute["memcpy"]["memcpy_gbps"],
                "model_parameters": summary["model_parameters"],
                "vocab": args.vocab,
                "block_size": block,
                "tokens_per_step": gbs * block,
                "steps": args.steps,
                "compile": not args.no_compile,
                "compiled": compiled,
                "graphs": graphs,
                "graph_breaks": breaks,
                "tokens_per_s": tok_s,
                "model_tflops": tflops,
                "mfu": mfu,
                "mfu_vs_measured_max": mfu_measured,
                "first_loss": rows[0]["loss"],
                "final_loss": rows[-1]["loss"],
                "wall_s": time.perf_counter() - t_start,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
