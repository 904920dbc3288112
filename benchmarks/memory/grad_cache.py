"""The gradient-cache step (a loss over the whole global batch, objectives/batch_loss.py) against
the naive step that runs the whole global batch in one forward: step time and peak memory.

    python benchmarks/memory/grad_cache.py [--batches 64 256 1024] [--pairs 5] [--micro-batch 16]
        [--threads 1] [--out benchmarks/memory/grad_cache.json] [--dry-run]

The job is configs/code_search.toml (the 2-layer GPT trunk as a dual encoder on docstring ->
function body pairs of the Python standard library, ``info_nce``), on ONE process (world 1, CPU,
``--threads`` intra-op threads), at each global batch of ``--batches``:

- paratrain: the real step, built as training builds it (trainer.py ``build_run``: the process
  group, ``check_run``, the seeded ``build`` of the model, ``build_parallel_with_weights``,
  ``build_optimizer``, ``key_detected_draws``) and run by ``step.train_step`` on the micro-batches
  of ``--micro-batch`` rows (accumulation = global / micro): pass 1 forwards every micro-batch
  without a graph, the loss of the whole global batch gives the cached output gradients, pass 2
  forwards each micro-batch again with its graph and backpropagates. Only ``train_step`` is timed.
- baseline: plain PyTorch, the same model (``torch.manual_seed(0)`` then ``gpt_encoder``), the
  whole global batch in one forward, ``paratrain.loss.info_nce`` on it, ``backward()``,
  ``optimizer.step()``, ``zero_grad``.

Both sides use plain SGD (``optim.name = "sgd"``, no momentum, no weight decay, no clipping: the
step still computes the gradient norm) at the config's lr, on the same global batch: the first
of the training sampler's stream (``GlobalBatchSampler``, seed 0), the same rows every step.

Checks (exit on failure; none on time): world size 1 and dp 1; both sides' rows equal the global
batch and paratrain runs global / micro micro-batches; the same initial parameters; the same loss
at step 1 (same init, same data, the same math: within 1e-4 relative). The step-2 losses (after
one update each) are compared too and a difference over 1e-4 is flagged, not fatal.

Time: after ``WARMUP`` steps each (step 1 included), ``--pairs`` pairs of single steps, the order
swapped every pair (A B, B A, ...); per side the median step time; per pair the ratio
paratrain / baseline, summarised as the median ratio and the 95% t-interval of the geometric
mean ratio (src/paratrain/testing/paired.py). Counting a backward as two forwards, the naive step is 3
forward-equivalents and the gradient cache's 4 (one more forward): ~1.33x expected, less the
fixed costs both share, more the per-micro-batch overheads of the smaller forwards.

Peak memory: one more step per side under MemTracker on real tensors (paratrain's
``_StepMemTracker``, batch/measure.py, the tool of its CPU measurement; it allows the several
forwards of the root module per step), the peak of all tensors tracked (parameters, gradients,
activations, temporaries; the batch was made before), MiB. The baseline's activations grow with
the global batch, paratrain's with the micro-batch.

The machine's load average is printed before and after (the times depend on it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


CONFIG = os.path.join(REPO, "configs", "code_search.toml")
WARMUP = 2  # steps per side before the timed pairs (the first one is the checked step 1)
LOSS_RTOL = 1e-4
MIB = 2**20


def load_line() -> str:
    """``uptime``'s line (the load averages over 1, 5 and 15 minutes)."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def overrides(global_batch: int, micro: int, out_dir: str, dry_run: bool) -> list[str]:
    sets = [
        f"batch.global_batch_size={global_batch}",
        f"batch.micro_batch_size={micro}",
        "optim.name='sgd'",
        "optim.beta1=0.0",  # SGD's momentum: plain SGD
        "optim.weight_decay=0.0",
        "optim.grad_clip=0.0",
        "eval.interval=0",
        f"eval.samples={global_batch}",  # must divide by the global batch even when unused
        f"run.out_dir='{out_dir}'",
    ]
    if dry_run:  # a few stdlib files and short rows: seconds
        sets += ["data.args.max_files=40", "data.args.seq_len=32", "model.args.block_size=32"]
    return sets


