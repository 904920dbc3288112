"""Pipeline parallelism with ``torch.distributed.pipelining``: stage split, schedules, the step.

A model whose blocks live in a ``layers`` container (ModuleDict "0".."n-1" like the built-in
GPT, ModuleList or Sequential) is cut into ``pp x pp_virtual_stages`` stages of consecutive
blocks. Each stage is a copy of the whole model with the blocks it does not own deleted and
the modules registered before ``layers`` (embeddings) set to None everywhere but on the first
stage, those after it (final norm, output layer) everywhere but on the last. That is
torchtitan's manual split: parameter names stay those of the whole model, so checkpoints and
``model.safetensors`` need no renaming, and no tracing is involved (the forward must skip the
None modules and iterate over ``layers``, as GPT.forward does).

Schedules (``parallel.pp_schedule``); ``n`` is the number of pipeline micro-batches a step runs:

- ``gpipe``  all forwards, then all backwards (Huang et al. 2019, arXiv:1811.06965). Any n.
- ``1f1b``   one forward one backward in the steady state, so at most pp micro-batches hold
  activations (PipeDream-flush, Narayanan et al. 2021, arXiv:2006.09377). n >= pp.
- ``interleaved1f1b``  V stages per rank in a loop, the bubble shrinks by V (Megatron-LM,
  arXiv:2104.04473). n a multiple of max(1, n // pp).
- ``looped_bfs``  V looped stages, breadth first (arXiv:2211.05953).
- ``interleaved_zb``  ZB-1P: the backward is split into input and weight gradients and the
  weight gradients fill the bubble (Qi et al. 2024, arXiv:2401.10241). Same n rule.
- ``zbv``  the zero-bubble V schedule, exactly 2 stages per rank in a V (arXiv:2401.10241 §6).
- ``dualpipev``  DeepSeek's DualPipe in its V form (arXiv:2412.19437), 2 stages per rank,
  n >= 2 pp.

Gradient accumulation is folded into the pipeline: each of the ``accum_steps`` micro-batches
is split into ``pp_microbatches`` pipeline micro-batches and one schedule run per optimiser
step goes through all ``n = accum_steps x pp_microbatches`` of them. The bubble is then paid
once per step (fraction (p-1)/(n+p-1) for 1F1B) and data-parallel gradients are reduced once,
in the last backward, as in the non-pipelined step. 1F1B-family schedules bound the live
activations by the pipeline depth whatever n is; GPipe keeps all n, so use 1f1b to bound memory.

The loss keeps step.py's exact normalisation: the global item count (all micro-batches, all
dp ranks) is gathered before the schedule runs, and the schedule's loss function returns
``sum of item losses x dp / items`` for its pipeline micro-batch (dp because DDP/FSDP average
over the dp ranks); the schedule's own 1/n gradient scaling is off (``scale_grads=False``).

Composition: ``parallelize`` calls ``apply_pp`` first and hands each stage back to itself, so
every stage gets TP -> AC -> FSDP2/DDP like a whole model; the PipelineStage then drives DDP's
and FSDP's gradient sync (reduce in the last backward only). The zero-bubble schedules are
refused with DDP and with resharding FSDP2 (see check_pp_layout); tensor parallel composes with
all schedules. Tied weights across stages are refused (each stage owns its parameters).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
from torch.nn.parallel import DistributedDataParallel

from paratrain.config import ConfigError, ParallelConfig
from paratrain.distributed.blocks import BLOCKS_ATTR
from paratrain.distributed.expert_parallel import gather_expert_weights
from paratrain.distributed.json_collectives import all_gather_json
from paratrain.distributed.layout_checks import (
    SCHEDULES,
    _blocks,
    check_untied,
    pp_microbatches,
    too_few_blocks,
    virtual_stages,
)
from paratrain.distributed.layout_checks import ZERO_BUBBLE as ZERO_BUBBLE  # re-exported: its old home
from paratrain.distributed.layout_checks import check_pp_layout as check_pp_layout  # re-exported: its old home

log = logging.getLogger("paratrain")

# ----------------------------------------------------------------------------- stage split


def balanced_split(block_sizes: list[int], stages: int, *, head: int = 0, tail: int = 0) -> list[int]:
    """Start block of each stage after the first, minimising the largest stage's parameter count.

    ``head``/``tail`` are the parameters the first/last stage carry besides blocks (embeddings,
    output layer). Dynamic programme over contiguous partitions: O(stages x blocks^2).
    """
    n = len(block_sizes)
    prefix = [0]
    for s in block_sizes:
        prefix.append(prefix[-1] + s)
    inf = (float("inf"), float("inf"))
    # best[k][j]: (largest stage, sum of squared stages) of the first j blocks cut into k stages,
    # compared in that order: the largest stage decides, the squares break ties towards even
    # stages. cut[k][j]: where the k-th stage starts.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0, 0)
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                load = prefix[j] - prefix[i] + (head if k == 1 else 0) + (tail if k == stages else 0)
                prev = best[k - 1][i]
                cand = (max(prev[0], load), prev[1] + load * load)
                if cand < best[k][j]:
                    best[k][j], cut[k][j] = cand, i
    starts, j = [], n
    for k in range(stages, 1, -1):
        j = cut[k][j]
        starts.append(j)
    return starts[::-1]


def _numel(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def stage_ranges(
    model: nn.Module, stages: int, split_points: list[int], *, blocks_attr: str = BLOCKS_ATTR
) -> list[range]:
    """The blocks (positions in the ``blocks_attr`` container) of every stage."""
    layers = _blocks(model, blocks_attr)
    n = len(layers)
    if stages > n:
        raise ConfigError(
            f"{stages} pipeline stages but the model has {n} blocks; lower parallel.pp or parallel.pp_virtual_stages"
        )
    if split_points:
        starts = list(split_points)
        if len(starts) != stages - 1 or any(b <= a for a, b in zip([0, *starts], [*starts, n])):
            raise ConfigError(
                f"parallel.pp_split_points = {starts} must be {stages - 1} strictly increasing block"
                f" indices within 1 .. {n - 1}; fix them or use []"
            )
    else:
        names = list(model._modules)
        pos = names.index(blocks_attr)
        head = sum(_numel(model._modules[k]) for k in names[:pos])
        tail = sum(_numel(model._modules[k]) for k in names[pos + 1 :])
        starts = balanced_split([_numel(b) for b in layers._modules.values()], stages, head=head, tail=tail)
    bounds = [0, *starts, n]
    return [range(bounds[s], bounds[s + 1]) for s in range(stages)]


def split_stage(
    model: nn.Module, blocks: range, *, first: bool, last: bool, blocks_attr: str = BLOCKS_ATTR
) -> nn.Module:
    """``model`` cut down in place to ``blocks`` (and its head/tail modules when first/last):
    the modules registered before the blocks go with the first stage, those after with the last."""
    layers = _blocks(model, blocks_attr)
    for i, key in enumerate(list(layers._modules)):
        if i not in blocks:
            # Deleting from _modules keeps the remaining blocks' keys, hence their names.
            del layers._modules[key]
    names = list(model._modules)
    pos = names.index(blocks_attr)
    for name in names[:pos] if not first else ():
        setattr(model, name, None)
    for name in names[pos + 1 :] if not last else ():
        setattr(model, name, None)
    return model


# ----------------------------------------------------------------------------- apply_pp


class _ScaledLoss:
    """The schedule's loss: ``sum x scale`` per pipeline micro-batch, recording sums and counts."""

    def __init__(self, loss_fn: Callable):
        self.loss_fn, self.scale = loss_fn, 1.0
        self.sums: list[torch.Tensor] = []
        self.counts: list[torch.Tensor] = []

    def __call__(self, output, target):
        s, c = self.loss_fn(output, target)
        self.sums.append(s.detach())
        self.counts.append(torch.as_tensor(c))
        return s * self.scale


