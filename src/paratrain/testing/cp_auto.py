"""What the ranks of tests/distributed/test_context_parallel.py's test of the "auto" attention run, in a module
that imports no transformers (the test module does, through tests/distributed/test_sft.py's fixtures), so
that each spawned rank starts seconds sooner on a loaded machine."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class PositionRows(Dataset):
    """Rows of 16 tokens with their position ids (B, 2, 16): one causal document each, or packed
    documents of 12 + 4 tokens, whose chunks look like one document on cp rank 1 of 2 (global
    tokens 4..11) but not on rank 0 (tokens 12..15 restart at 0): only the whole row tells."""

    def __init__(self, n: int, packed: bool):
        g = torch.Generator().manual_seed(5)
        self.ids = torch.randint(0, 32, (n, 16), generator=g)
        self.targets = torch.randint(0, 32, (n, 16), generator=g)
        self.positions = torch.cat([torch.arange(12), torch.arange(4)]) if packed else torch.arange(16)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return torch.stack([self.ids[i], self.positions]), self.targets[i]


def position_rows(n: int = 16, packed: bool = False) -> PositionRows:
    return PositionRows(n, packed)


def count_auto_rank(runs: dict[str, list[str]]) -> dict[str, dict[str, int]]:
    """Each run's dist.all_reduce calls (those made inside an "auto" attention call apart) and
    the attention path it took per call, counted in this rank."""
    import torch.distributed as dist

    import paratrain
    from paratrain.distributed import context_parallel

    counts: dict[str, int] = {}
    inside = []

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            if name == "all_reduce" and inside:
                counts["all_reduce_in_attention"] = counts.get("all_reduce_in_attention", 0) + 1
            return fn(*args, **kwargs)

        return call

    auto_call = context_parallel.AutoAttention.__call__

    def attention(self, *args, **kwargs):
        inside.append(1)
        try:
            return auto_call(self, *args, **kwargs)
        finally:
            inside.pop()

    dist.all_reduce = counted("all_reduce", dist.all_reduce)
    context_parallel.AutoAttention.__call__ = attention
    for name in ("ring_attention", "alltoall_attention"):
        setattr(context_parallel, name, counted(name, getattr(context_parallel, name)))
    dist.init_process_group("gloo")
    per_run = {}
    try:
        for name, overrides in runs.items():
            counts.clear()
            paratrain.train(paratrain.load_config(None, overrides))
            per_run[name] = dict(counts)
    finally:
        dist.destroy_process_group()
    return per_run
