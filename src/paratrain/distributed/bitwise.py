"""``run.bitwise``: the same weights, bit for bit, on any number of processes and any
accumulation (issue 59; docs/bitwise.md).

A layout changes the order of the sums over samples (inside a micro-batch's weight gradient,
across micro-batches, across ranks), and float addition is not associative: the per-step
difference is rounding, which AdamW amplifies over a run. Here that order is made one order:

- a **grain** of ``run.bitwise_grain`` rows is the unit of every backward: each micro-batch runs
  as ``micro_batch_size / grain`` forwards and backwards of exactly ``grain`` rows, the same rows
  and shapes on every layout, so each grain's gradient is the same bits everywhere;
- the grains' gradients are summed in one **binary tree** over their global index. On a rank a
  binary counter keeps it (:class:`GrainTree`): after grain i push its gradients; while the two
  top entries have the same level, replace them by left + right one level up. The sampler gives
  data-parallel rank r the r-th contiguous slice of the global batch (data/sampler.py
  ``rank_slice``), so with a power-of-two count of grains per rank that slice is one subtree;
- across ranks the subtrees are gathered (``all_gather``, whose result is in rank order) and
  combined pairwise in rank order, ``(p0 + p1) + (p2 + p3)``: with dp a power of two this is the
  same perfect tree as one process's. Never an all-reduce, whose summation order is gloo's/NCCL's.

DDP never reduces by itself in this mode (every backward runs under ``no_sync``); the result is
written into ``p.grad`` and the step's clip and optimiser step run as usual. The objectives'
scale is ``1 / units`` (not ``dp / units``): the ranks' gradients are summed here, not averaged.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from paratrain.config import ConfigError


def check_grains(*, grain: int, micro_batch_size: int, per_rank: int, dp: int) -> None:
    """The layouts whose tree is the one tree: one line (ConfigError) for any other."""
    if grain <= 0:
        raise ConfigError("run.bitwise = true needs run.bitwise_grain, the rows of each backward: set it to an int > 0")
    if micro_batch_size % grain:
        raise ConfigError(
            f"run.bitwise_grain = {grain} must divide batch.micro_batch_size = {micro_batch_size}: set the micro-batch"
            f" to a multiple of {grain} (or a smaller grain)"
        )
    grains = per_rank // grain
    if not _power_of_two(grains) or not _power_of_two(dp):
        raise ConfigError(
            f"run.bitwise sums the grains in one binary tree: the grains per rank ({per_rank} rows / run.bitwise_grain"
            f" = {grains}) and the data-parallel ranks ({dp}) must be powers of two; change"
            " batch.global_batch_size, run.bitwise_grain or the number of processes"
        )


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def split_grains(batches: list[tuple], keys: list[torch.Tensor] | None, grain: int):
    """Each micro-batch ``(input, target)`` cut into grains of ``grain`` rows, in order, and
    their rows' keys (keyed dropout); ``(grain_batches, grain_keys or None)``."""
    out, out_keys = [], [] if keys else None
    for k, (inputs, target) in enumerate(batches):
        rows = _count_rows(inputs)  # not len(target): a (y, w) target's len is its fields
        if rows % grain:
            raise ConfigError(f"run.bitwise_grain = {grain} does not divide a micro-batch of {rows} rows")
        for a in range(0, rows, grain):
            out.append((_rows(inputs, a, a + grain), _rows(target, a, a + grain)))
            if keys:
                out_keys.append(keys[k][a : a + grain])
    return out, out_keys


def _count_rows(obj) -> int:
    """The rows of a micro-batch's input: the first dimension of its first tensor."""
    if isinstance(obj, torch.Tensor):
        return obj.shape[0]
    for v in obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ():
        return _count_rows(v)
    raise ConfigError(f"run.bitwise cuts micro-batches into grains of rows but got a {type(obj).__name__} batch")


def _rows(obj, a: int, b: int):
    if isinstance(obj, torch.Tensor):
        return obj[a:b]
    if isinstance(obj, dict):
        return {k: _rows(v, a, b) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_rows(v, a, b) for v in obj)
    raise ConfigError(f"run.bitwise cuts micro-batches into grains of rows but got a {type(obj).__name__} batch")


class GrainTree:
    """The binary-counter sum of the grains' gradients of ``model`` (module docstring)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.stack: list[tuple[int, list[torch.Tensor]]] = []

    def no_sync(self) -> contextlib.AbstractContextManager:
        """DDP reduces nothing by itself: the tree is the only sum."""
        return self.model.no_sync() if isinstance(self.model, DDP) else contextlib.nullcontext()

    def push(self, _k: int = 0) -> None:
        """After a grain's backward: take its gradients out of ``p.grad`` (left None, so the next
        grain's backward starts from nothing) and carry them up the counter."""
        grads = []
        for p in self.params:
            g, p.grad = p.grad, None
            grads.append(torch.zeros_like(p) if g is None else g)  # a parameter this grain left unused
        level = 0
        while self.stack and self.stack[-1][0] == level:
            _, left = self.stack.pop()
            torch._foreach_add_(left, grads)  # left + right, in place in left (IEEE addition commutes)
            grads, level = left, level + 1
        self.stack.append((level, grads))

    def write_grads(self, *, group: dist.ProcessGroup | None, dp: int) -> None:
        """The rank's subtree, combined with the other ranks' in the tree's order, into ``p.grad``."""
        assert len(self.stack) == 1, "the grains per rank are a power of two (preflight: check_grains)"
        grads = self.stack.pop()[1]
        if dp > 1:
            grads = merge_ranks(grads, group=group, dp=dp)
        for p, g in zip(self.params, grads, strict=True):
            p.grad = g


def merge_ranks(grads: list[torch.Tensor], *, group: dist.ProcessGroup | None, dp: int) -> list[torch.Tensor]:
    """Every rank's ``grads`` gathered (rank order: the global grain order) and added pairwise,
    ``(p0 + p1) + (p2 + p3)``; the same bits on every rank. One flat buffer per dtype."""
    out: list[torch.Tensor | None] = [None] * len(grads)
    for dtype in dict.fromkeys(g.dtype for g in grads):
        idx = [i for i, g in enumerate(grads) if g.dtype == dtype]
        flat = torch.cat([grads[i].reshape(-1) for i in idx])
        parts = [torch.empty_like(flat) for _ in range(dp)]
        dist.all_gather(parts, flat, group=group)
        while len(parts) > 1:
            parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
        for i, piece in zip(idx, parts[0].split([grads[i].numel() for i in idx]), strict=True):
            out[i] = piece.view_as(grads[i])
    return out
