"""Context parallel: ring vs all-to-all (Ulysses) attention, step time paired, and their bytes.

The built-in GPT (4 layers, 8 heads, d_model 128) on one row of ``--seq`` tokens, split over cp =
world ranks (gloo, CPU, one thread per rank). Each rank holds two copies of the same model, one
calling the ring, one the all-to-all (``parallel.cp_attention``); they run forward + backward
alternately (the order flips every pair, so drift and warm-up fall on both), after a barrier,
and a pair's time is the slowest rank's. The statistic is the paired ratio ring / all-to-all
(median and 95% CI of the geometric mean, src/paratrain/testing/paired.py); > 1 means all-to-all is faster.

It also checks that both copies give the same loss (so each ran what it claims), and counts the
bytes each sends per step and rank: the ring's at its point-to-point exchange (formula: the
plan's ``paratrain.plan.cost.ring_bytes``), the all-to-all's at every functional all-to-all
(forward and, through a dispatch mode, the backward's), against ``8 x (cp - 1) / cp x B H (T/cp)
D`` elements per layer: q, k, v and the output forward, their gradients backward, each leaving
``(cp - 1) / cp`` of its elements to the other ranks. The position ids' all-gather (B x T int64
per layer) is not counted.

    PYTHONPATH=src python benchmarks/parallel/cp_ring_vs_alltoall.py [--seq 2048] [--pairs 8] [--worlds 2 4]

The CPU figure is a CPU figure: the ring's chunk pairs are an unfused Python loop over float32
matmuls, the all-to-all calls SDPA's fused kernel once; on accelerators both would use fused
kernels and the ring overlaps its hops with compute.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ARGS = dict(n_layer=4, n_head=8, d_model=128, vocab_size=256)


def rank_run(seq: int, pairs: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils._python_dispatch import TorchDispatchMode

    import paratrain.distributed.context_parallel as cpmod
    from paratrain.distributed.context_parallel import ATTENTIONS, shard_sequence
    from paratrain.models.gpt.model import build_gpt
    from paratrain.models.gpt.parallel import gpt_cp_attention

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    cp, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    models = {}
    for kind in ("ring", "alltoall"):
        torch.manual_seed(0)  # the same weights in both
        models[kind] = build_gpt(**ARGS, block_size=seq)
        gpt_cp_attention(models[kind], ATTENTIONS[kind](mesh))
    ids = torch.randint(0, ARGS["vocab_size"], (1, seq + 1), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(seq).unsqueeze(0)
    x = shard_sequence(torch.stack([ids[:, :-1], pos], dim=1), dim=-1, cp=cp, rank=rank)
    y = shard_sequence(ids[:, 1:], dim=-1, cp=cp, rank=rank)

    sent = {"ring": 0, "alltoall": 0}
    exchange = cpmod._exchange

    def counting_exchange(send, group, **kw):
        sent["ring"] += send.numel() * send.element_size()
        return exchange(send, group, **kw)

    cpmod._exchange = counting_exchange

    class CountAllToAll(TorchDispatchMode):  # forward and backward all-to-alls alike
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "all_to_all_single" in str(func):
                t = args[0]
                sent["alltoall"] += t.numel() * t.element_size() * (cp - 1) // cp  # 1/cp stays here
            return func(*args, **(kwargs or {}))

    def step(kind: str) -> tuple[float, float]:
        dist.barrier()
        t0 = time.perf_counter()
        logits = models[kind](x)
        s = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
        s.backward()
        dt = torch.tensor([time.perf_counter() - t0])
        models[kind].zero_grad(set_to_none=True)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the step ends when its slowest rank does
        loss = s.detach().clone()
        dist.all_reduce(loss)
        return dt.item(), loss.item()

    step("ring"), step("alltoall")  # warm-up
    sent.update(ring=0, alltoall=0)
    with CountAllToAll():
        _, loss_ring = step("ring")
        _, loss_a2a = step("alltoall")
    counted = dict(sent)
    times = {"ring": [], "alltoall": []}
    for i in range(pairs):
        for kind in ("ring", "alltoall") if i % 2 == 0 else ("alltoall", "ring"):
            times[kind].append(step(kind)[0])
    dist.destroy_process_group()
    return {"times": times, "sent": counted, "loss": (loss_ring, loss_a2a)}


def formula_bytes(seq: int, cp: int) -> dict:
    """Bytes per step and rank, float32: the ring's by the plan's formula, the all-to-all's 8 x
    (cp - 1) / cp x B H (T/cp) D elements per layer."""
    from paratrain.plan.cost import ring_bytes  # the plan prices cp_comm with it

    local = ARGS["d_model"] * (seq // cp)  # B x H x (T/cp) x D elements (B = 1, H x D = d_model)
    forward, backward = ring_bytes(mb=1, local_seq=seq // cp, width=ARGS["d_model"], cp=cp, act_bytes=4)
    return {
        "ring": ARGS["n_layer"] * (forward + backward),
        "alltoall": ARGS["n_layer"] * 8 * local * 4 * (cp - 1) // cp,
    }


def main() -> None:
    from paratrain.testing.dist_utils import run_ranks
    from paratrain.testing.paired import paired_ratios, summary_line

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    a = p.parse_args()
    print(f"GPT {ARGS}, one row of {a.seq} tokens, float32, gloo on CPU, load: {os.getloadavg()}")
    for cp in a.worlds:
        res = run_ranks(rank_run, cp, a.seq, a.pairs, timeout=1800)
        r0 = res[0]
        lr, la = r0["loss"]
        want = formula_bytes(a.seq, cp)
        print(f"\ncp = {cp}: loss ring {lr:.6f}, all-to-all {la:.6f} (rel diff {abs(lr - la) / abs(lr):.1e})")
        for kind in ("ring", "alltoall"):
            got = max(r["sent"][kind] for r in res)
            print(
                f"  {kind:>8}: median step {statistics.median(r0['times'][kind]):.3f} s,"
                f" sent {got / 2**20:.3f} MiB/rank/step, formula {want[kind] / 2**20:.3f} MiB"
            )
        ratios = paired_ratios(r0["times"]["ring"], r0["times"]["alltoall"])
        print("  " + summary_line(f"step time ring / all-to-all at cp = {cp}", ratios))
    print(f"\nload after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
