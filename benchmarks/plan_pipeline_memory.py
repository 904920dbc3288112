"""Pipeline-stage memory of `paratrain plan`: modelled vs measured peak per pipeline rank.

    python benchmarks/plan_pipeline_memory.py [--schedules 1f1b,gpipe] [--micro-batches 8,4]

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
import tempfile
import weakref

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "src"), REPO]

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from paratrain.config import load_config  # noqa: E402
from paratrain.plan.enumerate import Layout, meta_model  # noqa: E402
from paratrain.plan.memory import MemoryModel  # noqa: E402

MAIN = os.path.join(REPO, "configs", "main.toml")
DATA_BYTES = 300_000
COMMON = [
    f"data.args={{block_size=128, max_bytes={DATA_BYTES}}}",
    "run.steps=2",
    "run.progress=false",
    "run.save_model=false",
    "metrics.plot=false",
    "optim.warmup_steps=1",
    "eval.interval=0",
    "batch.global_batch_size=32",
]


class LiveBytes(TorchDispatchMode):
    """Bytes of the CPU storages alive (each counted once, from the op that made it) and their peak."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.sizes: dict[int, int] = {}

    def _gone(self, key: int) -> None:
        self.live -= self.sizes.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in self.sizes:
                    self.sizes[key] = storage.nbytes()
                    self.live += self.sizes[key]
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._gone, key)
        return out


def measure_rank(overrides: list[str], out_dir: str) -> int:
    """One rank: the peak live bytes of a short training run, less the dataset's tokens (int64)."""
    import paratrain

    cfg = paratrain.load_config(MAIN, [f"run.out_dir='{out_dir}'", *COMMON, *overrides])
    with LiveBytes() as mode:
        paratrain.train(cfg)
    return mode.peak - DATA_BYTES * 8


def modelled(layout: Layout) -> list[int]:
    cfg = load_config(MAIN, [*COMMON, *layout.set_lines()])
    model = meta_model(cfg)
    memory = MemoryModel(cfg, model=model, n_blocks=len(model.layers))
    if layout.pp == 1:
        return [memory.peak(layout).peak_bytes]
    return [r.peak_bytes for r in memory.pipeline_ranks(layout, cfg.batch.global_batch_size // layout.dp)]


def measured(layout: Layout) -> list[int]:
    from paratrain.testing.dist_utils import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        return run_ranks(measure_rank, layout.world_size, layout.set_lines(), tmp, timeout=900)


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
