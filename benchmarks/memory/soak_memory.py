"""Worker memory over a long run (issue 39, item 8): RSS of each worker of `paratrain train` sampled
while the debug config trains on 2 processes with checkpoints; bounded by --steps.

    python benchmarks/memory/soak_memory.py [--steps 50000] [--every 5] [--out soak-out]

Prints one line per sample (seconds, the step reached, each worker's RSS in MiB) and, at the
end, the RSS slope of each worker in MiB per 1000 steps over the second half of the run (after
warm-up), and writes soak.json into --out.

The growth issue 39 measured (about 0.9 MiB per 1000 steps on every rank) is the trainer's list
of every step's metrics row (trainer.loop's ``history``: a ~20-key dict a step, 0.7-0.9 KiB);
``observability.metrics.RowHistory`` keeps what the summary and plot read in 60 B a step.
Measured here, 6000 steps (2 shared cores, both runs at once), RSS of the two workers:

    history = []            step 2000: 330.4 / 329.6 MiB  step 6000: 334.7 / 332.9 MiB
                            slope over steps 3000-6000: 0.84 / 0.71 MiB per 1000 steps
    history = RowHistory()  step 2000: 330.2 / 328.9 MiB  step 6000: 331.0 / 329.2 MiB
                            slope over steps 3000-6000: 0.17 / 0.10 MiB per 1000 steps

And 50,000 steps with RowHistory (``--steps 50000 --every 30``, 9 minutes on the quiet machine,
docs/soak_memory.png, docs/resilience.md "Long runs"): step 2,398: 329.8 / 328.5 MiB, step
48,978: 334.4 / 332.4 MiB; slope over the second half 0.098 / 0.066 MiB per 1000 steps.
``--replot soak.json`` redraws the plot from a finished run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def workers(launcher: int) -> list[int]:
    """The worker processes: the launcher's children running paratrain's worker (torchrun's agent
    runs in the launcher; a worker's own children, its data-loader processes, are left out)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if b"paratrain.launch.worker" in b" ".join(cmd) and ppid == launcher:
            found.append(int(pid))
    return sorted(found)


def last_step(out: str) -> int:
    try:
        with open(os.path.join(out, "metrics.jsonl"), "rb") as f:
            f.seek(max(0, os.path.getsize(f.name) - 4096))
            lines = f.read().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError, KeyError, IndexError):
        return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=50_000)
    ap.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--out", default="soak-out")
    ap.add_argument("--png", default=os.path.join(ROOT, "docs", "soak_memory.png"), help="the RSS curve")
    ap.add_argument("--replot", metavar="SOAK_JSON", help="only draw --png from a finished run's soak.json")
    args = ap.parse_args()
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f), args.png)
        print(f"plot: {args.png}")
        return
    out = os.path.abspath(args.out)
    cmd = [sys.executable, "-m", "paratrain", "train", "configs/debug.toml", "--nproc-per-node", "2", "--overwrite"]
    sets = [f"run.steps={args.steps}", f"run.out_dir='{out}'", "run.progress=false", "metrics.plot=false"]
    sets += ["checkpoint.interval=1000", "checkpoint.keep=2", "data.args={block_size = 32, max_bytes = 200_000}"]
    for name in ("metrics.jsonl", "soak.json"):  # a previous run's rows would read as this one's steps
        if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    proc = subprocess.Popen(
        cmd + [x for s in sets for x in ("--set", s)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    samples, t0 = [], time.time()
    while proc.poll() is None:
        time.sleep(args.every)
        pids = workers(proc.pid)
        rss = [rss_mib(p) for p in pids]
        if len(pids) == 2 and None not in rss:
            samples.append({"t": round(time.time() - t0, 1), "step": last_step(out), "rss_mib": rss})
            print(
                f"{samples[-1]['t']:8.1f} s  step {samples[-1]['step']:6d}  RSS " + "  ".join(f"{r:.1f}" for r in rss)
            )
    half = [s for s in samples if s["step"] >= args.steps / 2]
    slopes = []
    if len(half) >= 2 and half[-1]["step"] > half[0]["step"]:
        for rank in range(2):
            xs, ys = [s["step"] for s in half], [s["rss_mib"][rank] for s in half]
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
            slopes.append(1000 * slope)
        print("RSS slope over the second half, MiB per 1000 steps: " + "  ".join(f"{s:.3f}" for s in slopes))
    os.makedirs(out, exist_ok=True)
    result = {"steps": args.steps, "exit_code": proc.returncode, "samples": samples, "slopes": slopes}
    with open(os.path.join(out, "soak.json"), "w") as f:
        json.dump(result, f)
    print(f"exit code {proc.returncode}; samples in {os.path.join(out, 'soak.json')}")
    if samples:
        plot(result, args.png)
        print(f"plot: {args.png}")


def plot(result: dict, path: str) -> None:
    """Each worker's RSS against the step, with the second half's fitted slope in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    steps = [s["step"] for s in result["samples"]]
    for rank in range(2):
        slope = f", {result['slopes'][rank]:+.3f} MiB / 1000 steps (2nd half)" if result["slopes"] else ""
        ax.plot(steps, [s["rss_mib"][rank] for s in result["samples"]], lw=1.2, label=f"rank {rank}{slope}")
    ax.axvline(result["steps"] / 2, color="grey", lw=0.8, ls=":")
    ax.set(
        xlabel="step",
        ylabel="worker RSS (MiB)",
        title=f"debug config, 2 processes, checkpoint every 1000 steps: {result['steps']:,} steps",
    )
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
