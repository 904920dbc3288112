"""The start-of-run layout probe: does this model's loss depend on how a batch is split?

Before the first step each rank takes its first micro-batch (R rows) and, on its own, forward
only, computes the model's output and the loss objective's sum twice in train mode: over the R
rows whole, and over two halves of them (outputs joined along the rows, sums added). A layout
(world size, accumulation, micro-batch size) only changes how the global batch is cut into such
pieces, so when the two agree to rounding, what the model computes per row does not depend on
the cut; when they do not, the
per-step losses of this run depend on the layout and the run stops with exit 2 and one line
(docs/layout-probe.md) unless ``run.layout_dependent`` accepts it.

When the sums differ, a second pass with forward hooks on every module records each call's
inputs and outputs, whole and split (the halves' outputs concatenated along the rows), and
names the first module, in the order the calls finish, whose output differs while its input
does not (when its input already differs, the code of its parent's forward before the call did
it), with a likely cause from what it is: BatchNorm's batch statistics, random draws from the
global generator (outside the keyed path of paratrain/randomness.py), or some other
computation across rows.

Why two halves and not single rows: a BatchNorm over (rows, features) refuses a one-row batch
in training, and any dependence across rows shows between two halves as well. The generators
are not reset between the whole and split passes, as consecutive steps do not reset them
either: an unkeyed draw then differs between the passes, as it differs between layouts
(reset, torch's CPU generator would give the halves exactly the whole's numbers). The run's
generators, the modules' buffers (BatchNorm's running statistics) and train/eval modes are
restored afterwards, so the probe does not change the run's trajectory.

Every rank decides from its own rows, then the ranks gather their findings (two small
collectives) so that all of them stop, or go on, together with the same line.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from paratrain.config import ConfigError, RunConfig
from paratrain.distributed.compile import run_eagerly
from paratrain.distributed.json_collectives import all_gather_json
from paratrain.distributed.pipeline_parallel import PipelineModel
from paratrain.randomness import kept_rngs, maybe_keyed_draws, site_names
from paratrain.step import to_device

log = logging.getLogger("paratrain")

# Relative difference of the loss sums, and of the outputs (a norm over the tensor), above which
# the split changes the math. Measured on CPU (fp32 and bf16 autocast) on the debug and main
# GPTs, whole against halves differs by rounding alone: the outputs bitwise equal, the loss sums
# 9e-8 apart (the order of the sum over rows). What the probe is for is far larger: at
# initialisation the GPT's attention dropout 0.1 moves the output by 7e-2 (its loss by 1e-4),
# noise or BatchNorm over a few rows by 6e-2..2. 1e-5 leaves two orders of magnitude on either
# side. On a GPU another matmul algorithm may be chosen for R/2 rows than for R: in bf16 (8-bit
# mantissa, 4e-3 per element, partly averaging out over a sum) and fp16 the tolerance is wider,
# still 30x below that dropout's output difference (not measured on a GPU here).
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-3, "fp16": 5e-4}

# Seconds the ranks that did not find what stops the run wait before stopping with the finder's
# line, so that the finder's failure is the first one recorded (layout_probe). Raising and
# recording a failure takes milliseconds; a second covers a loaded machine and costs a run that
# is stopping anyway.
FOLLOW_S = 1.0

ACCEPT = "set run.layout_dependent = true to accept a run whose losses depend on the layout (docs/layout-probe.md)"


@dataclass
class Finding:
    """What one rank found: the line to stop with (or None: the loss does not depend on the split)."""

    line: str | None
    seconds: float
    # The whole micro-batch fails, not a half of it: bad input (a user loss that returns a bare
    # tensor), which the first step would meet too; its line is not a layout's, nothing to accept.
    broken: bool = False


def layout_probe(run, *, run_cfg: RunConfig) -> None:
    """Probe the first micro-batch of the run's next step (trainer.Run ``run``); raise
    :class:`ConfigError` on every rank when its loss depends on the split, unless
    ``run_cfg.layout_dependent``; log one line either way."""
    if not run_cfg.probe:
        return
    why = skip_reason(run.model, dims=run.dims, micro_batch_size=run.plan.micro_batch_size, ctx=run.step_ctx)
    if why is not None:
        log.info("layout probe: skipped (%s)", why)
        return
    inputs, target, keys = first_micro_batch(run, seed=run_cfg.seed)
    finding = probe_micro_batch(
        run.model, inputs, target, ctx=run.step_ctx, keys=keys, dtype=run.precision.dtype, rank=run.ctx.rank
    )
    line, seconds, finder, broken = agree(
        finding, rank=run.ctx.rank, world_size=run.ctx.world_size, device=run.ctx.device
    )
    if line is None:
        log.info(
            "layout probe: the first micro-batch's loss and output (%d rows) are the same whole and split in two (probe: %.2f s)",
            run.plan.micro_batch_size,
            seconds,
        )
        return
    if run_cfg.layout_dependent and not broken:
        log.warning("%s (run.layout_dependent = true: going on; probe: %.2f s)", line, seconds)
        return
    if run.ctx.rank != finder:
        # Every rank stops with the finder's line, and the launcher names the worker that failed
        # first (launch/agent.first_failure, by when each recorded its failure): the others stop
        # a moment after the finder, or "worker rank 1 failed first" stood beside the finding's
        # "(rank 0)" (issue 60). A rank that the agent ends meanwhile loses nothing.
        time.sleep(FOLLOW_S)
    raise ConfigError(line if broken else f"{line}; {ACCEPT}")


def skip_reason(model: nn.Module, *, dims, micro_batch_size: int, ctx=None) -> str | None:
    """Why the probe cannot run or would say nothing at this layout (the same on every rank), or None."""
    if ctx is not None and not hasattr(ctx.objectives[0], "loss_fn"):  # objectives/preference.py, distill.py
        return "the loss is its own objective (preference, distillation, a plug-in's), not an item loss to split"
    if ctx is not None and getattr(ctx.objectives[0].loss_fn, "over_batch", False):
        return "the loss is over the whole global batch (the gradient cache): no micro-batch has a loss of its own"
    if ctx is not None and ctx.norm_group and (micro_batch_size // 2) % ctx.norm_group:
        return f"half a micro-batch does not hold whole BatchNorm groups of {ctx.norm_group} samples"
    if isinstance(model, PipelineModel):
        return "pipeline parallel: a rank holds some stages, no rank computes the loss alone"
    for degree, what in (("tp", "tensor"), ("cp", "context")):
        if getattr(dims, degree) > 1:
            return f"parallel.{degree} > 1: {what} parallel shards every row, no rank computes it alone"
    if getattr(dims, "ep", 1) > 1:
        return "parallel.ep > 1: the experts' all-to-all pairs the ranks' forwards"
    if micro_batch_size < 2:
        return "a micro-batch of one row: there is nothing to split"
    if any(p.device.type == "meta" for p in model.parameters()):
        return "the model is on the meta device"
    return None


def first_micro_batch(run, *, seed: int):
    """This rank's first micro-batch of the next step ``(inputs, target, keys)``, from the step's
    own loader, which keeps that step's batches for the step (``StepLoader.batches``): the
    dataset reads each sample of the stream once, probe or not."""
    loader, plan, position = run.loader, run.plan, run.state.consumed_samples
    inputs, target = loader.batches(position, plan.global_batch_size, plan.micro_batch_size)[0]
    keys = None
    if run.step_ctx.draw_sites is not None:
        keys = loader.keys(position, plan.global_batch_size, plan.micro_batch_size, seed=seed)[0]
    return inputs, target, keys


def agree(
    finding: Finding, *, rank: int = 0, world_size: int, device: torch.device
) -> tuple[str | None, float, int, bool]:
    """Every rank's finding gathered: the lowest finding rank's line (the same on every rank), the
    longest time, that rank (``rank`` itself when none found anything) and whether its micro-batch
    failed whole. Without it the ranks that found nothing would wait in the first step's
    collectives for the ones that stopped."""
    if world_size == 1 or not dist.is_initialized():
        return finding.line, finding.seconds, rank, finding.broken
    found = all_gather_json([finding.line, finding.seconds, finding.broken], device=device)
    finders = [r for r, (line, _, _) in enumerate(found) if line is not None]
    if not finders:
        return None, max(s for _, s, _ in found), rank, False
    return found[finders[0]][0], max(s for _, s, _ in found), finders[0], found[finders[0]][2]


# --- one rank's probe, no collectives of its own ---------------------------------------------


def probe_micro_batch(
    model: nn.Module,
    inputs,
    target,
    *,
    ctx,
    keys: torch.Tensor | None = None,
    dtype: str = "fp32",
    rank: int = 0,
) -> Finding:
    """The loss sum of ``(inputs, target)`` whole and as two halves (``ctx``: the StepContext);
    returns the finding. The generators, buffers and modules' modes are as before afterwards."""
    t0 = time.perf_counter()
    model = model.module if isinstance(model, DistributedDataParallel) else model  # its forward syncs buffers
    rows = count_rows(inputs)
    tol = tolerance(dtype, ctx.device)
    half = rows // 2
    pieces = [(0, rows), (0, half), (half, rows)]
    with preserved(model), run_eagerly(model), torch.no_grad():
        model.train()
        try:
            whole, output = forward(model, inputs, target, ctx=ctx, keys=keys, rows=pieces[0])
        except Exception as e:  # noqa: BLE001 - every rank stops with it (agree), none waits in the step
            # Not the layout's doing: its own line (a ConfigError's is the fix), without "accept it".
            first = (str(e).strip().splitlines() or [""])[0][:300]
            what = first if isinstance(e, ConfigError) else f"{type(e).__name__}: {first}"
            return Finding(
                f"the first micro-batch fails on rank {rank} before the first step: {what}",
                time.perf_counter() - t0,
                broken=True,
            )
        try:
            split = [forward(model, inputs, target, ctx=ctx, keys=keys, rows=p) for p in pieces[1:]]
        except Exception as e:  # noqa: BLE001 - a model that fails on half the rows is a finding
            first = (str(e).strip().splitlines() or [""])[0][:200]
            return Finding(
                f"layout probe: the model fails on half of the first micro-batch ({half} of {rows} rows) on rank {rank}:"
                f" {type(e).__name__}: {first}",
                time.perf_counter() - t0,
            )
        loss_diff = rel(sum(s for s, _ in split), whole)
        out_diff = output_difference(output, [out for _, out in split], pieces[1:])
        seconds = time.perf_counter() - t0
        if loss_diff <= tol and out_diff <= tol:
            return Finding(None, seconds)
        where = first_difference(model, inputs, target, ctx=ctx, keys=keys, pieces=pieces, tol=tol)
    return Finding(
        f"layout probe: the first micro-batch's loss differs by {loss_diff:.1e} and its output by {out_diff:.1e}"
        f" (relative, tolerance {tol:.0e}) when its {rows} rows are split into 2 micro-batches (rank {rank}); {where}",
        seconds,
    )


