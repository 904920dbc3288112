"""Expert parallelism (``parallel.ep``): each rank of an ep group holds ``n_experts / ep`` experts.

Layout (ParallelDims.ep_mesh): the ep ranks are borrowed from the data-parallel ranks (torchtitan's
choice): the ranks of one ep group load different batches, so dispatching every token to the rank
that holds its expert is useful work and no rank holds experts alone. The mesh is
``(ep_replicate, ep)`` over the dp ranks: rank ``r`` of an ep group holds experts
``[r * L, (r + 1) * L)`` (``L = n_experts / ep``); the ``dp / ep`` ranks of its ``ep_replicate``
group hold the same ones.

Gradients. The non-expert weights stay with DDP / FSDP2 over all of dp, which ignore the expert
weights (``expert_params``). An expert's local gradient is already a sum over its ep group's
tokens (the all_to_all's backward brings them home), so :func:`reduce_expert_grads` sums it over
``ep_replicate`` only and divides by ``dp``: the step scales each rank's loss by ``dp / items``
for the wrappers' average over dp (step.py), so the exact gradient is that sum over all dp ranks'
contributions divided by dp (torchtitan's ``set_gradient_divide_factor`` for the same reason).
Reducing over the ep group too would add other experts' gradients, or count tokens twice.

With FSDP2 (``parallel.dp_shard > 1``) the experts are sharded too (:func:`apply_expert_fsdp`):
FSDP2 of the non-expert weights over all of dp, of each layer's local experts over
``ep_replicate`` (what remains of dp once ep is taken), with the same MixedPrecisionPolicy, as
torchtitan does. FSDP2 then reduces their gradients (a summing reduce-scatter over
``ep_replicate``, then divided by ``dp`` instead of its size: ``set_gradient_divide_factor``),
and bf16 casts them like every other weight.

Exactness. Dispatch (:func:`dispatch`) sends each (token, slot) pair to its expert's rank and
brings the expert's float32 output back to the same (token, slot) position, so the MoE layer
combines in the same fixed slot order in float32 as at ep = 1 (models/gpt/moe.py): only the
experts' matmul rounding (rows grouped differently, ~1e-7) depends on ep.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

# DTensor and FSDP2 are imported in the functions that use them: importing them costs seconds, which
# the launcher, whose preflight reads this module through the models, must not pay (tests/e2e/test_startup.py).

# Set on each expert parameter by apply_ep: its ExpertGroup (the gradient reduce and norm read it).
EP_ATTR = "_paratrain_expert_group"
# Set on expert parameters FSDP2 shards over ep_replicate (apply_expert_fsdp): FSDP2 reduces them.
EP_FSDP_ATTR = "_paratrain_expert_fsdp"


@dataclass(frozen=True)
class ExpertGroup:
    """What an MoE layer and the step need of the ep layout."""

    group: dist.ProcessGroup  # the ep ranks, which exchange tokens
    rank: int  # this rank's position in it
    size: int  # ep
    replicas: dist.ProcessGroup | None  # the ranks holding the same experts (None when dp == ep)
    dp: int  # the gradient's divisor (see the module docstring)

    def local_experts(self, n_experts: int) -> range:
        per = n_experts // self.size
        return range(self.rank * per, (self.rank + 1) * per)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with autograd: the backward is the reverse exchange of the gradients."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, *, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    return _AllToAll.apply(x, out_splits, in_splits, group)


# train.compile: the dispatch runs eagerly inside the compiled block (torchtitan too keeps the
# token exchange out of its compiled MoE). Traced, it is correct but costly to compile: each host
# read (the split sizes' ``tolist``) and data-dependent gather (``nonzero`` per local expert)
# breaks the graph, so one MoE block becomes ~12 graphs, each compiled by inductor forward and
# backward, plus one recompile for dynamic row counts at the block's second call (the next MoE
# layer: not a recompile per step). One block's first call took 140 s at ep = 2 on the shared
# 2-core CPU machine at load 10: compile time, not a hang.
# Eager: 5 graphs, 24 s at the same load, and no recompile (the output has the fixed shape
# (N k, d), so the router, weighting and slot-order combine around it compile once).
@torch._disable_dynamo  # torch.compiler.disable, importing dynamo at the first call, not here
def dispatch(
    flat: torch.Tensor, experts: torch.Tensor, local: Sequence[nn.Module], n_experts: int, ep: ExpertGroup
) -> torch.Tensor:
    """Run each (token, slot) pair through its expert, wherever it lives: flat (N, d) tokens,
    experts (N, k) chosen expert ids, ``local`` this rank's experts in id order -> (N * k, d_out)
    float32 outputs in (token, slot) order (unweighted; the caller weights and combines them)."""
    k = experts.shape[1]
    pair_expert = experts.reshape(-1)
    # Pairs grouped by expert id, hence by destination rank (ranks hold consecutive ids).
    order = torch.argsort(pair_expert, stable=True)
    counts = torch.bincount(pair_expert, minlength=n_experts)
    # 1. The counts: recv[s, j] = pairs rank s sends to this rank's local expert j.
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=ep.group)
    per = n_experts // ep.size
    recv = recv.view(ep.size, per)
    in_splits = counts.view(ep.size, per).sum(1).tolist()
    out_splits = recv.sum(1).tolist()
    # 2. The tokens (a host read of the splits above: all_to_all_single takes Python lists).
    x = all_to_all(flat[order // k], out_splits=out_splits, in_splits=in_splits, group=ep.group)
    # 3. Each local expert on its rows (arrived by source rank, then by expert). On GPU, rows
    #    sorted by local expert and torch._grouped_mm would replace this loop (not built).
    ids = torch.repeat_interleave(torch.arange(per, device=x.device).repeat(ep.size), recv.reshape(-1))
    y = None
    for j, expert in enumerate(local):
        # Every local expert runs, on no rows at all if need be: its gradient always exists.
        rows = (ids == j).nonzero(as_tuple=True)[0]
        out = expert(x[rows]).float()
        y = (x.new_zeros((x.shape[0], out.shape[-1]), dtype=torch.float32) if y is None else y).index_put((rows,), out)
    # 4. Back to the ranks the pairs came from, in the order they were sent; then unsorted.
    back = all_to_all(y, out_splits=in_splits, in_splits=out_splits, group=ep.group)
    return back.new_zeros(back.shape).index_put((order,), back)


def apply_ep(model: nn.Module, ep: ExpertGroup) -> list[nn.Parameter]:
    """Keep only this rank's experts in every module that offers ``enable_expert_parallel(ep)``
    (models/gpt/moe.py: it returns the local experts' parameters); tag those parameters for
    :func:`reduce_expert_grads` and the gradient norm. Returns them, for the data-parallel
    wrappers to ignore. Call before DDP / FSDP2 wrap the model."""
    params: list[nn.Parameter] = []
    for module in list(model.modules()):
        if hasattr(module, "enable_expert_parallel"):
            params.extend(module.enable_expert_parallel(ep))
    for p in params:
        setattr(p, EP_ATTR, ep)
    return params


def apply_expert_fsdp(
    model: nn.Module, mesh: DeviceMesh, *, mp_policy, reshard_after_forward: bool, divide_factor: int
) -> None:
    """FSDP2 ``fully_shard`` of the local experts of every MoE layer over ``mesh`` (the
    ``ep_replicate`` ranks, which hold the same experts), one unit per layer, with the policy the
    other weights get (bf16 casts the experts too). Gradients: the reduce-scatter sums over
    ``mesh`` and divides by ``divide_factor`` (dp; module docstring). Call after :func:`apply_ep`,
    before the model's own FSDP2, which then leaves the experts to these units."""
    from torch.distributed.fsdp import fully_shard

    for unit in _expert_units(model):
        ep = getattr(next(iter(unit[0].parameters())), EP_ATTR)
        # One group for the layer's experts: the MoE calls each expert, never their container,
        # so each gets FSDP2's hooks and the first one to run gathers them all (every expert runs
        # at every forward, on no rows if need be).
        fully_shard(
            unit if len(unit) > 1 else unit[0],
            mesh=mesh,
            mp_policy=mp_policy,
            reshard_after_forward=reshard_after_forward,
        )
        unit[0].set_gradient_divide_factor(float(divide_factor))
        if mesh.size() > 1:
            # Sum, then divide by dp: with a factor other than the mesh size FSDP2 would reduce
            # with PREMUL_SUM, which gloo lacks ("Cannot use ReduceOp.PREMUL_SUM with Gloo").
            # Not on one rank: torch 2.13's foreach_reduce then divides by the factor in its
            # copy and would divide again after (found by tests/distributed/test_moe_layouts.py, 2x off).
            unit[0].set_force_sum_reduction_for_comms(True)
        for m in unit:
            for p in m.parameters():  # FSDP2 made new (DTensor) parameters: tag them again
                setattr(p, EP_ATTR, ep)
                setattr(p, EP_FSDP_ATTR, True)


def _expert_units(model: nn.Module) -> list[list[nn.Module]]:
    """The modules holding one layer's experts: the largest modules whose parameters are all
    expert parameters; a container (ModuleDict/ModuleList, never called itself) gives its children."""
    from torch.distributed.tensor import DTensor

    units = []

    def visit(m: nn.Module) -> None:
        params = list(m.parameters())
        if params and all(hasattr(p, EP_ATTR) for p in params):
            if any(isinstance(p, DTensor) for p in params):
                # Rows of a DTensor over the ep group (models/hf/moe.py's fused experts): not an
                # FSDP2 unit; reduce_expert_grads sums their local rows over ep_replicate.
                return
            units.append(list(m.children()) if isinstance(m, (nn.ModuleDict, nn.ModuleList)) else [m])
            return
        for child in m.children():
            visit(child)

    visit(model)
    return units


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if hasattr(p, EP_ATTR)]


