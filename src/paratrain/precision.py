"""Mixed precision: autocast (or FSDP2's parameter dtype) with fp32 master weights.

The parameters, their gradients and the optimiser state stay fp32 ("master weights"); the
matrix multiplies run in the compute dtype. Without FSDP2 that is ``torch.autocast`` around the
forward (the backward follows the forward's dtypes); under FSDP2 it is
``MixedPrecisionPolicy(param_dtype=...)``: the all-gathered parameters are cast once per
step, and the gradients are reduced in ``reduce_dtype`` (fp32 unless asked). torchtitan
chooses the same way (autocast only where FSDP does not cast).

fp16 has a narrow exponent range, so the loss is multiplied by a scale before backward
(``torch.amp.GradScaler``, Micikevicius et al., "Mixed Precision Training", ICLR 2018); a step
whose gradients overflow is skipped and the scale halved. The trainer logs ``loss_scale`` and
the running count ``skipped_steps``. With DDP every rank sees the same reduced gradients, so
every rank skips the same steps. bf16 has fp32's exponent range and needs no scaler.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from paratrain.config import ConfigError, PrecisionConfig

# THE dtype table: config names to torch dtypes (bytes: DTYPES[name].itemsize), for the step,
# the benchmarks and the planner.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_precision(
    cfg: PrecisionConfig, *, dp_shard: int = 1, tp: int = 1, pp: int = 1, compression: str = "none"
) -> None:
    """Refuse, before any process starts, a precision the layout cannot run."""
    if compression in ("bf16", "fp16") and cfg.reduce_dtype not in ("fp32", compression):
        raise ConfigError(
            f"precision.reduce_dtype = {cfg.reduce_dtype!r} contradicts comm.compression = {compression!r};"
            " set one of them only"
        )
    if cfg.dtype == "fp16" and (dp_shard > 1 or tp > 1 or pp > 1):
        # GradScaler's unscale and inf check assume plain local gradients; sharded (DTensor)
        # gradients and pipeline stages would need a scaler that reduces the inf flag across
        # shards/stages, which torch only offers for FSDP1 (ShardedGradScaler).
        raise ConfigError(
            "precision.dtype = 'fp16' needs a gradient scaler, which paratrain supports only with plain"
            " data parallelism; use precision.dtype = 'bf16' with dp_shard/tp/pp > 1"
        )


def check_device_supports(cfg: PrecisionConfig, device: torch.device) -> None:
    """Refuse a dtype the device cannot compute in (checked in each process, on its device)."""
    if cfg.dtype == "fp32":
        return
    dtype = DTYPES[cfg.dtype]
    if not torch.amp.is_autocast_available(device.type):
        raise ConfigError(
            f"precision.dtype = {cfg.dtype!r}: autocast is not available on {device.type}; use precision.dtype = 'fp32'"
        )
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"precision.dtype = 'bf16' is not supported by {torch.cuda.get_device_name(device)}"
            " (needs compute capability >= 8.0); use precision.dtype = 'fp16'"
        )
    # Ask autocast itself: a tiny matmul under it must come out in the requested dtype.
    try:
        a = torch.ones(2, 2, device=device)
        with torch.autocast(device.type, dtype=dtype):
            out = a @ a
    except (RuntimeError, AssertionError) as e:
        raise ConfigError(
            f"precision.dtype = {cfg.dtype!r} is not supported on {device.type} by torch "
            f"{torch.__version__} ({str(e).splitlines()[0]}); use precision.dtype = 'fp32' or 'bf16'"
        )
    if out.dtype != dtype:
        raise ConfigError(
            f"precision.dtype = {cfg.dtype!r}: autocast on {device.type} computed in {out.dtype};"
            " use precision.dtype = 'fp32' or 'bf16'"
        )


def maybe_autocast(dtype: str, device: torch.device, *, enabled: bool = True) -> contextlib.AbstractContextManager:
    """Autocast to ``dtype`` on ``device``; does nothing for fp32 or when not ``enabled``."""
    if dtype == "fp32" or not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[dtype])


def build_mp_policy(cfg: PrecisionConfig, *, compression: str = "none"):
    """FSDP2's MixedPrecisionPolicy for ``cfg`` (None for fp32 with fp32 reduce: FSDP's default).

    ``compression`` is ``comm.compression``: "bf16"/"fp16" lower the gradient reduce to that
    dtype, the FSDP2 form of DDP's compression hooks.
    """

    reduce = cfg.reduce_dtype
    if compression in ("bf16", "fp16"):
        reduce = compression
    if cfg.dtype == "fp32" and reduce == "fp32":
        return None
    # Here, not at the top: FSDP2 imports DTensor (about 1.5 s), which the launcher's preflight,
    # reading check_precision and DTYPES, must not pay (tests/e2e/test_startup.py).
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(
        param_dtype=DTYPES[cfg.dtype], reduce_dtype=DTYPES[reduce], output_dtype=None, cast_forward_inputs=True
    )


@dataclass
class Precision:
    """The step's view of mixed precision: an autocast context and, for fp16, a GradScaler."""

    dtype: str = "fp32"
    device: torch.device = torch.device("cpu")
    autocast_enabled: bool = True  # False where FSDP2's policy casts the parameters instead
    scaler: torch.amp.GradScaler | None = None
    skipped_steps: int = 0

    def autocast(self) -> contextlib.AbstractContextManager:
        return maybe_autocast(self.dtype, self.device, enabled=self.autocast_enabled)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaler is None else self.scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """optimizer.step(), through the scaler for fp16 (which skips a step with inf/nan grads)."""
        if self.scaler is None:
            optimizer.step()
            return
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        # The scaler lowers its scale exactly when it found inf/nan and skipped the step.
        if self.scaler.get_scale() < before:
            self.skipped_steps += 1

    def metrics(self) -> dict:
        if self.scaler is None:
            return {}
        return {"loss_scale": self.scaler.get_scale(), "skipped_steps": self.skipped_steps}


def build_precision(cfg: PrecisionConfig, *, device: torch.device, fsdp_enabled: bool = False) -> Precision:
    check_device_supports(cfg, device)
    scaler = torch.amp.GradScaler(device.type, init_scale=cfg.fp16_init_scale) if cfg.dtype == "fp16" else None
    return Precision(cfg.dtype, device, autocast_enabled=not fsdp_enabled, scaler=scaler)