def tolerance(dtype: str, device: torch.device) -> float:
    """The relative tolerance of the forward's precision: ``precision.dtype``'s, or fp16's where
    CUDA matmuls run in TF32 (``torch.backends.cuda.matmul.allow_tf32``: fp16's 10-bit mantissa)."""
    tol = TOLERANCE.get(dtype, TOLERANCE["fp32"])
    if torch.device(device).type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        tol = max(tol, TOLERANCE["fp16"])
    return tol


def output_difference(whole: list[torch.Tensor], split: list[list[torch.Tensor]], pieces) -> float:
    """``||whole - split|| / ||whole||`` over the model's output tensors whose first dimension is
    the rows. At initialisation the loss hardly moves with a change of the logits (dropout 0.1 in
    the GPT's attention: 1e-4 relative on the loss, 1e-2 on the logits), so the output is the
    sharper test; the loss covers what the loss function itself does across rows."""
    num = den = 0.0
    n = whole[0].shape[0] if whole and whole[0].dim() > 0 else 0
    for j, w in enumerate(whole):
        if w.dim() == 0 or w.shape[0] != n or not w.is_floating_point():
            continue
        parts = [out[j] if j < len(out) else None for out in split]
        if any(p is None or p.shape != w[a:b].shape for p, (a, b) in zip(parts, pieces, strict=True)):
            continue
        for p, (a, b) in zip(parts, pieces, strict=True):
            num += (w[a:b].double() - p.double()).pow(2).sum().item()
        den += w.double().pow(2).sum().item()
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return math.sqrt(num / den) if math.isfinite(num) else math.inf


