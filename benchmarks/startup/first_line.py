"""Start-up as a user sees it (issue 60): seconds from the command to its first console line, to
each start-up phase's line and to the first step's progress line, for ``paratrain train``.

    python benchmarks/startup/first_line.py [--runs 5] [--config configs/debug.toml] [--nproc 2]

Runs the command ``--runs`` times (each into a fresh folder, ``run.steps`` 20 so that the first
progress line is step 1), reads its stderr as it comes, and prints per phase the median and the
range over the runs (seconds since the command was started, as this script's clock sees it).
A timing, never a test: the machine's load moves it (see docs/observability.md).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def one_run(config: str, nproc: int, out: str) -> list[tuple[str, float]]:
    cmd = [sys.executable, "-m", "paratrain", "train", config, "--nproc-per-node", str(nproc)]
    cmd += ["--set", "run.steps=20", "--set", f"run.out_dir='{out}'", "--set", "run.save_model=false"]
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "src")}
    t0 = time.perf_counter()
    seen: list[tuple[str, float]] = []
    with subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True) as p:
        for line in p.stderr:
            t = time.perf_counter() - t0
            if not seen:
                seen.append(("first line", t))
            if line.startswith("start "):  # "start  3.1s  what": the phase, without its own time
                seen.append((re.sub(r"^start\s+[\d.]+s\s+", "", line.strip())[:60], t))
            elif line.startswith("step 1/"):
                seen.append(("first step's progress line", t))
    if p.returncode:
        raise SystemExit(f"the run failed (exit code {p.returncode})")
    return seen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--config", default="configs/debug.toml")
    p.add_argument("--nproc", type=int, default=2)
    args = p.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            runs.append(one_run(args.config, args.nproc, os.path.join(tmp, f"run{i}")))
            print(f"run {i + 1}/{args.runs}: first line {runs[-1][0][1]:.2f} s", file=sys.stderr)
    load = os.getloadavg()[0]
    print(f"paratrain train {args.config} --nproc-per-node {args.nproc}: {args.runs} runs, load average {load:.1f}")
    print(f"{'phase':<62} {'median s':>9} {'min':>6} {'max':>6}")
    for k, (name, _) in enumerate(runs[0]):
        times = [r[k][1] for r in runs if len(r) > k]
        print(f"{name:<62} {statistics.median(times):>9.2f} {min(times):>6.2f} {max(times):>6.2f}")


if __name__ == "__main__":
    main()
