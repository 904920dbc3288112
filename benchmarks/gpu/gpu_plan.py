"""On one CUDA GPU: `paratrain plan`'s predictions against real steps, for every micro-batch x
activation-checkpointing choice of a 124M GPT (issue 14's GPU check).

The GPT-2-small shape (12 layers, d_model 768, 12 heads, context 1024, vocabulary 50304), bf16
autocast, AdamW, one process. For each layout the plan offers at world 1 (micro-batches from
--min-micro-batch up to the per-rank batch, checkpointing none / selective / full):

- predicted: the cost model's step time on the data-sheet profile of the device (--hardware,
  default h200) and the fake-tensor peak per rank, as `paratrain plan` computes them;
- measured: `paratrain.train` for --steps steps on the GPU, the median step_time_s of the steps
  after the first two, and the allocator's peak (`max_memory_allocated`), with the allocator
  capped at 1 - batch.memory_margin of the device (the plan's usable memory): an out-of-memory
  error is recorded as OOM, and compared with whether the plan said the layout fits.

It prints one row per layout, then the Spearman rank correlation of step times, the memory error
(median and max over the layouts that ran), and the fit/OOM agreement. Run it alone on the GPU:

    PYTHONPATH=src python benchmarks/gpu/gpu_plan.py [--global-batch 256] [--steps 5]

`--dry-run-cpu` checks the script here: a tiny GPT on the CPU, times only (no device memory).
Without CUDA and without that flag it says so and exits with code 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--global-batch", type=int, default=256)
    ap.add_argument("--min-micro-batch", type=int, default=4, help="smaller ones take many micro-batches a step")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--dry-run-cpu", action="store_true", help="check this script on CPU with a tiny GPT")
    args = ap.parse_args()

    import torch

    dry = args.dry_run_cpu
    if not torch.cuda.is_available() and not dry:
        print("gpu_plan.py needs a CUDA device; nothing measured. On CPU: benchmarks/parallel/plan_accuracy.py")
        return 0

    import paratrain
    from paratrain.plan import get_profile
    from paratrain.plan.cost import ModelStats, step_cost
    from paratrain.plan.enumerate import enumerate_layouts, meta_model
    from paratrain.plan.memory import MemoryModel
    from paratrain.testing.paired import spearman

    T = 32 if dry else 1024
    model = "n_layer=2, n_head=2, d_model=32" if dry else "n_layer=12, n_head=12, d_model=768"
    base = [
        f"model.args={{{model}, block_size={T}, vocab_size={256 if dry else 50304}}}",
        f"data.args={{block_size={T}, max_bytes={200_000 if dry else 4_000_000}}}",
        f"batch.global_batch_size={args.global_batch}",
        f"dist.device='{'cpu' if dry else 'cuda'}'",
        *([] if dry else ["precision.dtype='bf16'"]),
    ]
    cfg = paratrain.load_config(os.path.join(ROOT, "configs", "debug.toml"), base)
    hw = get_profile("cpu" if dry else args.hardware)
    if dry:
        usable = None
        print("dry run on CPU: tiny GPT, times only")
    else:
        device = torch.device("cuda", 0)
        total = torch.cuda.get_device_properties(device).total_memory
        fraction = 1 - cfg.batch.memory_margin
        torch.cuda.set_per_process_memory_fraction(fraction, device)
        usable = int(total * fraction)
        print(f"device: {torch.cuda.get_device_name(device)}, {total / 2**30:.1f} GiB, usable {usable / 2**30:.1f} GiB")
    print(hw.describe())

    meta = meta_model(cfg)
    layouts, _ = enumerate_layouts(cfg, world_size=1, nproc_per_node=1, model=meta)
    layouts = [lay for lay in layouts if lay.micro_batch_size >= args.min_micro_batch]
    stats = ModelStats.of(meta, cfg)
    memory = MemoryModel(cfg, model=meta, n_blocks=len(meta.layers))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, lay in enumerate(sorted(layouts, key=lambda x: (x.activation_checkpointing, x.micro_batch_size))):
            predicted = step_cost(lay, cfg=cfg, stats=stats, hw=hw, ranks_per_node=1).step_time_s
            peak = memory.peak(lay).peak_bytes
            out = os.path.join(tmp, f"l{i}")
            run_cfg = paratrain.load_config(
                os.path.join(ROOT, "configs", "debug.toml"),
                [*base, *lay.set_lines(), f"run.out_dir='{out}'", f"run.steps={args.steps}", "run.progress=false"]
                + ["run.save_model=false", "metrics.plot=false", "eval.interval=0", "checkpoint.interval=0"],
            )
            measured = measured_peak = None
            if not dry:
                gc.collect()  # what an earlier out-of-memory error left referenced
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            try:
                paratrain.train(run_cfg)
                with open(os.path.join(out, "metrics.jsonl")) as f:
                    times = [json.loads(line)["step_time_s"] for line in f][2:]
                measured = statistics.median(times)
                if not dry:
                    measured_peak = torch.cuda.max_memory_allocated(device)
            except torch.OutOfMemoryError:
                measured = "OOM"
            rows.append((lay, predicted, peak, measured, measured_peak))
            print(row(lay, predicted, peak, measured, measured_peak, usable), flush=True)
    ran = [r for r in rows if isinstance(r[3], float)]
    if len(ran) >= 2:
        print(
            f"Spearman of step times over {len(ran)} layouts: {spearman([r[1] for r in ran], [r[3] for r in ran]):.3f}"
        )
        best_pred = min(ran, key=lambda r: r[1])
        best = min(r[3] for r in ran)
        print(f"predicted best {best_pred[0].short()}: {best_pred[3] / best - 1:+.1%} from the measured best")
    errors = [abs(r[2] / r[4] - 1) for r in ran if r[4]]
    if errors:
        print(f"memory error: median {statistics.median(errors):.1%}, max {max(errors):.1%} over {len(errors)} layouts")
    if usable is not None:
        said_fits = {id(r): r[2] <= usable for r in rows}
        wrong = [r[0].short() for r in rows if said_fits[id(r)] == (r[3] == "OOM")]
        print(f"fit vs OOM: {len(rows) - len(wrong)} of {len(rows)} agree" + (f"; disagree: {wrong}" if wrong else ""))
    return 0


def row(lay, predicted: float, peak: int, measured, measured_peak, usable) -> str:
    m = measured if isinstance(measured, str) else f"{measured:.4f}"
    mp = f"{measured_peak / 2**30:9.2f}" if measured_peak else f"{'-':>9}"
    fits = "" if usable is None else ("fits" if peak <= usable else "does not fit")
    return f"  {predicted:9.4f} {m:>9} {peak / 2**30:9.2f} {mp}  {fits:<12} {lay.short()}"


if __name__ == "__main__":
    sys.exit(main())
