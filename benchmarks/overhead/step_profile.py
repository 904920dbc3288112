"""Where a paratrain step's time goes next to the hand-written DDP loop: deterministic counts first.

Runs the main job (world 2, gloo) twice under torchrun, paratrain's loop and the loop of
src/paratrain/testing/baseline_ddp.py (here with phase timers), each with torch.profiler over steps
11-20, and prints per step:

- the collectives (the profiler's ``gloo:*`` events, DDP's bucket all-reduce included);
- the host reads: ``aten::_local_scalar_dense`` (``.item()``, ``float(t)``; AdamW on CPU reads
  each parameter's step count, in both loops) and ``Tensor.tolist`` calls;
- the median wall time of each phase (ms): paratrain's count before backward, forward/backward,
  clip + optimiser step, the wait for the totals reduce, the rest of ``train_step``, and the loop
  outside ``train_step`` (loader, metrics row, rank stats, checkpoint checks, the row's write);
  the baseline's data, forward/backward, clip + optimiser step and loss reduce + read.

The counts do not depend on the machine's load; the times do (state ``uptime`` beside them).
``--ops N`` adds the op table: calls and self CPU ms per step of each loop, the N ops whose time
differs most and every op whose count differs.

``--interleaved STEPS``: one job instead, paratrain's loop with a hand-written DDP step (its own
model copy) beside each of its steps, before and after it in turn: the paired ratio of wall and
of CPU seconds per step, and each loop's phases in main-thread CPU ms, which waits and other
jobs' load hardly move (a figure for a shared machine, where two separate jobs' medians swing).

    python benchmarks/overhead/step_profile.py [--config configs/main.toml] [--src /path/to/other/src] [--ops 25]
    python benchmarks/overhead/step_profile.py --interleaved 60
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
WAIT, ACTIVE = 10, 10  # profiler: steps skipped, steps recorded (after one warm-up step)


def timer(cur: dict, clock):
    """``timed(name, fn)``: fn wrapped so that the ``clock`` seconds it takes add to ``cur[name]``."""

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                cur[name] = cur.get(name, 0.0) + clock() - t

        return wrapper

    return timed


def name_tolist() -> None:
    """Make Tensor.tolist (a host read the profiler does not name) a profiler event."""
    import torch
    from torch.profiler import record_function

    tolist = torch.Tensor.tolist

    def named(self):
        with record_function("Tensor.tolist"):
            return tolist(self)

    torch.Tensor.tolist = named


def report(prof, phases: dict, out: str) -> None:
    counts = {e.key: e.count for e in prof.key_averages()}
    row = {
        "collectives": {k: c / ACTIVE for k, c in counts.items() if k.startswith(("gloo:", "nccl:"))},
        "item_reads": counts.get("aten::_local_scalar_dense", 0) / ACTIVE,
        "tolist_reads": counts.get("Tensor.tolist", 0) / ACTIVE,
        "phase_ms": {k: 1e3 * statistics.median(v[2:]) for k, v in phases.items()},
        # Per op and step: calls and self CPU ms (--ops compares the two loops op by op).
        "ops": {e.key: [e.count / ACTIVE, e.self_cpu_time_total / 1e3 / ACTIVE] for e in prof.key_averages()},
    }
    with open(out, "w") as f:
        json.dump(row, f)


def print_ops(base: dict, ours: dict, n: int) -> None:
    """The ops whose self CPU time per step differs most between the loops, and every op whose
    count differs (the counts do not depend on the load; the times do)."""
    keys = set(base) | set(ours)
    zero = [0.0, 0.0]
    diff = {k: ours.get(k, zero)[1] - base.get(k, zero)[1] for k in keys}
    shown = sorted(keys, key=lambda k: -abs(diff[k]))[:n]
    shown += sorted(k for k in keys if k not in shown and base.get(k, zero)[0] != ours.get(k, zero)[0])
    print(f"{'op':<48} {'calls base':>10} {'calls ours':>10} {'ms base':>8} {'ms ours':>8} {'diff':>7}")
    for k in shown:
        (cb, mb), (co, mo) = base.get(k, zero), ours.get(k, zero)
        print(f"{k[:48]:<48} {cb:>10g} {co:>10g} {mb:>8.2f} {mo:>8.2f} {diff[k]:>+7.2f}")
    total = sum(diff.values())
    print(
        f"self CPU ms per step: baseline {sum(v[1] for v in base.values()):.2f}, paratrain"
        f" {sum(v[1] for v in ours.values()):.2f} ({total:+.2f})"
    )


def profiler():
    from torch.profiler import ProfilerActivity, profile, schedule

    return profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=WAIT, warmup=1, active=ACTIVE))


def baseline(config: str, out: str) -> None:
    """src/paratrain/testing/baseline_ddp.py's loop, with phase timers."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from paratrain.config import load_config
    from paratrain.testing.baseline_ddp import setup

    cfg = load_config(config, [f"run.steps={WAIT + ACTIVE + 2}"])
    rank, model, data, opt, per_rank, mbs, accum, g = setup(cfg)
    phases = {k: [] for k in ("data", "forward_backward", "clip_optimizer", "loss_reduce_read", "total")}
    name_tolist()
    with profiler() as prof:
        for step in range(cfg.run.steps):
            prof.step()
            t0 = time.perf_counter()
            idx = torch.randint(0, len(data), (cfg.batch.global_batch_size,), generator=g).tolist()
            mine = idx[rank * per_rank : (rank + 1) * per_rank]
            t_data = t_fb = 0.0
            for k in range(accum):
                a = time.perf_counter()
                xs, ys = zip(*(data[i] for i in mine[k * mbs : (k + 1) * mbs]))
                x, y = torch.stack(xs), torch.stack(ys)
                b = time.perf_counter()
                with model.no_sync() if k < accum - 1 else torch.enable_grad():
                    logits = model(x)
                    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)) / accum
                    loss.backward()
                t_data, t_fb = t_data + b - a, t_fb + time.perf_counter() - b
            a = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            b = time.perf_counter()
            loss_val = loss.detach().clone()
            dist.all_reduce(loss_val)
            loss_val.item()
            c = time.perf_counter()
            if step > WAIT:
                for name, v in zip(phases, (t_data, t_fb, b - a, c - b, c - t0)):
                    phases[name].append(v)
    if rank == 0:
        report(prof, phases, out)
    dist.barrier()
    dist.destroy_process_group()