def count_rows(inputs) -> int:
    t = first_tensor(inputs)
    return int(t.shape[0]) if t is not None and t.dim() > 0 else 0


def first_tensor(obj):
    return next(iter(tensors(obj)), None)


def tensors(obj) -> list[torch.Tensor]:
    """The tensors in a module's input or output (a tensor, tuple/list, dict or ModelOutput), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):  # also transformers' ModelOutput
        return [t for v in obj.values() for t in tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors(v)]
    if hasattr(obj, "select_rows"):  # a typed batch (data/image_rows.py ImageTextBatch): its token ids first
        return tensors(list(vars(obj).values()))
    return []


def rows_of(obj, a: int, b: int, n: int):
    """Rows ``a:b`` of every tensor in ``obj`` whose first dimension is the micro-batch's ``n`` rows."""
    if isinstance(obj, torch.Tensor):
        return obj[a:b] if obj.dim() > 0 and obj.shape[0] == n else obj
    if hasattr(obj, "select_rows"):  # a typed batch whose tensors are not all by row (images)
        return obj.select_rows(a, b)
    if isinstance(obj, dict):
        return type(obj)({k: rows_of(v, a, b, n) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)):
        return type(obj)(rows_of(v, a, b, n) for v in obj)
    return obj


def forward(model, inputs, target, *, ctx, keys, rows) -> tuple[float, list[torch.Tensor]]:
    """The loss objective's sum over ``rows`` (a, b) of the micro-batch, as the step computes it
    (on the step's device, under its autocast, with the rows' keyed draws), and the model's output tensors."""
    a, b = rows
    n = count_rows(inputs)
    x = to_device(rows_of(inputs, a, b, n), ctx.device)
    y = to_device(rows_of(target, a, b, n), ctx.device)
    with maybe_keyed_draws(ctx.draw_sites, None if keys is None else keys[a:b]), ctx.amp.autocast():
        output = model(x)
        s, _ = ctx.objectives[0].loss_fn(output, y)
    s = s.full_tensor() if hasattr(s, "full_tensor") else s
    return float(s.detach().double()), [t.detach() for t in tensors(output)]


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a - b)


