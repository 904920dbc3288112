"""What the MoE block's plain expert loop costs against a dense MLP of the same active size.

One process, forward + backward of one layer on ``--tokens`` tokens of width ``--d-model``:

- ``dense (active)``: the GPT's MLP with hidden width ``top_k x mlp_ratio x d_model``, the same
  FLOPs per token as the MoE's routed experts (the baseline a user compares with);
- ``moe loop``: paratrain's MoE block (models/gpt/moe.py): router, gather per expert, the
  expert MLPs, the float32 (tokens, k, d) buffer and the slot-order sum;
- ``moe dense-all``: every expert on every token, weighted by the routing (what a capacity-free
  MoE costs without the gather: ``n_experts / top_k`` times the FLOPs).

Rounds alternate the order; prints the median seconds per forward+backward and the ratio to the
dense baseline.

    PYTHONPATH=src python benchmarks/parallel/moe_block.py [--tokens 4096] [--d-model 256] [--experts 8] [--top-k 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from paratrain.models.gpt.model import MLP, GPTConfig
from paratrain.models.gpt.moe import MoE, MoEConfig, route

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    d = a.d_model
    moe = MoE(MoEConfig(n_experts=a.experts, top_k=a.top_k), d, lambda: MLP(GPTConfig(d_model=d)))
    dense = MLP(GPTConfig(d_model=d, mlp_ratio=4 * a.top_k))
    x = torch.randn(a.tokens // 128, 128, d, requires_grad=True)

    def dense_all(x):
        flat = x.reshape(-1, d)
        probs, weights, experts = route(flat @ moe.router.weight.t(), top_k=a.top_k, norm_topk=True)
        gate = torch.zeros_like(probs).scatter(1, experts, weights)  # (N, E), zero outside the top-k
        out = sum(gate[:, e : e + 1] * expert(flat) for e, expert in enumerate(moe.experts))
        return out.view_as(x)

    variants = {"dense (active)": dense, "moe loop": moe, "moe dense-all": dense_all}
    times = {name: [] for name in variants}
    for r in range(a.rounds + 1):
        order = list(variants) if r % 2 else list(reversed(variants))
        for name in order:
            t0 = time.perf_counter()
            variants[name](x).square().mean().backward()
            if r:  # round 0 warms up
                times[name].append(time.perf_counter() - t0)
            moe.router_stats = None
    base = statistics.median(times["dense (active)"])
    print(f"tokens {a.tokens}, d_model {d}, experts {a.experts}, top_k {a.top_k}, threads {a.threads}")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"  {name:16s} {m * 1e3:8.2f} ms  x{m / base:.2f}")


if __name__ == "__main__":
    main()
