"""paratrain's data-parallel step against a plain hand-written torch DDP loop, world size 2.

Both train the same model, data and global batch through torchrun, alternating, several runs;
a step is the whole loop iteration (paratrain: the difference of consecutive metrics rows'
``time``, logging and rank stats included; the baseline times its whole loop body). It
prints each run's median step time and the paired ratio paratrain/baseline of that run (the
first steps of every run left out as warm-up), then the median ratio with a 95% confidence
interval of the geometric mean ratio (src/paratrain/testing/paired.py) and, as its last line,
`ratio paratrain/baseline: X [L, U]`. "At or below the baseline" means the interval reaches 1.

    python benchmarks/overhead/dp_overhead.py [--runs 5] [--steps 40] [--config configs/main.toml]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from paratrain.testing.bench import run_job
from paratrain.testing.paired import paired_ratios, ratio_ci, summary_line

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
WARMUP = 5


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
                run_job(
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
                run_job(
                    [
                        sys.executable,
                        "-m",
                        "torch.distributed.run",
                        "--standalone",
                        "--nproc-per-node",
                        str(args.nproc),
                        "-m",
                        "paratrain.testing.baseline_ddp",
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
