"""Memory per rank of parameters + gradients + optimiser state: DDP, FSDP2 (dp_shard=N) and tensor
parallel (tp=N), at N = 2 and 4, next to the ZeRO paper's formulas.

Measured from the real tensors after one AdamW step of paratrain's GPT: the local shard of every
parameter, of every gradient (before zero_grad) and of every optimiser-state tensor, on each rank
(``DTensor.to_local()``; plain tensors count whole).

ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory optimizations toward training trillion parameter
models", section 3.1/5): with Ψ parameters and mixed-precision Adam, DDP holds 2Ψ (fp16 params) +
2Ψ (fp16 grads) + 12Ψ (fp32 master params, momentum, variance) = 16Ψ bytes per rank, and ZeRO
stage 3 (P_os+g+p, what FSDP's full sharding is) 16Ψ/N. paratrain trains in fp32 here: DDP holds
4Ψ params + 4Ψ grads + 8Ψ Adam states = 16Ψ as well, and full sharding 16Ψ/N. Tensor parallelism
shards the matrices the same way; the norms and the row-parallel biases stay replicated, a small
excess over 16Ψ/N.

Check: the sharded state per rank is within 10% of DDP's / N (exit 1 otherwise).

    PYTHONPATH=src python benchmarks/memory/memory.py [--n 2 4] [--n-layer 4 --d-model 128]
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def local_bytes(t) -> int:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def measure(layout: dict, gpt_args: dict, batch: int) -> dict:
    """One AdamW step under ``layout`` on this rank; local bytes of params, grads, states."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from paratrain.config import OptimConfig, ParallelConfig
    from paratrain.distributed.parallel_dims import ParallelDims
    from paratrain.distributed.parallelize import parallelize
    from paratrain.models.gpt import GPT_SPEC, build_gpt
    from paratrain.optim import build_optimizer

    torch.manual_seed(0)
    model = build_gpt(**gpt_args)
    psi = sum(p.numel() for p in model.parameters())
    cfg = ParallelConfig(**layout)
    dims = ParallelDims.from_config(cfg, dist.get_world_size())
    model = parallelize(model, dims, cfg=cfg, device=torch.device("cpu"), spec=GPT_SPEC)
    opt = build_optimizer(model, OptimConfig())
    g = torch.Generator().manual_seed(1)  # the same batch on every rank: only memory is measured
    x = torch.randint(0, gpt_args["vocab_size"], (batch, gpt_args["block_size"]), generator=g)
    logits = model(x)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x.reshape(-1)).backward()
    params = [p for p in model.parameters()]
    out = {
        "psi": psi,
        "params": sum(local_bytes(p) for p in params),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
    }
    opt.step()
    out["optim"] = sum(local_bytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    return out


def measure_rank(layouts: dict, gpt_args: dict, batch: int) -> dict:
    """One rank (under paratrain.testing.dist_utils.run_ranks): every layout's bytes on this rank."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        return {name: measure(layout, gpt_args, batch) for name, layout in layouts.items()}
    finally:
        dist.destroy_process_group()


def run_world(n: int, gpt_args: dict, batch: int) -> dict:
    """DDP, FSDP2 and TP at world ``n`` (the tests' spawn-and-collect harness): results by rank."""
    from paratrain.testing.dist_utils import run_ranks

    layouts = {
        "DDP": {"dp_replicate": n},
        f"dp_shard={n}": {"dp_replicate": 1, "dp_shard": n},
        f"tp={n}": {"dp_replicate": 1, "tp": n},
    }
    return dict(enumerate(run_ranks(measure_rank, n, layouts, gpt_args, batch, timeout=600)))


def mib(b: float) -> str:
    return f"{b / 2**20:8.3f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    args = ap.parse_args()
    gpt_args = dict(n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head, vocab_size=256, block_size=64)

    rows, failed = [], False
    for n in args.n:
        results = run_world(n, gpt_args, args.batch)
        psi = results[0]["DDP"]["psi"]
        ddp_total = max(sum(r["DDP"][k] for k in ("params", "grads", "optim")) for r in results.values())
        for name in results[0]:
            per_rank = [sum(r[name][k] for k in ("params", "grads", "optim")) for r in results.values()]
            worst = max(per_rank)
            r0 = results[0][name]
            sharded = name != "DDP"
            formula = 16 * psi / (n if sharded else 1)
            paper = "16Ψ/N (ZeRO-3)" if name.startswith("dp_shard") else ("≈16Ψ/N" if sharded else "16Ψ")
            ratio = worst / (ddp_total / n)
            ok = (not sharded) or abs(ratio - 1) <= 0.10
            failed |= not ok
            rows.append(
                (
                    n,
                    name,
                    r0["params"],
                    r0["grads"],
                    r0["optim"],
                    worst,
                    formula,
                    paper,
                    f"{ratio:.3f}" if sharded else "-",
                    "ok" if ok else "FAIL",
                )
            )
    print(f"GPT {gpt_args}, Ψ = {psi:,} parameters, fp32 AdamW; bytes per rank (MiB), rank 0 split, worst rank total")
    head = ("N", "layout", "params", "grads", "optim", "total", "formula", "paper", "total/(DDP/N)", "10%")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for n, name, p, g, o, t, f, paper, ratio, ok in rows:
        print(f"| {n} | {name} | {mib(p)} | {mib(g)} | {mib(o)} | {mib(t)} | {mib(f)} | {paper} | {ratio} | {ok} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
