"""THE training step (plain and pipeline share its finish) and the eval step.

``train_step(model, optimizer, batches, ctx)`` reads like this docstring: **count** the global
batch's units before any backward, **forward/backward** (the plain micro-batch loop here, or the
pipeline schedule of distributed/pipeline_parallel.py), launch the **reduce** of the step's sums
over the pipeline, data-parallel and tensor-parallel ranks without waiting for it, unscale
(fp16), **clip** by the whole model's gradient norm, optimiser **step**, then wait for the reduce
and read it. Every rank reads the same reduced numbers, so a check on them (the loss's own
count) raises on every rank together instead of leaving the others in a collective. The
SIGTERM stop flag (preemption.py) rides that reduce: agreeing on it costs no collective of its own.

What a step computes is its **objectives** (paratrain/objectives: the loss, the balance loss of
a mixture of experts, ...; docs/structure.md). Each is ``sum over the global batch's units /
their global count``, the count gathered over all micro-batches and data-parallel ranks *before*
the first backward. Averaging micro-batch means instead weights a micro-batch with few items as
much as one with many: that was the gradient-accumulation bug several frameworks shipped in 2024
(see transformers#34191). The step knows nothing of any objective but that interface.

When every objective knows its count from the rows' shapes (``Objective.static_count``: the
data path's static item count, every sample has that many targets, none ignored) the count is
arithmetic and needs no collective: the default step then has the same collectives as a
hand-written DDP loop, the gradient all-reduce and one reduce of the loss, and that one overlaps
the optimiser step (docs/overhead.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, is_dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from paratrain.config import ConfigError
from paratrain.data.packing import attention_square, count_input_tokens, split_packed
from paratrain.distributed.bitwise import GrainTree, split_grains
from paratrain.distributed.context_parallel import (
    AutoAttention,
    auto_attentions,
    global_indices,
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
from paratrain.objectives import Objective
from paratrain.objectives.items import check_count
from paratrain.precision import Precision
from paratrain.randomness import maybe_keyed_draws, maybe_keyed_stages


@dataclass(frozen=True)
class StepContext:
    """What a step needs besides the model, optimiser and batches (the same every step).

    ``objectives``: what the step computes (paratrain/objectives, ``build_objectives``); the
    first is the loss whose mean is ``StepResult.loss``. ``loss_parallel``: the logits are
    vocabulary-sharded DTensors (tensor parallel), the loss runs under torch's loss_parallel.
    ``sync_each_micro_batch``: the FSDP2 ZeRO-3 sync policy (see distributed/data_parallel.py);
    otherwise gradients are reduced on the last micro-batch only. Ranks of one tensor-parallel
    or pipeline group get the same batches; the sums are reduced over ``loss_group``, or
    ``dp_group`` (and the pipeline group) when that is None.
    """

    objectives: tuple[Objective, ...]
    device: torch.device
    dp: int = 1
    dp_group: dist.ProcessGroup | None = None
    grad_clip: float = 0.0
    precision: Precision | None = None
    loss_parallel: bool = False
    sync_each_micro_batch: bool = False
    # The one reduce of [loss sum, item count, stop flag, other objectives' sums]: pp x dp
    # flattened (ParallelDims.group("pp_dp")), or the whole world when tp > 1, so that a SIGTERM
    # reaching only a tensor-parallel peer still stops every rank at the same step. None: the
    # pipeline group (if any) then dp_group, two reduces with the same sums.
    loss_group: dist.ProcessGroup | None = None
    # False on tensor-parallel ranks other than the first when loss_group spans tp: their sums
    # are copies of the first one's, so they add zeros (exact) and only their stop flag counts.
    adds_loss: bool = True
    # Context parallel (distributed/context_parallel.py): this rank keeps its part (cp_rank of cp)
    # of every row of the micro-batches it loads, the same ones as its cp peers.
    cp: int = 1
    cp_rank: int = 0
    # Keyed dropout (paratrain/randomness.py): the model's modules' site names; the step then
    # draws each micro-batch's masks from its rows' keys. None: torch's own dropout.
    draw_sites: dict[int, str] | None = None
    # BatchNorm's groups (models/batch_norm.py, batch.norm_group; 0: the model has none): groups
    # wider than a micro-batch lay the rows out over ranks (data/sampler.py rank_micro_batches).
    norm_group: int = 0
    # run.bitwise (distributed/bitwise.py): the rows of each backward, summed in one fixed tree;
    # 0: off, the micro-batch loop with DDP's or FSDP's own reduce.
    bitwise_grain: int = 0
    # False in the memory estimate (batch/measure.py): on fake tensors every host read is a
    # placeholder (1), so the count must come from reads too, like the loss's own returned count
    # that the objectives check it against; a count from the rows' shapes would never match it.
    static_counts: bool = True

    @property
    def amp(self) -> Precision:
        return self.precision or Precision(device=self.device)

    @property
    def loss_fn(self):
        """The loss objective's ``(sum, count)`` function (the gradient-noise probe runs it)."""
        return self.objectives[0].loss_fn


