"""Peak memory of the cross-entropy's step with the whole logits and with ``loss.chunk_size``.

One output layer ``d_model -> vocab`` over ``--seq`` positions, forward and backward through the
loss, as the last layer of a language model runs it: ``full`` makes the ``[seq, vocab]`` logits
and their float32 copy at once (the default path: the model's ``lm_head``, then
``F.cross_entropy``); ``chunked`` is paratrain's ``ChunkedCrossEntropy`` (loss.py), chunk by
chunk, recomputed in the backward.

Each case runs in a fresh process (alternating full and chunked, ``--rounds`` times). The figure
is the rise of the process's peak resident memory over the step (Linux ``VmHWM``, reset through
``/proc/self/clear_refs`` just before the step; the weights, hidden states and targets already
exist), median over rounds; the ratio full / chunked is per round. Every chunked run's loss is
checked against the full run's (1e-6 relative). What the full logits alone take is printed
beside it: ``seq x vocab x 4`` bytes.

    python benchmarks/memory/chunked_loss_memory.py [--vocabs 32768 151936] [--seq 4096] [--d-model 256]
        [--chunk 1024] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "src"), REPO])}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def one_case(mode: str, vocab: int, seq: int, d_model: int, chunk: int) -> dict:
    """Run in a child process: the step's peak memory rise and its loss."""
    import gc

    import torch
    import torch.nn.functional as F
    from torch import nn

    from paratrain.loss import ChunkedCrossEntropy

    torch.manual_seed(0)
    head = nn.Linear(d_model, vocab, bias=False)
    hidden = torch.randn(seq, d_model, requires_grad=True)
    target = torch.randint(vocab, (seq,))
    chunked = ChunkedCrossEntropy(chunk, -100)
    chunked.bind(head, loss_parallel=False)

    def loss():
        if mode == "full":
            return F.cross_entropy(head(hidden).float(), target, reduction="sum")
        return chunked(hidden, target)[0]

    # Warm the kernels and thread pools on a small slice, so the step measures tensors only.
    F.cross_entropy(head(hidden[:8]).float(), target[:8], reduction="sum").backward()
    head.weight.grad = hidden.grad = None
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    before = _status("VmRSS")
    s = loss()
    s.backward()
    peak = _status("VmHWM")
    return {"peak_rise": peak - before, "loss": float(s.detach()), "grad_norm": float(head.weight.grad.norm())}


def run_case(mode: str, vocab: int, args) -> dict:
    call = f"one_case({mode!r}, {vocab}, {args.seq}, {args.d_model}, {args.chunk})"
    # A fresh process per case (its peak RSS is the case's alone); this file's one_case, loaded by path.
    load = f"one_case = runpy.run_path({os.path.abspath(__file__)!r})['one_case']"
    code = f"import json, runpy; {load}; print(json.dumps({call}))"
    out = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocabs", type=int, nargs="+", default=[32768, 151936])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    mib = 2**20
    print(f"seq {args.seq}, d_model {args.d_model}, chunk {args.chunk}, float32 weights, {args.rounds} rounds")
    print(f"{'vocab':>7} {'logits MiB':>10} {'full MiB':>9} {'chunked MiB':>11} {'full/chunked':>12}  max loss diff")
    for vocab in args.vocabs:
        full, chunked, ratios, diffs = [], [], [], []
        for r in range(args.rounds):
            order = ("full", "chunked") if r % 2 == 0 else ("chunked", "full")
            got = {mode: run_case(mode, vocab, args) for mode in order}
            full.append(got["full"]["peak_rise"])
            chunked.append(got["chunked"]["peak_rise"])
            ratios.append(full[-1] / chunked[-1])
            diffs.append(abs(got["chunked"]["loss"] - got["full"]["loss"]) / abs(got["full"]["loss"]))
        print(
            f"{vocab:>7} {args.seq * vocab * 4 / mib:>10.0f} {statistics.median(full) / mib:>9.0f}"
            f" {statistics.median(chunked) / mib:>11.0f} {statistics.median(ratios):>11.1f}x  {max(diffs):.1e}"
        )
        if max(diffs) > 1e-6:
            sys.exit(f"the chunked loss differs from the full one by {max(diffs):.1e} (relative)")


if __name__ == "__main__":
    main()
