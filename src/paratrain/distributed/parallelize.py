"""The one place that composes the parallelisms, in a fixed order."""

from __future__ import annotations

import torch
from torch import nn

from paratrain.config import ConfigError, ParallelConfig
from paratrain.distributed.data_parallel import apply_ddp
from paratrain.distributed.parallel_dims import ParallelDims


def check_supported(dims: ParallelDims) -> None:
    """Refuse, before any process group exists, a layout this version cannot run."""
    for name in ("dp_shard", "tp", "pp"):
        if getattr(dims, name) > 1:
            raise ConfigError(f"parallel.{name} = {getattr(dims, name)} is not available yet; set parallel.{name} = 1")


def parallelize(model: nn.Module, dims: ParallelDims, *, cfg: ParallelConfig, device: torch.device) -> nn.Module:
    """Move ``model`` to ``device`` and apply the parallelisms its layout asks for."""
    check_supported(dims)
    # Only move what is elsewhere: Module.to cannot swap the fake tensors of the memory
    # estimator (paratrain.find_batch) in torch 2.13, and they already sit on the device.
    if any(t.device != device for t in [*model.parameters(), *model.buffers()]):
        model.to(device)
    # Replicated data parallel goes last: it wraps whatever the model has become.
    if dims.dp_replicate > 1:
        model = apply_ddp(model, dims.submesh("dp_replicate"), device=device, bucket_mb=cfg.ddp_bucket_mb)
    return model
