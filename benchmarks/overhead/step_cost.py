"""What a step's regions cost at one paratrain commit against another (issue 58 item 4).

Two checkouts' ``src/`` (e.g. git worktrees of two commits, or one of them this tree's), each
running its own ``configs/main.toml`` as its CLI would (world 2, DDP), in separate jobs that
alternate (A B, B A, ...). Each job times the main thread's CPU seconds of every step's regions
(thread CPU time counts no waiting; under load it still moves by a few per cent from job to job),
by wrapping functions that both commits have:

- ``forward``: ``DistributedDataParallel.forward`` (the model); ``backward``: ``Tensor.backward``
  (DDP's bucket all-reduce in the last micro-batch's);
- ``loss``: ``Loss.__call__`` (the cross-entropy sum and count);
- ``clip+optimiser``: ``step.finish_step``;
- ``objective interface``: the rest of ``step.train_step``: the count before the backward
  (``count``), the micro-batch loop's own Python around forward, loss and backward (``loop``:
  contexts, device moves, scaling, the objectives' hooks), the one reduce launched and read
  (``reduce``), the scale, the objectives' start and read (``own``);
- ``rest``: the loop outside ``train_step`` (loader, metrics row, checks); and per iteration the
  process CPU, wall, the main thread's kernel CPU time and minor page faults.

It prints each region's median ms per step at each side and the paired ratio B/A per region
(median over the pairs with the 95% CI of the geometric mean, src/paratrain/testing/paired.py).
``--ops``: one more job per side under torch.profiler and cProfile over 10 steps: the aten ops
and Python function calls per step (deterministic: the load does not move them), and every op or
paratrain function whose count differs.

    python benchmarks/overhead/step_cost.py --a OLD/src --b NEW/src [--pairs 8] [--steps 30] [--ops]
    python benchmarks/overhead/step_cost.py --a src --b src --env-b MALLOC_TRIM_THRESHOLD_=1073741824
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import resource
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
WARMUP = 5  # steps left out of each job
OPS_AT, OPS_STEPS = 11, 10  # --ops: the steps profiled
REGIONS = (
    "forward+backward",
    "loss",
    "clip+optimiser",
    "objective interface",
    "  count",
    "  loop",
    "  reduce",
    "  own",
    "rest",
    "whole iteration",
    "iteration, process CPU",
    "iteration, wall",
    "iteration, kernel (sys) CPU",
    "minor page faults",
)


from step_profile import timer  # noqa: E402 - the one timing wrapper (this folder is on sys.path as a script's)


def regions(raw: dict) -> dict:
    """Per step, the regions above from the wrapped functions' inclusive seconds."""
    g = raw.get
    model = g("forward", 0.0) + g("loss_fn", 0.0) + g("backward", 0.0)
    interface = g("step", 0.0) - model - g("clip_optimizer", 0.0)
    loop = g("fb_loop", 0.0) - model
    out = {
        "forward+backward": g("forward", 0.0) + g("backward", 0.0),
        "loss": g("loss_fn", 0.0),
        "clip+optimiser": g("clip_optimizer", 0.0),
        "objective interface": interface,
        "  count": g("count", 0.0),
        "  loop": loop,
        "  reduce": g("reduce", 0.0),
        "  own": interface - g("count", 0.0) - loop - g("reduce", 0.0),
        "rest": g("iteration", 0.0) - g("step", 0.0),
        "whole iteration": g("iteration", 0.0),
        "iteration, process CPU": g("process", 0.0),
        "iteration, wall": g("wall", 0.0),
        "iteration, kernel (sys) CPU": g("sys", 0.0),
    }
    return {**{k: 1e3 * v for k, v in out.items()}, "minor page faults": g("faults", 0.0)}


