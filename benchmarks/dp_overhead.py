"""paratrain's data-parallel step against a plain hand-written torch DDP loop, world size 2.

Both train the same model, data and global batch through torchrun, alternating, several runs;
a step is the whole loop iteration (paratrain: the difference of consecutive metrics rows'
``time``, logging and rank stats included; the baseline times its whole loop body). It
prints each run's median step time and the paired ratio paratrain/baseline of that run (the
first steps of every run left out as warm-up), then the median ratio with a 95% confidence
interval of the geometric mean ratio (benchmarks/paired.py) and, as its last line,
`ratio paratrain/baseline: X [L, U]`. "At or below the baseline" means the interval reaches 1.

    python benchmarks/dp_overhead.py [--runs 5] [--steps 40] [--config configs/main.toml]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile

from paired import paired_ratios, ratio_ci, summary_line

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
WARMUP = 5


def run(cmd: list[str], *, timeout_s: float = 300, tries: int = 2, out_dir: str | None = None) -> None:
    """Run one job to its end. A job past ``timeout_s`` (a gloo rendezvous or teardown that
    never returns; seen once in 16 baseline runs) is killed with its whole process group and
    run again from a fresh ``out_dir``, said on stderr: a hang is not a timing, and a re-run of
    the same job is."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "src"), REPO])}
    for attempt in range(1, tries + 1):
        if out_dir and os.path.exists(out_dir):
            shutil.rmtree(out_dir)  # never a resume of the killed run
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            _, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            print(
                f"benchmark run hung past {timeout_s:.0f} s (try {attempt}/{tries}), killed: {' '.join(cmd)}",
                file=sys.stderr,
            )
            continue
        if proc.returncode:
            sys.exit(f"benchmark run failed: {' '.join(cmd)}\n{err[-3000:]}")
        return
    sys.exit(f"benchmark run hung {tries} times: {' '.join(cmd)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--config", default="configs/main.toml")
    p.add_argument("--nproc", type=int, default=2)
    args = p.parse_args()
    overrides = [f"run.steps={args.steps}"]
    ours, base = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            out, bout = os.path.join(tmp, f"pt{i}"), os.path.join(tmp, f"base{i}.json")

            def run_ours():
                run(
                    [
                        sys.executable,
                        "-m",
                        "paratrain",
                        "train",
                        args.config,
                        "--nproc-per-node",
                        str(args.nproc),
                        *[
                            a
                            for o in overrides
                            + [
                                f"run.out_dir='{out}'",
                                "run.progress=false",
                                "metrics.plot=false",
                                "run.save_model=false",
                            ]
                            for a in ("--set", o)
                        ],
                    ],
                    out_dir=out,
                )
                with open(os.path.join(out, "metrics.jsonl")) as f:
                    stamps = [json.loads(line)["time"] for line in f]
                # The whole loop iteration (rows' wall-clock differences), not the row's
                # step_time_s, which ends before logging, rank stats and checkpoint checks.
                ours.append(statistics.median([b - a for a, b in zip(stamps, stamps[1:])][WARMUP:]))

            def run_base():
                run(
                    [
                        sys.executable,
                        "-m",
                        "torch.distributed.run",
                        "--standalone",
                        "--nproc-per-node",
                        str(args.nproc),
                        os.path.join(HERE, "baseline_ddp.py"),
                        args.config,
                        bout,
                        *overrides,
                    ]
                )
                with open(bout) as f:
                    base.append(statistics.median(json.load(f)["step_time_s"][WARMUP:]))

            # Alternate which goes first, so neither always inherits the other's wind-down.
            for fn in (run_ours, run_base) if i % 2 == 0 else (run_base, run_ours):
                fn()
            print(
                f"run {i + 1}/{args.runs}: paratrain {ours[-1] * 1e3:.1f} ms/step, baseline {base[-1] * 1e3:.1f}"
                f" ms/step, ratio {ours[-1] / base[-1]:.3f}",
                flush=True,
            )
    m_ours, m_base = statistics.median(ours), statistics.median(base)
    print(
        f"median step time: paratrain {m_ours * 1e3:.1f} ms, plain DDP {m_base * 1e3:.1f} ms"
        f" (world {args.nproc}, {args.config}, {args.runs} runs x {args.steps} steps)"
    )
    ratios = paired_ratios(ours, base)
    print(summary_line("paired ratio paratrain/baseline", ratios))
    _, lo, hi = ratio_ci(ratios)
    print(f"ratio paratrain/baseline: {statistics.median(ratios):.3f} [{lo:.3f}, {hi:.3f}]")


if __name__ == "__main__":
    main()
