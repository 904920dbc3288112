"""Context parallel on one GPU: a 32k-token row at cp = 1 against one rank of a simulated cp.

Issue 23's GPU check. The GPT at GPT-2-small shape (12 layers, 12 heads, d_model 768, vocab
50304), bf16 autocast, one row of ``--seq`` tokens (32768), forward + backward + an SGD step:

- **cp = 1**: the whole row on the GPU, SDPA's causal flash kernel.
- **simulated cp = N** (one GPU cannot hold N NCCL ranks): ONE rank's work, the rank that holds
  chunks 0 and 2N - 1 of the head-tail split: embeddings, MLPs and the loss on its T/N tokens,
  and the attention exactly as distributed/context_parallel.py runs it, with the communication
  replaced by a local copy of the right shape: ``alltoall`` (what ``parallel.cp_attention =
  "auto"`` picks for a causal row: SDPA over the whole T for H/N heads) or ``ring`` (the chunk
  pairs of the ring, this rank's K/V standing in for the others'). The numbers it computes are
  therefore not a model's (the loss is not compared); the time and the peak memory are one
  rank's. The cp group's tokens/s is T over that time if the N ranks run in parallel and their
  communication hides (it is not measured here; the bytes it would send are printed by formula:
  all-to-all ``8 (N - 1) / N x T/N x d_model`` elements per layer, bf16 forward, fp32 gradients
  counted as bf16 here for simplicity).

If the row does not fit at cp = 1 (out of memory), the script halves ``--seq`` until it does and
says so: the longest that fits. Prints one line per configuration, then ONE JSON line.

    python benchmarks/gpu/gpu_cp.py [--seq 32768] [--cps 2 4 8] [--attention alltoall ring] [--steps 5]
    python benchmarks/gpu/gpu_cp.py --dry-run   # CPU, a tiny GPT, seconds: checks the plumbing only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))

GPT2_SMALL = dict(n_layer=12, n_head=12, d_model=768, vocab_size=50304, bias=False)
TINY = dict(n_layer=2, n_head=4, d_model=64, vocab_size=256, bias=False)


def _patches(cp: int):
    """(module, attribute, replacement) for :func:`run_config`'s simulated cp."""
    import torch.distributed._functional_collectives as fc

    import paratrain.distributed.context_parallel as cpmod

    fake_dist = types.SimpleNamespace(
        get_world_size=lambda group=None: cp,
        get_rank=lambda group=None: 0,
        get_global_rank=lambda group, r: r,
        all_gather=None,  # positions are not passed: a causal row
    )
    return [
        (cpmod, "dist", fake_dist),
        (cpmod, "_exchange", lambda send, group, **kw: (send.clone(), [])),
        (fc, "all_to_all_single_autograd", lambda x, *a: x.clone()),  # same shape: (cp, ...) stays
        (fc, "wait_tensor", lambda x: x),
    ]


def run_config(args, *, seq: int, cp: int, attention: str, device) -> dict:
    import torch

    from paratrain.distributed.context_parallel import AllToAllAttention, RingAttention, shard_sequence
    from paratrain.models.gpt.model import build_gpt
    from paratrain.models.gpt.parallel import gpt_cp_attention

    shape = TINY if args.dry_run else GPT2_SMALL
    torch.manual_seed(0)
    model = build_gpt(**shape, block_size=seq).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    ids = torch.randint(0, shape["vocab_size"], (1, seq + 1), generator=torch.Generator().manual_seed(1)).to(device)
    x, y = ids[:, :-1], ids[:, 1:]
    patches = []
    if cp > 1:
        fn = object.__new__(AllToAllAttention if attention == "alltoall" else RingAttention)
        fn.mesh = fn.group = None  # no process group: the patches answer for it
        gpt_cp_attention(model, fn)
        # Positions None: the ring and the all-to-all treat the row as one causal document.
        x = shard_sequence(x, dim=-1, cp=cp, rank=0)
        y = shard_sequence(y, dim=-1, cp=cp, rank=0)
        patches = _patches(cp)
    saved = [(m, a, getattr(m, a)) for m, a, _ in patches]
    for m, a, v in patches:
        setattr(m, a, v)
    cuda = device.type == "cuda"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)
    times = []
    try:
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        for i in range(args.warmup + args.steps):
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            with autocast:
                logits = model(x)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize(device)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
    finally:
        for m, a, v in saved:
            setattr(m, a, v)
    step = statistics.median(times)
    local = seq // cp
    a2a_bytes = shape["n_layer"] * 8 * (cp - 1) * local * shape["d_model"] * 2 // cp if cp > 1 else 0
    return {
        "seq": seq,
        "cp": cp,
        "attention": attention if cp > 1 else "sdpa",
        "rank_tokens": local,
        "step_s": step,
        "group_tokens_per_s": seq / step,  # the N ranks in parallel, communication hidden
        "per_device_tokens_per_s": local / step,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "alltoall_bytes_per_rank_step": a2a_bytes if attention == "alltoall" else None,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=32768)
    p.add_argument("--cps", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--attention", nargs="+", default=["alltoall", "ring"], choices=["alltoall", "ring"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny GPT, seq 512: the plumbing in seconds")
    args = p.parse_args()

    import torch

    if args.dry_run:
        args.seq, args.steps, args.warmup = 512, 1, 1
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("benchmarks/gpu/gpu_cp.py needs a CUDA GPU (or --dry-run); nothing was measured.", file=sys.stderr)
        print(json.dumps({"skipped": "no CUDA device", "torch": torch.__version__}))
        return 2
    else:
        device = torch.device("cuda", 0)
    name = "CPU (dry run)" if args.dry_run else torch.cuda.get_device_name(device)
    print(f"{name}, torch {torch.__version__}, GPT {TINY if args.dry_run else GPT2_SMALL}", flush=True)

    seq, results = args.seq, []
    while True:  # cp = 1, halving the row until it fits
        try:
            results.append(run_config(args, seq=seq, cp=1, attention="sdpa", device=device))
            break
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            print(f"cp = 1: {seq} tokens do not fit; trying {seq // 2}", flush=True)
            seq //= 2
    for cp in args.cps:
        for attention in args.attention:
            if seq % (2 * cp) or (attention == "alltoall" and (TINY if args.dry_run else GPT2_SMALL)["n_head"] % cp):
                print(f"cp = {cp} {attention}: does not apply (row or heads not divisible)")
                continue
            try:
                results.append(run_config(args, seq=seq, cp=cp, attention=attention, device=device))
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                print(f"cp = {cp} {attention}: out of memory at {seq} tokens")
    for r in results:
        mem = f", peak {r['peak_gib']:.1f} GiB" if r["peak_gib"] is not None else ""
        print(
            f"seq {r['seq']} cp {r['cp']} {r['attention']:>8}: one rank's step {r['step_s']:.3f} s{mem};"
            f" group {r['group_tokens_per_s']:,.0f} tokens/s, per device {r['per_device_tokens_per_s']:,.0f}"
        )
    print(json.dumps({"device": name, "torch": torch.__version__, "requested_seq": args.seq, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