def paratrain(config: str, out: str) -> None:
    """paratrain's loop as the CLI runs it, its phases timed by wrapping step.py's functions."""
    import paratrain.step as S
    import paratrain.trainer as T
    from paratrain.config import load_config

    tmp = out + ".run"  # one folder for every rank (the run's ranks share run.out_dir: preflight/shared.py)
    sets = [f"run.steps={WAIT + ACTIVE + 2}", f"run.out_dir='{tmp}'", "run.progress=false", "metrics.plot=false"]
    cfg = load_config(config, [*sets, "run.save_model=false", "eval.interval=0"])
    names = ("count", "forward_backward", "clip_optimizer", "totals_wait", "rest_of_step", "outside_step", "total")
    phases, cur = {k: [] for k in names}, {}

    timed = timer(cur, time.perf_counter)
    S.count_global_items = timed("count", S.count_global_items)
    S.forward_backward = timed("forward_backward", S.forward_backward)
    S.finish_step = timed("clip_optimizer", S.finish_step)
    if hasattr(S, "PendingTotals"):
        S.PendingTotals.wait = timed("totals_wait", S.PendingTotals.wait)
    else:  # an older step.py (--src): its reduce waited at once
        S.reduce_totals = timed("totals_wait", S.reduce_totals)
    step, state = S.train_step, {"last": None, "n": 0}
    name_tolist()

    def train_step(*args, **kwargs):
        now = time.perf_counter()
        if state["last"] is not None and state["n"] > WAIT + 1:  # the previous step, now complete
            cur["total"] = now - state["last"]
            cur["outside_step"] = cur["total"] - cur["step"]
            cur["rest_of_step"] = cur["step"] - sum(cur.get(k, 0.0) for k in names[:4])
            for k in names:
                phases[k].append(cur.get(k, 0.0))
        cur.clear()
        state["last"], state["n"] = now, state["n"] + 1
        prof.step()
        try:
            return step(*args, **kwargs)
        finally:
            cur["step"] = time.perf_counter() - now

    T.train_step = train_step
    with profiler() as prof:
        T.train(cfg)
    if int(os.environ["RANK"]) == 0:
        report(prof, phases, out)