@dataclass(kw_only=True)
class StepResult:
    loss: float  # mean over the global batch's items
    items: int  # global count of target items
    grad_norm: float
    tokens: int  # input tokens of the global batch (samples, for non-token inputs)
    stop: bool = False  # some rank's stop flag was set (the same on every rank: read from the step's reduce)
    # Packed documents (data/packing.py): the sum of their squared lengths, what their attention
    # covers; None for other inputs, whose rows attend over their whole length.
    attention_square: int | None = None
    # What the other objectives read from the reduce (Objective.read), e.g. a mixture of
    # experts' aux_loss and tokens_per_expert; their metrics.jsonl columns: Objective.metrics.
    extras: dict = field(default_factory=dict)


@dataclass(frozen=True)
class GlobalCount:
    """The whole global batch, counted before any backward: each objective's units (in the
    objectives' order: the first is the loss's items), input tokens, and packed documents'
    attention square (None when the inputs are not packed)."""

    units: tuple[int, ...]
    tokens: int
    attention_square: int | None = None

    @property
    def items(self) -> int:
        return self.units[0]


def to_device(obj, device: torch.device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if is_dataclass(obj):  # a typed batch, e.g. objectives/policy_gradient.py Rollout
        return replace(obj, **{f.name: to_device(getattr(obj, f.name), device) for f in fields(obj)})
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
    """Rows of a micro-batch (a packed row of documents counts one)."""
    return inputs.shape[0] if isinstance(inputs, torch.Tensor) else len(inputs)


def count_global_items(
    batches: list[tuple],
    *,
    objectives: Sequence[Objective],
    dp_group: dist.ProcessGroup | None,
    dp: int = 1,
    static: bool = True,
) -> GlobalCount:
    """Every objective's units, the input tokens and the packed documents' attention square of
    the whole global batch, from the rows and targets alone, before any backward. Counted on the
    CPU so this small all-reduce never waits for the device.

    When every objective knows its count from the rows' shapes (``static_count``; ``static``
    False: the eval step, whose validation data the training data path's declaration does not
    cover): no all-reduce at all. Every data-parallel rank holds the same number of rows of the
    same shape (the sampler's equal rank slices, collated), so the global figures are this
    rank's times ``dp``: the same numbers on every rank, which the loss objective's ``read``
    compares with the loss's own reduced count.
    """
    known = [[o.static_count(x) for x, _ in batches] for o in objectives] if static else None
    if known is not None and all(c is not None for per in known for c in per):
        units = tuple(sum(per) * dp for per in known)
        if units[0] == 0:
            raise ConfigError("a global batch has no target items; check the data")
        return GlobalCount(units, sum(count_tokens(x) for x, _ in batches) * dp)
    local_units = [
        torch.stack([torch.as_tensor(o.count(x, t), dtype=torch.float64) for x, t in batches]).sum() for o in objectives
    ]
    squares = [attention_square(x) for x, _ in batches]
    local = [float(sum(count_tokens(x) for x, _ in batches)), float(sum(q or 0 for q in squares))]
    counts = torch.cat([torch.stack(local_units), torch.tensor(local, dtype=torch.float64)])
    if dp_group is not None:
        dist.all_reduce(counts, group=dp_group)
    *units, tokens, square = (int(c) for c in counts.tolist())
    if units[0] == 0:
        raise ConfigError("a global batch has no target items (every target is loss.ignore_index); check the data")
    return GlobalCount(tuple(units), tokens, square if squares[0] is not None else None)


def prepare_batches(model: nn.Module, batches: list[tuple], ctx: StepContext, objectives, *, static: bool = True):
    """What the train and eval steps share before their loops: the count over whole rows, then
    context parallel's "auto" decisions (from the whole rows too) and its cut of every row.
    Returns ``(count, batches, autos, decisions)``."""
    count = count_global_items(batches, objectives=objectives, dp_group=ctx.dp_group, dp=ctx.dp, static=static)
    autos = auto_attentions(model) if ctx.cp > 1 else []  # cp_attention = "auto": decided here, per micro-batch
    decisions = cp_decisions(model, batches) if autos else None
    batches = [cp_local_batch(x, t, ctx) for x, t in batches]  # context parallel: after the count
    return count, batches, autos, decisions


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[tuple],
    ctx: StepContext,
    *,
    after_backward: Callable[[int], None] | None = None,
    stop_flag: Callable[[], bool] | None = None,
    keys: list[torch.Tensor] | None = None,
) -> StepResult:
    """One optimiser step over this rank's micro-batches ``[(input, target), ...]`` (on CPU).

    ``after_backward(k)`` runs after micro-batch k's backward (the gradient-noise probe of
    batch.adaptive, batch/adaptive.py; not with a pipeline). ``stop_flag()`` is read just before
    the step's reduce (this rank got SIGTERM: preemption.py); ``StepResult.stop`` says whether
    any rank's was set. ``keys``: each micro-batch's row keys (``StepLoader.keys``), from which
    keyed dropout draws when ``ctx.draw_sites`` is set.
    """
    objectives = ctx.objectives
    count, batches, autos, decisions = prepare_batches(model, batches, ctx, objectives, static=ctx.static_counts)
    if ctx.bitwise_grain:
        # run.bitwise: the objectives see the grains as the micro-batches (a reference's, a teacher's
        # or the gradient cache's forward, BatchNorm's groups, indexed per grain as the loop's
        # calls), the same rows and shapes on every layout.
        batches, keys = split_grains(batches, keys, ctx.bitwise_grain)
    for objective, units in zip(objectives, count.units, strict=True):
        # DDP (and FSDP) average gradients over the dp ranks; multiplying by dp turns that mean
        # back into the sum over ranks, so the gradient is d(global sum)/d(theta) / units. dp is
        # a power of two in practice, which makes the round trip exact in floating point. With
        # context parallel FSDP2 averages over the dp x cp ranks (each holding part of the rows).
        # run.bitwise sums the ranks' gradients itself: 1 / units, the same scale on every layout.
        objective.start(scale=(1 if ctx.bitwise_grain else ctx.dp * ctx.cp) / units, device=ctx.device)
        objective.before_micro_batches(model, batches, forward=no_grad_forward(model, batches, ctx, keys))
    bitwise_norm = None  # run.bitwise's norm of the whole merged gradient
    if isinstance(model, PipelineModel):  # the schedule runs forward and backward
        with (
            maybe_auto_decision(autos, decisions),
            maybe_keyed_stages(model.parts, ctx.draw_sites, keys, stage_inputs) as split_inputs,
        ):
            pipeline_forward_backward(
                model,
                batches,
                objectives=objectives,
                device=ctx.device,
                autocast=ctx.amp.autocast(),
                split_inputs=split_inputs,
            )
        pp_group = model.pp_group
    elif ctx.bitwise_grain:
        bitwise_norm = bitwise_forward_backward(model, batches, ctx, keys=keys)
        pp_group = None
    else:
        forward_backward(
            model, batches, ctx, after_backward=after_backward, autos=autos, decisions=decisions, keys=keys
        )
        pp_group = None
    # The sums are final once the backward is done: their reduce is launched now and waited for
    # after the optimiser step, which it overlaps (with DDP the ranks have just met in the
    # gradient all-reduce, so it hardly waits for anyone either). The stop flag is read here.
    stop = bool(stop_flag()) if stop_flag is not None else False
    pending = launch_totals(objectives, ctx=ctx, pp_group=pp_group, stop=stop)
    grad_norm = finish_step(model, optimizer, ctx, pp_group=pp_group, grad_norm=bitwise_norm)
    # The norm is read only after the reduce's read has waited for the device: on a GPU that
    # wait is the step's only one for plain-tensor models (with clipping on under FSDP, TP or
    # pipelining the clip coefficient is still read in distributed/grad_norm.py); this one copies
    # a value already computed. (One joint read via torch.cat adds three tensor ops and showed
    # no gain: preempt_overhead.py.)
    parts, stops = pending.read()
    values = {}
    for objective, part, units in zip(objectives, parts, count.units, strict=True):
        values.update(objective.read(part, units=units))
    return StepResult(
        loss=values.pop("loss"),
        items=count.items,
        grad_norm=float(grad_norm),
        tokens=count.tokens,
        stop=stops > 0,
        attention_square=count.attention_square,
        extras=values,
    )


