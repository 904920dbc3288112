"""Pipeline-stage memory of `paratrain plan`: modelled vs measured peak per pipeline rank.

    python benchmarks/parallel/plan_pipeline_memory.py [--schedules 1f1b,gpipe] [--micro-batches 8,4]

Method: each case trains the main GPT (configs/main.toml, 4 blocks, width 128, fp32) for 2 steps
at pp = 2 on gloo over 127.0.0.1 and tracks, on each rank, the bytes of every CPU tensor storage
alive (a TorchDispatchMode that sees every op's outputs and a weakref finaliser per storage,
what MemTracker does without its module hooks, which refuse the pipeline's ``autograd.grad``;
torch has no CPU allocator statistics and tracemalloc does not see torch's allocations). The
peak of the whole run, less the dataset's token tensor (loaded by the run, not part of the step),
is compared with the plan's per-rank model (plan/memory.py ``MemoryModel.pipeline_ranks``). The
same method at pp = 1 matches the fake-tensor estimate to 1% (printed first).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from paratrain.plan.enumerate import Layout
from paratrain.testing.pipeline_memory import measured, modelled

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schedules", default="1f1b,gpipe")
    ap.add_argument("--micro-batches", default="8,4")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cases = [Layout(1, 1, 1, 1, 8)]
    for mb in (int(x) for x in args.micro_batches.split(",")):
        cases += [Layout(1, 1, 1, 2, mb, pp_schedule=s) for s in args.schedules.split(",")]
    errors = []
    for layout in cases:
        meas, mod = measured(layout), modelled(layout)
        err = [b / a - 1 for a, b in zip(meas, mod)]
        if layout.pp > 1:
            errors += err
        print(
            f"{layout.short():32s} measured MiB {' '.join(f'{b / 2**20:7.2f}' for b in meas)}"
            f"   modelled MiB {' '.join(f'{b / 2**20:7.2f}' for b in mod)}"
            f"   error {' '.join(f'{e:+.1%}' for e in err)}",
            flush=True,
        )
    print(f"pipeline ranks: error max |{max(abs(e) for e in errors):.1%}| over {len(errors)} ranks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