def worker(config: str, out: str, steps: int, ops: bool) -> None:
    """The main job as the CLI runs it (trainer.train), with the wrappers above; rank 0 writes
    each step's regions (or, with ``ops``, the op and call counts of steps OPS_AT..)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import paratrain.loss as L
    import paratrain.step as S
    import paratrain.trainer as T
    from paratrain.config import load_config

    sets = [f"run.steps={steps}", f"run.out_dir='{out}.run'", "run.progress=false", "metrics.plot=false"]
    cfg = load_config(config, [*sets, "run.save_model=false", "eval.interval=0"])
    cur, rows = {}, []
    timed = timer(cur, time.thread_time)
    if not ops:  # the wrappers' own few microseconds stay out of the op counts
        DDP.forward = timed("forward", DDP.forward)
        L.Loss.__call__ = timed("loss_fn", L.Loss.__call__)
        torch.Tensor.backward = timed("backward", torch.Tensor.backward)
        S.forward_backward = timed("fb_loop", S.forward_backward)
        S.finish_step = timed("clip_optimizer", S.finish_step)
        S.count_global_items = timed("count", S.count_global_items)
        S.launch_totals = timed("reduce", S.launch_totals)
        S.PendingTotals.read = timed("reduce", S.PendingTotals.read)
    step, last, prof = T.train_step, {}, {}
    clocks = {
        "iteration": time.thread_time,
        "process": time.process_time,
        "wall": time.perf_counter,
        # The main thread's kernel time and minor page faults (counted in its CPU time: a job's
        # heap history can move a step's figures without any change of the step's code).
        "sys": lambda: resource.getrusage(resource.RUSAGE_THREAD).ru_stime,
        "faults": lambda: resource.getrusage(resource.RUSAGE_THREAD).ru_minflt,
    }

    def train_step(*args, **kwargs):
        now = {k: c() for k, c in clocks.items()}
        if last:  # the previous iteration, now complete
            cur.update({k: now[k] - last[k] for k in clocks})
            rows.append(dict(cur))
        cur.clear()
        last.update(now)
        if ops and len(rows) == OPS_AT:
            prof["torch"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            prof["py"] = cProfile.Profile()
            prof["torch"].start()
            prof["py"].enable()
        if ops and len(rows) == OPS_AT + OPS_STEPS:
            prof["py"].disable()
            prof["torch"].stop()
        t = time.thread_time()
        try:
            return step(*args, **kwargs)
        finally:
            cur["step"] = time.thread_time() - t

    T.train_step = train_step
    T.train(cfg)
    if int(os.environ["RANK"]) != 0:
        return
    if not ops:
        with open(out, "w") as f:
            json.dump([regions(r) for r in rows[WARMUP:]], f)
        return
    aten = {e.key: e.count / OPS_STEPS for e in prof["torch"].key_averages() if e.key.startswith(("aten::", "gloo:"))}
    st = pstats.Stats(prof["py"]).stats
    calls = {f"{os.path.basename(f)}:{n}": v[1] / OPS_STEPS for (f, _, n), v in st.items() if "paratrain" in f}
    with open(out, "w") as f:
        json.dump({"aten": aten, "py_calls": sum(v[1] for v in st.values()) / OPS_STEPS, "paratrain": calls}, f)


def run(src: str, out: str, *, steps: int, nproc: int, ops: bool = False, env: dict | None = None):
    """One job of the checkout whose ``src`` is given, from its root, with its own configs/main.toml."""
    root = os.path.dirname(os.path.abspath(src))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), __file__]
    cmd += ["--worker", "--out", out, "--config", os.path.join(root, "configs/main.toml"), "--steps", str(steps)]
    env = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.abspath(src)}
    res = subprocess.run(cmd + (["--ops"] if ops else []), cwd=root, env=env, capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"job failed ({src}): {' '.join(cmd)}\n{res.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def diff_counts(name: str, a: dict, b: dict) -> None:
    keys = sorted(k for k in set(a) | set(b) if a.get(k, 0) != b.get(k, 0))
    print(f"{name} per step whose count differs (A, B):")
    for k in keys:
        print(f"  {k[:60]:<60} {a.get(k, 0):>8g} {b.get(k, 0):>8g}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", help="side A: a checkout's src/ (the ratios are B/A)")
    p.add_argument("--b", default=os.path.join(REPO, "src"), help="side B: a checkout's src/ (default: this tree)")
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--ops", action="store_true", help="also: op and Python call counts per step, one job per side")
    p.add_argument(
        "--env-b", nargs="*", default=[], metavar="KEY=VALUE", help="environment of side B's jobs only (e.g. malloc's)"
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        import torch

        torch.set_num_threads(1)
        worker(args.config, args.out, args.steps, args.ops)
        return
    if not args.a:
        p.error("--a is required: the src/ of the checkout to compare with")
    from paratrain.testing.paired import summary_line

    med = {"A": [], "B": []}  # per job: each region's median ms per step
    env = {"A": {}, "B": dict(kv.split("=", 1) for kv in args.env_b)}
    with tempfile.TemporaryDirectory() as tmp:
        if args.ops:
            got = {s: run(src, os.path.join(tmp, f"ops{s}.json"), steps=OPS_AT + OPS_STEPS + 2, nproc=args.nproc, ops=True, env=env[s])
                   for s, src in (("A", args.a), ("B", args.b))}  # fmt: skip
            print(f"aten ops per step: A {sum(got['A']['aten'].values()):g}, B {sum(got['B']['aten'].values()):g}")
            print(f"Python function calls per step (cProfile): A {got['A']['py_calls']:g}, B {got['B']['py_calls']:g}")
            diff_counts("aten ops", got["A"]["aten"], got["B"]["aten"])
            diff_counts("paratrain functions' calls", got["A"]["paratrain"], got["B"]["paratrain"])
        for i in range(args.pairs):
            for side in ("A", "B") if i % 2 == 0 else ("B", "A"):
                src = args.a if side == "A" else args.b
                rows = run(src, os.path.join(tmp, f"{side}{i}.json"), steps=args.steps, nproc=args.nproc, env=env[side])
                med[side].append({k: statistics.median(r[k] for r in rows) for k in REGIONS})
            load = os.getloadavg()[0]
            a, b = med["A"][-1], med["B"][-1]
            print(
                f"pair {i + 1}: whole iteration A {a['whole iteration']:.2f} B {b['whole iteration']:.2f} ms (load {load:.1f})"
            )
    if not args.pairs:
        return
    print(f"main thread CPU ms per step, median over {args.pairs} jobs each side; ratio B/A paired by job:")
    for k in REGIONS:
        a = statistics.median(m[k] for m in med["A"])
        b = statistics.median(m[k] for m in med["B"])
        ratios = [y[k] / x[k] for x, y in zip(med["A"], med["B"]) if x[k] > 0 and y[k] > 0]
        line = summary_line("B/A", ratios) if len(ratios) >= 2 else ""
        print(f"{k:<28} A {a:8.3f}  B {b:8.3f}  B-A {b - a:+7.3f}  {line}")
    print(f"(A: {args.a}; B: {args.b} {' '.join(args.env_b)}; load {' '.join(f'{x:.2f}' for x in os.getloadavg())})")


if __name__ == "__main__":
    main()
