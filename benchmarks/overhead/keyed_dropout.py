"""Keyed dropout against torch's own dropout: the main job's step time, and the ops alone.

    python benchmarks/overhead/keyed_dropout.py [--pairs 6] [--steps 20] [--nproc 1] [--ops-only]
    python benchmarks/overhead/keyed_dropout.py --in-process 30

End to end: configs/main.toml with ``model.args.dropout = 0.1`` (the GPT's attention dropout),
run as paratrain trains it (keyed, the default) and with ``run.keyed_random = false`` (torch's
dropout inside ``scaled_dot_product_attention``, each rank's RNG; ``run.layout_dependent`` accepts
it), alternately, the order swapped every pair. Each run's statistic is the median step time
after 3 warm-up steps; the pair's observation is keyed / torch, summarised as the median ratio
and the 95% t-interval of the geometric mean (src/paratrain/testing/paired.py). Each run's log is checked
for the world size and global batch it claims.

Ops: one attention-probabilities-sized tensor (the main job's micro-batch: 8 x 4 heads x 256 x
256) through ``keyed_dropout`` and ``F.dropout``, and the attention with keyed dropout (the
math path: softmax, keyed mask, times v) against ``scaled_dot_product_attention(dropout_p=0.1)``;
median of 20 timings each, one thread.

``--in-process N``: the main job's model (dropout 0.1) in one process, one micro-batch's forward
and backward with keyed dropout and with torch's, alternating N times (the order swapped every
pair), in CPU time of the thread (other jobs' load hardly moves it); then the share of the keyed
forward and backward spent drawing the masks (``randomness.uniform``).
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
WARMUP = 3


def run(out: str, overrides: list[str], *, steps: int, nproc: int) -> float:
    """The median step time (after WARMUP) of the main job with ``overrides`` (also bitwise_cost.py's)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "src"), REPO])}
    sets = [
        f"run.out_dir='{out}'",
        f"run.steps={steps}",
        "run.progress=false",
        "metrics.plot=false",
        "run.save_model=false",
        "eval.interval=0",
        *overrides,
    ]
    cmd = [sys.executable, "-m", "paratrain", "train", "configs/main.toml", "--nproc-per-node", str(nproc)]
    cmd += [a for s in sets for a in ("--set", s)]
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if res.returncode:
        sys.exit(f"benchmark run failed: {' '.join(cmd)}\n{res.stderr[-3000:]}")
    if f"world {nproc} on" not in res.stderr:
        sys.exit(f"the run did not report world {nproc}:\n{res.stderr[-2000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return statistics.median(r["step_time_s"] for r in rows[WARMUP:])


def paired_runs(variants: dict, common: list[str], *, pairs: int, steps: int, nproc: int, memory=None) -> dict:
    """Each variant's median step time per run, the two variants alternating (the order swapped
    every pair, so neither always inherits the other's wind-down); also bitwise_cost.py's, which
    passes ``memory`` (a dict) to get each run's peak memory per variant (summary.json's
    ``max_memory_gib``: rank 0's resident set on a CPU)."""
    a, b = variants
    times: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(pairs):
            for name in (a, b) if i % 2 == 0 else (b, a):
                out = f"{tmp}/{name}{i}"
                times[name].append(run(out, [*common, *variants[name]], steps=steps, nproc=nproc))
                if memory is not None:
                    with open(os.path.join(out, "summary.json")) as f:
                        memory.setdefault(name, []).append(json.load(f).get("max_memory_gib", float("nan")))
            print(f"pair {i + 1}: {a} {times[a][-1]:.3f} s, {b} {times[b][-1]:.3f} s", flush=True)
    return times


def ops() -> None:
    import torch
    import torch.nn.functional as F

    from paratrain.randomness import KeyedDraws, keyed_dropout, row_keys

    torch.set_num_threads(1)
    b, h, t, d = 8, 4, 256, 32
    keys = row_keys(0, [(0, i) for i in range(b)])
    probs = torch.rand(b, h, t, t)
    q, k, v = (torch.randn(b, h, t, d) for _ in range(3))

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    mode = KeyedDraws({}, keys)

    def keyed_attention():
        with mode:
            F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1)

    rows = [
        ("dropout op", timed(lambda: keyed_dropout(probs, 0.1, keys, 7)), timed(lambda: F.dropout(probs, 0.1))),
        (
            "attention with dropout",
            timed(keyed_attention),
            timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1)),
        ),
    ]
    for name, keyed, plain in rows:
        print(
            f"{name}: keyed {keyed * 1e3:.2f} ms, torch {plain * 1e3:.2f} ms, ratio {keyed / plain:.2f} (median of 20)"
        )


def in_process(n: int) -> None:
    import torch
    import torch.nn.functional as F

    import paratrain.randomness as R
    from paratrain.build import draw_sites
    from paratrain.config import load_config
    from paratrain.models import build_model
    from paratrain.testing.paired import summary_line

    torch.set_num_threads(1)
    cfg = load_config(os.path.join(REPO, "configs", "main.toml"), ["model.args.dropout=0.1"])
    torch.manual_seed(0)
    model = build_model(cfg.model).train()
    b, t = cfg.batch.micro_batch_size, cfg.model.args["block_size"]
    x, y = torch.randint(0, 256, (b, t)), torch.randint(0, 256, (b, t))
    mode = R.KeyedDraws(draw_sites(model), R.row_keys(0, [(0, i) for i in range(b)]))

    def torch_dropout() -> float:
        c = time.thread_time()
        out = model(x)
        F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum").backward()
        model.zero_grad(set_to_none=True)
        return time.thread_time() - c

    def keyed() -> float:
        with mode:
            return torch_dropout()

    for _ in range(3):  # warm-up
        keyed(), torch_dropout()
    times = {"keyed": [], "torch": []}
    for i in range(n):
        for name, fn in (("keyed", keyed), ("torch", torch_dropout))[:: 1 if i % 2 else -1]:
            times[name].append(fn())
    drawing, uniform = [0.0], R.uniform

    def timed_uniform(*args, **kwargs):
        c = time.thread_time()
        try:
            return uniform(*args, **kwargs)
        finally:
            drawing[0] += time.thread_time() - c

    R.uniform = timed_uniform
    try:
        spent = sum(keyed() for _ in range(10))
    finally:
        R.uniform = uniform
    k, p = statistics.median(times["keyed"]), statistics.median(times["torch"])
    print(
        f"one micro-batch ({b} x {t}), forward + backward, thread CPU: keyed {k * 1e3:.1f} ms, torch {p * 1e3:.1f} ms"
    )
    print(summary_line("keyed / torch", [a / b for a, b in zip(times["keyed"], times["torch"])]))
    print(
        f"drawing the keyed masks: {drawing[0] / 10 * 1e3:.1f} ms ({drawing[0] / spent:.1%} of the keyed forward + backward)"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--ops-only", action="store_true")
    ap.add_argument("--in-process", type=int, default=0, metavar="N", help="instead: N alternated pairs in one process")
    args = ap.parse_args()
    if args.in_process:
        in_process(args.in_process)
        return 0
    ops()
    if args.ops_only:
        return 0
    from paratrain.testing.paired import summary_line

    variants = {"keyed": [], "torch": ["run.keyed_random=false", "run.layout_dependent=true"]}
    times = paired_runs(variants, ["model.args.dropout=0.1"], pairs=args.pairs, steps=args.steps, nproc=args.nproc)
    ratios = [a / b for a, b in zip(times["keyed"], times["torch"])]
    print(f"main job, world {args.nproc}, dropout 0.1, median step time per run")
    print(summary_line("keyed / torch step time", ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
