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

FSDP2 and HSDP (``fully_shard``) reduce-scatter each backward in the backend's order, so every
grain's backward runs with ``set_requires_gradient_sync(False)``: autograd leaves the grain's
whole gradient on the unsharded parameter FSDP gathered and the tree takes it from there. FSDP2
alone merges by ``all_to_all`` (:func:`scatter_ranks`): rank j receives chunk j of every rank's
subtree and adds them in the same pairwise order, so it holds one gradient, not ``dp``; HSDP keeps
the gather over the flattened dp ranks (the sampler's order), each rank keeping its own shard.
The norm adds each row's sum of squares (:func:`row_squares`) in the parameters' row order: a
row's sum is the same bits whole or sharded, so every layout takes the same norm (a norm of
shards reduced by DTensor adds the shards' squares in the collective's order).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP

from paratrain.config import ConfigError


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
        fsdp = _fsdp_params(model)
        # FSDP2: a unit left gathered by a forward without backward (the layout probe, an
        # evaluation; the last block is never resharded after its forward) registers its unsharded
        # parameters on the module: the tree's are the sharded ones, the optimiser's.
        params = [fsdp[id(p)].sharded_param if id(p) in fsdp else p for p in model.parameters()]
        self.params = [p for p in params if p.requires_grad]
        self.fsdp = {id(fp.sharded_param): fp for fp in fsdp.values()}
        self.stack: list[tuple[int, list[torch.Tensor]]] = []

    def no_sync(self) -> contextlib.AbstractContextManager:
        """DDP and FSDP2 reduce nothing by themselves: the tree is the only sum."""
        if isinstance(self.model, DDP):
            return self.model.no_sync()
        if isinstance(self.model, FSDPModule):
            return _fsdp_unsynced(self.model)
        return contextlib.nullcontext()

    def push(self, _k: int = 0) -> None:
        """After a grain's backward: take its gradients out (left None, so the next grain's
        backward starts from nothing) and carry them up the counter."""
        grads = []
        for p in self.params:
            g = self._take(p)
            # A parameter this grain left unused; p.shape is the whole shape (FSDP2's too).
            grads.append(torch.zeros(p.shape, dtype=p.dtype, device=p.device) if g is None else g)
        level = 0
        while self.stack and self.stack[-1][0] == level:
            _, left = self.stack.pop()
            torch._foreach_add_(left, grads)  # left + right, in place in left (IEEE addition commutes)
            grads, level = left, level + 1
        self.stack.append((level, grads))

    def _take(self, p: torch.Tensor) -> torch.Tensor | None:
        """The grain's whole gradient of ``p``: ``p.grad``, or under FSDP2 (no sync) the gradient
        autograd left on the unsharded parameter (upcast to ``reduce_dtype`` when that differs)."""
        fp = self.fsdp.get(id(p))
        if fp is None:
            g, p.grad = p.grad, None
            return g
        g, fp.unsharded_accumulated_grad = fp.unsharded_accumulated_grad, None
        if g is None:
            g, fp.unsharded_param.grad = fp.unsharded_param.grad, None
        return g

    def write_grads(self, *, group: dist.ProcessGroup | None, dp: int) -> torch.Tensor:
        """The rank's subtree, combined with the other ranks' in the tree's order, into ``p.grad``
        (this rank's shard of it for a sharded parameter). Returns the gradient norm, the same bits
        on every layout (:func:`row_squares`)."""
        assert len(self.stack) == 1, "the grains per rank are a power of two (preflight: check_grains)"
        if dp > 1 and all(_fsdp_sharded(p, dp) for p in self.params) and len({p.dtype for p in self.params}) == 1:
            # FSDP2 alone: each rank receives its shard of every rank's subtree, one gradient, not dp.
            return scatter_ranks(self.stack.pop()[1], self.params, group=group, dp=dp)
        grads = self.stack.pop()[1]
        if dp > 1:
            grads = merge_ranks(grads, group=group, dp=dp)
        for p, g in zip(self.params, grads, strict=True):
            p.grad = _shard_like(p, g) if isinstance(p, DTensor) else g
        return _norm([row_squares(g) for g in grads], grads[0].dtype)


def _fsdp_params(model: nn.Module) -> dict:
    """``{id(parameter): FSDPParam}`` of every ``fully_shard`` unit in ``model``, by its sharded
    and its unsharded parameter (empty without FSDP2). torch has no public getter of the unsharded
    gradient a no-sync backward leaves; this reads FSDP2's own record of it (torch 2.13,
    _fully_shard/_fsdp_param.py)."""
    out = {}
    for module in model.modules():
        if isinstance(module, FSDPModule) and (group := module._get_fsdp_state()._fsdp_param_group) is not None:
            for fp in group.fsdp_params:
                out[id(fp.sharded_param)] = fp
                if hasattr(fp, "_unsharded_param"):  # made at the first all-gather
                    out[id(fp.unsharded_param)] = fp
    return out


