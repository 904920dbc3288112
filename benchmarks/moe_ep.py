"""Expert parallelism on CPU (gloo): step time, per-rank expert memory and all_to_all bytes vs ep.

Each of ``--world`` processes runs one MoE layer (models/gpt/moe.py) on its own ``--tokens``
tokens, forward + backward, then the experts' gradient reduce a step needs: at ep = 1 the
all-reduce of every expert over the world (what DDP does for replicated experts), at ep > 1
distributed/expert_parallel.reduce_expert_grads (the ``world / ep`` ranks holding the same
experts). Reported per ep: the median step time (of rank 0), the expert weights one rank holds
against the planner's estimate (all experts' weights / ep, plan/memory.py), and the bytes each
rank's token all_to_alls sent to *other* ranks in one forward (dispatch and combine), against
the planner's balanced-routing formula (plan/cost.py ``moe_all_to_all_bytes``, the one place)

    tokens x top_k x d_model x 4 bytes x 2 directions x (ep - 1) / ep

(the backward sends as much again). Tokens and outputs travel in float32 here.

    PYTHONPATH=src python benchmarks/moe_ep.py --world 2 [--tokens 2048] [--d-model 256] [--experts 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from paratrain.distributed.expert_parallel import ExpertGroup, apply_ep, reduce_expert_grads  # noqa: E402
from paratrain.models.gpt.model import MLP, GPTConfig  # noqa: E402
from paratrain.models.gpt.moe import MoE, MoEConfig  # noqa: E402
from paratrain.plan.cost import moe_all_to_all_bytes  # noqa: E402


def rank_main(rank: int, a, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=a.world)
    sent = [0]
    a2a = dist.all_to_all_single

    def counting(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        if input.is_floating_point() and input_split_sizes is not None:
            me = dist.get_group_rank(group, rank)
            row = input[0].numel() * input.element_size() if len(input) else 0
            sent[0] += (sum(input_split_sizes) - input_split_sizes[me]) * row
        return a2a(output, input, output_split_sizes, input_split_sizes, group=group, **kw)

    dist.all_to_all_single = counting
    results = {}
    for ep in a.eps:
        # Every rank creates every group, in the same order (torch.distributed's rule).
        ep_groups = [dist.new_group(list(range(g * ep, (g + 1) * ep))) for g in range(a.world // ep)]
        rep_groups = [dist.new_group(list(range(r, a.world, ep))) for r in range(ep)]
        torch.manual_seed(0)
        d = a.d_model
        moe = MoE(MoEConfig(n_experts=a.experts, top_k=a.top_k), d, lambda: MLP(GPTConfig(d_model=d)))
        estimated = sum(p.numel() for p in moe.experts.parameters()) * 4 / ep  # the planner's rule
        if ep > 1:
            group = ep_groups[rank // ep]
            replicas = rep_groups[rank % ep] if a.world > ep else None
            ep_info = ExpertGroup(group, rank % ep, ep, replicas, a.world)
            local = apply_ep(moe, ep_info)
        else:
            local = list(moe.experts.parameters())
        expert_bytes = sum(p.numel() * p.element_size() for p in local)
        torch.manual_seed(1 + rank)  # each rank its own tokens
        x = torch.randn(a.tokens // 128, 128, d, requires_grad=True)
        times, fwd_bytes = [], []
        for r in range(a.rounds + 1):
            dist.barrier()
            t0 = time.perf_counter()
            sent[0] = 0
            y = moe(x)
            fwd_bytes.append(sent[0])
            y.square().mean().backward()
            if ep > 1:
                reduce_expert_grads(local)
            else:
                for p in local:
                    dist.all_reduce(p.grad)
            if r:
                times.append(time.perf_counter() - t0)
            moe.zero_grad(set_to_none=True)
            moe.router_stats = None
        formula, _ = moe_all_to_all_bytes(tokens=a.tokens, top_k=a.top_k, d_model=d, ep=ep)
        results[ep] = (statistics.median(times), expert_bytes, estimated, statistics.mean(fwd_bytes), formula)
    if rank == 0:
        out.put(results)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    a.eps = [ep for ep in (1, 2, 4, 8) if ep <= a.world and a.world % ep == 0 and a.experts % ep == 0]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(rank_main, args=(a, port, q), nprocs=a.world, start_method="spawn", join=False)
    results = q.get(timeout=600)
    print(
        f"world {a.world}, {a.tokens} tokens/rank, d_model {a.d_model}, {a.experts} experts, top_k {a.top_k},"
        " 1 thread/rank"
    )
    print(
        f"  {'ep':>3} {'step ms':>9} {'experts MiB/rank':>17} {'plan MiB':>9} {'a2a fwd MiB/rank':>17}"
        f" {'formula MiB':>12}"
    )
    for ep, (t, mem, est, sent, formula) in results.items():
        print(
            f"  {ep:>3} {t * 1e3:9.1f} {mem / 2**20:17.2f} {est / 2**20:9.2f} {sent / 2**20:17.3f}"
            f" {formula / 2**20:12.3f}"
        )


if __name__ == "__main__":
    main()
