"""Loading a sharded HF checkpoint: paratrain (world 2, dp_shard 2, each rank reads its shards) vs from_pretrained.

Saves a random Llama of about 1B parameters (``--hidden 2048 --layers 16``, fp32, sharded
safetensors with an index) to ``--dir`` once, then alternates, ``--rounds`` times:

- paratrain: 2 processes (gloo, CPU), the model built on the meta device, FSDP2 over both,
  then ``ModelSpec.materialize`` reading only each rank's row slices (models/hf/weights.py);
- transformers: ``AutoModelForCausalLM.from_pretrained(dir)`` in one process.

Each measurement runs in a fresh process, reads every loaded parameter once (transformers 5
maps the files lazily: without that its "load" reads nothing), and reports the wall time, the
peak resident memory (``ru_maxrss``: includes the interpreter and torch, ~0.4 GB, and the touched
pages of the mmap'd safetensors files, which are shared page cache) and the private resident
memory after the load (``RssAnon``: the process's own copies). Prints medians per tool and the
paired ratios of the load times.

    python benchmarks/peers/hf_loading.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM  # imported before either clock starts

from paratrain.config import ModelConfig, ParallelConfig
from paratrain.distributed.json_collectives import all_gather_json
from paratrain.distributed.parallel_dims import ParallelDims
from paratrain.distributed.parallelize import parallelize
from paratrain.models import build

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def anon_rss_gb() -> float:
    """Private (anonymous) resident memory now: the process's own copies, without the page cache
    of the mmap'd safetensors files that ru_maxrss also counts."""
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))
    return kib / 2**20


def touch(model: torch.nn.Module) -> float:
    """Read every local parameter once: a lazily mapped load (transformers 5 may map the files)
    is then really in memory, as it is for training."""
    total = 0.0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += float(local.detach().float().sum())
    return total


def save_model(path: str, args) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.isfile(os.path.join(path, "model.safetensors.index.json")):
        return
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=8,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    # Random weights without an init pass over 1B parameters: fill each tensor from a generator.
    g = torch.Generator().manual_seed(0)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=g)
    model.save_pretrained(path, max_shard_size="500MB")
    n = sum(p.numel() for p in model.parameters())
    print(f"saved {n / 1e9:.2f}B parameters to {path}", flush=True)


def paratrain_rank(model_dir: str) -> None:
    """One rank (under torchrun): build on meta, FSDP2 over 2 ranks, read this rank's shards."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    t0 = time.perf_counter()
    model, spec = build(ModelConfig(hf=model_dir))
    dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=1, pp=1, world_size=2)
    model = parallelize(model, dims, cfg=ParallelConfig(dp_shard=2), device=torch.device("cpu"))
    read = spec.materialize(model, device=torch.device("cpu"))
    touch(model)
    dist.barrier()
    out = {"s": time.perf_counter() - t0, "rss_gb": peak_rss_gb(), "anon_gb": anon_rss_gb(), "read": read}
    rows = all_gather_json(out)
    if dist.get_rank() == 0:
        print(json.dumps(rows))
    dist.destroy_process_group()


def hf_process(model_dir: str) -> None:
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    touch(model)
    n = sum(p.numel() for p in model.parameters())
    print(json.dumps([{"s": time.perf_counter() - t0, "rss_gb": peak_rss_gb(), "anon_gb": anon_rss_gb(), "read": n}]))


def measure(cmd: list[str]) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "src")]), "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, check=True, env=env, capture_output=True, text=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default="/tmp/paratrain_llama_1b")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--role", choices=["paratrain", "hf"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role == "paratrain":
        return paratrain_rank(args.dir)
    if args.role == "hf":
        return hf_process(args.dir)
    save_model(args.dir, args)
    if args.rounds == 0:
        return
    ours_cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    ours_cmd += [__file__, "--role", "paratrain", "--dir", args.dir]
    theirs_cmd = [sys.executable, __file__, "--role", "hf", "--dir", args.dir]
    ours, theirs = [], []
    for r in range(args.rounds):
        for tool in ("paratrain", "hf") if r % 2 == 0 else ("hf", "paratrain"):
            rows = measure(ours_cmd if tool == "paratrain" else theirs_cmd)
            (ours if tool == "paratrain" else theirs).append(rows)
            desc = ", ".join(
                f"{x['s']:.1f} s, peak RSS {x['rss_gb']:.2f} GB (private {x['anon_gb']:.2f} GB), {x['read'] / 1e9:.2f}B read"
                for x in rows
            )
            print(f"round {r} {tool}: {desc}", flush=True)
    t_ours = [max(x["s"] for x in rows) for rows in ours]
    t_theirs = [rows[0]["s"] for rows in theirs]
    print(
        f"median load: paratrain (2 ranks) {statistics.median(t_ours):.1f} s, from_pretrained {statistics.median(t_theirs):.1f} s;"
        f" peak RSS per rank: paratrain {statistics.median(max(x['rss_gb'] for x in rows) for rows in ours):.2f} GB,"
        f" from_pretrained {statistics.median(rows[0]['rss_gb'] for rows in theirs):.2f} GB;"
        f" private after load: paratrain {statistics.median(max(x['anon_gb'] for x in rows) for rows in ours):.2f} GB,"
        f" from_pretrained {statistics.median(rows[0]['anon_gb'] for rows in theirs):.2f} GB"
    )
    ratios = [a / b for a, b in zip(t_ours, t_theirs)]
    print(f"paired load-time ratios: {', '.join(f'{x:.2f}' for x in ratios)}")
    print(f"ratio paratrain/from_pretrained (load time): {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
