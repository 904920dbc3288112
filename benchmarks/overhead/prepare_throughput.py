"""`paratrain prepare` against the plain loop a user would write, and chat rows against text.

The corpus is Python's standard library text repeated into jsonl files (one document per line)
until it holds ``--size-mb`` MB (default 30). The tokenizer is a byte-level BPE of ``--vocab``
tokens (default 16384: ids fit ``uint16`` in both programs) trained once on the standard library
(``--tokenizer bytes`` skips it). Each round runs every configuration once as a subprocess, the
order reversed every other round (prepare, loop, chat, startup, startup, chat, loop, prepare, ...):

- ``prepare N``: ``paratrain prepare CORPUS --workers N`` for each ``--workers`` N;
- ``loop`` (``--compare loop``): what a user writes without paratrain (the script ``LOOP``
  below): read the same jsonl lines, ``json.loads``, ``tokenizer.encode_batch`` of 1024 texts
  with the tokenizers library's own threads, each document's ids and EOS appended as ``uint16``
  to one file. Its tokens must be prepare's train + val tokens (count and histogram of ids,
  checked every round: "same tokens"), so the two do the same work;
- ``chat N`` (``--compare chat``, N the largest ``--workers``): ``paratrain prepare --format chat``
  on the same documents cut into conversations (turns of about 2 KB at line ends, user and
  assistant alternating), with the same BPE plus ChatML's two special tokens and a ChatML
  template with ``{% generation %}`` marks (src/paratrain/testing/sft_data.py), so the content tokenises the same.

Printed per run and as medians: MB/s of text, tokens/s, the peak memory of the process tree (the
sum of the PSS of the process and its workers, polled every 0.5 s) and MB per CPU-second (user +
sys of the process and its workers: the figure a machine shared with other jobs distorts least).
Then the paired ratios with src/paratrain/testing/paired.py's ``summary_line`` (median, 95% CI of the
geometric mean): prepare / loop wall time, chat / text prepare time per token (wall, and
CPU-seconds of the process and its workers), N / first workers speed-up. Every round also times
``startup``: ``python -m paratrain prepare --help``, the interpreter and imports that every
prepare run pays before its first document; ``(prepare - startup) / loop`` is the ratio of the
work after them. With ``--compare chat`` it times ``chat-startup`` too (the chat tokenizer's load,
which imports transformers, about 1 s whatever the corpus) and prints chat / text per token
after each one's start.

    python benchmarks/overhead/prepare_throughput.py [--size-mb 30] [--vocab 16384] [--workers 2] [--runs 4]
        [--compare loop chat] [--tokenizer bpe|bytes]
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

import numpy as np

from paratrain.testing.paired import summary_line

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "src"), REPO])}
STDLIB_GLOB = os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py")
EXCLUDE = ["*/site-packages/*", "*/test/*", "*/tests/*"]
VAL_FRACTION = "0.005"
LOOP_BATCH = 1024
# The end of a run is seen within POLL_S (it was 0.5 s: wall times came in steps of 0.5 s, about
# 4% of a run). The memory is polled every PSS_EVERY-th time, 0.5 s: a poll reads /proc of every
# process and the smaps of the tree, about 10 ms of CPU here, and every 0.1 s that took 5% of a
# 2-core machine away from the runs it measured.
POLL_S = 0.02
PSS_EVERY = 25

# The baseline: the loop a user writes with Hugging Face tokenizers alone (its thread pool on).
LOOP = r"""
import glob, json, os, sys
import numpy as np

corpus, tokenizer, out = sys.argv[1:4]
batch_size = int(sys.argv[4])
if tokenizer == "bytes":
    encode_batch, eos = (lambda texts: [list(t.encode("utf-8")) for t in texts]), 0
else:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer)
    eos = tok.token_to_id("<|endoftext|>")
    encode_batch = lambda texts: [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def batches():
    batch = []
    for path in sorted(glob.glob(os.path.join(corpus, "*.jsonl"))):
        with open(path, encoding="utf-8") as f:
            for line in f:
                batch.append(json.loads(line)["text"])
                if len(batch) == batch_size:
                    yield batch
                    batch = []
    if batch:
        yield batch


with open(out, "wb") as f:
    for texts in batches():
        for ids in encode_batch(texts):
            f.write(np.array(ids + [eos], dtype=np.uint16).tobytes())
"""


def stdlib_docs() -> list[str]:
    files = sorted(glob.glob(STDLIB_GLOB, recursive=True))
    files = [f for f in files if not any(x.strip("*") in f for x in EXCLUDE)]
    return [open(f, encoding="utf-8", errors="replace").read() for f in files]


def make_corpus(root: str, size_mb: int, row=None) -> int:
    """jsonl files of about 64 MB each; every copy of a document gets a distinct last line.
    ``row(text)`` is the jsonl record of a document (default ``{"text": text}``)."""
    row = row or (lambda text: {"text": text})
    docs, total, copy, part = stdlib_docs(), 0, 0, 0
    f = None
    while total < size_mb * 1e6:
        for d in docs:
            if f is None or f.tell() > 64e6:
                f and f.close()
                f = open(os.path.join(root, f"part-{part:04d}.jsonl"), "w")
                part += 1
            text = f"{d}\n# copy {copy}\n"
            f.write(json.dumps(row(text)) + "\n")
            total += len(text.encode())
            if total >= size_mb * 1e6:
                break
        copy += 1
    f.close()
    return total


def conversation(text: str, turn_bytes: int = 2000) -> dict:
    """A document as one conversation: turns of about ``turn_bytes`` cut at line ends, user and
    assistant alternating, ending with an assistant turn (a row must have one to train on)."""
    turns, cur = [], ""
    for line in text.splitlines(keepends=True):
        cur += line
        if len(cur) >= turn_bytes:
            turns.append(cur)
            cur = ""
    if cur:
        turns.append(cur)
    if len(turns) == 1:
        turns.insert(0, "Show me a Python file.")
    if len(turns) % 2:
        turns.append("That is the whole file.")
    return {"messages": [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]}


def save_chat_tokenizer(out: str, tokenizer: str) -> str:
    """A transformers tokenizer directory: the BPE ``tokenizer`` (a tokenizer.json, or "bytes":
    src/paratrain/testing/sft_data.py's byte-level one) with ChatML's special tokens and template."""
    from paratrain.testing.sft_data import CHATML
    from paratrain.testing.sft_data import save_chat_tokenizer as save_bytes_chat_tokenizer

    if tokenizer == "bytes":
        return save_bytes_chat_tokenizer(out)
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_file=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.chat_template = CHATML
    fast.save_pretrained(out)
    return out


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


def timed(cmd: list[str], env: dict) -> dict:
    """Wall seconds, CPU seconds (the process and its joined children) and peak PSS of ``cmd``."""
    t0, ru0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak, polls = 0, 0
    while proc.poll() is None:
        if polls % PSS_EVERY == 0:
            peak = max(peak, tree_pss_kb(proc.pid))
        polls += 1
        time.sleep(POLL_S)
    wall = time.perf_counter() - t0
    _, stderr = proc.communicate()
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd[:4])} ... failed: {stderr[-2000:]}")
    return {"s": wall, "cpu_s": ru.ru_utime + ru.ru_stime - ru0.ru_utime - ru0.ru_stime, "peak_mib": peak / 1024}


# What `prepare --format chat` runs before its first document, beyond text's start: paratrain's
# CLI imports, then the chat tokenizer's load (which imports transformers).
CHAT_STARTUP = (
    "import sys, paratrain.cli; from paratrain.data.chat import load_chat_tokenizer; load_chat_tokenizer(sys.argv[1])"
)


def histogram(paths: list[str], dtype: str) -> np.ndarray:
    """How many times each id occurs in the files: the same multiset of tokens, in any order."""
    counts = np.zeros(0, dtype=np.int64)
    for p in paths:
        c = np.bincount(np.fromfile(p, dtype=dtype))
        counts = np.pad(counts, (0, max(0, len(c) - len(counts))))
        counts[: len(c)] += c
    return counts


def run_prepare(corpus: str, out: str, tokenizer: str, workers: int, fmt: str = "text") -> dict:
    cmd = [sys.executable, "-m", "paratrain", "prepare", corpus, "--out", out, "--tokenizer", tokenizer]
    cmd += ["--workers", str(workers), "--val-fraction", VAL_FRACTION, "--format", fmt]
    res = timed(cmd, ENV)
    meta = json.load(open(os.path.join(out, "meta.json")))
    shards = [os.path.join(out, f["name"]) for s in meta["splits"].values() for f in s["files"]]
    res["tokens"] = sum(s["tokens"] for s in meta["splits"].values())
    res["mb"] = meta["text_bytes"] / 1e6
    res["hist"] = histogram(shards, meta["dtype"]) if fmt == "text" else None
    shutil.rmtree(out)  # keep the disk use at one corpus
    return res


def run_loop(corpus: str, out: str, tokenizer: str, mb: float) -> dict:
    # The library's default, stated: its thread pool on, one thread per core.
    env = {**ENV, "TOKENIZERS_PARALLELISM": "true"}
    res = timed([sys.executable, "-c", LOOP, corpus, tokenizer, out, str(LOOP_BATCH)], env)
    res["tokens"] = os.path.getsize(out) // 2
    res["mb"] = mb
    res["hist"] = histogram([out], "uint16")
    os.remove(out)
    return res


def same_tokens(a: dict, b: dict) -> None:
    n = max(len(a["hist"]), len(b["hist"]))
    ha, hb = (np.pad(x["hist"], (0, n - len(x["hist"]))) for x in (a, b))
    if a["tokens"] != b["tokens"] or not np.array_equal(ha, hb):
        sys.exit(f"not the same tokens: prepare {a['tokens']} (train + val), loop {b['tokens']}")


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def line(name: str, res: dict) -> str:
    return (
        f"{name}: {res['s']:.1f} s, {res['mb'] / res['s']:.2f} MB/s, {res['tokens'] / res['s'] / 1e6:.2f} M tokens/s,"
        f" {res['s'] / res['tokens'] * 1e6:.3f} us/token, peak PSS {res['peak_mib']:.0f} MiB,"
        f" {res['mb'] / res['cpu_s']:.2f} MB per CPU-second"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=30, help="corpus size in MB of text (default 30)")
    p.add_argument("--workers", type=int, nargs="+", default=[2], help="prepare --workers values (default 2)")
    p.add_argument("--runs", type=int, default=4, help="rounds (default 4)")
    p.add_argument("--vocab", type=int, default=16384, help="BPE vocabulary (default 16384; at most 65536)")
    p.add_argument("--tokenizer", default="bpe", help="'bpe' (trained on the stdlib once) or 'bytes'")
    p.add_argument(
        "--compare", nargs="*", default=["loop", "chat"], choices=["loop", "chat"], help="baselines (default both)"
    )
    args = p.parse_args()
    if not 257 <= args.vocab <= 1 << 16:
        p.error("--vocab must be within [257, 65536]: the loop writes uint16")
    load_at_start = load_average()  # other jobs on the machine: the context of every figure
    with tempfile.TemporaryDirectory() as tmp:
        corpus, chat_corpus = os.path.join(tmp, "corpus"), os.path.join(tmp, "chat")
        os.makedirs(corpus)
        size = make_corpus(corpus, args.size_mb)
        print(f"corpus: {size / 1e6:.0f} MB of text in {len(os.listdir(corpus))} jsonl files", flush=True)
        tokenizer = "bytes"
        if args.tokenizer == "bpe":
            tok_dir = os.path.join(tmp, "bpe")
            cmd = [sys.executable, "-m", "paratrain", "prepare", STDLIB_GLOB, "--out", tok_dir, "--workers", "2"]
            cmd += ["--tokenizer", f"bpe:{args.vocab}", *[a for x in EXCLUDE for a in ("--exclude", x)]]
            subprocess.run(cmd, cwd=REPO, env=ENV, check=True, capture_output=True)
            tokenizer = os.path.join(tok_dir, "tokenizer.json")
        configs = [f"prepare {w}" for w in args.workers]
        if "loop" in args.compare:
            configs.append("loop")
        if "chat" in args.compare:
            os.makedirs(chat_corpus)
            make_corpus(chat_corpus, args.size_mb, conversation)
            chat_tok = save_chat_tokenizer(os.path.join(tmp, "chat_tokenizer"), tokenizer)
            configs += [f"chat {max(args.workers)}", "chat-startup"]
        configs.append("startup")
        results: dict[str, list[dict]] = {c: [] for c in configs}
        for r in range(args.runs):
            for c in configs if r % 2 == 0 else configs[::-1]:  # alternate the order
                kind, _, w = c.partition(" ")
                out = os.path.join(tmp, f"out-{r}")
                if kind == "startup":  # what every prepare run pays before its first document
                    res = timed([sys.executable, "-m", "paratrain", "prepare", "--help"], ENV)
                    results[c].append(res)
                    print(f"run {r} startup (`python -m paratrain prepare --help`): {res['s']:.2f} s", flush=True)
                    continue
                if kind == "chat-startup":  # and what a chat run adds: transformers' import, the tokenizer's load
                    res = timed([sys.executable, "-c", CHAT_STARTUP, chat_tok], ENV)
                    results[c].append(res)
                    print(f"run {r} chat-startup (load the chat tokenizer): {res['s']:.2f} s", flush=True)
                    continue
                if kind == "prepare":
                    res = run_prepare(corpus, out, tokenizer, int(w))
                elif kind == "loop":
                    res = run_loop(corpus, out, tokenizer, size / 1e6)
                else:
                    res = run_prepare(chat_corpus, out, chat_tok, int(w), fmt="chat")
                results[c].append(res)
                print(f"run {r} {line(c, res)}", flush=True)
            if "loop" in results:
                for w in args.workers:
                    same_tokens(results[f"prepare {w}"][-1], results["loop"][-1])
        print(f"load average at the end: {load_average()} (at the start: {load_at_start})")
        for c, rs in results.items():
            if c.endswith("startup"):
                print(f"median of {len(rs)} {c}: {statistics.median(x['s'] for x in rs):.2f} s")
                continue
            med = {k: statistics.median(x[k] for x in rs) for k in ("s", "cpu_s", "peak_mib")}
            med |= {"tokens": rs[0]["tokens"], "mb": rs[0]["mb"]}
            print(f"median of {len(rs)} {line(c, med)}")
        first = f"prepare {args.workers[0]}"
        for w in args.workers:
            if "loop" in results:
                ratios = [a["s"] / b["s"] for a, b in zip(results[f"prepare {w}"], results["loop"])]
                print(summary_line(f"time prepare --workers {w} / loop", ratios))
                # The same with the round's startup taken off prepare: its work after the imports.
                ratios = [
                    (a["s"] - st["s"]) / b["s"]
                    for a, b, st in zip(results[f"prepare {w}"], results["loop"], results["startup"])
                ]
                if min(ratios) > 0:  # a corpus of a few MB can take less than a startup that round
                    print(summary_line(f"time (prepare --workers {w} - startup) / loop", ratios))
            if f"prepare {w}" != first:
                ratios = [a["s"] / b["s"] for a, b in zip(results[first], results[f"prepare {w}"])]
                print(summary_line(f"speed-up workers {w} / {args.workers[0]}", ratios))
        if "chat" in args.compare:
            w = max(args.workers)
            per_token = [
                (a["s"] / a["tokens"]) / (b["s"] / b["tokens"])
                for a, b in zip(results[f"chat {w}"], results[f"prepare {w}"])
            ]
            print(summary_line(f"time per token chat / text (--workers {w})", per_token))
            # The same in CPU-seconds (the process and its workers): what other jobs distort least.
            per_token_cpu = [
                (a["cpu_s"] / a["tokens"]) / (b["cpu_s"] / b["tokens"])
                for a, b in zip(results[f"chat {w}"], results[f"prepare {w}"])
            ]
            print(summary_line(f"CPU per token chat / text (--workers {w})", per_token_cpu))
            # Per token after each one's fixed start (chat's includes transformers' import, about
            # 1 s whatever the corpus): the rate a larger corpus approaches.
            per_token_after = [
                ((a["s"] - ca["s"]) / a["tokens"]) / ((b["s"] - st["s"]) / b["tokens"])
                for a, b, ca, st in zip(
                    results[f"chat {w}"], results[f"prepare {w}"], results["chat-startup"], results["startup"]
                )
            ]
            print(summary_line(f"time per token after the start, chat / text (--workers {w})", per_token_after))


if __name__ == "__main__":
    main()
