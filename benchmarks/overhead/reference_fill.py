"""``preference.precompute``'s fill, before and after issue 53: the time to compute the store.

Before, the store ran every distinct pair once on rows of ``block_size`` (torch's
``default_collate``), grouped in data-set order; after, it runs the micro-batches the run will read
(the sampler's stream, the data set's own ``collate``: rows end at the micro-batch's longest pair,
rounded up to ``pad_to``), so each value is computed on the very row the per-step reference
would see. Same config both arms: one process, a random Qwen2 policy and reference (hidden
``--hidden``, ``--layers`` layers), ``--pairs`` conversational pairs of
``paratrain.testing.sft_data.preference_pairs``, rows of ``--block`` columns, global batch 8 in
micro-batches of 2, ``--steps`` steps (``--pairs / 8`` steps is one epoch: then both arms compute
each pair once). Each run gets a fresh store, and its time is rank 0's line ``preference:
reference of N pair(s)|row(s) computed in X s``.

The "before" arm is the source tree of ``--before`` (a commit, checked out as a git worktree in a
temporary folder) on ``PYTHONPATH``; the "after" arm this tree's ``src``. Runs alternate (before,
after, after, before, ...); each round's ratio after/before is the observation, summarised by
``paratrain.testing.paired.summary_line`` (median ratio, 95% CI of the geometric mean).

    .venv/bin/python benchmarks/overhead/reference_fill.py --rounds 6

Measured: see docs/preference.md ("Precomputed once").
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

from paratrain.testing.paired import summary_line

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINE = re.compile(r"preference: reference of (\d+) (?:pair|row)\(s\) computed in ([\d.]+) s")
RUN = """
import sys
import paratrain
from paratrain.config import load_config
paratrain.train(load_config(None, sys.argv[1:]))
"""


def setup(root: str, args) -> dict:
    from paratrain.data.prepare import prepare
    from paratrain.testing.hf_models import save_tiny
    from paratrain.testing.sft_data import VOCAB, preference_pairs, save_chat_tokenizer, write_jsonl

    tok = save_chat_tokenizer(os.path.join(root, "tok"))
    data = write_jsonl(os.path.join(root, "pairs.jsonl"), preference_pairs(args.pairs))
    shape = dict(hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers)
    models = {}
    for name, seed in (("policy", 0), ("ref", 1)):
        path = os.path.join(root, name)
        models[name] = save_tiny(
            "qwen2", path, vocab_size=VOCAB, max_position_embeddings=args.block, seed=seed, **shape
        )
    corpus = os.path.join(root, "corpus")
    prepare([data], out_dir=corpus, tokenizer=tok, fmt="preference", val_fraction=0, progress=False)
    return {**models, "corpus": corpus}


def one_run(src: str, paths: dict, out: str, args) -> tuple[int, float]:
    over = [
        f"model.hf='{paths['policy']}'",
        "data.name='tokens'",
        f"data.args={{path = '{paths['corpus']}', block_size = {args.block}}}",
        "loss.name='preference'",
        f"preference.reference='{paths['ref']}'",
        "preference.precompute=true",
        f"preference.store='{out}/store'",
        "batch.global_batch_size=8",
        "batch.micro_batch_size=2",
        f"run.steps={args.steps}",
        f"run.out_dir='{out}'",
        "run.progress=false",
        "metrics.plot=false",
    ]
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", RUN, *over], env=env, capture_output=True, text=True)
    found = LINE.search(done.stdout + done.stderr)
    if done.returncode or not found:
        raise SystemExit(f"run in {out} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    return int(found.group(1)), float(found.group(2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", default="27b632d", help="the commit before issue 53's store")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--pairs", type=int, default=64)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--block", type=int, default=512)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as root:
        before = os.path.join(root, "before")
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", before, args.before], check=True)
        try:
            paths = setup(root, args)
            srcs = {"before": os.path.join(before, "src"), "after": os.path.join(REPO, "src")}
            times: dict[str, list[float]] = {"before": [], "after": []}
            counts = {}
            for r in range(args.rounds):
                for arm in ("before", "after") if r % 2 == 0 else ("after", "before"):
                    n, s = one_run(srcs[arm], paths, os.path.join(root, f"{arm}{r}"), args)
                    counts[arm] = n
                    times[arm].append(s)
                    print(f"round {r} {arm}: {n} computed in {s:.2f} s", flush=True)
        finally:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", before], check=False)
    for arm in ("before", "after"):
        print(f"{arm}: {counts[arm]} computed, median {statistics.median(times[arm]):.2f} s")
    print(summary_line("fill time after/before", [a / b for a, b in zip(times["after"], times["before"])]))


if __name__ == "__main__":
    main()
