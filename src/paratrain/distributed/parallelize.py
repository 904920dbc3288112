"""The one place that composes the parallelisms, in a fixed order."""

from __future__ import annotations

import torch
from torch import nn

from paratrain.config import ConfigError, ParallelConfig
from paratrain.distributed.data_parallel import apply_ddp
from paratrain.distributed.parallel_dims import ParallelDims
from paratrain.distributed.pipeline_parallel import apply_pp, is_pipeline_stage


def check_supported(dims: ParallelDims) -> None:
    """Refuse, before any process group exists, a layout this version cannot run."""
    for name in ("dp_shard", "tp"):
        if getattr(dims, name) > 1:
            raise ConfigError(f"parallel.{name} = {getattr(dims, name)} is not available yet; set parallel.{name} = 1")


def parallelize(model: nn.Module, dims: ParallelDims, *, cfg: ParallelConfig, device: torch.device) -> nn.Module:
    """Move ``model`` to ``device`` and apply the parallelisms its layout asks for."""
    check_supported(dims)
    # Pipeline parallel splits first: this rank keeps its stage(s), and each stage is then
    # parallelised like a whole model by the rest of this function (torchtitan's order).
    if dims.pp > 1 and not is_pipeline_stage(model):
        return apply_pp(model, dims.submesh("pp"), cfg=cfg, device=device,
                        parallelize_stage=lambda stage: parallelize(stage, dims, cfg=cfg, device=device))
    model.to(device)
    # Replicated data parallel goes last: it wraps whatever the model has become.
    if dims.dp_replicate > 1:
        model = apply_ddp(model, dims.submesh("dp_replicate"), device=device, bucket_mb=cfg.ddp_bucket_mb)
    return model
