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

    PYTHONPATH=src python benchmarks/parallel/cp_memory.py [--seq 1024] [--repeats 3]

``--budget-mib M`` answers the other question instead: the longest sequence whose saved
activations fit ``M`` MiB per rank at cp = 1, 2 and 4. The estimate scales cp = 1's bytes per
token at ``--seq`` (activations grow linearly in T: SDPA and the ring keep q, k, v, the output
and a log-sum-exp, never the T x T scores) by cp; the measurement searches the length (forward
only, in steps of 64 tokens: doubling, then bisection) with the same saved-bytes count, the
largest over the ranks. The transient scores of one chunk pair, ``(T / 2cp)^2`` per head, are not
saved activations and are not counted.

    PYTHONPATH=src python benchmarks/parallel/cp_memory.py --budget-mib 32

CPU, gloo, each rank on one thread: the time shows the ring's overhead on this machine, not the
speed-up of a real accelerator (where each rank would have its own device).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


def saved_bytes_of(model, x) -> int:
    """Bytes autograd saves for backward in one forward of ``model`` on ``x`` (weights left out)."""
    import torch

    saved: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            saved.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(saved.values())


def longest_fit(budget: int, max_seq: int, kind: str) -> dict:
    """The longest sequence (a multiple of 64) whose saved bytes fit ``budget`` on every rank."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from paratrain.distributed.context_parallel import ATTENTIONS, shard_sequence
    from paratrain.models.gpt.model import build_gpt
    from paratrain.models.gpt.parallel import gpt_cp_attention

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    cp, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = build_gpt(**ARGS, block_size=max_seq)
    if cp > 1:
        gpt_cp_attention(model, ATTENTIONS[kind](init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))))
    probes = []

    def fits(seq: int) -> bool:
        ids = torch.randint(0, ARGS["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(1))
        if cp > 1:
            ids = shard_sequence(torch.stack([ids, torch.arange(seq).unsqueeze(0)], dim=1), dim=-1, cp=cp, rank=rank)
        worst = torch.tensor([saved_bytes_of(model, ids)])
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        probes.append((seq, worst.item()))
        return worst.item() <= budget

    lo, hi = 0, 64
    while hi <= max_seq and fits(hi):  # doubling
        lo, hi = hi, 2 * hi
    hi = min(hi, max_seq + 64)
    while hi - lo > 64:  # bisection on multiples of 64
        mid = (lo + hi) // 128 * 64
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    dist.destroy_process_group()
    return {"seq": lo, "bytes": dict(probes).get(lo, 0), "probes": len(probes)}


def budget_table(budget_mib: float, seq: int, max_seq: int) -> None:
    from paratrain.testing.dist_utils import run_ranks

    budget = int(budget_mib * 2**20)
    base = run_ranks(rank_run, 1, seq, 1, "-", timeout=900)[0]["saved_bytes"]
    per_token = base / seq
    print(f"cp = 1 saves {per_token / 1024:.2f} KiB per token (at {seq} tokens); budget {budget_mib} MiB per rank")
    print(
        f"{'cp':>3} {'attention':>9} {'estimate':>9} {'measured':>9} {'meas/est':>9} {'vs cp=1':>8} {'saved MiB':>10}"
    )
    first = None
    for cp, kind in ((1, "-"), (2, "ring"), (2, "alltoall"), (4, "ring"), (4, "alltoall")):
        estimate = int(cp * budget / per_token) // 64 * 64
        (res, *_) = run_ranks(longest_fit, cp, budget, max_seq, kind, timeout=1800)
        first = first or res["seq"]
        print(
            f"{cp:>3} {kind:>9} {estimate:>9} {res['seq']:>9} {res['seq'] / estimate:>9.3f}"
            f" {res['seq'] / first:>8.2f} {res['bytes'] / 2**20:>10.2f}"
        )


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
    from paratrain.testing.dist_utils import run_ranks

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget-mib", type=float, default=0, help="search the longest sequence that fits this many MiB")
    p.add_argument("--max-seq", type=int, default=65536, help="the longest sequence the search tries")
    a = p.parse_args()
    print(f"load: {os.getloadavg()}")
    if a.budget_mib:
        print(f"GPT {ARGS}, one row, float32, saved activations per rank, gloo on CPU")
        budget_table(a.budget_mib, a.seq, a.max_seq)
        return
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
