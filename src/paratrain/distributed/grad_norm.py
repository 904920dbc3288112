"""The global gradient norm and clipping over plain, DTensor (FSDP/TP) and mixed gradients.

``torch.nn.utils.clip_grad_norm_`` stacks per-tensor norms, which fails when the gradients live
on different meshes (FSDP puts plain-parameter gradients on the dp mesh and TP ones on the
dp x tp mesh) and returns a DTensor when they are sharded. Here each group of gradients on one
mesh gets its norm from torch (a sharded norm reduced by DTensor), made a full (replicated)
tensor with ``full_tensor()``, and the groups are combined: the norm is the one of the whole,
unsharded model on every rank, as the single-process reference computes it.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from paratrain.distributed.expert_parallel import EP_ATTR, EP_FSDP_ATTR, ExpertGroup, expert_norm_power


def global_grad_norm(params, *, norm_type: float = 2.0) -> torch.Tensor:
    params = [p for p in params if p.grad is not None]
    if not params:
        return torch.zeros(())
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    experts: dict[ExpertGroup, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        g = p.grad
        if (ep := getattr(p, EP_ATTR, None)) is not None:
            # Expert parallel: each ep rank holds different experts. A DTensor over the ep group's
            # rows (models/hf/moe.py) gives its local rows; FSDP2's expert shards stay DTensors.
            experts[ep].append(g.to_local() if isinstance(g, DTensor) and not hasattr(p, EP_FSDP_ATTR) else g)
            continue
        groups[g.device_mesh if isinstance(g, DTensor) else None].append(g)
    parts = []
    for mesh, gs in groups.items():
        n = torch.nn.utils.get_total_norm(gs, norm_type=norm_type)
        parts.append(n.full_tensor() if isinstance(n, DTensor) else n)
    for ep, gs in experts.items():
        n = expert_norm_power(gs, ep, norm_type)
        parts.append(n if math.isinf(norm_type) else n ** (1.0 / norm_type))
    device = parts[0].device
    parts = torch.stack([p.to(device=device, dtype=torch.float32) for p in parts])
    if math.isinf(norm_type):
        return parts.max()
    return parts.pow(norm_type).sum().pow(1.0 / norm_type)


def clip_grad_norm_(
    params, max_norm: float, *, norm_type: float = 2.0, pp_group=None, total: torch.Tensor | None = None
) -> torch.Tensor:
    """Clip the gradients in place to ``max_norm`` (inf: no clipping); returns the global norm as
    a 0-dim tensor, not read on the host (the step reads it after its loss reduce).

    ``pp_group``: the pipeline group, whose stages each hold a part of the model. Each stage's
    norm (itself whole over its FSDP/TP shards) is partial, so the p-th powers are summed over
    the pipeline ranks before clipping (max for the inf norm).

    ``total``: the norm, already taken (run.bitwise takes it on the whole merged gradient, before
    FSDP2's shards: a norm of shards adds their squares in the collective's order).
    """
    params = [p for p in params if p.grad is not None]
    if total is not None:
        return _clip_with(params, max_norm, total)
    if pp_group is None and not any(isinstance(p.grad, DTensor) or hasattr(p, EP_ATTR) for p in params):
        # Plain tensors: torch's own (fused, foreach) implementation, as the reference uses it.
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)  # no host sync
    total = global_grad_norm(params, norm_type=norm_type)
    if pp_group is not None:
        total = total.double().reshape(())
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_group)
        else:
            total = total**norm_type
            dist.all_reduce(total, group=pp_group)
            total = total ** (1.0 / norm_type)
    return _clip_with(params, max_norm, total)


def _clip_with(params, max_norm: float, total: torch.Tensor) -> torch.Tensor:
    if math.isinf(max_norm):  # no clipping: the coefficient would be 1 (no host read for it)
        return total
    # The same coefficient as torch.nn.utils.clip_grads_with_norm_, applied as a Python scalar so
    # that it multiplies plain tensors and DTensors on any mesh alike (a host read, when clipping).
    coef = min(1.0, float(max_norm / (total + 1e-6)))
    if coef < 1.0:
        with torch.no_grad():
            for p in params:
                p.grad.mul_(coef)
    return total
