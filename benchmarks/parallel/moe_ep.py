"""Expert parallelism on CPU (gloo), issue 24: step time, memory per rank and all_to_all bytes of
the MoE GPT at every ep, against a dense GPT with the same active parameters per token.

One command, one process tree: for each world (2 and 4) and each round, every layout of that
world is one ``torchrun`` job of paratrain's own trainer (this file's ``--worker`` mode: the
trainer's worker with a byte counter and a memory reading added, nothing else changed), the
layouts in alternating order (reversed every other round), so that each round gives *paired*
runs: the ratios ep k / ep 1 and MoE / dense of the same round cancel the drift of a shared
machine (src/paratrain/testing/paired.py: median ratio and the 95% t-interval of the geometric mean).

Layouts, with DDP for everything but the experts (``parallel.dp_replicate = world``):
    MoE GPT at ep 1 (the experts replicated, all-reduced by DDP), ep 2, ..., ep = world;
    dense GPT: same d_model and layers, MLP width ``(top_k + n_shared) x mlp_ratio x d_model``,
    so the FLOPs per token match (its parameters = the MoE's active ones but the router and
    ``top_k - 1`` output biases per layer; both counts are printed).
Same data (the built-in byte corpus), seed, global batch (one micro-batch per rank), steps, AdamW.

Reported per layout:
- **step ms**: the median over rounds of each run's median loop iteration (differences of
  consecutive metrics rows' ``time``, the first ``WARMUP`` steps left out, as dp_overhead.py).
- **state MiB**: parameters + gradients + AdamW moments held by one rank, the local bytes of the
  real tensors (``DTensor.to_local()``), read just before the last optimiser step (as
  benchmarks/memory/memory.py counts them), worst rank. **RSS MiB**: the peak resident set of one rank
  (``getrusage`` ``ru_maxrss``: torch's libraries, activations and buffers included), worst rank.
- **a2a MiB**: the bytes one rank's token all_to_alls send to *other* ranks per optimiser step
  (dispatch and combine, forward and backward, every MoE layer; ``all_to_all_single``'s floating
  point calls, counted by split size), mean over steps, worst rank, against plan/cost.py's
  ``moe_all_to_all_bytes`` (balanced routing), the one formula, x 2 (forward + backward) x the
  MoE layers, at the rank's tokens per step.
Each run is checked to be what it claims from its own files (``config.toml``, ``summary.json``,
``metrics.jsonl``): world size, ep, dp, global and micro batch, steps, MoE or dense; exit 1 if not.

    PYTHONPATH=src python benchmarks/parallel/moe_ep.py [--quick] [--worlds 2 4] [--rounds 5] [--steps 14]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

from paratrain.testing.bench import run_job
from paratrain.testing.moe_ep import MIB, WARMUP, a2a_formula, layouts, overrides, param_counts, read_run
from paratrain.testing.paired import paired_ratios, ratio_ci

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


# ----- the worker: one rank of one run (under torchrun) ----------------------------------------


def worker(argv: list[str]) -> int:
    """paratrain's worker (launch/worker.py) with two readings added: the bytes every floating
    point ``all_to_all_single`` sends to other ranks, and the local bytes of parameters, gradients
    and optimiser state before each optimiser step; written to ``<out_dir>/rank<r>.json``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from paratrain import trainer
    from paratrain.launch import worker as pt_worker
    from paratrain.models.gpt.moe import MoE

    sent = [0]
    a2a = dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        if input.is_floating_point() and input_split_sizes is not None:  # the tokens, not the counts
            me = dist.get_group_rank(group, dist.get_rank())
            row = input[0].numel() * input.element_size() if len(input) else 0
            sent[0] += (sum(input_split_sizes) - input_split_sizes[me]) * row
        return a2a(output, input, output_split_sizes, input_split_sizes, group=group, **kw)

    dist.all_to_all_single = counting  # expert_parallel.py calls it as dist.all_to_all_single

    def local_bytes(t) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    state = {}
    build_run = trainer.build_run

    def build_run_counted(cfg, ctx, **kw):
        run = build_run(cfg, ctx, **kw)
        params = list(run.model.parameters())
        state["local_experts"] = sorted({len(m.experts) for m in run.model.modules() if isinstance(m, MoE)})

        def before_step(opt, args, kwargs) -> None:  # gradients exist; zero_grad follows the step
            state.update(
                params=sum(local_bytes(p) for p in params),
                grads=sum(local_bytes(p.grad) for p in params if p.grad is not None),
                optim=sum(local_bytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v)),
            )

        run.optimizer.register_step_pre_hook(before_step)
        return run

    trainer.build_run = build_run_counted
    out_dir = next(o.split("=", 1)[1].strip("'\"") for o in argv if o.startswith("run.out_dir="))
    rc = pt_worker.main(argv)
    rank = int(os.environ["RANK"])
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        # ru_maxrss: kilobytes on Linux
        json.dump(
            {**state, "a2a_bytes": sent[0], "rss_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}, f
        )
    return rc


# ----- the driver --------------------------------------------------------------------------------


def launch(world: int, sets: list[str], out: str, *, timeout_s: float = 240, tries: int = 2) -> None:
    """One torchrun job of this file's worker, through paratrain.testing.bench's runner (a job hung past
    ``timeout_s`` is killed with its process group and run again from a fresh ``out``)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    cmd += [os.path.abspath(__file__), "--worker", os.path.join(REPO, "configs", "debug.toml")]
    cmd += [x for s in sets for x in ("--set", s)]
    run_job(cmd, timeout_s=timeout_s, tries=tries, out_dir=out)


def ci_text(ratios: list[float]) -> str:
    if len(ratios) < 2:
        return f"{statistics.median(ratios):.3f}"
    g, lo, hi = ratio_ci(ratios)
    return f"{statistics.median(ratios):.3f} [{lo:.3f}, {hi:.3f}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke test: world 2 only, 2 rounds of 5 steps")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=5, help="paired rounds per world")
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--shared", type=int, default=0, help="shared experts")
    a = ap.parse_args()
    if a.quick:
        a.worlds, a.rounds, a.steps = [2], 2, WARMUP + 2
    counts = param_counts(a)
    print(
        f"GPT n_layer {a.n_layer}, d_model {a.d_model}, seq {a.seq}, global batch {a.batch} x {a.seq} tokens,"
        f" {a.steps} steps, AdamW, DDP + ep, gloo, 1 thread/rank; MoE: {a.experts} experts, top_k {a.top_k},"
        f" {a.shared} shared, every block"
    )
    print(
        f"parameters: MoE {counts['moe_total']:,} (active per token {counts['moe_active']:,}),"
        f" dense {counts['dense']:,} (MLP width {(a.top_k + a.shared) * 4} x d_model)"
    )
    print(f"load before: {os.getloadavg()}", flush=True)
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for world in a.worlds:
            lays = layouts(world, a)
            runs = {name: [] for name, _, _ in lays}
            for i in range(a.rounds):
                for name, ep, moe in lays if i % 2 == 0 else lays[::-1]:
                    out = os.path.join(tmp, f"w{world}-{name.replace(' ', '')}-{i}")
                    t0 = time.time()
                    launch(world, overrides(a, world, ep, moe, out), out)
                    runs[name].append(read_run(out, a=a, world=world, ep=ep, moe=moe))
                    print(
                        f"  world {world} round {i + 1}/{a.rounds} {name}: {runs[name][-1]['step_s'] * 1e3:.1f} ms/step"
                        f" ({time.time() - t0:.0f} s)",
                        flush=True,
                    )
            ep1 = [r["step_s"] for r in runs["moe ep 1"]]
            dense = [r["step_s"] for r in runs["dense"]]
            print(f"world {world} ({a.rounds} paired rounds)")
            head = f"  {'layout':<9} {'step ms':>8} {'vs ep 1 [95% CI]':>22} {'vs dense [95% CI]':>22}"
            print(head + f" {'state MiB':>9} {'RSS MiB':>8} {'a2a MiB':>8} {'formula':>8}")
            for name, ep, moe in lays:
                rs = runs[name]
                t = [r["step_s"] for r in rs]
                vs1 = ci_text(paired_ratios(t, ep1)) if moe and ep > 1 else "-"
                vsd = ci_text(paired_ratios(t, dense)) if moe else "-"
                formula = a2a_formula(a, world, ep, counts["moe_layers"]) if moe else 0.0
                a2a = statistics.mean(r["a2a"] for r in rs)
                # The balanced-routing formula within the routing's imbalance (the tokens go where
                # the router sends them): 10%, and exactly 0 where nothing is exchanged.
                failed |= abs(a2a - formula) > 0.10 * formula if formula else a2a != 0
                print(
                    f"  {name:<9} {statistics.median(t) * 1e3:8.1f} {vs1:>22} {vsd:>22}"
                    f" {max(r['state'] for r in rs) / MIB:9.2f} {max(r['rss'] for r in rs) / MIB:8.0f}"
                    f" {a2a / MIB:8.3f} {formula / MIB:8.3f}"
                )
    print(
        "state: params + grads + AdamW moments, local tensor bytes before the last step, worst rank;"
        " RSS: peak resident set (ru_maxrss), worst rank; a2a: bytes sent to other ranks per step"
        " (fwd + bwd, all MoE layers), mean over steps, worst rank; ratios: median [95% CI of the"
        " geometric mean] of paired rounds"
    )
    print(f"load after: {os.getloadavg()}")
    if failed:
        print("a2a bytes off the formula by more than 10%", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        from paratrain.distributed.process_group import run_then_exit

        run_then_exit(lambda: worker(sys.argv[2:]))
    else:
        sys.exit(main())