class Paratrain:
    """The step as training builds it (trainer.py build_run), for world 1."""

    def __init__(self, cfg, ctx, dataset):
        from paratrain.build import build_parallel_with_weights, key_detected_draws
        from paratrain.data.sampler import GlobalBatchSampler, load_batches, rank_micro_batches
        from paratrain.models import build
        from paratrain.objectives.registry import build_loss
        from paratrain.optim import build_optimizer
        from paratrain.precision import build_precision
        from paratrain.preflight import check_run
        from paratrain.trainer import static_item_count

        self.dims, self.plan = check_run(cfg, ctx.world_size)
        loss_fn = build_loss(cfg.loss)
        torch.manual_seed(cfg.run.seed)
        model, spec = build(cfg.model)
        self.initial = [p.detach().clone() for p in model.parameters()]
        precision = build_precision(cfg.precision, device=ctx.device, fsdp_enabled=self.dims.fsdp_enabled)
        self.model, self.step_ctx, _ = build_parallel_with_weights(
            cfg,
            self.dims,
            model,
            spec=spec,
            device=ctx.device,
            loss_fn=loss_fn,
            precision=precision,
            items_per_sample=static_item_count(dataset, cfg.loss, loss_fn.plugin),
        )
        self.optimizer = build_optimizer(self.model, cfg.optim)
        # The first global batch of the training stream, cut as the loader cuts it (dp 1).
        g = self.plan.global_batch_size
        indices = GlobalBatchSampler(len(dataset), seed=cfg.run.seed, shuffle=cfg.data.shuffle).global_indices(0, g)
        parts = rank_micro_batches(indices, dp_rank=0, dp=self.dims.dp, micro_batch_size=self.plan.micro_batch_size)
        self.batches = [b for mb in parts for b in load_batches(dataset, mb, self.plan.micro_batch_size)]
        self.step_ctx = key_detected_draws(cfg, self.dims, self.model, self.step_ctx, self.batches[0][0])
        self.model.train()

    def step(self) -> float:
        from paratrain.step import train_step

        return train_step(self.model, self.optimizer, self.batches, self.step_ctx).loss


class Baseline:
    """Plain PyTorch: the whole global batch in one forward."""

    def __init__(self, cfg, batches):
        from paratrain.loss import info_nce
        from paratrain.models.gpt.encoder import gpt_encoder

        torch.manual_seed(cfg.run.seed)
        self.model = gpt_encoder(**cfg.model.args)
        self.initial = [p.detach().clone() for p in self.model.parameters()]
        # Plain SGD, the same lr; the fused kernel, as paratrain's build_optimizer picks on CPU.
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=cfg.optim.lr, fused=True)
        self.loss_fn = info_nce(cfg.loss.temperature)
        self.x = torch.cat([x for x, _ in batches])
        self.y = torch.cat([torch.as_tensor(t) for _, t in batches])
        self.model.train()

    def step(self) -> float:
        loss = self.loss_fn(self.model(self.x), self.y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())


def timed(side) -> tuple[float, float]:
    t0 = time.perf_counter()
    loss = side.step()
    return time.perf_counter() - t0, loss


def peak_memory(side, params) -> dict:
    """One step under MemTracker: the peak of all tracked tensors and its parts, bytes."""
    from torch.distributed._tools.mem_tracker import _MemRefType

    from paratrain.batch.measure import _StepMemTracker

    tracker = _StepMemTracker()
    tracker.track_external(side.model, side.optimizer)
    with tracker:
        side.step()
    snap = tracker.get_tracker_snapshot("peak")
    dev = max(snap, key=lambda d: snap[d]["Total"])
    parts = {str(k.value if isinstance(k, _MemRefType) else k): v for k, v in snap[dev].items()}
    return {"peak_bytes": snap[dev]["Total"], "params_bytes": params, "parts_at_peak": parts}


def relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def measure(global_batch: int, args, ctx, dataset) -> dict:
    import torch.distributed as dist

    from paratrain.config import load_config
    from paratrain.testing.paired import paired_ratios, ratio_ci

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(CONFIG, overrides(global_batch, args.micro_batch, tmp, args.dry_run))
        para = Paratrain(cfg, ctx, dataset)
    base = Baseline(cfg, para.batches)

    # What the baseline claims: the same world, global batch, init and rows.
    world = dist.get_world_size()
    assert world == 1 and para.dims.world_size == 1 and para.step_ctx.dp == 1, (world, para.dims, para.step_ctx.dp)
    accum = global_batch // args.micro_batch
    assert para.plan.global_batch_size == global_batch and para.plan.accum_steps == accum, para.plan
    para_rows = [x.shape[0] for x, _ in para.batches]
    assert len(para_rows) == accum and set(para_rows) == {args.micro_batch}, para_rows
    assert base.x.shape[0] == sum(para_rows) == global_batch, (base.x.shape, para_rows)
    assert torch.equal(base.x, torch.cat([x for x, _ in para.batches])), "the two sides' rows differ"
    assert len(base.initial) == len(para.initial) and all(
        a.shape == b.shape and torch.equal(a, b) for a, b in zip(base.initial, para.initial)
    ), "the two sides' initial parameters differ"
    params = sum(p.numel() * p.element_size() for p in base.initial)
    del base.initial, para.initial

    times: dict[str, list[float]] = {"baseline": [], "paratrain": []}
    sides = {"baseline": base, "paratrain": para}
    losses: dict[str, list[float]] = {"baseline": [], "paratrain": []}
    for _ in range(WARMUP):
        for name, side in sides.items():
            losses[name].append(timed(side)[1])
    step1 = relative(losses["paratrain"][0], losses["baseline"][0])
    if step1 > LOSS_RTOL:
        sys.exit(
            f"global batch {global_batch}: step-1 loss paratrain {losses['paratrain'][0]!r} vs baseline"
            f" {losses['baseline'][0]!r}, relative difference {step1:.3e} > {LOSS_RTOL:g} (same init, data, math)"
        )
    step2 = relative(losses["paratrain"][1], losses["baseline"][1])
    pairs = args.pairs
    for i in range(pairs):
        order = ["baseline", "paratrain"] if i % 2 == 0 else ["paratrain", "baseline"]
        for name in order:
            times[name].append(timed(sides[name])[0])
        print(
            f"  global {global_batch} pair {i + 1}/{pairs}: baseline {times['baseline'][-1] * 1e3:.0f} ms,"
            f" paratrain {times['paratrain'][-1] * 1e3:.0f} ms",
            flush=True,
        )
    ratios = paired_ratios(times["paratrain"], times["baseline"])
    geo, lo, hi = ratio_ci(ratios)
    memory = {name: peak_memory(side, params) for name, side in sides.items()}
    row = {
        "global_batch": global_batch,
        "micro_batch": args.micro_batch,
        "accumulation": accum,
        "world_size": world,
        "pairs": pairs,
        "step_time_s": times,
        "median_step_time_s": {k: statistics.median(v) for k, v in times.items()},
        "ratios_paratrain_over_baseline": ratios,
        "ratio_median": statistics.median(ratios),
        "ratio_geometric_mean": geo,
        "ratio_geometric_mean_ci95": [lo, hi],
        "loss_step1": {k: v[0] for k, v in losses.items()},
        "loss_step1_relative_difference": step1,
        "loss_step2": {k: v[1] for k, v in losses.items()},
        "loss_step2_relative_difference": step2,
        "memory": memory,
        "peak_mib": {k: v["peak_bytes"] / MIB for k, v in memory.items()},
        "peak_ratio_paratrain_over_baseline": memory["paratrain"]["peak_bytes"] / memory["baseline"]["peak_bytes"],
    }
    print(
        f"  global {global_batch}: step-1 loss paratrain {losses['paratrain'][0]:.6f} baseline"
        f" {losses['baseline'][0]:.6f} (relative difference {step1:.1e}); step 2 {step2:.1e}"
        + (" <- over 1e-4: the first update differs" if step2 > LOSS_RTOL else ""),
        flush=True,
    )
    return row


