"""What agreeing on a SIGTERM costs per step: now (the flag rides the step's loss reduce) and in 0.2.

Spawns WORLD gloo ranks on 127.0.0.1 (one thread each) and times, in rounds whose order
alternates, three versions of the end of a step:

- ``loss only``: 0.2's reduce of ``[loss_sum, item_count]`` and its read, then the read of the
  gradient norm, without any preemption check;
- ``now``: what ``step.train_step`` does now: ``launch_totals`` of the loss objective's sums
  with the stop flag as a third element, its read, ``check_count``, then the gradient norm's read;
- ``joint read``: ``now`` with the totals and the norm read in one ``.tolist()`` (torch.cat),
  the variant not taken (three more tensor ops per step);
- ``0.2``: ``loss only`` plus the separate one-float ``all_reduce(MAX)`` on a gloo group of its
  own that ``Preemption.should_stop`` did every step before.

Prints the median per-step time of each and the paired differences (rounds of the same moment
see the same machine load): median and bootstrap 95% interval.

    PYTHONPATH=src python benchmarks/resilience/preempt_overhead.py [--world 2] [--rounds 20] [--checks 200]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from paratrain.testing.dist_utils import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rank_main(rounds: int, checks: int) -> list[dict[str, float]]:
    """Seconds per step of each version, one dict per round."""
    import torch
    import torch.distributed as dist

    from paratrain.config import LossConfig
    from paratrain.objectives import ItemLoss
    from paratrain.objectives.items import check_count
    from paratrain.objectives.registry import build_loss
    from paratrain.step import StepContext, launch_totals

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    loss = ItemLoss(build_loss(LossConfig()))
    ctx = StepContext(objectives=(loss,), device=torch.device("cpu"), loss_group=dist.group.WORLD)
    flag_group = dist.new_group(backend="gloo")  # 0.2's Preemption group
    loss_sum = torch.tensor(1.5, dtype=torch.float64)
    returned = torch.tensor(1.0, dtype=torch.float64)
    loss.start(scale=1.0, device=ctx.device)
    loss.add(loss_sum, returned)
    grad_norm = torch.tensor(0.75)

    def loss_only() -> None:
        totals = torch.stack([loss_sum, returned])
        dist.all_reduce(totals, group=ctx.loss_group)
        check_count(totals.tolist()[1], world)
        float(grad_norm)

    def now() -> None:
        (values,), _ = launch_totals(ctx.objectives, ctx=ctx, pp_group=None, stop=False).read()
        check_count(values[1], world)
        float(grad_norm)

    def joint_read() -> None:
        totals = launch_totals(ctx.objectives, ctx=ctx, pp_group=None, stop=False).wait()
        values = torch.cat([totals, grad_norm.reshape(1).to(totals)]).tolist()
        check_count(values[1], world)

    def old() -> None:
        loss_only()
        t = torch.tensor([0.0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=flag_group)
        t.item()

    versions = {"loss only": loss_only, "now": now, "joint read": joint_read, "0.2": old}
    out = []
    for r in range(rounds):
        row = {}
        for name in list(versions)[:: 1 if r % 2 == 0 else -1]:
            fn = versions[name]
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(checks):
                fn()
            row[name] = (time.perf_counter() - t0) / checks
        out.append(row)
    dist.destroy_process_group()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--checks", type=int, default=200)
    args = ap.parse_args()
    versions_order = ("loss only", "now", "joint read", "0.2")
    rows = run_ranks(rank_main, args.world, args.rounds, args.checks)[0]  # rank 0's view
    print(f"world {args.world}, {args.rounds} rounds x {args.checks} steps each (gloo, loopback); per step:")
    for name in versions_order:
        print(f"  {name:>9}: median {statistics.median(r[name] for r in rows) * 1e6:8.1f} us")
    for a, b in (("now", "loss only"), ("joint read", "loss only"), ("0.2", "loss only"), ("now", "0.2")):
        diffs = [r[a] - r[b] for r in rows]
        boot = sorted(statistics.median(random.choices(diffs, k=len(diffs))) for _ in range(2000))
        print(
            f"  {a} - {b} (paired): median {statistics.median(diffs) * 1e6:7.1f} us,"
            f" 95% bootstrap interval [{boot[50] * 1e6:.1f}, {boot[1949] * 1e6:.1f}] us"
        )


if __name__ == "__main__":
    main()