def forward_backward(
    model: nn.Module,
    batches: list[tuple],
    ctx: StepContext,
    *,
    after_backward=None,
    autos: Sequence[AutoAttention] = (),
    decisions: list[bool] | None = None,
    keys: list[torch.Tensor] | None = None,
) -> None:
    """The plain micro-batch loop: each micro-batch's objectives' terms, summed, differentiated.

    ``autos``: the model's "auto" context-parallel attentions, given each micro-batch's decision
    (``decisions``, :func:`cp_decisions`) over its forward and backward. ``keys``: each
    micro-batch's row keys, from which keyed dropout draws over its forward and backward (an
    activation checkpoint's recomputation runs in the backward and draws the same masks)."""
    precision = ctx.amp  # --- mixed precision (paratrain.precision)
    last = len(batches) - 1
    for k, (inputs, target) in enumerate(batches):
        inputs, target = to_device(inputs, ctx.device), to_device(target, ctx.device)
        # Gradients are reduced once, in the backward of the last micro-batch (DDP, ZeRO-2-like
        # FSDP), or every micro-batch into 1/N shards (ZeRO-3-like FSDP: sync_each_micro_batch).
        with (
            maybe_no_sync(model, sync=k == last, sync_each_micro_batch=ctx.sync_each_micro_batch),
            maybe_loss_parallel(ctx.loss_parallel),
            maybe_auto_decision(autos, decisions[k] if decisions else None),
            maybe_keyed_draws(ctx.draw_sites, keys[k] if keys else None, cp_sequence(inputs, ctx) if keys else None),
        ):
            with precision.autocast():  # forward under autocast; backward follows its dtypes
                output = model(inputs)
                terms = [objective.loss(output, target) for objective in ctx.objectives]
                # The output (the logits) is not held through the backward or into the next
                # micro-batch's forward: 2 logits-sized buffers at the peak otherwise (caught by
                # tests/distributed/test_plan.py's pipeline-memory check against a real run).
                del output
            precision.scale(add_terms(terms)).backward()  # fp16: times the GradScaler's loss scale
        for objective in ctx.objectives:
            objective.end_micro_batch()
        if after_backward is not None:
            after_backward(k)