def reduce_expert_grads(params) -> None:
    """Sum each expert gradient over the ranks holding the same expert and divide by dp (the
    module docstring says why); call once per step, after the last backward, before the norm."""
    for p in params:
        ep: ExpertGroup | None = getattr(p, EP_ATTR, None)
        if ep is None or hasattr(p, EP_FSDP_ATTR):  # FSDP2 reduced those (apply_expert_fsdp)
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if ep.replicas is not None:  # a DTensor's (models/hf/moe.py) local rows: its mesh is the ep group
            dist.all_reduce(_local(p.grad), group=ep.replicas)
        p.grad.div_(ep.dp)


def expert_norm_power(grads: list[torch.Tensor], ep: ExpertGroup, norm_type: float) -> torch.Tensor:
    """The ``norm_type``-th power of the norm of all of the ep group's expert gradients (each
    rank holds different experts: a sum over the ep group; the max for the inf norm)."""
    from torch.distributed.tensor import DTensor

    # Two kinds of expert gradients reach here, never mixed in one model: FSDP2-sharded over
    # ep_replicate (apply_expert_fsdp: the norm of the whole experts, full_tensor), or a
    # DTensor's own rows on the ep group's mesh (models/hf/moe.py), which grad_norm passes local.
    n = torch.nn.utils.get_total_norm(grads, norm_type=norm_type)
    if isinstance(n, DTensor):
        n = n.full_tensor()
    n = n.double().reshape(())
    if math.isinf(norm_type):
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=ep.group)
        return n
    n = n**norm_type
    dist.all_reduce(n, group=ep.group)
    return n


