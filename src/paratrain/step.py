"""THE training step (plain and pipeline share its finish) and the eval step.

``train_step(model, optimizer, batches, ctx)``: count the global items, run forward/backward
(the plain micro-batch loop here, or the pipeline schedule of distributed/pipeline_parallel.py),
then one finish for both: launch the reduce of ``[loss_sum, returned_count, stop_flag]`` over the
pipeline, data-parallel and tensor-parallel ranks without waiting for it, unscale (fp16), clip by
the whole model's gradient norm, optimiser step, then wait for the reduce and check the loss's
own count on the reduced numbers, so every rank raises the same error together instead of one
rank leaving the others in a collective. The SIGTERM stop flag (preemption.py) rides that reduce:
agreeing on it costs no collective of its own.

On a plain data path (``StepContext.items_per_sample``: every sample has that many targets, none
ignored) the global count is arithmetic and the count needs no collective: the default step then
has the same collectives as a hand-written DDP loop, the gradient all-reduce and one reduce of the
loss, and that one overlaps the optimiser step (docs/overhead.md).

The differentiated loss is ``sum of item losses / global item count``, the count gathered over
all micro-batches and data-parallel ranks *before* the first backward. Averaging micro-batch
means instead weights a micro-batch with few items as much as one with many: that was the
gradient-accumulation bug several frameworks shipped in 2024 (see transformers#34191).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from paratrain.config import ConfigError
from paratrain.data.packing import attention_square, count_input_tokens, split_packed
from paratrain.distributed.context_parallel import (
    AutoAttention,
    auto_attentions,
    maybe_auto_decision,
    one_document_rows,
    shard_sequence,
)
from paratrain.distributed.data_parallel import maybe_no_sync
from paratrain.distributed.expert_parallel import reduce_expert_grads
from paratrain.distributed.grad_norm import clip_grad_norm_
from paratrain.distributed.pipeline_parallel import (
    PipelineModel,
    pipeline_forward,
    pipeline_forward_backward,
    pp_microbatches,
)
from paratrain.distributed.tensor_parallel import maybe_loss_parallel
from paratrain.loss import Loss, RouterTotals
from paratrain.precision import Precision


@dataclass(frozen=True)
class StepContext:
    """What a step needs besides the model, optimiser and batches (the same every step).

    ``loss_parallel``: the logits are vocabulary-sharded DTensors (tensor parallel), the loss runs
    under torch's loss_parallel. ``sync_each_micro_batch``: the FSDP2 ZeRO-3 sync policy (see
    distributed/data_parallel.py); otherwise gradients are reduced on the last micro-batch only.
    Ranks of one tensor-parallel or pipeline group get the same batches; the loss is reduced over
    ``loss_group``, or ``dp_group`` (and the pipeline group) when that is None.
    """

    loss_fn: Loss
    device: torch.device
    dp: int = 1
    dp_group: dist.ProcessGroup | None = None
    grad_clip: float = 0.0
    precision: Precision | None = None
    loss_parallel: bool = False
    sync_each_micro_batch: bool = False
    # The one reduce of [loss sum, item count, stop flag]: pp x dp flattened (ParallelDims.group
    # ("pp_dp")), or the whole world when tp > 1, so that a SIGTERM reaching only a tensor-parallel
    # peer still stops every rank at the same step. None: the pipeline group (if any) then
    # dp_group, two reduces with the same sums.
    loss_group: dist.ProcessGroup | None = None
    # False on tensor-parallel ranks other than the first when loss_group spans tp: their loss is
    # a copy of the first one's, so they add zeros (exact) and only their stop flag counts.
    adds_loss: bool = True
    # Mixture-of-experts layers (loss.router_layers of the model): their auxiliary loss joins the
    # differentiated loss, divided by the global sequence count; their stats are logged.
    router_layers: tuple[nn.Module, ...] = ()
    # Under pipeline parallel (a stage holds some of them): their positions among the whole
    # model's router layers, and (all router layers, experts) (loss.RouterTotals).
    router_slots: tuple[int, ...] | None = None
    router_shape: tuple[int, int] | None = None
    # Context parallel (distributed/context_parallel.py): this rank keeps its part (cp_rank of cp)
    # of every row of the micro-batches it loads, the same ones as its cp peers.
    cp: int = 1
    cp_rank: int = 0
    # The data path's static count (data/datasets.py static_items_per_sample): every sample has
    # exactly this many target items, so the global count is items_per_sample x the global batch's
    # rows, known without the count's all-reduce. None: counted and reduced (masked or packed
    # data, user losses). The reduced count of the loss itself is checked against it every step.
    items_per_sample: int | None = None

    @property
    def amp(self) -> Precision:
        return self.precision or Precision(device=self.device)


@dataclass
class StepResult:
    loss: float  # mean over the global batch's items
    items: int  # global count of target items
    grad_norm: float
    tokens: int  # input tokens of the global batch (samples, for non-token inputs)
    stop: bool = False  # some rank's stop flag was set (the same on every rank: read from the step's reduce)
    # Packed documents (data/packing.py): the sum of their squared lengths, what their attention
    # covers; None for other inputs, whose rows attend over their whole length.
    attention_square: int | None = None
    # Mixture of experts (StepContext.router_layers): the auxiliary loss (mean over the global
    # batch's sequences, weight included) and the global tokens per expert, (layers, experts).
    aux_loss: float | None = None
    tokens_per_expert: list[list[int]] | None = None


def to_device(obj, device: torch.device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def count_tokens(inputs) -> int:
    """Token ids count one each (packed documents: their real tokens, not the padding); any other
    input counts one per sample."""
    packed = count_input_tokens(inputs)
    if packed is not None:
        return packed
    if isinstance(inputs, torch.Tensor):
        return inputs.numel() if not inputs.is_floating_point() else inputs.shape[0]
    return len(inputs)


def count_sequences(inputs) -> int:
    """Rows of a micro-batch (a packed row of documents counts one): what a sequence-wise
    auxiliary loss is averaged over."""
    return inputs.shape[0] if isinstance(inputs, torch.Tensor) else len(inputs)


def count_global_items(
    batches: list[tuple],
    *,
    loss_fn: Loss,
    dp_group: dist.ProcessGroup | None,
    dp: int = 1,
    items_per_sample: int | None = None,
) -> tuple[int, int, int | None, int]:
    """Target items, input tokens, packed documents' attention square (None when the inputs
    are not packed) and sequences of the whole global batch, from the targets alone, before any
    backward. Counted on the CPU so this small all-reduce never waits for the device.

    ``items_per_sample`` (a static count declared by the data path): no all-reduce at all. Every
    data-parallel rank holds the same number of rows of the same shape (the sampler's equal rank
    slices, collated), so the global figures are this rank's times ``dp``: the same numbers on
    every rank, which the step's :func:`check_count` compares with the loss's own reduced count.
    """
    if items_per_sample is not None:
        rows = sum(count_sequences(x) for x, _ in batches)
        tokens = sum(count_tokens(x) for x, _ in batches)
        if rows == 0:
            raise ConfigError("a global batch has no target items; check the data")
        return items_per_sample * rows * dp, tokens * dp, None, rows * dp
    local_items = torch.stack([loss_fn.count(t) for _, t in batches]).sum()
    squares = [attention_square(x) for x, _ in batches]
    local = [
        float(sum(count_tokens(x) for x, _ in batches)),
        float(sum(q or 0 for q in squares)),
        float(sum(count_sequences(x) for x, _ in batches)),
    ]
    counts = torch.cat([local_items.reshape(1), torch.tensor(local, dtype=torch.float64)])
    if dp_group is not None:
        dist.all_reduce(counts, group=dp_group)
    items, tokens, square, sequences = (int(c) for c in counts.tolist())
    if items == 0:
        raise ConfigError("a global batch has no target items (every target is loss.ignore_index); check the data")
    return items, tokens, (square if squares[0] is not None else None), sequences


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[tuple],
    ctx: StepContext,
    *,
    after_backward: Callable[[int], None] | None = None,
    stop_flag: Callable[[], bool] | None = None,
) -> StepResult:
    """One optimiser step over this rank's micro-batches ``[(input, target), ...]`` (on CPU).

    ``after_backward(k)`` runs after micro-batch k's backward (the gradient-noise probe of
    batch.adaptive, batch/adaptive.py; not with a pipeline). ``stop_flag()`` is read just before
    the step's reduce (this rank got SIGTERM: preemption.py); ``StepResult.stop`` says whether
    any rank's was set.
    """
    items, tokens, square, sequences = count_global_items(
        batches, loss_fn=ctx.loss_fn, dp_group=ctx.dp_group, dp=ctx.dp, items_per_sample=ctx.items_per_sample
    )
    autos = auto_attentions(model) if ctx.cp > 1 else []  # cp_attention = "auto": decided here, per micro-batch
    decisions = cp_decisions(model, batches) if autos else None
    batches = [cp_local_batch(x, t, ctx) for x, t in batches]  # context parallel: after the count
    # DDP (and FSDP) average gradients over the dp ranks; multiplying by dp turns that mean back
    # into the sum over ranks, so the gradient is d(global sum)/d(theta) / items. dp is a power
    # of two in practice, which makes the round trip exact in floating point. With context
    # parallel FSDP2 averages over the dp x cp ranks (each holding part of the rows): the same.
    scale = ctx.dp * ctx.cp / items
    # Mixture of experts: under context parallel each cp rank's auxiliary loss is its tokens' share
    # of its sequences' (models/gpt/moe.py sequence_balance_loss), averaged over dp x cp like the
    # language-model loss.
    router = RouterTotals(
        ctx.router_layers,
        aux_scale=ctx.dp * ctx.cp / sequences,
        device=ctx.device,
        slots=ctx.router_slots,
        shape=ctx.router_shape,
    )
    if isinstance(model, PipelineModel):  # the schedule runs forward and backward
        with maybe_auto_decision(autos, decisions):
            loss_sum, returned = pipeline_forward_backward(
                model,
                batches,
                scale=scale,
                loss_fn=ctx.loss_fn,
                device=ctx.device,
                autocast=ctx.amp.autocast(),
                split_inputs=stage_inputs,
                router=router,
            )
        pp_group = model.pp_group
    else:
        loss_sum, returned = forward_backward(
            model,
            batches,
            ctx,
            scale=scale,
            after_backward=after_backward,
            router=router,
            autos=autos,
            decisions=decisions,
        )
        pp_group = None
    # The totals are final once the backward is done: their reduce is launched now and waited for
    # after the optimiser step, which it overlaps (with DDP the ranks have just met in the
    # gradient all-reduce, so it hardly waits for anyone either). The stop flag is read here.
    stop = bool(stop_flag()) if stop_flag is not None else False
    pending = launch_totals(loss_sum, returned, ctx=ctx, pp_group=pp_group, stop=stop, extra=router.totals())
    grad_norm = finish_step(model, optimizer, ctx, pp_group=pp_group)
    totals = pending.read()
    loss_total, returned_total, stops = totals[:3]
    check_count(returned_total, items, static=ctx.items_per_sample is not None)
    aux_loss, tokens_per_expert = router.read(totals[3:], sequences=sequences)
    # The norm is read only now, after the reduce's read has waited for the device: on a GPU that
    # wait is the step's only one for plain-tensor models (the norm's read used to wait before the
    # optimiser step was queued; with clipping on under FSDP, TP or pipelining the clip
    # coefficient is still read in distributed/grad_norm.py); this one copies a value already
    # computed. The same tensor as before: exact.
    # (One joint read via torch.cat adds three tensor ops and showed no gain: preempt_overhead.py.)
    return StepResult(
        loss_total / items, items, float(grad_norm), tokens, stops > 0, square, aux_loss, tokens_per_expert
    )


def forward_backward(
    model: nn.Module,
    batches: list[tuple],
    ctx: StepContext,
    *,
    scale: float,
    after_backward=None,
    router: RouterTotals | None = None,
    autos: Sequence[AutoAttention] = (),
    decisions: list[bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain micro-batch loop: this rank's ``(loss_sum, returned_count)`` as float64 tensors.

    ``autos``: the model's "auto" context-parallel attentions, given each micro-batch's decision
    (``decisions``, :func:`cp_decisions`) over its forward and backward."""
    precision = ctx.amp  # --- mixed precision (paratrain.precision)
    loss_sum = torch.zeros((), device=ctx.device, dtype=torch.float64)
    returned = torch.zeros((), device=ctx.device, dtype=torch.float64)
    last = len(batches) - 1
    for k, (inputs, target) in enumerate(batches):
        inputs, target = to_device(inputs, ctx.device), to_device(target, ctx.device)
        # Gradients are reduced once, in the backward of the last micro-batch (DDP, ZeRO-2-like
        # FSDP), or every micro-batch into 1/N shards (ZeRO-3-like FSDP: sync_each_micro_batch).
        with (
            maybe_no_sync(model, sync=k == last, sync_each_micro_batch=ctx.sync_each_micro_batch),
            maybe_loss_parallel(ctx.loss_parallel),
            maybe_auto_decision(autos, decisions[k] if decisions else None),
        ):
            with precision.autocast():  # forward under autocast; backward follows its dtypes
                s, c = ctx.loss_fn(model(inputs), target)
            aux = router.take() if router is not None else None
            if aux is not None and isinstance(s, DTensor):
                # loss_parallel: the loss is a replicated DTensor; the auxiliary loss of MoE layers
                # (replicated over tp) a plain tensor, the same on every tp rank.
                aux = DTensor.from_local(aux, s.device_mesh, s.placements, run_check=False)
            objective = s * scale if aux is None else s * scale + aux
            precision.scale(objective).backward()  # fp16: times the GradScaler's loss scale
        if router is not None:
            router.clear()
        if after_backward is not None:
            after_backward(k)
        loss_sum += _plain(s).detach().double()
        returned += torch.as_tensor(c, device=ctx.device, dtype=torch.float64)
    return loss_sum, returned


