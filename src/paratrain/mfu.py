"""Model FLOPs utilisation (MFU): the model's FLOPs per second over the devices' peak.

MFU counts the FLOPs the model needs, not those the hardware did: activation recomputation
and padding are not credited (Chowdhery et al., "PaLM", 2022, appendix B). For a forward and
backward, a weight matrix costs 6 FLOPs per parameter per token (2 forward, 4 backward), and
causal self-attention adds ``12 * n_layer * d_model * seq_len`` per token (the QK^T and AV
products, counted over the whole T x T square as PaLM does, not halved for the mask). The
parameters counted are those that multiply: embeddings are lookups and left out; the output
projection is a matmul and kept (this GPT does not tie it to the input embedding).

For a user model paratrain knows nothing of, it uses ``6 * parameters`` per token (sample,
for non-token inputs): a lower bound that ignores attention-like products.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch
from torch import nn

from paratrain.config import ConfigError, HardwareConfig
from paratrain.models.gpt import GPT, GPT_SPEC, gpt_flops_per_token
from paratrain.models.spec import default_spec

__all__ = [
    "build_flops_per_token",
    "datasheet_peak_flops",
    "gpt_flops_per_token",
    "mfu",
    "resolve_peak_flops",
    "seq_len_of",
]

# Dense (no 2:4 sparsity) bf16 tensor-core peaks per device from NVIDIA's data sheets, the
# denominator of MFU in the PaLM paper, torchtitan (utils.get_peak_flops) and Megatron: a
# measured matmul peak is lower and flatters the MFU. Matched on torch.cuda.get_device_name(),
# the more specific names first.
DATASHEET_BF16_FLOPS = [
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("GH200", 989e12),
    ("H100", 989e12),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("H200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("RTX 4090", 165e12),  # fp32 accumulation
]


def build_flops_per_token(model: nn.Module) -> Callable[[int], float]:
    """``f(seq_len) -> training FLOPs per token`` for ``model`` (call before any parallel wrapping):
    its ModelSpec's rule (models/), 6 x parameters for a model paratrain does not know."""
    spec = GPT_SPEC if isinstance(model, GPT) else default_spec(type(model).__name__, lambda: model)
    return spec.flops_per_token(model)


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
            data = json.load(f)
        rows = data["matmul"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"hardware.compute_bench = {path!r} is not a `paratrain bench compute --json` file ({e}); rerun it"
        )
    for row in rows:
        if row.get("dtype") == dtype and row.get("device_type") == device.type:
            return float(row["flops_per_s"]), f"bench compute ({path})"
    have = ", ".join(f"{r.get('device_type')}/{r.get('dtype')}" for r in rows)
    raise ConfigError(
        f"hardware.compute_bench = {path!r} has no matmul figure for {device.type}/{dtype} (it has {have});"
        f" run `paratrain bench compute --dtype {dtype} --json {path}` on this device"
    )


def datasheet_peak_flops(device_name: str, dtype: str = "bf16") -> float | None:
    """The data-sheet dense peak of a device by its name (bf16/fp16 tensor cores); None if unknown."""
    if dtype not in ("bf16", "fp16"):
        return None
    return next((flops for key, flops in DATASHEET_BF16_FLOPS if key in device_name), None)


def mfu(*, flops: float, seconds: float, peak_flops_per_device: float, devices: int) -> float:
    return flops / (seconds * peak_flops_per_device * devices)
