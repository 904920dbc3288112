"""The one place that composes the parallelisms, in a fixed order."""

from __future__ import annotations

import torch
from torch import nn

from paratrain.compiling import apply_compile
from paratrain.config import CommConfig, ConfigError, ParallelConfig, PrecisionConfig
from paratrain.distributed.data_parallel import apply_ddp
from paratrain.distributed.parallel_dims import ParallelDims


def check_supported(dims: ParallelDims) -> None:
    """Refuse, before any process group exists, a layout this version cannot run."""
    for name in ("dp_shard", "tp", "pp"):
        if getattr(dims, name) > 1:
            raise ConfigError(f"parallel.{name} = {getattr(dims, name)} is not available yet; set parallel.{name} = 1")


def parallelize(model: nn.Module, dims: ParallelDims, *, cfg: ParallelConfig, device: torch.device,
                comm: CommConfig | None = None, precision: PrecisionConfig | None = None,
                compile_enabled: bool = False) -> nn.Module:
    """Move ``model`` to ``device`` and apply the parallelisms its layout asks for.

    ``precision`` is for FSDP2's MixedPrecisionPolicy (``paratrain.precision.build_mp_policy``);
    without FSDP2, autocast in the step does the casting.
    """
    check_supported(dims)
    comm = comm or CommConfig()
    model.to(device)
    # Compile after activation checkpointing and before FSDP (torchtitan's order): per block.
    if compile_enabled:
        apply_compile(model, device=device)
    # Replicated data parallel goes last: it wraps whatever the model has become.
    if dims.dp_replicate > 1:
        model = apply_ddp(model, dims.submesh("dp_replicate"), device=device, bucket_mb=comm.bucket_mb)
    return model
