"""The explicit training step: micro-batch loop, exact loss normalisation, sync, clip, step.

The differentiated loss is ``sum of item losses / global item count``, the count gathered over
all micro-batches and data-parallel ranks *before* the first backward. Averaging micro-batch
means instead weights a micro-batch with few items as much as one with many: that was the
gradient-accumulation bug several frameworks shipped in 2024 (see transformers#34191).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from paratrain.config import ConfigError
from paratrain.distributed.data_parallel import maybe_no_sync
from paratrain.distributed.grad_norm import clip_grad_norm_
from paratrain.distributed.tensor_parallel import maybe_loss_parallel
from paratrain.loss import Loss
from paratrain.precision import Precision


@dataclass
class StepResult:
    loss: float  # mean over the global batch's items
    items: int  # global count of target items
    grad_norm: float
    tokens: int  # input tokens of the global batch (samples, for non-token inputs)


def to_device(obj, device: torch.device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def count_tokens(inputs) -> int:
    """Token ids count one each; any other input counts one per sample."""
    if isinstance(inputs, torch.Tensor):
        return inputs.numel() if not inputs.is_floating_point() else inputs.shape[0]
    return len(inputs)


def count_global_items(
    batches: list[tuple], *, loss_fn: Loss, dp_group: dist.ProcessGroup | None
) -> tuple[int, int, int]:
    """Target items and input tokens of the whole global batch, and this rank's items, from the
    targets alone, before any backward. Counted on the CPU so this small all-reduce never waits
    for the device."""
    local_items = torch.stack([loss_fn.count(t) for _, t in batches]).sum()
    counts = torch.stack(
        [local_items, torch.tensor(float(sum(count_tokens(x) for x, _ in batches)), dtype=torch.float64)]
    )
    if dp_group is not None:
        dist.all_reduce(counts, group=dp_group)
    items, tokens = int(counts[0].item()), int(counts[1].item())
    if items == 0:
        raise ConfigError("a global batch has no target items (every target is loss.ignore_index); check the data")
    return items, tokens, int(local_items.item())


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[tuple],
    *,
    loss_fn: Loss,
    dp: int,
    dp_group: dist.ProcessGroup | None,
    grad_clip: float,
    device: torch.device,
    precision: Precision | None = None,
    loss_parallel: bool = False,
    sync_each_micro_batch: bool = False,
    after_backward: Callable[[int], None] | None = None,
) -> StepResult:
    """One optimiser step over this rank's micro-batches ``[(input, target), ...]`` (on CPU).

    ``loss_parallel``: the logits are vocabulary-sharded DTensors (tensor parallel), the loss runs
    under torch's loss_parallel. ``sync_each_micro_batch``: the FSDP2 ZeRO-3 sync policy (see
    distributed/data_parallel.py); otherwise gradients are reduced on the last micro-batch only.
    Ranks of one tensor-parallel group get the same batches and compute the same loss; the loss
    is reduced over ``dp_group`` only.
    """
    items, tokens, _ = count_global_items(batches, loss_fn=loss_fn, dp_group=dp_group)
    # DDP (and FSDP) average gradients over the dp ranks; multiplying by dp turns that mean back
    # into the sum over ranks, so the gradient is d(global sum)/d(theta) / items. dp is a power
    # of two in practice, which makes the round trip exact in floating point.
    scale = dp / items
    precision = precision or Precision(device=device)  # --- mixed precision (paratrain.precision)

    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    returned = torch.zeros((), device=device, dtype=torch.float64)
    last = len(batches) - 1
    for k, (inputs, target) in enumerate(batches):
        inputs, target = to_device(inputs, device), to_device(target, device)
        # Gradients are reduced once, in the backward of the last micro-batch (DDP, ZeRO-2-like
        # FSDP), or every micro-batch into 1/N shards (ZeRO-3-like FSDP: sync_each_micro_batch).
        with (
            maybe_no_sync(model, sync=k == last, sync_each_micro_batch=sync_each_micro_batch),
            maybe_loss_parallel(loss_parallel),
        ):
            with precision.autocast():  # forward under autocast; backward follows its dtypes
                s, c = loss_fn(model(inputs), target)
            precision.scale(s * scale).backward()  # fp16: times the GradScaler's loss scale
        if isinstance(s, DTensor):  # loss_parallel: a replicated scalar DTensor
            s = s.full_tensor()
        if after_backward is not None:  # e.g. the gradient-noise probe of batch.adaptive (adaptive_batch.py)
            after_backward(k)
        loss_sum += s.detach().double()
        returned += torch.as_tensor(c, device=device, dtype=torch.float64)

    precision.unscale_(optimizer)  # fp16: back to true gradients before clipping
    # The norm of the whole model's gradient on every rank, also when gradients are sharded.
    grad_norm = clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else math.inf)
    precision.step(optimizer)  # fp16: skipped when the gradients overflowed
    optimizer.zero_grad(set_to_none=True)

    # One reduce and one host read for the logged loss and the check of the loss's own counts;
    # checked on the global sums, every rank raises together instead of one leaving the others.
    totals = torch.stack([loss_sum, returned])
    if dp_group is not None:
        dist.all_reduce(totals, group=dp_group)
    loss_total, returned_total = totals.tolist()
    if int(returned_total) != items:
        raise ConfigError(
            f"the loss returned item count {int(returned_total)} but counting the targets gave"
            f" {items}; give the loss function a count(target) attribute that matches"
        )
    return StepResult(loss_total / items, items, float(grad_norm), tokens)