def fmt_ci(lo: float, hi: float) -> str:
    return "n/a" if math.isnan(lo) else f"{lo:.3f}, {hi:.3f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256, 1024], help="global batch sizes")
    ap.add_argument("--pairs", type=int, default=5, help="timed pairs per global batch")
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the other benchmarks run 1)")
    ap.add_argument("--out", default=os.path.join(HERE, "grad_cache.json"))
    ap.add_argument("--dry-run", action="store_true", help="seconds: global 8 and 16, micro-batch 4, 2 pairs")
    args = ap.parse_args()
    if args.dry_run:
        args.batches, args.micro_batch, args.pairs = [8, 16], 4, 2
        args.out = os.path.join(tempfile.gettempdir(), "grad_cache_dry_run.json")
    for g in args.batches:
        if g % args.micro_batch:
            ap.error(f"global batch {g} is not a multiple of --micro-batch {args.micro_batch}")
    torch.set_num_threads(args.threads)

    from paratrain.config import load_config
    from paratrain.data.datasets import build_dataset
    from paratrain.distributed.process_group import close_distributed, init_distributed

    load_before = load_line()
    print(f"load before: {load_before}", flush=True)
    t_start = time.perf_counter()
    cfg = load_config(CONFIG, overrides(args.batches[0], args.micro_batch, tempfile.gettempdir(), args.dry_run))
    ctx = init_distributed(cfg.dist)  # world 1: a private in-memory store, as `python train.py` gets
    rows = []
    try:
        dataset = build_dataset(cfg.data)
        print(f"data: {json.dumps(dataset.description)}", flush=True)
        for g in args.batches:
            rows.append(measure(g, args, ctx, dataset))
    finally:
        close_distributed(ctx)
    load_after = load_line()
    elapsed = time.perf_counter() - t_start

    print()
    print(
        f"code_search (configs/code_search.toml), world 1 on CPU, {args.threads} thread(s), micro-batch"
        f" {args.micro_batch}, plain SGD; torch {torch.__version__}"
    )
    print(
        "time: median step time of each side over the timed steps; ratio = paratrain / baseline per pair:"
        " median of the pairs [95% t-interval of the geometric mean ratio]"
    )
    print("peak: MemTracker peak of all tensors during one step (parameters, gradients, activations), MiB")
    head = (
        "global batch",
        "pairs",
        "baseline ms (median)",
        "paratrain ms (median)",
        "ratio median [95% CI]",
        "baseline peak MiB",
        "paratrain peak MiB",
        "peak paratrain/baseline",
    )
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        med = r["median_step_time_s"]
        print(
            f"| {r['global_batch']} | {r['pairs']} | {med['baseline'] * 1e3:.0f} | {med['paratrain'] * 1e3:.0f}"
            f" | {r['ratio_median']:.3f} [{fmt_ci(*r['ratio_geometric_mean_ci95'])}]"
            f" | {r['peak_mib']['baseline']:.1f} | {r['peak_mib']['paratrain']:.1f}"
            f" | {r['peak_ratio_paratrain_over_baseline']:.3f} |"
        )
    print(f"\nload before: {load_before}\nload after:  {load_after}\n({elapsed:.0f} s in all)")
    result = {
        "command": "python benchmarks/memory/grad_cache.py " + " ".join(sys.argv[1:]),
        "config": os.path.relpath(CONFIG, REPO),
        "dry_run": args.dry_run,
        "threads": args.threads,
        "warmup_steps": WARMUP,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "dataset": dataset.description,
        "load_before": load_before,
        "load_after": load_after,
        "elapsed_s": elapsed,
        "rows": rows,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"wrote {os.path.relpath(args.out, REPO) if args.out.startswith(REPO) else args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
