"""Model FLOPs utilisation (MFU): the model's FLOPs per second over the devices' peak.

MFU counts the FLOPs the model needs, not those the hardware did: activation recomputation
and padding are not credited (Chowdhery et al., "PaLM", 2022, appendix B). For a forward and
backward, a weight matrix costs 6 FLOPs per parameter per token (2 forward, 4 backward), and
causal self-attention adds ``12 * n_layer * d_model * seq_len`` per token (the QK^T and AV
products, counted over the whole T x T square as PaLM does, not halved for the mask). The
parameters counted are those that multiply: embeddings are lookups and left out; the output
projection is a matmul and kept (this GPT does not tie it to the input embedding).

Each model's count is its ModelSpec's ``flops_per_token`` (models/); for a user model paratrain
knows nothing of, ``6 * parameters`` per token (sample, for non-token inputs): a lower bound that
ignores attention-like products. The data-sheet peaks are hardware/specs.py's.
"""

from __future__ import annotations

import json
import os

import torch

from paratrain.config import ConfigError, HardwareConfig
from paratrain.hardware.bench_compute import read_compute_json
from paratrain.hardware.specs import datasheet_peak_flops

__all__ = ["datasheet_peak_flops", "mfu", "resolve_peak_flops", "seq_len_of"]


def seq_len_of(inputs) -> int:
    """The sequence length of a micro-batch of token ids (B, T); 1 for anything else."""
    if isinstance(inputs, torch.Tensor) and not inputs.is_floating_point() and inputs.dim() >= 2:
        return int(inputs.shape[-1])
    return 1


def resolve_peak_flops(cfg: HardwareConfig, *, device: torch.device, dtype: str) -> tuple[float | None, str]:
    """The per-device peak FLOP/s for MFU and where it came from; (None, why) when unknown."""
    if cfg.peak_flops > 0:
        return cfg.peak_flops, "hardware.peak_flops"
    if not cfg.compute_bench:
        return None, "set hardware.peak_flops, or hardware.compute_bench to a `paratrain bench compute --json` file"
    path = cfg.compute_bench
    if not os.path.isfile(path):
        raise ConfigError(
            f"hardware.compute_bench = {path!r} not found; run `paratrain bench compute --json {path}` first"
        )
    try:
        with open(path) as f:
            rows, _ = read_compute_json(json.load(f))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"hardware.compute_bench = {path!r} is not a `paratrain bench compute --json` file ({e}); rerun it"
        )
    for device_type, row_dtype, flops in rows:
        if row_dtype == dtype and device_type == device.type:
            return flops, f"bench compute ({path})"
    have = ", ".join(f"{device_type}/{row_dtype}" for device_type, row_dtype, _ in rows)
    raise ConfigError(
        f"hardware.compute_bench = {path!r} has no matmul figure for {device.type}/{dtype} (it has {have});"
        f" run `paratrain bench compute --dtype {dtype} --json {path}` on this device"
    )


def mfu(*, flops: float, seconds: float, peak_flops_per_device: float, devices: int) -> float:
    return flops / (seconds * peak_flops_per_device * devices)
