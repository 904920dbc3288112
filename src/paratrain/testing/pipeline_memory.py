"""Peak bytes per pipeline rank, measured (every CPU storage alive, tracked by a dispatch mode)
and modelled by the plan (benchmarks/parallel/plan_pipeline_memory.py and tests/distributed/test_plan.py)."""

from __future__ import annotations

import os
import tempfile
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from paratrain.config import load_config
from paratrain.plan.enumerate import Layout, meta_model
from paratrain.plan.memory import MemoryModel
from paratrain.testing.dist_utils import REPO

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