def finish_step(model: nn.Module, optimizer: torch.optim.Optimizer, ctx: StepContext, *, pp_group) -> torch.Tensor:
    """Unscale (fp16), clip by the whole model's gradient norm, step, zero the gradients; returns
    the norm as a 0-dim tensor (not read on the host here: the step reads it after its reduce)."""
    precision = ctx.amp
    reduce_expert_grads(model.parameters())  # expert parallel (a no-op without): before the norm
    precision.unscale_(optimizer)  # fp16: back to true gradients before clipping
    # The norm of the whole model's gradient on every rank, also when gradients are sharded or
    # the model is split into pipeline stages.
    grad_norm = clip_grad_norm_(model.parameters(), ctx.grad_clip if ctx.grad_clip > 0 else math.inf, pp_group=pp_group)
    precision.step(optimizer)  # fp16: skipped when the gradients overflowed
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


@dataclass
class PendingTotals:
    """A launched reduce of the step's totals: :meth:`read` waits for it and reads it on the host."""

    totals: torch.Tensor
    work: dist.Work | None = None

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.totals

    def read(self) -> list[float]:
        return self.wait().tolist()


def launch_totals(
    loss_sum: torch.Tensor,
    returned: torch.Tensor,
    *,
    ctx: StepContext,
    pp_group,
    stop: bool = False,
    extra: torch.Tensor | None = None,
) -> PendingTotals:
    """``[loss_sum, returned_count, stop]`` summed over the step's ranks: one tensor, one reduce,
    launched with ``async_op`` and left on the device for the caller's one host read (then
    :func:`check_count`).

    (Under pipeline parallel only the last stage has the loss, and with tensor parallel only the
    first tp rank adds it: the others contribute zeros.) The stop flag is a SUM of 0/1s, as good
    as a MAX: any rank > 0 stops every rank, after the same step. Every rank launches it at the
    same point of the step, before the same collectives of the optimiser step (the gradient
    norm's under FSDP/TP/pipelining, expert parallel's gradient reduce), so the collectives are
    issued in one order on all ranks, as an asynchronous collective requires.
    """
    if not ctx.adds_loss:
        loss_sum, returned = torch.zeros_like(loss_sum), torch.zeros_like(returned)
    totals = torch.stack([loss_sum, returned, torch.full_like(returned, float(stop))])
    if extra is not None:  # more float64 sums (the routers' stats) in the same reduce
        totals = torch.cat([totals, extra if ctx.adds_loss else torch.zeros_like(extra)])
    groups = [
        g for g in ([ctx.loss_group] if ctx.loss_group is not None else [pp_group, ctx.dp_group]) if g is not None
    ]
    for group in groups[:-1]:  # two groups (no loss_group): the first reduce before the second
        dist.all_reduce(totals, group=group)
    work = dist.all_reduce(totals, group=groups[-1], async_op=True) if groups else None
    return PendingTotals(totals, work)