def interleaved(config: str, out: str, steps: int) -> None:
    """paratrain's loop as the CLI runs it, with one hand-written DDP step (its own DDP copy of the
    model, AdamW and sampler: the loop of src/paratrain/testing/baseline_ddp.py) beside each
    paratrain step, so that every pair of steps shares the machine's state of that moment. Per
    step: wall, process CPU and main-thread CPU seconds of each, and the main thread's CPU
    seconds of each one's phases (CPU time counts no waiting: the least sensitive to load)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import paratrain.step as S
    import paratrain.trainer as T
    from paratrain.config import load_config
    from paratrain.data.datasets import build_dataset
    from paratrain.models import build_model

    sets = [f"run.steps={steps}", f"run.out_dir='{out}.run'", "run.progress=false", "metrics.plot=false"]
    cfg = load_config(config, [*sets, "run.save_model=false", "eval.interval=0"])
    base, phases, cur = {}, {}, {}

    timed = timer(cur, time.thread_time)  # the main thread's CPU seconds in fn, per step
    S.forward_backward = timed("ours forward_backward", S.forward_backward)
    S.finish_step = timed("ours clip_optimizer", S.finish_step)
    S.PendingTotals.read = timed("ours totals_read", S.PendingTotals.read)
    step, pairs = T.train_step, []

    def baseline_step():
        if not base:  # after paratrain made the process group
            torch.manual_seed(cfg.run.seed)
            model = DDP(build_model(cfg.model), bucket_cap_mb=cfg.comm.bucket_mb, gradient_as_bucket_view=True)
            opt = torch.optim.AdamW(
                model.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                weight_decay=cfg.optim.weight_decay,
            )  # fmt: skip
            base.update(model=model, opt=opt, data=build_dataset(cfg.data), g=torch.Generator().manual_seed(0))
        model, opt, data, g = base["model"], base["opt"], base["data"], base["g"]
        rank, world = dist.get_rank(), dist.get_world_size()
        per_rank = cfg.batch.global_batch_size // world
        mbs = cfg.batch.micro_batch_size or per_rank
        accum = per_rank // mbs
        idx = torch.randint(0, len(data), (cfg.batch.global_batch_size,), generator=g).tolist()
        mine = idx[rank * per_rank : (rank + 1) * per_rank]
        for k in range(accum):
            xs, ys = zip(*(data[i] for i in mine[k * mbs : (k + 1) * mbs]))
            x, y = torch.stack(xs), torch.stack(ys)
            t = time.thread_time()
            with model.no_sync() if k < accum - 1 else torch.enable_grad():
                logits = model(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)) / accum
                loss.backward()
            cur["base forward_backward"] = cur.get("base forward_backward", 0.0) + time.thread_time() - t
        t = time.thread_time()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        cur["base clip_optimizer"] = time.thread_time() - t
        loss_val = loss.detach().clone()
        dist.all_reduce(loss_val)
        loss_val.item()

    clocks = (time.perf_counter, time.process_time, time.thread_time)  # wall, process CPU, main thread CPU
    last = {}

    def timed_baseline():
        t = [c() for c in clocks]
        baseline_step()
        return [c() - x for c, x in zip(clocks, t)]

    def train_step(*args, **kwargs):
        # The pair's order alternates (the baseline step before, then after paratrain's), so that
        # neither always follows the other's collectives. paratrain's iteration is the time from
        # this entry to the next one, less the baseline step run within it.
        now = [c() for c in clocks]
        if last:
            ours = [n - t - b for n, t, b in zip(now, last["t"], last["base"])]
            pairs.append([last["base"][0], last["base"][1], ours[0], ours[1]])
            cur["base whole step (main thread)"], cur["ours whole iteration (main thread)"] = last["base"][2], ours[2]
            for k, v in cur.items():
                phases.setdefault(k, []).append(v)
        cur.clear()
        last["t"] = now
        if len(pairs) % 2 == 0:
            last["base"] = timed_baseline()
            return step(*args, **kwargs)
        result = step(*args, **kwargs)
        last["base"] = timed_baseline()
        return result

    T.train_step = train_step
    T.train(cfg)
    if int(os.environ["RANK"]) == 0:
        with open(out, "w") as f:  # pairs: [baseline wall, CPU, paratrain wall, CPU] per step
            json.dump({"pairs": pairs, "phases": phases}, f)


def run_interleaved(args, env) -> None:
    from paratrain.testing.paired import summary_line

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "pairs.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc)]
        cmd += [__file__, "--worker", "interleaved", "--out", out, "--config", args.config]
        res = subprocess.run(
            cmd,
            cwd=REPO,
            env={**env, "STEP_PAIRS": str(args.interleaved)},
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if res.returncode:
            sys.exit(f"interleaved run failed: {' '.join(cmd)}\n{res.stderr[-3000:]}")
        with open(out) as f:
            got = json.load(f)
    pairs = got["pairs"][5:]  # warm-up left out
    print(
        "main thread CPU ms per step (median): "
        + ", ".join(f"{k} {1e3 * statistics.median(v[5:]):.2f}" for k, v in sorted(got["phases"].items()))
    )
    for name, b_at, o_at in (("wall", 0, 2), ("CPU", 1, 3)):
        base, ours = [p[b_at] for p in pairs], [p[o_at] for p in pairs]
        diffs = sorted(o - b for b, o in zip(base, ours))
        print(
            f"{name}, {len(pairs)} interleaved step pairs: baseline {statistics.median(base) * 1e3:.2f} ms, paratrain"
            f" {statistics.median(ours) * 1e3:.2f} ms; paratrain - baseline median"
            f" {statistics.median(diffs) * 1e3:+.2f} ms (quartiles {diffs[len(diffs) // 4] * 1e3:+.2f},"
            f" {diffs[3 * len(diffs) // 4] * 1e3:+.2f})"
        )
        print("  " + summary_line("paratrain/baseline", [o / b for b, o in zip(base, ours)]))
    print(f"(load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/main.toml")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument(
        "--src", default=os.path.join(REPO, "src"), help="paratrain's src/ to profile (e.g. an older checkout)"
    )
    p.add_argument("--ops", type=int, default=0, help="also list the N ops whose self CPU ms per step differ most")
    p.add_argument(
        "--interleaved",
        type=int,
        default=0,
        metavar="STEPS",
        help="instead: one job, a hand-written DDP step beside each paratrain step (before, then after), STEPS steps",
    )
    p.add_argument("--worker", choices=["paratrain", "baseline", "interleaved"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        import torch

        torch.set_num_threads(1)
        if args.worker == "interleaved":
            interleaved(args.config, args.out, int(os.environ["STEP_PAIRS"]))
        else:
            (paratrain if args.worker == "paratrain" else baseline)(args.config, args.out)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([args.src, REPO])}
    if args.interleaved:
        run_interleaved(args, env)
        return
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("baseline", "paratrain"):
            out = os.path.join(tmp, f"{variant}.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc)]
            cmd += [__file__, "--worker", variant, "--out", out, "--config", args.config]
            res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
            if res.returncode:
                sys.exit(f"profile run failed: {' '.join(cmd)}\n{res.stderr[-3000:]}")
            with open(out) as f:
                rows[variant] = json.load(f)
    for variant, row in rows.items():
        coll = ", ".join(f"{k} {v:g}" for k, v in sorted(row["collectives"].items())) or "none"
        print(
            f"{variant}: collectives per step: {coll}; host reads per step: {row['item_reads']:g} item/float,"
            f" {row['tolist_reads']:g} tolist"
        )
        print("  median ms: " + ", ".join(f"{k} {v:.2f}" for k, v in row["phase_ms"].items()))
    if args.ops:
        print_ops(rows["baseline"]["ops"], rows["paratrain"]["ops"], args.ops)
    print(f"(load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f})")


if __name__ == "__main__":
    main()
