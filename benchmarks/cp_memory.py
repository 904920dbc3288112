"""Context parallel at a fixed sequence length: activation memory, ring traffic and step time per cp.

The built-in GPT on one row of ``--seq`` tokens, at cp = 1, 2 and 4 (gloo ranks on this machine).
Per rank it reports

- the bytes autograd saves for backward during the forward (``saved_tensors_hooks``, each storage
  counted once, the weights left out): the activation memory of the step, which should fall
  close to 1/cp;
- the bytes the ring sends per step (counted at its point-to-point exchange) against the plan's
  formula (``paratrain.plan.cost.ring_bytes``) per attention layer: forward ``(cp - 1) x 2 x B H (T/cp) D`` elements (K and V), backward
  ``(cp - 1) x 4 x B H (T/cp) D`` (K, V and their gradients) ``+ 2 x B H (T/cp) D`` (the gradients'
  last hop home), float32;
- the forward + backward time (median of ``--repeats``) and whether the loss equals cp = 1's;
- the same for ``parallel.cp_attention = "alltoall"`` (its traffic by the formula only: ``8 x
  (cp - 1) / cp x B H (T/cp) D`` elements per layer, q, k, v and out forward and their gradients
  backward).

    PYTHONPATH=src:. python benchmarks/cp_memory.py [--seq 1024] [--repeats 3]

CPU, gloo, each rank on one thread: the time shows the ring's overhead on this machine, not the
speed-up of a real accelerator (where each rank would have its own device).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]

ARGS = dict(n_layer=2, n_head=4, d_model=64, vocab_size=256)


def rank_run(seq: int, repeats: int, kind: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import paratrain.distributed.context_parallel as cpmod
    from paratrain.distributed.context_parallel import ATTENTIONS, shard_sequence
    from paratrain.models.gpt.model import build_gpt
    from paratrain.models.gpt.parallel import gpt_cp_attention

    dist.init_process_group("gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = build_gpt(**ARGS, block_size=seq)
    ids = torch.randint(0, ARGS["vocab_size"], (1, seq + 1), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1], ids[:, 1:]
    if cp > 1:
        gpt_cp_attention(model, ATTENTIONS[kind](init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))))
        pos = torch.arange(seq).unsqueeze(0)
        x = shard_sequence(torch.stack([x, pos], dim=1), dim=-1, cp=cp, rank=rank)
        y = shard_sequence(y, dim=-1, cp=cp, rank=rank)

    sent = [0]
    exchange = cpmod._exchange

    def counting_exchange(send, group, **kw):
        sent[0] += send.numel() * send.element_size()
        return exchange(send, group, **kw)

    cpmod._exchange = counting_exchange
    saved: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() in weights:  # a layer's weight, not an activation
            return t
        saved.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    times, loss = [], None
    for i in range(repeats + 1):  # the first is a warm-up
        sent[0] = 0
        saved.clear()
        if cp > 1:
            dist.barrier()
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(x)
        s = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
        s.backward()
        model.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - t0)
        loss = s.detach()
    if cp > 1:
        dist.all_reduce(loss)
    dist.destroy_process_group()
    return {
        "saved_bytes": sum(saved.values()),
        "sent_bytes": sent[0],
        "time_s": statistics.median(times),
        "loss": loss.item(),
    }


def formula_bytes(seq: int, cp: int, kind: str) -> int:
    if cp == 1:
        return 0
    local = 1 * ARGS["d_model"] * (seq // cp)  # B x H x (T/cp) x D elements, H x D = d_model
    if kind == "alltoall":  # q, k, v, out forward and their gradients backward, (cp-1)/cp of each leaves
        return int(4 * ARGS["n_layer"] * 8 * local * (cp - 1) / cp)
    from paratrain.plan.cost import ring_bytes  # the plan's formula (its cp_comm term prices these bytes)

    forward, backward = ring_bytes(mb=1, local_seq=seq // cp, width=ARGS["d_model"], cp=cp, act_bytes=4)
    return ARGS["n_layer"] * (forward + backward)


def main() -> None:
    from tests.dist_utils import run_ranks

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    print(f"GPT {ARGS}, one row of {a.seq} tokens, float32, gloo on CPU")
    print(
        f"{'cp':>3} {'attention':>9} {'saved MiB/rank':>15} {'vs cp=1':>8} {'sent MiB/rank':>14} {'formula':>8}"
        f" {'fwd+bwd s':>10} {'loss rel diff':>14}"
    )
    base = None
    for cp, kind in ((1, "-"), (2, "ring"), (2, "alltoall"), (4, "ring"), (4, "alltoall")):
        res = run_ranks(rank_run, cp, a.seq, a.repeats, kind, timeout=900)
        saved = max(r["saved_bytes"] for r in res)
        sent = max(r["sent_bytes"] for r in res)  # counted at the ring's exchange only
        base = base or (saved, res[0]["loss"])
        print(
            f"{cp:>3} {kind:>9} {saved / 2**20:>15.2f} {saved / base[0]:>8.3f}"
            f" {(f'{sent / 2**20:.2f}' if kind != 'alltoall' else '-'):>14}"
            f" {formula_bytes(a.seq, cp, kind) / 2**20:>8.2f} {statistics.median(r['time_s'] for r in res):>10.3f}"
            f" {abs(res[0]['loss'] - base[1]) / abs(base[1]):>14.2e}"
        )


if __name__ == "__main__":
    main()