@contextlib.contextmanager
def preserved(model: nn.Module):
    """The generators (torch CPU and CUDA, numpy, Python), the modules' buffers and their
    train/eval modes as they were before the body."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    modes = [(m, m.training) for m in model.modules()]
    try:
        with kept_rngs():
            yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for m, training in modes:
            m.training = training


# --- which module: the second pass, with hooks ------------------------------------------------


@dataclass
class Call:
    name: str
    module: nn.Module
    parent: int | None  # index of the enclosing call in the pass's calls, in start order
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor] | None = None
    drew: bool = False  # the global CPU or CUDA generator advanced during it


class Recorder:
    """Forward hooks on every module of ``model`` recording each call (start order), its inputs
    and outputs (copies: an in-place module would change them later) and whether it drew from
    the global generators."""

    def __init__(self, model: nn.Module):
        self.names = site_names(model)
        self.calls: list[Call] = []
        self.finished: list[int] = []  # call indices in the order they finished
        self.stack: list[tuple[int, torch.Tensor, object]] = []
        self.handles = []
        for m in model.modules():
            self.handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.handles.append(m.register_forward_hook(self._post))

    def _pre(self, module, args, kwargs):
        parent = self.stack[-1][0] if self.stack else None
        self.calls.append(
            Call(self.names.get(id(module), "?"), module, parent, [t.clone() for t in tensors((args, kwargs))])
        )
        self.stack.append((len(self.calls) - 1, *rng_states()))

    def _post(self, module, args, output):
        i, cpu, cuda = self.stack.pop()
        call = self.calls[i]
        call.outputs = [t.clone() for t in tensors(output)]
        now_cpu, now_cuda = rng_states()
        call.drew = not torch.equal(cpu, now_cpu) or (cuda is not None and not torch.equal(cuda, now_cuda))
        self.finished.append(i)

    def reset(self):
        self.calls, self.finished, self.stack = [], [], []

    def remove(self):
        for h in self.handles:
            h.remove()


def rng_states():
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.random.get_rng_state(), cuda


def joined(parts: list[list[torch.Tensor]], n: int) -> list[torch.Tensor | None]:
    """The split passes' tensors of one call joined along the rows (None where a tensor's first
    dimension is not the rows, e.g. a transposed layout or a scalar)."""
    out = []
    for group in zip(*parts, strict=False):
        if all(t.dim() > 0 for t in group) and sum(t.shape[0] for t in group) == n:
            try:
                out.append(torch.cat(group))
            except RuntimeError:  # shapes past the rows differ (padding per micro-batch)
                out.append(None)
        else:
            out.append(None)
    return out


def differs(whole: list[torch.Tensor], split: list[torch.Tensor | None], tol: float) -> bool | None:
    """Whether any comparable tensor differs (None: nothing comparable)."""
    seen = False
    for a, b in zip(whole, split, strict=False):
        if b is None or a.shape != b.shape:
            continue
        seen = True
        if a.is_floating_point() or a.is_complex():
            num = (a.double() - b.double()).norm().item()
            den = a.double().norm().item()
            if not num <= tol * den + 1e-30:  # also NaN against a number
                return True
        elif not torch.equal(a, b):
            return True
    return None if not seen else False


def first_difference(model, inputs, target, *, ctx, keys, pieces, tol) -> str:
    """The one-line account of where the split changes the forward: the first module (in the
    order calls finish) whose output differs with its input the same, and its likely cause."""
    rec = Recorder(model)
    try:
        passes = []
        for piece in pieces:
            rec.reset()
            forward(model, inputs, target, ctx=ctx, keys=keys, rows=piece)
            passes.append((rec.calls, rec.finished))
    finally:
        rec.remove()
    (whole, order), *split = passes
    n = count_rows(inputs)
    if any(len(calls) != len(whole) for calls, _ in split):
        return (
            "the modules called differ between the whole and the split forward (control flow that depends on the rows)"
        )
    for i in order:
        call = whole[i]
        out = differs(call.outputs or [], joined([calls[i].outputs or [] for calls, _ in split], n), tol)
        if not out:
            continue
        inp = differs(call.inputs, joined([calls[i].inputs for calls, _ in split], n), tol)
        if inp and call.parent is not None:  # the parent's own code before this call changed its input
            parent = whole[call.parent]
            return f"first differing module: {label(parent)}, in its own forward before {call.name!r}: {cause(parent, ctx)}"
        return f"first differing module: {label(call)}: {cause(call, ctx)}"
    return (
        "every module's output is the same whole and split, so the loss function is: its sum over the rows depends"
        " on how they are split (a mean per micro-batch, or a computation across rows); return the sum over items"
        " and their count"
    )


def label(call: Call) -> str:
    return f"{call.name or '(the model)'!r} ({type(call.module).__name__})"


def cause(call: Call, ctx) -> str:
    m = call.module
    if isinstance(m, nn.modules.batchnorm._BatchNorm):
        return "batch statistics (BatchNorm): set batch.norm_group > 0 (fixed groups, docs/batch-math.md) or use GroupNorm/LayerNorm"
    if call.drew or (isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 and ctx.draw_sites is None):
        return "random draws outside the keyed path (run.keyed_random = false, or a draw it does not cover: docs/randomness.md)"
    return "a computation over the batch (e.g. a loss or a normalisation across rows) or random draws outside the keyed path"