def bitwise_forward_backward(model: nn.Module, grains: list[tuple], ctx: StepContext, *, keys) -> torch.Tensor:
    """run.bitwise (distributed/bitwise.py): the loop over grains of ``ctx.bitwise_grain`` rows
    (``train_step`` cut the micro-batches into them) instead of micro-batches, each grain's
    gradient carried into the fixed tree, whose sum over every rank is left in ``p.grad`` (FSDP2:
    this rank's shard) for the clip and the optimiser step. Returns the gradient norm, taken on
    the whole merged gradient as one process takes it."""
    tree = GrainTree(model)
    with tree.no_sync():
        # One grain per call: its own sync decision (maybe_no_sync) would re-enable FSDP2's
        # reduce-scatter after the first grain; the tree's no_sync is the only one here.
        for k, grain in enumerate(grains):
            forward_backward(model, [grain], ctx, after_backward=tree.push, keys=keys[k : k + 1] if keys else None)
    return tree.write_grads(group=ctx.dp_group, dp=ctx.dp)


def no_grad_forward(model: nn.Module, batches: list[tuple], ctx: StepContext, keys) -> Callable:
    """``forward(k)``: micro-batch ``k``'s output without a graph, as the step's loop computes it
    (its device, autocast and keyed draws): an objective's first pass (the gradient cache).
    ``forward(k, module)``: the same input through another model (a preference loss's frozen
    reference, laid out like ``model``)."""

    def forward(k: int, module: nn.Module | None = None):
        inputs = to_device(batches[k][0], ctx.device)
        key = keys[k] if keys else None
        with (
            torch.no_grad(),
            maybe_keyed_draws(ctx.draw_sites, key, cp_sequence(inputs, ctx) if keys else None),
            ctx.amp.autocast(),
        ):
            return (model if module is None else module)(inputs)

    return forward