def gather_expert_weights(model: nn.Module, sd: dict) -> dict:
    """``sd`` (a full state dict) with every expert of the ep group, under the names ep = 1 uses
    (each rank holds some; the model's own names already are the global ones): a collective of
    the ep group, for the full-weights export."""
    from torch.distributed.tensor import DTensor

    # DTensor rows over the ep group (models/hf/moe.py) came out of get_model_state_dict whole
    # already; FSDP2's expert shards (DTensors too, tagged EP_FSDP_ATTR) are gathered below.
    local = {
        _plain_name(n): p
        for n, p in model.named_parameters()
        if hasattr(p, EP_ATTR) and (hasattr(p, EP_FSDP_ATTR) or not isinstance(p, DTensor))
    }
    if not local:
        return sd
    ep: ExpertGroup = getattr(next(iter(local.values())), EP_ATTR)
    parts: list[dict | None] = [None] * ep.size
    # FSDP2-sharded experts (apply_expert_fsdp): whole first, a collective of their ep_replicate
    # ranks (the same names, in the same order, on each of them).
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu() for n, p in local.items()}
    dist.all_gather_object(parts, full, group=ep.group)
    merged = dict(sd)
    for part in parts:
        merged.update(part)
    return merged


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _plain_name(name: str) -> str:
    """A parameter's name without the wrappers' modules (DDP's ``module.``, activation
    checkpointing's and compile's), as get_model_state_dict names it."""
    name = name.removeprefix("module.")
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