class PipelineModel(nn.Module):
    """This rank's pipeline stages (``parts``) and their schedule; not callable as a module.

    ``parameters()``/``train()`` see all local parts, so the optimiser and the loop treat it
    like a model; step.train_step runs it (through :func:`pipeline_forward_backward`). The schedule is built at the first step,
    when the number of micro-batches and the loss are known.
    """

    def __init__(self, parts: list[nn.Module], stages: list, *, cfg: ParallelConfig, pp_group, device: torch.device):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.stages = stages
        self.cfg = cfg
        self.pp_group = pp_group
        self.pp = dist.get_world_size(pp_group)
        self.device = device
        ids = [st.stage_index for st in stages]
        self.has_first = 0 in ids
        self.has_last = stages[0].num_stages - 1 in ids
        self.schedule = None
        self.loss: _ScaledLoss | None = None

    def forward(self, *args, **kwargs):
        raise RuntimeError("a PipelineModel runs through its schedule; use paratrain.step.train_step")

    def build_schedule(self, *, micro_batch_size: int, accum_steps: int, loss_fn: Callable) -> None:

        m = pp_microbatches(self.cfg, pp=self.pp, micro_batch_size=micro_batch_size, accum_steps=accum_steps)
        n = m * accum_steps
        self.loss = _ScaledLoss(loss_fn)
        cls = getattr(pipelining.schedules, SCHEDULES[self.cfg.pp_schedule][0])
        if cls in (pipelining.ScheduleGPipe, pipelining.Schedule1F1B):
            self.schedule = cls(self.stages[0], n, loss_fn=self.loss, scale_grads=False)
        else:
            self.schedule = cls(self.stages, n, loss_fn=self.loss, scale_grads=False)
        self.n_microbatches = n
        log.info(
            "pipeline: %s over %d pipeline micro-batches per step (%d per micro-batch)", self.cfg.pp_schedule, n, m
        )

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights with their original names on pp rank 0 (None elsewhere)."""

        sd: dict[str, torch.Tensor] = {}
        for part in self.parts:  # a collective within the part's dp_shard/tp groups, if any
            # Not cpu_offload=True: that keeps the tensors on global rank 0 only, and here every
            # pp rank must contribute its stages. Each part is moved to the CPU on its own.
            part_sd = get_model_state_dict(part, options=StateDictOptions(full_state_dict=True))
            part_sd = gather_expert_weights(part, part_sd)  # expert parallel: the ep group's experts
            sd.update({k: v.detach().cpu() for k, v in part_sd.items()})
        # Names, shapes and dtypes as JSON, then the tensors themselves: no pickle crosses the
        # transport (gather_object would unpickle each stage's dict; docs/security.md).
        metas = all_gather_json(
            [[k, list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in sd.items()], group=self.pp_group
        )
        if dist.get_rank(self.pp_group) != 0:
            for v in sd.values():
                dist.send(v.contiguous(), group=self.pp_group, group_dst=0)
            return None
        for src, meta in enumerate(metas[1:], start=1):
            for name, shape, dtype in meta:
                sd[name] = torch.empty(shape, dtype=getattr(torch, dtype))
                dist.recv(sd[name], group=self.pp_group, group_src=src)
        return sd


def is_pipeline_stage(model: nn.Module) -> bool:
    return getattr(model, "_paratrain_pp_stage", False)


def apply_pp(
    model: nn.Module,
    pp_mesh: DeviceMesh,
    *,
    cfg: ParallelConfig,
    device: torch.device,
    parallelize_stage: Callable[[nn.Module], nn.Module] = lambda m: m,
    blocks_attr: str = BLOCKS_ATTR,
) -> PipelineModel:
    """Split ``model`` into stages, keep this rank's, parallelise each and wrap it in a PipelineStage.

    ``parallelize_stage`` applies the other parallelisms (TP -> AC -> FSDP/DDP) to one stage as
    to a whole model; the PipelineStage wraps the result, so the schedule drives DDP's and
    FSDP's gradient sync itself (only the last backward of a step reduces).
    """

    pp, pp_rank, pp_group = pp_mesh.size(), pp_mesh.get_local_rank(), pp_mesh.get_group()
    v = virtual_stages(cfg)
    num_stages = pp * v
    check_untied(model, blocks_attr=blocks_attr)
    if num_stages > len(_blocks(model, blocks_attr)):  # a model preflight could not count
        raise ConfigError(too_few_blocks(cfg, pp=pp, n_blocks=len(_blocks(model, blocks_attr))))
    ranges = stage_ranges(model, num_stages, cfg.pp_split_points, blocks_attr=blocks_attr)
    owner = generate_stage_to_rank_mapping(pp, num_stages, style=SCHEDULES[cfg.pp_schedule][2])
    stage_ids = sorted(s for s in range(num_stages) if owner[s] == pp_rank)
    parts, stages = [], []
    for k, s in enumerate(stage_ids):
        # The last local stage cuts the model itself; earlier ones cut a copy of it.
        whole = model if k == len(stage_ids) - 1 else copy.deepcopy(model)
        part = split_stage(whole, ranges[s], first=s == 0, last=s == num_stages - 1, blocks_attr=blocks_attr)
        part._paratrain_pp_stage = True
        part = parallelize_stage(part)
        parts.append(part)
        stages.append(PipelineStage(part, s, num_stages, device, group=pp_group))
    log.info(
        "pipeline: %d stages (%d per rank), blocks %s; this rank holds stages %s",
        num_stages,
        v,
        [f"{r.start}-{r.stop - 1}" for r in ranges],
        stage_ids,
    )
    return PipelineModel(parts, stages, cfg=cfg, pp_group=pp_group, device=device)


# ----------------------------------------------------------------------------- the step


def _no_split(inputs):
    return inputs, {}


def _stage_inputs(model: PipelineModel, inputs: torch.Tensor, split: Callable) -> tuple[tuple, dict]:
    """The schedule's ``(args, kwargs)``: ``split(inputs)`` gives the first stage's input and
    the keywords that every stage gets (packed documents' ``positions``: each stage builds its
    own document mask, and stages pass on hidden states alone; step.py's ``stage_inputs``).

    torch's schedules cut keyword tensors into micro-batches like the input and hand them to
    every stage (``PipelineStage.forward_one_chunk``: "kwargs can be passed to all stages");
    an integer tensor takes no gradient, so nothing flows back for it.
    """
    first, kwargs = split(inputs)
    return ((first,) if model.has_first else ()), kwargs


def pipeline_forward_backward(
    model: PipelineModel,
    batches: list[tuple],
    *,
    objectives: Sequence,
    device: torch.device,
    autocast,
    split_inputs: Callable = _no_split,
) -> None:
    """One schedule run (forward and backward) over this rank's micro-batches ``[(input, target), ...]``.

    ``objectives`` (paratrain/objectives, already started for the step): the first one's
    ``loss_fn`` is the schedule's loss on the last stage, times its ``scale``, and its sums (the
    loss's own sums and counts on the last stage, zeros on the others) are handed to it
    (``add``); step.py finishes the step (clip, optimiser, the reduce over pp and dp, the
    count check) as for a plain model. An objective whose sum is left by modules of the model
    (``take``, the routers of a mixture of experts) is taken after each forward of a stage that
    holds some of them and joins that stage's backward (:func:`_stage_terms`).
    """
    loss, others = objectives[0], objectives[1:]
    for o in others:
        if not o.pipeline_stage_term:
            raise ConfigError(
                f"the objective {o.name!r} is not computed from modules of the model, which parallel.pp > 1"
                " needs for every objective but the loss; set parallel.pp = 1"
            )
    # The rank's whole batch, cut into accum x pp_microbatches pieces by the schedule (the
    # concatenated micro-batches in order, so piece k is a slice of micro-batch k // m).
    inputs, target = _whole_batch(model, batches, loss, device)
    scaled = model.loss
    scaled.scale, scaled.sums, scaled.counts = loss.scale, [], []
    args, kwargs = _stage_inputs(model, inputs, split_inputs)
    with contextlib.ExitStack() as stack:
        # The schedule reduces DDP gradients itself, in the last backward, through an explicit
        # reducer.prepare_for_backward that no_sync does not block. But its shape-inference
        # forward on the first run calls the DDP module outside no_sync, which arms the reducer
        # early so every parameter is counted twice (reducer.cpp "rebuilt parameter indices
        # size" assert at the next forward). Holding no_sync over the run prevents that.
        for part in model.parts:
            if isinstance(part, DistributedDataParallel):
                stack.enter_context(part.no_sync())
        stack.enter_context(autocast)
        for o in others:
            if o.modules:
                stack.enter_context(_stage_terms(model, o))
        model.schedule.step(*args, target=target if model.has_last else None, return_outputs=False, **kwargs)
    _add_sums(model, loss, device)


def _whole_batch(model: PipelineModel, batches: list[tuple], loss, device: torch.device):
    """The rank's inputs and targets concatenated, and the schedule built at the first run with
    the loss objective's per-piece function: its ``pipeline_loss`` when it has one (a loss that
    keeps its own sums per row, objectives/preference.py, whose ``pipeline_target`` adds each
    row's index to the target, so a piece knows its rows), else its ``loss_fn``."""
    inputs = torch.cat([x for x, _ in batches]).to(device)
    target = torch.cat([t for _, t in batches]).to(device)
    if loss.pipeline_rows:  # objectives/base.py declares the pipeline hooks
        target = loss.pipeline_target(target)
    fn = loss.pipeline_loss if loss.pipeline_rows else loss.loss_fn
    if model.schedule is None:
        model.build_schedule(micro_batch_size=len(batches[0][1]), accum_steps=len(batches), loss_fn=fn)
    model.loss.loss_fn = fn  # a forward-only pass (pipeline_forward_each) may have used the schedule
    return inputs, target


def _add_sums(model: PipelineModel, loss, device: torch.device) -> None:
    """The loss objective's sums of the step's pieces: its own (``pipeline_done``) or the
    schedule's loss sums and counts (``add``)."""
    if loss.pipeline_rows:
        loss.pipeline_done(last=model.has_last)
    else:
        loss.add(*_local_sums(model, device))


def pipeline_forward_each(
    model: PipelineModel,
    batches: list[tuple],
    *,
    fn: Callable,
    target: torch.Tensor,
    device: torch.device,
    autocast,
    split_inputs: Callable = _no_split,
) -> None:
    """Forward only through ``model``'s schedule, ``fn(output, target piece)`` on the last stage
    for each pipeline piece of this rank's rows (its return value unused): an objective's first
    pass, e.g. a preference loss's reference log-probabilities, kept on the last stage where the
    loss runs. ``target``: the whole target the pieces are cut from (the rows' indices in it tell
    ``fn`` which rows a piece holds; torch's first run also calls the loss once on piece 0 to infer
    shapes, which a function writing per row simply repeats). ``model`` may be the policy
    itself (a LoRA policy with its adapters off): its training loss is put back by the next
    training run (:func:`_whole_batch`)."""
    inputs = torch.cat([x for x, _ in batches]).to(device)

    def each(output, piece):
        fn(output, piece)
        return torch.zeros((), device=device), 0

    if model.schedule is None:
        model.build_schedule(micro_batch_size=len(batches[0][1]), accum_steps=len(batches), loss_fn=each)
    scaled = model.loss
    scaled.loss_fn, scaled.sums, scaled.counts = each, [], []
    args, kwargs = _stage_inputs(model, inputs, split_inputs)
    with autocast, torch.no_grad(), _forward_actions_only(model.schedule):
        model.schedule.eval(*args, target=target.to(device) if model.has_last else None, **kwargs)


class _AuxLoss(torch.autograd.Function):
    """A stage's output, unchanged, carrying the stage's auxiliary loss into its backward.

    Only the last stage has a loss to differentiate; an earlier stage's backward starts from the
    gradient of its output. Attaching ``aux`` to the output makes that backward also run
    ``aux``'s with gradient 1, as if ``aux`` had been added to the loss (Megatron-LM's
    ``MoEAuxLossAutoScaler``, megatron/core/transformer/moe/moe_utils.py, does the same for the
    same reason). ``aux`` arrives already scaled (the objective's ``scale``)."""

    @staticmethod
    def forward(ctx, output, aux):
        ctx.save_for_backward(aux)
        return output

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.ones_like(aux)


@contextlib.contextmanager
def _stage_terms(model: PipelineModel, objective):
    """While the schedule runs: after each forward of a stage holding some of ``objective``'s
    modules, take their sum and stats (``objective.take``), attach the sum times the objective's
    scale to the stage's output (:class:`_AuxLoss`) and keep the stats; then give ``objective``
    those of the step's own forwards (``objective.add``).

    A part's forward, not each module's, is hooked: activation checkpointing recomputes the
    layers (not the part) in backward. torch's schedule also runs each stage once for shape
    inference on its first step (on placeholder values), so, as for the loss (``_local_sums``),
    only the last ``n_microbatches`` forwards of each part count."""
    kept: list[tuple[list[nn.Module], list]] = []
    handles = []
    for part in model.parts:
        inside = {id(m) for m in part.modules()}
        mine = [m for m in objective.modules if id(m) in inside]
        if not mine:
            continue
        seen: list = []
        kept.append((mine, seen))

        def hook(module, args, output, mine=mine, seen=seen):
            aux, stats = objective.take(mine)
            seen.append((aux.detach(), stats))
            if not torch.is_grad_enabled() or not isinstance(output, torch.Tensor) or not output.requires_grad:
                return None
            return _AuxLoss.apply(output, aux * objective.scale)

        handles.append(part.register_forward_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
    for mine, seen in kept:
        for aux, stats in seen[-model.n_microbatches :]:
            objective.add(mine, aux, stats)
    objective.end_micro_batch()


def pipeline_forward(
    model: PipelineModel,
    batches: list[tuple],
    *,
    loss,
    device: torch.device,
    autocast,
    split_inputs: Callable = _no_split,
) -> None:
    """Forward only through the schedule (``eval()``, torch >= 2.9, running only the forward
    actions, see :func:`_forward_actions_only`): the loss objective's sums as above."""
    inputs, target = _whole_batch(model, batches, loss, device)
    scaled = model.loss
    scaled.sums, scaled.counts = [], []
    args, kwargs = _stage_inputs(model, inputs, split_inputs)
    with autocast, torch.no_grad(), _forward_actions_only(model.schedule):
        model.schedule.eval(*args, target=target if model.has_last else None, **kwargs)
    _add_sums(model, loss, device)


# The actions of torch's lowered (compute + comm) schedule that a forward-only run keeps, by
# their names in its CSV format ("2F0", "3SEND_F1", "1UNSHARD"): forwards, their sends and
# receives, and FSDP's unshard/reshard around them.
_FORWARD_ACTIONS = ("F", "SEND_F", "RECV_F", "UNSHARD", "RESHARD")


@contextlib.contextmanager
def _forward_actions_only(schedule):
    """Run ``schedule`` on this rank's forward actions only, in their order.

    torch 2.13's ``eval()`` runs a multi-stage schedule's whole action list with the stages'
    backward off: the backward actions are meant to be no-ops, but under the V schedules (zbv,
    dualpipev), where one rank holds two adjacent stages, a backward action still hands its
    input gradient to the rank's other stage through ``stage.get_local_bwd_output``, which
    asserts the stage has a backward ("can't steal_bwd_input", schedules.py
    ``_PipelineScheduleRuntime._step_microbatches``, its FULL_BACKWARD and BACKWARD_INPUT
    branches). So eval crashed under them; the loop-style schedules only ran the no-ops.

    The lowered list is the runtime's own input, which it allows editing (pytorch PR #130488:
    "possible to manually edit the compute+comm schedule"), so eval swaps in the list without
    backward, weight, gradient-send/receive and gradient-reduce actions, and an OVERLAP_F_B
    (dualpipev's forward paired with a backward) by its forward. Dropping actions keeps the run
    deadlock-free: every forward still waits only on forwards that ran before it in the full
    schedule, and sends do not block. torch still sets up (or re-sets up, on a switch between
    training and eval) the stages' buffers, also when eval comes before any training step.
    """
    # gpipe/1f1b (PipelineScheduleSingle) have no action list; their eval() runs forwards only.
    orders = getattr(schedule, "pipeline_order_with_comms", None)
    if orders is None:
        yield
        return
    full = orders[schedule.rank]
    subs = [sub for a in full for sub in (a.sub_actions or (a,))]
    orders[schedule.rank] = [a for a in subs if a.computation_type.value in _FORWARD_ACTIONS]
    try:
        yield
    finally:
        orders[schedule.rank] = full


def _local_sums(model: PipelineModel, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    returned = torch.zeros((), device=device, dtype=torch.float64)
    if model.has_last:
        # The first run also calls the loss once for shape inference (on a throw-away forward):
        # the step's own calls are the last n.
        n = model.n_microbatches
        scaled = model.loss
        scaled.sums, scaled.counts = scaled.sums[-n:], scaled.counts[-n:]
        loss_sum += torch.stack([s.double() for s in scaled.sums]).sum()
        returned += sum(float(c) for c in scaled.counts)
    return loss_sum, returned