def reduce_totals(
    loss_sum: torch.Tensor,
    returned: torch.Tensor,
    *,
    ctx: StepContext,
    pp_group,
    stop: bool = False,
    extra: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`launch_totals`, waited for (the eval step)."""
    return launch_totals(loss_sum, returned, ctx=ctx, pp_group=pp_group, stop=stop, extra=extra).wait()


def check_count(returned_total: float, items: int, *, static: bool = False) -> None:
    """The loss's own item count against the pre-backward ``items``, on the reduced numbers, so
    every rank raises the same error together. ``static``: ``items`` came from the data path's
    declared count (StepContext.items_per_sample), not from counting the targets."""
    if int(returned_total) == items:
        return
    if static:
        raise ConfigError(
            f"the loss returned item count {int(returned_total)} but the dataset's items_per_sample gave"
            f" {items}; a dataset that declares items_per_sample must have exactly that many targets per sample,"
            " none of them loss.ignore_index: fix or remove its items_per_sample"
        )
    raise ConfigError(
        f"the loss returned item count {int(returned_total)} but counting the targets gave"
        f" {items}; give the loss function a count(target) attribute that matches"
    )


def cp_local_batch(inputs, target, ctx: StepContext):
    """The one place a micro-batch is cut for context parallel (plain and pipeline steps, eval):
    this rank's two chunks (distributed/context_parallel.py, head-tail) of every row's token ids,
    position ids and targets, after the step counted the whole rows' items. The input becomes
    packed (B, 2, T/cp) (data/packing.py) with the rows' global positions, so the position
    embedding and the attention's masks see where each token really is; plain rows get positions
    0..T-1 (one document: causal)."""
    if ctx.cp == 1:
        return inputs, target
    ids, positions = split_packed(inputs)
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dim() != 2:
        raise ConfigError("parallel.cp > 1 needs token-id inputs (batch, sequence); set parallel.cp = 1")
    t = ids.shape[-1]
    if t % (2 * ctx.cp):
        raise ConfigError(
            f"parallel.cp = {ctx.cp} splits each row into {2 * ctx.cp} chunks but a row has {t} tokens;"
            f" use rows of a multiple of {2 * ctx.cp} tokens (data.args.block_size)"
        )
    if positions is None:
        positions = torch.arange(t, device=ids.device).expand_as(ids)
    packed = torch.stack([ids, positions], dim=1)
    return (
        shard_sequence(packed, dim=-1, cp=ctx.cp, rank=ctx.cp_rank),
        shard_sequence(target, dim=-1, cp=ctx.cp, rank=ctx.cp_rank),
    )


def cp_decisions(model: nn.Module, batches: list[tuple]) -> list[bool] | bool | None:
    """``parallel.cp_attention = "auto"``'s decision (distributed/context_parallel.py
    AutoAttention), from the whole rows before :func:`cp_local_batch` cuts them: whether every row
    is one causal document. Every cp rank holds the same rows, so they decide alike with no
    collective. Rows without position ids (a token stream) are one document each: nothing to look at.

    The plain loop: one decision per micro-batch, which is what each attention call sees. A
    pipeline: the schedule cuts the rank's rows into pipeline micro-batches (``tensor_split``, in
    order) and an attention call sees one of them; the one decision for the whole schedule run is
    theirs when they all decide alike, else None (undecided: the ranks agree per layer). One per
    run, not one per pipeline micro-batch: the schedule interleaves their forwards and backwards,
    and activation checkpointing reruns a forward in its backward, so a setting per pipeline
    micro-batch could be read by another one."""
    rows = []
    for x, _ in batches:
        _, positions = split_packed(x)
        rows.append(None if positions is None else one_document_rows(positions))
    if not isinstance(model, PipelineModel):
        return [r is None or bool(r.all()) for r in rows]
    if all(r is None for r in rows):
        return True
    whole = torch.cat(
        [
            torch.ones(count_sequences(x), dtype=torch.bool) if r is None else r
            for r, (x, _) in zip(rows, batches, strict=True)
        ]
    )
    if model.schedule is not None:
        pieces = model.n_microbatches
    else:  # the schedule is built in the first step's run (pipeline_parallel.py), with this count
        m = pp_microbatches(model.cfg, pp=model.pp, micro_batch_size=len(batches[0][1]), accum_steps=len(batches))
        pieces = m * len(batches)
    decided = {bool(p.all()) for p in whole.tensor_split(pieces)}
    return decided.pop() if len(decided) == 1 else None


def stage_inputs(inputs) -> tuple[torch.Tensor, dict]:
    """A pipeline's first-stage input and the keywords for every stage: packed documents
    (data/packing.py) send their token ids to the first stage and their positions to all."""
    ids, positions = split_packed(inputs)
    return ids, ({} if positions is None else {"positions": positions})


@torch.no_grad()
def eval_step(model: nn.Module, batches: list[tuple], ctx: StepContext) -> tuple[float, int]:
    """The loss sum and item count of a global batch, forward only, summed over all ranks.

    Shares the step's counting and checking; the mean is ``loss_sum / items``.
    """
    items, _, _, _ = count_global_items(batches, loss_fn=ctx.loss_fn, dp_group=ctx.dp_group)
    autos = auto_attentions(model) if ctx.cp > 1 else []
    decisions = cp_decisions(model, batches) if autos else None
    batches = [cp_local_batch(x, t, ctx) for x, t in batches]
    if isinstance(model, PipelineModel):
        with maybe_auto_decision(autos, decisions):
            loss_sum, returned = pipeline_forward(
                model,
                batches,
                loss_fn=ctx.loss_fn,
                device=ctx.device,
                autocast=ctx.amp.autocast(),
                split_inputs=stage_inputs,
            )
        pp_group = model.pp_group
    else:
        loss_sum = torch.zeros((), device=ctx.device, dtype=torch.float64)
        returned = torch.zeros((), device=ctx.device, dtype=torch.float64)
        for k, (inputs, target) in enumerate(batches):
            inputs, target = to_device(inputs, ctx.device), to_device(target, ctx.device)
            with (
                maybe_loss_parallel(ctx.loss_parallel),
                ctx.amp.autocast(),
                maybe_auto_decision(autos, decisions[k] if decisions else None),
            ):
                s, c = ctx.loss_fn(model(inputs), target)
            loss_sum += _plain(s).double()
            returned += torch.as_tensor(c, device=ctx.device, dtype=torch.float64)
        pp_group = None
    loss_total, returned_total, _ = reduce_totals(loss_sum, returned, ctx=ctx, pp_group=pp_group).tolist()
    check_count(returned_total, items)
    return loss_total, items


def _plain(s: torch.Tensor) -> torch.Tensor:
    # loss_parallel: a replicated scalar DTensor
    return s.full_tensor() if isinstance(s, DTensor) else s
