"""Replicated data parallelism (DDP).

Gradient sync policy: DDP all-reduces in buckets during the backward of the last micro-batch
only; the earlier micro-batches run under ``no_sync`` and accumulate locally, so a step costs
one gradient all-reduce whatever the accumulation (as nanoGPT explains, syncing every
micro-batch would multiply the communication by ``accum_steps`` for nothing).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel as DDP


def apply_ddp(model: nn.Module, mesh: DeviceMesh, *, device: torch.device, bucket_mb: float) -> DDP:
    """Wrap ``model`` in DDP over ``mesh`` (a 1-D data-parallel mesh)."""
    return DDP(
        model,
        process_group=mesh.get_group(),
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=bucket_mb,
        # Gradients become views into the buckets: no copy in and out of them each step.
        gradient_as_bucket_view=True,
    )


def maybe_no_sync(model: nn.Module, *, sync: bool) -> contextlib.AbstractContextManager:
    """Skip the gradient reduce of this backward unless ``sync`` (a no-op without DDP)."""
    if sync or not isinstance(model, DDP):
        return contextlib.nullcontext()
    return model.no_sync()
