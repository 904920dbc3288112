"""Data parallelism: replicated (DDP) and sharded (FSDP2 ``fully_shard``: ZeRO, and HSDP).

Gradient sync policy, per strategy (memory against communication):

- DDP all-reduces in buckets during the backward of the last micro-batch only; the earlier
  micro-batches run under ``no_sync`` and accumulate locally, so a step costs one gradient
  all-reduce whatever the accumulation (as nanoGPT explains, syncing every micro-batch would
  multiply the communication by ``accum_steps`` for nothing). Free in memory: DDP holds full
  gradients anyway. FSDP2's ``replicate`` (``dp_replicate`` with tensor parallel) does the same.
- FSDP2 with ``reshard_after_forward = false`` (ZeRO-2-like: parameters stay gathered from
  forward to backward) skips the reduce-scatter on early micro-batches too
  (``set_requires_gradient_sync(False)``): the unsharded gradients accumulate locally and are
  reduce-scattered once, on the last micro-batch. This layout already spends memory to save
  communication, so it spends a full gradient's memory to save ``accum_steps - 1`` collectives.
- FSDP2 with ``reshard_after_forward = true`` (ZeRO-3-like) reduce-scatters every micro-batch and
  accumulates the 1/N gradient shards: skipping the sync would hold a full-size unsharded
  gradient per rank and give up the point of ZeRO-3 (the ZeRO paper's stage 2/3 also reduce
  every micro-batch into partitioned gradients; Rajbhandari et al. 2020, section 5).
  Summing shards per micro-batch instead of once changes only float rounding.

Loss scale: the step multiplies the loss by ``dp / items`` because DDP averages gradients over
its ranks; FSDP2 averages too (over ``dp_shard``, and for HSDP also over ``dp_replicate``, so
over all ``dp = dp_replicate x dp_shard`` ranks), so the same scale gives the exact gradient of
the global mean in every data-parallel strategy.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import ReplicateModule, replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from paratrain.distributed.blocks import BLOCKS_ATTR, blocks_of
from paratrain.distributed.expert_parallel import EP_ATTR


def apply_ddp(model: nn.Module, mesh: DeviceMesh, *, device: torch.device, bucket_mb: float) -> DDP:
    """Wrap ``model`` in DDP over ``mesh`` (a 1-D data-parallel mesh). Expert-parallel weights
    (distributed/expert_parallel.py) are left out: they differ between ranks of an ep group."""
    ignored = [name for name, p in model.named_parameters() if hasattr(p, EP_ATTR)]
    if ignored:
        DDP._set_params_and_buffers_to_ignore_for_model(model, ignored)
    return DDP(
        model,
        process_group=mesh.get_group(),
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=bucket_mb,
        # Gradients become views into the buckets: no copy in and out of them each step.
        gradient_as_bucket_view=True,
    )


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool,
    cpu_offload: bool,
    mp_policy: MixedPrecisionPolicy | None = None,
    blocks_attr: str = BLOCKS_ATTR,
    keep_root_unsharded: bool = False,
) -> nn.Module:
    """FSDP2 ``fully_shard`` each block of ``model.layers``, then the root (in place).

    ``keep_root_unsharded``: the root's parameters stay gathered from its forward to its
    backward, because the loss reads one of them after the forward (loss.chunk_size: the loss
    runs the output layer; loss.py ``ChunkedCrossEntropy``).

    ``mesh`` is 1-D (``dp_shard``: ZeRO over all dp ranks) or 2-D (``dp_replicate, dp_shard``:
    HSDP, sharded within a group and replicated across groups, reduce-scatter then all-reduce).
    Per-block units let FSDP gather one block's parameters at a time and overlap the gather of
    the next with this one's compute; the root unit holds the rest (embeddings, final norm,
    output layer). A model without ``layers`` is one unit (correct, but gathered all at once).
    """
    # Offload pins host memory for fast copies, which needs an accelerator; on a CPU mesh the
    # shards already live in host memory and the policy only changes where the optimiser runs.
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu") if cpu_offload else OffloadPolicy()
    common = dict(mesh=mesh, mp_policy=mp_policy or MixedPrecisionPolicy(), offload_policy=offload)
    # Expert-parallel weights differ between the ranks of an ep group: FSDP2 leaves them alone
    # (expert_parallel.reduce_expert_grads reduces their gradients).
    common["ignored_params"] = {p for p in model.parameters() if hasattr(p, EP_ATTR)} or None
    blocks = blocks_of(model, blocks_attr)
    for i, (_, block) in enumerate(blocks):
        # The last block's parameters would be gathered again at once by the backward that
        # follows: keeping them saves one all-gather for a block's worth of memory (torchtitan).
        last = i == len(blocks) - 1
        fully_shard(block, reshard_after_forward=reshard_after_forward and not last, **common)
    # An explicit reshard_after_forward=True reshards the root too (only FSDP2's automatic
    # default, None, keeps the root gathered): a loss that reads the root's output layer after
    # the forward would otherwise see its shards.
    fully_shard(model, reshard_after_forward=reshard_after_forward and not keep_root_unsharded, **common)
    return model


def apply_replicate(model: nn.Module, mesh: DeviceMesh, *, blocks_attr: str = BLOCKS_ATTR) -> nn.Module:
    """Replicated data parallel over ``mesh`` for a model whose parameters are DTensors (tensor
    parallel): DDP cannot bucket DTensors, so this uses torch's FSDP2-based ``replicate`` (the
    same per-block units and hooks as ``apply_fsdp``, all-reduce instead of reduce-scatter)."""

    # Expert-parallel weights differ between the ranks of an ep group, as in apply_fsdp.
    ignored = {p for p in model.parameters() if hasattr(p, EP_ATTR)} or None
    for _, block in blocks_of(model, blocks_attr):
        replicate(block, mesh=mesh, ignored_params=ignored)
    replicate(model, mesh=mesh, ignored_params=ignored)
    return model


def maybe_no_sync(
    model: nn.Module, *, sync: bool, sync_each_micro_batch: bool = False
) -> contextlib.AbstractContextManager:
    """Skip the gradient reduce of this backward unless ``sync`` (a no-op without DP wrappers).

    ``sync_each_micro_batch`` is the FSDP2 ZeRO-3 policy of the module docstring: reduce-scatter
    every micro-batch (and so never hold an unsharded gradient).
    """
    if sync:
        return contextlib.nullcontext()
    if isinstance(model, DDP):
        return model.no_sync()
    if isinstance(model, FSDPModule) and (not sync_each_micro_batch or _is_replicated(model)):
        return _fsdp_no_sync(model)
    return contextlib.nullcontext()


def _is_replicated(model: nn.Module) -> bool:
    # FSDP2's replicate holds full gradients anyway: like DDP, it syncs on the last micro-batch.

    return isinstance(model, ReplicateModule)


@contextlib.contextmanager
def _fsdp_no_sync(model: FSDPModule):
    model.set_requires_gradient_sync(False)  # no reduce-scatter (nor HSDP all-reduce) this backward
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
