"""How well `paratrain plan` predicts: predicted vs measured step time and peak memory per layout.

    python benchmarks/parallel/plan_accuracy.py [--worlds 2,4] [--configs debug,main] [--max-layouts 24] [--steps 6] [--rounds 3]

1. Calibrates the `cpu` profile with a quick `paratrain bench compute` (one thread, as every rank
   runs) and `paratrain bench comm` at each world size.
2. Prices every valid layout of each config at each world size (the plan's ranking) and
   estimates the memory of those measured.
3. Measures layouts on gloo over 127.0.0.1: the same processes train each layout in turn for
   ``--steps`` steps (the median step_time_s of the steps after the first two), then, where
   MemTracker can follow the step on real tensors (no pipeline, no DDP replica: the estimate's
   own method), its peak memory. With more valid layouts than ``--max-layouts``, an even sample
   across the predicted ranking is measured (the first and the last included).
4. Prints per layout predicted vs measured, then the Spearman rank correlation, how far the
   predicted best is from the measured best, and the memory error; writes a scatter plot.

The machine's cores are shared (with other jobs here too): timings are noisy; the layouts run
``--rounds`` times in alternating order and each keeps its least disturbed round (see main).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from paratrain.config import load_config
from paratrain.plan import calibrate, get_profile
from paratrain.plan.cost import ModelStats, step_cost
from paratrain.plan.enumerate import Layout, enumerate_layouts, meta_model
from paratrain.plan.memory import MemoryModel
from paratrain.plan.planner import Planned
from paratrain.testing.paired import spearman

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


CONFIGS = {"debug": os.path.join(REPO, "configs", "debug.toml"), "main": os.path.join(REPO, "configs", "main.toml")}


def cli(*args: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "src"), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "paratrain", *args], check=True, env=env, capture_output=True, text=True)


def tiny_step_s(n_layer: int, wrap, repeats: int = 30) -> tuple[float, float, int]:
    """A tiny GPT (one sample of 8 tokens, width 32, 4 heads) wrapped by ``wrap``: median seconds of
    forward + backward, of the step's end (norm, clipping, AdamW, zero_grad), and its parameter tensors."""
    from paratrain.distributed.grad_norm import clip_grad_norm_
    from paratrain.models.gpt import build_gpt

    torch.manual_seed(0)
    model = build_gpt(n_layer=n_layer, n_head=4, d_model=32, block_size=8)
    wrap(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 256, (1, 8))
    passes, ends = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        y = model(x)
        (y.full_tensor() if hasattr(y, "full_tensor") else y).sum().backward()
        t1 = time.perf_counter()
        clip_grad_norm_(list(model.parameters()), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        passes.append(t1 - t0)
        ends.append(time.perf_counter() - t1)
    return statistics.median(passes[3:]), statistics.median(ends[3:]), len(list(model.parameters()))


def per_block(wrap) -> tuple[float, float]:
    """(one block's forward + backward, the step's end per parameter tensor): 5 blocks less 1."""
    (p1, e1, n1), (p5, e5, n5) = tiny_step_s(1, wrap), tiny_step_s(5, wrap)
    return max(1e-6, (p5 - p1) / 4), max(0.0, (e5 - e1) / (n5 - n1))


def tp_wrap(mesh):
    from paratrain.distributed.tensor_parallel import apply_tp
    from paratrain.models.gpt import gpt_tp_plan

    return lambda m: apply_tp(
        m, mesh, plan={}, plan_factory="", sequence_parallel=False, loss_parallel=False, model_plan=gpt_tp_plan
    )


def overheads() -> dict[str, float]:
    """The profile's fixed costs, as ``Profile`` fields: seconds of one block pass that do not
    shrink with the work, plain and under TP, of one FSDP unit's collective, and of the step's end
    per parameter tensor, plain and as DTensors: the tiny GPT with 1 and 5 blocks, in this process
    on a 1-rank mesh (the DTensor and FSDP2 machinery runs, the collectives have nobody to talk
    to). A calibration at world 1, not on the layouts ranked."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from paratrain.distributed.data_parallel import apply_fsdp

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    try:
        plain, end_plain = per_block(lambda m: None)
        tp_block, _ = per_block(tp_wrap(mesh))
        fsdp_block, end_dtensor = per_block(
            lambda m: apply_fsdp(m, mesh, reshard_after_forward=True, cpu_offload=False)
        )
    finally:
        dist.destroy_process_group()
    return {
        "block_overhead_s": plain / 3,  # forward 1 + backward 2 passes
        "tp_block_overhead_s": tp_block / 3,
        # FSDP: per unit one all-gather in forward, one in backward, one reduce-scatter.
        "fsdp_unit_overhead_s": max(0.0, fsdp_block - plain) / 3,
        "optimizer_tensor_overhead_s": end_plain,
        "dtensor_optimizer_tensor_overhead_s": end_dtensor,
    }


def tp_block_rank() -> float:
    """On one rank of a world: the tiny GPT's block under TP over the whole world (for run_ranks)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    try:
        return per_block(tp_wrap(init_device_mesh("cpu", (dist.get_world_size(),))))[0]
    finally:
        dist.destroy_process_group()


def collective_sync(world: int, hw, tp_block_world1: float) -> float:
    """What one collective costs in a step beyond its isolated `bench comm` time, measured in place:
    the tiny GPT's block under TP at ``world`` less the same at world 1 is its 4 all-reduces (2 in
    forward, 2 in backward) of 8 x 32 activations; less their bench time, per collective. The
    world-1 figure is taken as the cost model prices a pass at this world, over the share of a
    core each rank gets (``share`` in cost.py): more ranks than cores slow the passes too, and
    that is in the ``overhead`` term already."""
    from paratrain.testing.dist_utils import run_ranks

    tp_block = max(run_ranks(tp_block_rank, world))
    share = min(1.0, hw.cores / world) if hw.cores else 1.0
    isolated = dataclasses.replace(hw, collective_sync_s=0.0).collective_s("all_reduce", 8 * 32 * 4, world, inter=False)
    return max(0.0, (tp_block - tp_block_world1 / share) / 4 - isolated)


def measure_rank(config: str, layouts: list[dict], steps: int, out_root: str) -> list[dict]:
    """On one rank: train each layout, then measure its peak with MemTracker where it can."""
    import torch.distributed as dist

    import paratrain
    from paratrain.batch.measure import StepRunner, measure_peak
    from paratrain.distributed.parallel_dims import ParallelDims

    dist.init_process_group("gloo")
    results = []
    for i, d in enumerate(layouts):
        lay = Layout(**d)
        out = os.path.join(out_root, f"l{i}")
        overrides = [f"run.out_dir='{out}'", f"run.steps={steps}", "run.progress=false", "run.save_model=false"]
        # No validation: only the steps are timed (and validation under DualPipeV fails in torch's
        # schedule.eval: "can't steal_bwd_input if this stage doesn't have backward").
        overrides += ["metrics.plot=false", "optim.warmup_steps=1", "eval.interval=0", *lay.set_lines()]
        cfg = paratrain.load_config(config, overrides)
        paratrain.train(cfg)
        peak = None
        if lay.pp == 1 and lay.dp_replicate == 1:
            dims = ParallelDims(1, lay.dp_shard, lay.tp, 1, lay.world_size)
            peak = measure_peak(StepRunner(cfg, dims, device=torch.device("cpu")), lay.micro_batch_size)
            dist.barrier()
        if dist.get_rank() == 0:
            with open(os.path.join(out, "metrics.jsonl")) as f:
                times = [json.loads(line)["step_time_s"] for line in f][2:]
            results.append({"step_time_s": statistics.median(times), "step_times": times, "peak_bytes": peak})
    dist.destroy_process_group()
    return results


def run_world(config: str, layouts: list[Layout], world: int, steps: int) -> list[dict]:
    from paratrain.testing.dist_utils import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        dicts = [dataclasses.asdict(lay) for lay in layouts]
        return run_ranks(measure_rank, world, config, dicts, steps, tmp, timeout=600)[0]


def sample(items: list, k: int) -> list:
    if len(items) <= k:
        return items
    idx = sorted({round(i * (len(items) - 1) / (k - 1)) for i in range(k)})
    return [items[i] for i in idx]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--configs", default="debug,main")
    ap.add_argument("--max-layouts", type=int, default=24)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3, help="runs of every layout, in alternating order")
    ap.add_argument("--plot", default=os.path.join(REPO, "docs", "plan_accuracy.png"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    worlds = [int(w) for w in args.worlds.split(",")]
    summary, points = [], []
    with tempfile.TemporaryDirectory() as tmp:
        fixed = overheads()
        print("calibrated at world 1: " + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in fixed.items()))
        compute = os.path.join(tmp, "compute.json")
        cli("bench", "compute", "--device", "cpu", "--n", "512", "--runs", "5", "--json", compute)
        for world in worlds:
            comm = os.path.join(tmp, f"comm{world}.json")
            cli(
                "bench", "comm", "--nproc-per-node", str(world), "--ops", "all_reduce,all_gather,reduce_scatter,send_recv",
                "--max-bytes", str(4 << 20), "--iters", "20", "--warmup", "3", "--pair-bytes", "-1", "--json", comm,
            )  # fmt: skip
            hw = calibrate(get_profile("cpu"), [compute, comm])
            hw = dataclasses.replace(hw, **fixed)
            hw = dataclasses.replace(hw, collective_sync_s=collective_sync(world, hw, 3 * fixed["tp_block_overhead_s"]))
            print(
                f"world {world}: a collective costs {hw.collective_sync_s * 1e3:.2f} ms more inside a step", flush=True
            )
            if world == worlds[0]:
                print(hw.describe())
            for name in args.configs.split(","):
                cfg = load_config(CONFIGS[name])
                # Step time of every valid layout (a formula); memory only for those measured.
                model = meta_model(cfg)
                layouts, _ = enumerate_layouts(cfg, world_size=world, nproc_per_node=world, model=model)
                stats = ModelStats.of(model, cfg)
                ranked = sorted(
                    (
                        Planned(lay, step_cost(lay, cfg=cfg, stats=stats, hw=hw, ranks_per_node=world))
                        for lay in layouts
                    ),
                    key=lambda p: p.cost.step_time_s,
                )
                chosen = sample(ranked, args.max_layouts)
                memory = MemoryModel(cfg, model=model, n_blocks=len(model.layers))
                for p in chosen:
                    p.memory = memory.peak(p.layout)
                print(f"\n{name} at world {world}: {len(ranked)} valid layouts, measuring {len(chosen)}", flush=True)
                # Rounds in alternating order: drift of the shared machine hits both ends alike.
                # Other processes only ever add time, so a layout's figure is its least disturbed
                # round (the minimum of the per-round medians; Python's timeit documentation
                # argues the same for repeated timings), with the spread over rounds printed.
                # Each layout in its own processes: one the run refuses is reported, not fatal.
                runs: dict[int, list[dict]] = {i: [] for i in range(len(chosen))}
                for r in range(args.rounds):
                    order = list(range(len(chosen)))[:: 1 if r % 2 == 0 else -1]
                    for i in order:
                        if r and not runs[i]:
                            continue  # it failed in the first round
                        try:
                            runs[i] += run_world(CONFIGS[name], [chosen[i].layout], world, args.steps)
                        except AssertionError as e:
                            reason = str(e).strip().splitlines()[-1][:200]
                            print(f"  FAILED to train {chosen[i].layout.short()}: {reason}", flush=True)
                rows = []
                print(f"  {'predicted_s':>11} {'measured_s':>10} {'spread':>7} {'pred_MiB':>9} {'meas_MiB':>9}  layout")
                for i, p in enumerate(chosen):
                    if not runs[i]:
                        continue
                    times = [run["step_time_s"] for run in runs[i]]
                    t = min(times)
                    meas = runs[i][0]["peak_bytes"]
                    rows.append((p, t, meas))
                    mm = f"{meas / 2**20:9.2f}" if meas else f"{'-':>9}"
                    print(
                        f"  {p.cost.step_time_s:11.4f} {t:10.4f} {max(times) / t - 1:7.1%}"
                        f" {p.memory.peak_bytes / 2**20:9.2f} {mm}  {p.layout.short()}",
                        flush=True,
                    )
                rho = spearman([r[0].cost.step_time_s for r in rows], [r[1] for r in rows])
                best_meas = min(r[1] for r in rows)
                pred_best = min(rows, key=lambda r: r[0].cost.step_time_s)
                gap = pred_best[1] / best_meas - 1
                mem_err = [abs(r[0].memory.peak_bytes / r[2] - 1) for r in rows if r[2]]
                line = (
                    f"{name} world {world}: Spearman {rho:.3f} over {len(rows)} layouts; predicted best"
                    f" {pred_best[0].layout.short()} measured {pred_best[1]:.4f} s, {gap:+.1%} from the measured"
                    f" best {best_meas:.4f} s; memory error median {statistics.median(mem_err):.1%}"
                    f" max {max(mem_err):.1%} over {len(mem_err)} layouts"
                    if mem_err
                    else ""
                )
                print(line, flush=True)
                summary.append(line)
                points.append((f"{name} w{world}", rows))
    print("\n" + "\n".join(summary))
    plot(points, args.plot)
    return 0


def plot(points, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5))
    for label, rows in points:
        ax.scatter([r[0].cost.step_time_s * 1e3 for r in rows], [r[1] * 1e3 for r in rows], label=label, s=14)
    lo = min(min(r[0].cost.step_time_s, r[1]) for _, rows in points for r in rows) * 1e3
    hi = max(max(r[0].cost.step_time_s, r[1]) for _, rows in points for r in rows) * 1e3
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted step time (ms)")
    ax.set_ylabel("measured step time (ms)")
    ax.set_title("paratrain plan on CPU/gloo (calibrated cpu profile)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
