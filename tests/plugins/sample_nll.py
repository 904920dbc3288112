"""A user's objective as a plug-in (objectives/registry.py): the mean over the global batch's
samples of each sample's mean token negative log-likelihood. Its unit is a sample, so a sample of
few target tokens weighs as much as one of many (the token mean weighs them by their length).

``plugin``: exact (its sums ride the step's reduce, its normaliser is the global sample count).
``per_micro_batch``: each micro-batch's own mean, the mistake a loss written for one forward makes
under accumulation: k micro-batches add k means, a gradient k times too large (data parallelism
alone hides it: DDP averages the ranks' means).
"""

from __future__ import annotations

import torch

from paratrain.objectives.base import Objective
from paratrain.objectives.registry import Plugin

IGNORE = -100


class SampleNLL(Objective):
    name = "loss"
    unit = "sample"

    def __init__(self, *, per_micro_batch: bool = False):
        self.per_micro_batch = per_micro_batch

    def count(self, inputs, target) -> float:
        return float(target.shape[0])

    def static_count(self, inputs) -> int:
        return inputs.shape[0]

    def start(self, *, scale: float, device: torch.device) -> None:
        self.scale, self.device = scale, device
        self.total = torch.zeros(2, dtype=torch.float64, device=device)

    def loss(self, output, target) -> torch.Tensor:
        logp = output.float().log_softmax(-1)
        valid = target != IGNORE
        nll = -logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        per_sample = (nll * valid).sum(-1) / valid.sum(-1).clamp(min=1)
        self.total += torch.stack(
            [per_sample.sum().detach().double(), torch.tensor(len(per_sample), device=self.device)]
        )
        if self.per_micro_batch:  # the mistake: each micro-batch's own mean, whatever the step's count
            return per_sample.mean()
        return per_sample.sum() * self.scale

    def sums(self) -> torch.Tensor:
        return self.total

    def read(self, reduced: list[float], *, units: int) -> dict:
        return {"loss": reduced[0] / units}


# A sample's mean is over its whole row: a context-parallel rank holds a chunk of it, whose mean is
# another number (`paratrain verify --layouts all` shows it: cp off by 1e+00 when not refused).
WHOLE_ROWS = (("cp", "a sample's mean token loss needs the whole row, which context parallel splits"),)

plugin = Plugin("sample_nll", objective=lambda cfg, **_: SampleNLL(), refuses=WHOLE_ROWS)
per_micro_batch = Plugin(
    "sample_nll_per_micro_batch", objective=lambda cfg, **_: SampleNLL(per_micro_batch=True), refuses=WHOLE_ROWS
)
