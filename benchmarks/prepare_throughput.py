"""`paratrain prepare` throughput and peak memory with 1 and N workers, on a corpus of SIZE MB.

The corpus is Python's standard library text repeated into jsonl files (one document per line)
until it holds ``--size-mb`` MB (default 1024). The tokenizer is a 4096-token byte-level BPE
trained once on the standard library (``--tokenizer bytes`` skips it). Each configuration runs
``--runs`` times as a `paratrain prepare` subprocess, alternating; printed per configuration:
median MB/s of text, tokens/s, and the peak memory of the process tree (the sum of the PSS of
prepare and its workers, polled every 0.1 s), then the paired ratio of N workers to 1 per run.
MB per CPU-second (user + sys of prepare and its workers) is the figure that a machine shared
with other jobs does not distort.

    python benchmarks/prepare_throughput.py [--size-mb 1024] [--workers 1 2] [--runs 1]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "src"), REPO])}
STDLIB_GLOB = os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py")
EXCLUDE = ["*/site-packages/*", "*/test/*", "*/tests/*"]


def stdlib_docs() -> list[str]:
    files = sorted(glob.glob(STDLIB_GLOB, recursive=True))
    files = [f for f in files if not any(x.strip("*") in f for x in EXCLUDE)]
    return [open(f, encoding="utf-8", errors="replace").read() for f in files]


def make_corpus(root: str, size_mb: int) -> int:
    """jsonl files of about 64 MB each; every copy of a document gets a distinct last line."""
    docs, total, copy, part = stdlib_docs(), 0, 0, 0
    f = None
    while total < size_mb * 1e6:
        for d in docs:
            if f is None or f.tell() > 64e6:
                f and f.close()
                f = open(os.path.join(root, f"part-{part:04d}.jsonl"), "w")
                part += 1
            text = f"{d}\n# copy {copy}\n"
            f.write(json.dumps({"text": text}) + "\n")
            total += len(text.encode())
            if total >= size_mb * 1e6:
                break
        copy += 1
    f.close()
    return total


def tree_pss_kb(pid: int) -> int:
    """Memory of ``pid`` and its descendants: the sum of their PSS (/proc/PID/smaps_rollup).

    PSS divides each shared page among the processes that map it, so forked workers' pages
    shared with the parent are counted once (a sum of VmRSS would count them in every process).
    """
    children: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = open(stat).read().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
        except (OSError, IndexError, ValueError):
            continue
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            for line in open(f"/proc/{p}/smaps_rollup"):
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def run_prepare(corpus: str, out: str, tokenizer: str, workers: int) -> dict:
    cmd = [sys.executable, "-m", "paratrain", "prepare", corpus, "--out", out, "--tokenizer", tokenizer]
    cmd += ["--workers", str(workers), "--val-fraction", "0.005"]
    t0, ru0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_pss_kb(proc.pid))
        time.sleep(0.1)
    wall = time.perf_counter() - t0
    stdout, stderr = proc.communicate()
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)  # prepare and its (joined) workers
    cpu = ru.ru_utime + ru.ru_stime - ru0.ru_utime - ru0.ru_stime
    if proc.returncode:
        sys.exit(f"prepare failed: {stderr[-2000:]}")
    meta = json.load(open(os.path.join(out, "meta.json")))
    tokens = sum(s["tokens"] for s in meta["splits"].values())
    mb = meta["text_bytes"] / 1e6
    return {"s": wall, "mb_s": mb / wall, "tok_s": tokens / wall, "peak_mib": peak / 1024, "mb_cpu_s": mb / cpu}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=1024, help="corpus size in MB of text (default 1024)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--tokenizer", default="bpe", help="'bpe' (4096, trained on the stdlib once) or 'bytes'")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus")
        os.makedirs(corpus)
        size = make_corpus(corpus, args.size_mb)
        print(f"corpus: {size / 1e6:.0f} MB of text in {len(os.listdir(corpus))} jsonl files", flush=True)
        tokenizer = "bytes"
        if args.tokenizer == "bpe":
            tok_dir = os.path.join(tmp, "bpe")
            cmd = [sys.executable, "-m", "paratrain", "prepare", STDLIB_GLOB, "--out", tok_dir]
            cmd += ["--tokenizer", "bpe:4096", *[a for x in EXCLUDE for a in ("--exclude", x)]]
            subprocess.run(cmd, cwd=REPO, env=ENV, check=True, capture_output=True)
            tokenizer = os.path.join(tok_dir, "tokenizer.json")
        results: dict[int, list[dict]] = {w: [] for w in args.workers}
        for r in range(args.runs):
            order = args.workers if r % 2 == 0 else args.workers[::-1]  # alternate the order
            for w in order:
                res = run_prepare(corpus, os.path.join(tmp, f"out{w}-{r}"), tokenizer, w)
                results[w].append(res)
                print(
                    f"run {r} workers {w}: {res['s']:.1f} s, {res['mb_s']:.2f} MB/s, {res['tok_s'] / 1e6:.2f} M tokens/s,"
                    f" peak PSS {res['peak_mib']:.0f} MiB, {res['mb_cpu_s']:.2f} MB per CPU-second",
                    flush=True,
                )
                shutil.rmtree(os.path.join(tmp, f"out{w}-{r}"))  # keep the disk use at one corpus
        for w, rs in results.items():
            med = {k: statistics.median(x[k] for x in rs) for k in ("mb_s", "tok_s", "peak_mib")}
            print(
                f"workers {w}: median {med['mb_s']:.2f} MB/s, {med['tok_s'] / 1e6:.2f} M tokens/s,"
                f" peak PSS {med['peak_mib']:.0f} MiB (max {max(x['peak_mib'] for x in rs):.0f}) over {len(rs)} runs"
            )
        base = args.workers[0]
        for w in args.workers[1:]:
            ratios = [b["mb_s"] / a["mb_s"] for a, b in zip(results[base], results[w])]
            print(
                f"speed-up workers {w}/{base}: median {statistics.median(ratios):.2f}"
                f" (paired runs: {', '.join(f'{x:.2f}' for x in ratios)})"
            )


if __name__ == "__main__":
    main()