def cp_sequence(inputs, ctx: StepContext) -> tuple[torch.Tensor, int] | None:
    """Context parallel: the whole-sequence index of each of this rank's tokens of ``inputs``
    (already cut) and the whole length, for keyed dropout on hidden states; None at cp = 1."""
    if ctx.cp == 1 or not isinstance(inputs, torch.Tensor):
        return None
    local = inputs.shape[-1]  # packed documents (B, 2, T): the tokens are the last dim too
    return global_indices(local, cp=ctx.cp, rank=ctx.cp_rank), local * ctx.cp


def add_terms(terms: list[torch.Tensor | None]) -> torch.Tensor:
    """The objectives' terms of one micro-batch, summed in order. Under loss_parallel the loss is
    a replicated DTensor and another term (a mixture of experts' auxiliary loss, replicated over
    tp) a plain tensor, the same on every tp rank: it joins as a DTensor of the same placements."""
    total = None
    for term in terms:
        if term is None:
            continue
        if total is None:
            total = term
            continue
        if isinstance(total, DTensor) and not isinstance(term, DTensor):
            term = DTensor.from_local(term, total.device_mesh, total.placements, run_check=False)
        total = total + term
    return total


def finish_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, ctx: StepContext, *, pp_group, grad_norm=None
) -> torch.Tensor:
    """Unscale (fp16), clip by the whole model's gradient norm, step, zero the gradients; returns
    the norm as a 0-dim tensor (not read on the host here: the step reads it after its reduce).
    ``grad_norm``: the norm already taken (run.bitwise, on the whole gradient), used as is."""
    precision = ctx.amp
    # One walk of the module tree for both uses: each model.parameters() walk cost about 0.1 ms of
    # a step's Python on the main job's GPT (docs/overhead.md, issue 58 item 4).
    params = list(model.parameters())
    reduce_expert_grads(params)  # expert parallel (a no-op without): before the norm
    precision.unscale_(optimizer)  # fp16: back to true gradients before clipping
    # The norm of the whole model's gradient on every rank, also when gradients are sharded or
    # the model is split into pipeline stages.
    max_norm = ctx.grad_clip if ctx.grad_clip > 0 else math.inf
    grad_norm = clip_grad_norm_(params, max_norm, pp_group=pp_group, total=grad_norm)
    precision.step(optimizer)  # fp16: skipped when the gradients overflowed
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