@contextlib.contextmanager
def _fsdp_unsynced(model: FSDPModule):
    model.set_requires_gradient_sync(False)  # no reduce-scatter (nor HSDP all-reduce) in any grain
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _shard_like(p: DTensor, full: torch.Tensor) -> DTensor:
    """This rank's piece of the whole gradient ``full``, laid out as the parameter ``p`` (FSDP2:
    Shard(0) over dp_shard, Replicate over dp_replicate). DTensor cuts it locally, without
    communication (``src_data_rank=None``), with the chunks FSDP2 uses; copied (where the shard
    lives: CPU under parallel.cpu_offload) so that the merged flat buffer is freed."""
    shard = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
    shard = shard.to(device=p.device, dtype=p.dtype, copy=True)
    return DTensor.from_local(shard, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)


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
            parts = [parts[i].add_(parts[i + 1]) for i in range(0, len(parts), 2)]  # in place: no new buffers
        for i, piece in zip(idx, parts[0].split([grads[i].numel() for i in idx]), strict=True):
            out[i] = piece.view_as(grads[i])
    return out


def row_squares(g: torch.Tensor) -> torch.Tensor:
    """The sum of squares of each row (dim 0) of a gradient, in float64. A row's sum is the same
    bits whether its rows are the whole gradient or an FSDP2 shard of it (checked on CPU for
    shapes 2-D and 4-D, views at odd offsets), so the norm over rows in the parameters' order is
    the same on every layout; torch's norm of a whole tensor is not a function of its shards."""
    n = g.shape[0] if g.dim() else 1
    return g.reshape(n, g.numel() // n if n else 0).square().sum(1).double()


def _norm(rows: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat(rows).sum().sqrt().to(dtype)


def _fsdp_sharded(p: torch.Tensor, dp: int) -> bool:
    """FSDP2 alone (not HSDP): the parameter is cut along dim 0 over the dp ranks."""
    return isinstance(p, DTensor) and p.placements == (Shard(0),) and p.device_mesh.size() == dp


def _shard_rows(rows: int, dp: int) -> list[int]:
    """The rows of each rank's chunk: torch.chunk's, which DTensor's Shard(0) and FSDP2 use (the
    last ranks get none when there are fewer chunks than ranks)."""
    size = -(-rows // dp)
    return [max(0, min(size, rows - j * size)) for j in range(dp)]


def scatter_ranks(
    grads: list[torch.Tensor], params: list[DTensor], *, group: dist.ProcessGroup | None, dp: int
) -> torch.Tensor:
    """FSDP2's merge: rank j receives shard j of every rank's subtree (``all_to_all``, a
    reduce-scatter's volume) and adds them pairwise in rank order, ``(p0 + p1) + (p2 + p3)``, into
    its sharded ``p.grad``: the same bits as the gather's shard, with one gradient sent and one
    received instead of ``dp`` gathered. The norm's row sums (:func:`row_squares`) of every shard
    are then gathered and added in the parameters' row order: the same bits as one process's."""
    me = dist.get_rank(group)
    cuts = [_shard_rows(g.shape[0], dp) for g in grads]
    inner = [g[:1].numel() for g in grads]  # elements per row
    send = torch.cat([g[sum(c[:j]) : sum(c[: j + 1])].reshape(-1) for j in range(dp) for g, c in zip(grads, cuts)])
    del grads  # the subtree: only the flat copy travels on
    counts = [sum(c[j] * n for c, n in zip(cuts, inner)) for j in range(dp)]
    recv = send.new_empty(counts[me] * dp)
    dist.all_to_all_single(recv, send, [counts[me]] * dp, counts, group=group)
    del send
    parts = list(recv.split(counts[me]))
    while len(parts) > 1:
        parts = [parts[i].add_(parts[i + 1]) for i in range(0, len(parts), 2)]
    mine = parts[0].clone()  # the shard alone, so the received buffer is freed
    del recv, parts
    rows = []
    for p, piece in zip(params, mine.split([c[me] * n for c, n in zip(cuts, inner)]), strict=True):
        shard = piece.view(p.to_local().shape).to(device=p.device, dtype=p.dtype)
        p.grad = DTensor.from_local(
            shard, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False
        )
        rows.append(row_squares(shard))
    # Every rank's row sums, padded to one length for all_gather, then in the parameters' order.
    width = max(sum(c[j] for c in cuts) for j in range(dp))
    local = torch.cat(rows)
    gathered = [local.new_empty(width) for _ in range(dp)]
    dist.all_gather(gathered, torch.cat([local, local.new_zeros(width - local.numel())]), group=group)
    ordered, offsets = [], [0] * dp
    for c in cuts:
        for j in range(dp):
            ordered.append(gathered[j][offsets[j] : offsets[j] + c[j]])
            offsets[j] += c[j]
    return _norm(ordered, mine.dtype)
