"""Objectives: what a training step computes, plugged into the one step (step.py).

The step is a small core: count, forward/backward, reduce, clip, step. Everything it
differentiates and logs besides that comes from its objectives, each one term of the loss::

    term = (sum over the global batch's units of a per-unit loss) / (global count of units)

A *unit* is what the normaliser counts (a target token, a sample, a sequence, later a pair, a
group of samples, the whole global batch). The count is formed over the whole global batch
before the first backward (architecture: "never average micro-batch means"), in the step's one
count: every objective's units ride one small all-reduce with the step's token count, or none
at all when every objective can say its count from the shapes alone (:meth:`Objective.static_count`).

An objective's life (objectives/base.py; ``count``, ``start``, ``loss`` are required, the other
hooks have defaults that do nothing):

0. ``bind(model)`` once, with the parallelised model (a pipeline rank holds some modules), then
   ``attach(world)``: the frozen models it names in ``frozen`` and the pipeline (build/frozen.py).
1. ``count(inputs, target)`` per micro-batch, before any forward (whole rows: before context
   parallel cuts them); ``static_count(inputs)`` when the count needs no collective.
2. ``start(scale=..., device=...)`` with ``scale = dp x cp / units`` (DDP and FSDP average
   gradients over the ranks: times ``dp x cp`` turns that back into the sum), then
   ``before_micro_batches(model, batches)``: an optional phase over this rank's whole global
   batch before the loop (a cached or two-pass objective's first pass, a generation phase).
3. Per micro-batch ``loss(output, target)``: its sum with its graph, times ``scale``, which the
   step adds to the micro-batch's backward; ``end_micro_batch()`` once that backward is done.
4. ``sums()``: float64 sums that ride the step's one reduce of the loss (no collective of their
   own), e.g. the loss sum and its own count, router statistics.
5. ``read(reduced, units=...)``: values from the reduced sums (and checks, raised on every rank
   alike because every rank has the same reduced numbers); ``metrics(values)``: metrics.jsonl
   columns.
6. In evaluation (the loss alone): ``before_micro_batches`` when ``first_pass_in_eval`` (a
   preference loss's reference, a teacher), ``eval_add(reduced)`` after each eval step and
   ``eval_metrics()`` after the evaluation (``val_`` columns: recall@1, reward accuracy).

The first objective of a step is *the* loss: its ``read`` gives ``loss``, the logged mean, and
its sums come first in the reduce. The others add terms and values (``StepResult.extras``). Objectives are stateful per step (``start`` resets them) and built once
per run (:func:`build_objectives`).

Under pipeline parallel (distributed/pipeline_parallel.py) the schedule runs the micro-batches:
the first objective's ``loss_fn`` is the schedule's loss on the last stage and the schedule's
sums come back through ``add``; an objective whose sum is left by modules of the model
(``modules``, the MoE routers) is taken after the forward of the stage that holds them
(``take``/``add``) and joins that stage's backward. An objective of another kind is refused
under pipeline parallel.

Keyed draws are not an objective: the step draws each micro-batch's dropout from its rows'
keys (``StepContext.draw_sites``, paratrain/randomness.py), whatever the objectives. A loss over
the whole global batch (objectives/batch_loss.py, the gradient cache) and BatchNorm's running
statistics over fixed groups (objectives/batch_norm.py) and the preference losses over pairs
(objectives/preference.py: a pair per row, the reference's log-probabilities in
``before_micro_batches``), distillation (objectives/distill.py: the teacher's forward per
micro-batch) and GRPO's policy-gradient losses (objectives/policy_gradient.py: unit = a
completion or a completion token) are built. GRPO's generation is not a hook of the step: it
makes the batches of a whole round of steps (``rl.steps_per_generation``), so it is a phase of
the loop (paratrain/objectives/rl/rollout.py) whose rows carry everything the loss needs (old and reference
log-probabilities, advantages, weights; docs/structure.md).
"""

from __future__ import annotations

from torch import nn

from paratrain.loss import Loss
from paratrain.objectives.base import Objective
from paratrain.objectives.batch_loss import BatchLoss
from paratrain.objectives.batch_norm import NormStatistics
from paratrain.objectives.distill import DistillLoss
from paratrain.objectives.items import ItemLoss
from paratrain.objectives.moe import BalanceLoss
from paratrain.objectives.preference import PreferenceLoss


def build_objectives(
    loss_fn: Loss,
    model: nn.Module | None = None,
    *,
    items_per_sample: int | None = None,
    pipeline: bool = False,
    norm=None,
    positions=None,
    dp_rank: int = 0,
    dp: int = 1,
    dp_group=None,
    own: Objective | None = None,
) -> tuple:
    """A run's objectives: the loss (the built-in token or item loss, a user's ``(sum, count)``
    loss or the chunked cross-entropy, :class:`ItemLoss`; a loss over the whole global batch,
    :class:`BatchLoss`), then the balance loss of a mixture of experts when ``model`` has router
    layers (:class:`BalanceLoss`, built from the whole model, before any parallelism: under
    ``pipeline`` a stage holds some of its layers, and the stages' layers are bound after the
    split, ``BalanceLoss.bind``), then BatchNorm's running statistics when ``norm`` (the model's
    BatchNorm groups, models/batch_norm.py) is given (:class:`NormStatistics`). ``own``: a loss
    that is its own objective, built with its second model by build/frozen.py (:class:`PreferenceLoss`
    over pairs with its reference, :class:`DistillLoss` with its teacher)."""
    if own is not None:
        first = own
    elif loss_fn.over_batch:
        group = norm.group if norm is not None else 0
        first = BatchLoss(loss_fn, positions=positions, dp_rank=dp_rank, dp=dp, dp_group=dp_group, norm_group=group)
    else:
        first = ItemLoss(loss_fn, items_per_sample=items_per_sample)
    objectives: list = [first]
    balance = BalanceLoss.of(model, pipeline=pipeline) if model is not None else None
    if balance is not None:
        objectives.append(balance)
    if norm is not None:
        objectives.append(NormStatistics(norm))
    return tuple(objectives)


__all__ = [
    "BalanceLoss",
    "BatchLoss",
    "DistillLoss",
    "ItemLoss",
    "NormStatistics",
    "Objective",
    "PreferenceLoss",
    "build_objectives",
]
