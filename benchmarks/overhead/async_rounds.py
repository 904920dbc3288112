"""What asynchronous GRPO rounds buy: the step time of ``rl.async_steps = 1`` against 0.

    python benchmarks/overhead/async_rounds.py [--pairs 4] [--steps 20] [--nproc 1] [--config configs/grpo.toml] [--set KEY=VALUE]

The GRPO recipe (configs/grpo.toml: the built-in GPT over bytes, 64 completions a step, one
optimiser step per round) run with ``rl.async_steps = 0`` and ``1``, alternately, the order swapped
every pair (benchmarks/overhead/keyed_dropout.py's paired_runs), ``OMP_NUM_THREADS=1`` as torchrun
sets it for several processes. Each run's statistic is the median step time after 3 warm-up steps
(a step includes its wait for the round's generation, ``generation_s``); the pair's observation
is k1 / k0, summarised as the median ratio and the 95% t-interval of the geometric mean
(src/paratrain/testing/paired.py). Also printed: the median ``generation_s`` of each variant, the
time the step waited for its round. ``k = 1`` also recomputes the trainer's log-probabilities of
each round (the importance weight's ``pi_old``), which an on-policy ``k = 0`` round without a KL
skips; ``--set rl.importance='none'`` leaves the overlap alone.

With k = 1 and whole weights, round r + 1 is sampled in a background thread on a copy of the
weights while round r trains: on one process that thread can take a free core; with as many
processes as cores (``--nproc 2`` here) there is none to take.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
WARMUP = 3


def run(out: str, config: str, overrides: list[str], *, steps: int, nproc: int) -> tuple[float, float]:
    """(median step time, median generation_s) after WARMUP steps of ``config`` with ``overrides``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "src"), REPO])}
    sets = [f"run.out_dir='{out}'", f"run.steps={steps}", "run.progress=false", "metrics.plot=false", *overrides]
    cmd = [sys.executable, "-m", "paratrain", "train", config, "--nproc-per-node", str(nproc)]
    cmd += [a for s in sets for a in ("--set", s)]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if res.returncode:
        sys.exit(f"benchmark run failed: {' '.join(cmd)}\n{res.stderr[-3000:]}")
    if f"world {nproc} on" not in res.stderr:
        sys.exit(f"the run did not report world {nproc}:\n{res.stderr[-2000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f][WARMUP:]
    return statistics.median(r["step_time_s"] for r in rows), statistics.median(r["generation_s"] for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--config", default="configs/grpo.toml")
    ap.add_argument("--set", action="append", default=[], help="more overrides of both, e.g. rl.importance='none'")
    args = ap.parse_args()
    from paratrain.testing.paired import summary_line

    got: dict[int, list[tuple[float, float]]] = {1: [], 0: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):  # alternately, the order swapped every pair
            for k in (1, 0) if i % 2 == 0 else (0, 1):
                got[k].append(
                    run(
                        f"{tmp}/k{k}_{i}",
                        args.config,
                        [f"rl.async_steps={k}", *args.set],
                        steps=args.steps,
                        nproc=args.nproc,
                    )
                )
            print(f"pair {i + 1}: step k1 {got[1][-1][0]:.4f} s, k0 {got[0][-1][0]:.4f} s", flush=True)
    wait = {k: statistics.median(g for _, g in got[k]) for k in got}
    print(
        f"{args.config} {args.set}, world {args.nproc}, {args.steps} steps, median per run after {WARMUP} warm-up steps"
    )
    print(f"median wait for the round's generation (generation_s): k1 {wait[1]:.4f} s, k0 {wait[0]:.4f} s")
    print(summary_line("async_steps=1 / async_steps=0 step time", [a[0] / b[0] for a, b in zip(got[1], got[0])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