@dataclass
class PendingTotals:
    """A launched reduce of the step's sums: :meth:`read` waits for it and reads it on the host."""

    totals: torch.Tensor
    work: dist.Work | None = None
    sizes: tuple[int, ...] = (2,)  # each objective's sums; the stop flag follows the first's

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.totals

    def read(self) -> tuple[list[list[float]], float]:
        """Each objective's reduced sums and the reduced stop flag."""
        values = self.wait().tolist()
        first = self.sizes[0]
        parts, at = [values[:first]], first + 1
        for n in self.sizes[1:]:
            parts.append(values[at : at + n])
            at += n
        return parts, values[first]


def launch_totals(objectives: Sequence[Objective], *, ctx: StepContext, pp_group, stop: bool = False) -> PendingTotals:
    """``[loss objective's sums, stop, other objectives' sums]`` summed over the step's ranks:
    one tensor, one reduce, launched with ``async_op`` and left on the device for the caller's
    one host read (:meth:`PendingTotals.read`).

    (Under pipeline parallel only the last stage has the loss, and with tensor parallel only the
    first tp rank adds its sums: the others contribute zeros.) The stop flag is a SUM of 0/1s, as
    good as a MAX: any rank > 0 stops every rank, after the same step. Every rank launches it at
    the same point of the step, before the same collectives of the optimiser step (the gradient
    norm's under FSDP/TP/pipelining, expert parallel's gradient reduce), so the collectives are
    issued in one order on all ranks, as an asynchronous collective requires.
    """
    sums = [o.sums() for o in objectives]
    sums = [torch.zeros(0, device=sums[0].device, dtype=torch.float64) if s is None else s for s in sums]
    if not ctx.adds_loss:
        sums = [torch.zeros_like(s) for s in sums]
    flag = torch.full_like(sums[0][:1], float(stop))
    totals = torch.cat([sums[0], flag, *sums[1:]])
    groups = [
        g for g in ([ctx.loss_group] if ctx.loss_group is not None else [pp_group, ctx.dp_group]) if g is not None
    ]
    for group in groups[:-1]:  # two groups (no loss_group): the first reduce before the second
        dist.all_reduce(totals, group=group)
    work = dist.all_reduce(totals, group=groups[-1], async_op=True) if groups else None
    return PendingTotals(totals, work, tuple(s.numel() for s in sums))


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
    """The loss objective's sum and item count of a global batch, forward only, summed over all
    ranks. Shares the step's count, context-parallel cut and check; the mean is ``loss_sum / items``.
    """
    loss = ctx.objectives[0]
    count, batches, autos, decisions = prepare_batches(model, batches, ctx, (loss,), static=False)
    if ctx.bitwise_grain:  # run.bitwise: the rows of each forward are the training grains, the same on every layout
        batches, _ = split_grains(batches, None, ctx.bitwise_grain)
    loss.start(scale=1.0, device=ctx.device)
    if loss.first_pass_in_eval:
        loss.before_micro_batches(model, batches, forward=no_grad_forward(model, batches, ctx, None))
    if isinstance(model, PipelineModel):
        with maybe_auto_decision(autos, decisions):
            pipeline_forward(
                model, batches, loss=loss, device=ctx.device, autocast=ctx.amp.autocast(), split_inputs=stage_inputs
            )
        pp_group = model.pp_group
    else:
        for k, (inputs, target) in enumerate(batches):
            inputs, target = to_device(inputs, ctx.device), to_device(target, ctx.device)
            with (
                maybe_loss_parallel(ctx.loss_parallel),
                ctx.amp.autocast(),
                maybe_auto_decision(autos, decisions[k] if decisions else None),
            ):
                loss.loss(model(inputs), target)
            loss.end_micro_batch()
        pp_group = None
    ((loss_total, returned_total, *more),), _ = launch_totals((loss,), ctx=ctx, pp_group=pp_group).read()
    check_count(returned_total, count.items)
    loss.eval_add([loss_total, returned_total, *more])  # its own metrics over the evaluation (eval_metrics)
    return loss_total, count.items
