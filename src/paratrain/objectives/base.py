"""The objective interface. The package docstring (objectives/__init__.py) says when the step
calls each hook; docs/structure.md has the examples."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class Objective:
    """One term of a step's loss, ``sum over the global batch's units / their global count``.

    A subclass gives :meth:`count`, :meth:`start` and :meth:`loss` (and most often :meth:`sums`
    and :meth:`read`); the other hooks do nothing by default. An objective whose micro-batch sum is left by modules of the
    model (the routers of a mixture of experts) also has ``take(modules)`` and
    ``add(modules, sum, stats)``, which a pipeline stage calls for the modules it holds.
    """

    name = "objective"
    unit = "item"  # what count() counts, in words (docs, errors)
    # Whether its units are target tokens (logged as trainable_tokens too, trainer.metrics_row),
    # not samples, pairs or completions.
    counts_target_tokens = False
    # The metrics-row keys (fnmatch patterns) a user watches for this objective, shown on the
    # console beside the loss (observability/metrics.py progress_fields): issue 60.
    watched: tuple[str, ...] = ()
    # Modules whose forward leaves this objective's micro-batch sum; () for a loss of the output.
    modules: tuple[nn.Module, ...] = ()

    # --- 1. the count, before any forward

    def count(self, inputs, target) -> torch.Tensor | float:
        """This micro-batch's units (a number or a 0-dim tensor), from its whole rows on the
        host: the step sums them over micro-batches and ranks before the first backward."""
        raise NotImplementedError

    def static_count(self, inputs) -> int | None:
        """The same units known from the rows' shapes alone, or None. When every objective of
        the step knows its count so, the count needs no collective (each data-parallel rank holds
        as many rows of the same shape: the global count is this rank's times dp)."""
        return None

    # --- 2. optional phase over the whole global batch

    def before_micro_batches(self, model: nn.Module, batches: Sequence[tuple], *, forward=None) -> None:
        """Before the micro-batch loop, with this rank's whole global batch (whole rows, on the
        host): a first pass (cached or two-pass objectives), a generation phase. ``forward(k)``:
        micro-batch ``k``'s output without a graph, under the step's autocast and keyed draws
        (step.no_grad_forward). Its collectives, if any, are its own and must be issued alike
        on every rank."""

    # The eval step runs before_micro_batches too (without keyed draws): a loss whose value
    # needs the first pass (a preference loss's reference log-probabilities).
    first_pass_in_eval = False

    # --- 3. the micro-batches

    def bind(self, model: nn.Module) -> None:
        """Once, with the model the step runs (after the parallelisms: a pipeline rank holds
        only some of the modules)."""

    # The frozen models this objective asks for, by name: "reference" (the model its plug-in's
    # ``reference`` config key names: the initial policy, the policy with its adapters off, or a
    # model directory), "teacher" (``distill.teacher``). The build copies the initial policy
    # before the parallelisms only when a reference is asked for.
    frozen: tuple[str, ...] = ()

    def attach(self, world) -> None:
        """Once, after :meth:`bind`: take what this objective needs of the laid-out run from
        ``world`` (build/frozen.py ``Frozen``): ``world.pipeline`` (the PipelineModel, or None),
        ``world.reference()`` and ``world.teacher()`` (the frozen models of :attr:`frozen`, laid
        out like the policy), ``world.policy_forward()`` (under pp: rows forward through the
        policy's pipeline). One interface for every objective: the build sets no attribute of a
        concrete objective (issue 54)."""

    def start(self, *, scale: float, device: torch.device) -> None:
        """A new step: the sums are zero; each micro-batch term is times ``scale`` (``dp x cp /
        units``: DDP and FSDP average gradients over the ranks, times dp x cp makes that the sum)."""
        raise NotImplementedError

    def loss(self, output, target) -> torch.Tensor | None:
        """This micro-batch's term, with its graph, times ``scale``, which the step adds to the
        micro-batch's backward (None: nothing to add). Runs under the step's autocast, after
        the model's forward."""
        raise NotImplementedError

    def end_micro_batch(self) -> None:
        """After the micro-batch (its backward, in training): keep what it summed."""

    # --- under pipeline parallel (distributed/pipeline_parallel.py), declared here, never probed.
    # The first objective is the schedule's loss on the last stage: by default its ``loss_fn``
    # (a loss.py function, objectives/items.py), whose sums the schedule keeps and hands back
    # through ``add``. The others must be terms left by modules of the model, which each stage
    # takes for the modules it holds (``take``/``add``: the MoE routers, objectives/moe.py).
    pipeline_stage_term = False  # this objective's term is taken per stage (take/add)
    pipeline_rows = False  # as the loss: it keeps its own sums per row (the three hooks below)

    def pipeline_target(self, target: torch.Tensor) -> torch.Tensor:
        """The schedule's target for the rank's whole batch (e.g. with each row's index, so a
        piece of rows knows which rows it holds)."""
        return target

    def pipeline_loss(self, output, target: torch.Tensor):
        """The schedule's loss of one piece of rows on the last stage: ``(sum times scale, count)``."""
        raise NotImplementedError

    def pipeline_done(self, *, last: bool) -> None:
        """After the schedule's run: gather the pieces' sums (``last``: this rank holds the last stage)."""
        raise NotImplementedError

    # --- 4. the reduce

    def sums(self) -> torch.Tensor | None:
        """1-d float64 sums that ride the step's one reduce (None: none). The same length on
        every rank and every step of a run."""
        return None

    # --- 5. metrics

    def read(self, reduced: list[float], *, units: int) -> dict:
        """Values from this objective's reduced ``sums`` (``StepResult.extras``, the same on
        every rank, so a check raised here is raised by every rank together)."""
        return {}

    def metrics(self, values: dict) -> dict:
        """metrics.jsonl columns from the step's ``extras``."""
        return {}

    # --- 6. evaluation (the first objective only: the eval step runs the loss alone)

    def eval_add(self, reduced: list[float]) -> None:
        """After each eval step: its reduced ``sums`` (the loss sum and count first)."""

    def eval_metrics(self) -> dict:
        """After an evaluation: its values over every eval step (logged as ``val_`` + name), then forgotten."""
        return {}
