"""The objective interface (paratrain/objectives, docs/structure.md): an objective written outside
the package plugs into the step through its hooks alone.

The test objective has its own unit (a sample), an extra term in the backward, a sum that rides
the step's reduce, a metric and a phase before the micro-batch loop. Fault it catches: a hook the
step skips or calls in another order, a term normalised per micro-batch instead of over the
global count (accumulation then changes its value and gradient), an extra objective that moves
the loss's own numbers.
"""

from __future__ import annotations

import copy

import pytest
import torch

from paratrain.config import LossConfig
from paratrain.models.gpt import build_gpt
from paratrain.objectives import Objective, build_objectives
from paratrain.objectives.registry import build_loss
from paratrain.step import StepContext, train_step

GPT_ARGS = dict(n_layer=2, n_head=2, d_model=32, block_size=8, vocab_size=32)


class MeanLogitSquare(Objective):
    """weight x the mean over the global batch's samples of (mean logit of the sample)^2."""

    name = "mean_logit_square"
    unit = "sample"

    def __init__(self, weight: float):
        self.weight = weight
        self.calls: list[str] = []
        self.phases: list[int] = []

    def count(self, inputs, target):
        return inputs.shape[0]

    def static_count(self, inputs):
        return inputs.shape[0]

    def before_micro_batches(self, model, batches, *, forward):
        self.phases.append(sum(x.shape[0] for x, _ in batches))

    def start(self, *, scale, device):
        self.calls.append("start")
        self.scale, self.total, self.last = scale, torch.zeros((), dtype=torch.float64, device=device), None

    def loss(self, output, target):
        self.calls.append("loss")
        s = self.weight * output.float().mean(dim=(1, 2)).pow(2).sum()
        self.last = s.detach()
        return s * self.scale

    def end_micro_batch(self):
        self.calls.append("end")
        self.total += self.last.double()

    def sums(self):
        return self.total.reshape(1)

    def read(self, reduced, *, units):
        return {"mean_logit_square": reduced[0] / units, "samples": units}

    def metrics(self, values):
        return {"mean_logit_square": values["mean_logit_square"]}


def _step(model, batches, objectives):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return train_step(model, optimizer, batches, StepContext(objectives=objectives, device=torch.device("cpu")))


def test_a_new_objective_plugs_in_through_its_hooks_alone():
    torch.manual_seed(0)
    base = build_gpt(**GPT_ARGS)
    x = torch.randint(0, 32, (8, 9))
    whole = [(x[:, :-1], x[:, 1:])]
    micro = [(c[:, :-1], c[:, 1:]) for c in x.split(2)]
    loss_fn = build_loss(LossConfig())
    results, extra = {}, {}
    for name, batches, weight in (
        ("one", whole, 0.5),
        ("acc4", micro, 0.5),
        ("zero", whole, 0.0),
        ("none", whole, None),
    ):
        extra[name] = MeanLogitSquare(weight) if weight is not None else None
        objectives = (*build_objectives(loss_fn), *([extra[name]] if extra[name] else []))
        results[name] = _step(copy.deepcopy(base), batches, objectives)

    one, acc = results["one"], results["acc4"]
    # Its hooks, in order: start once, then loss and end per micro-batch; the phase saw the whole batch.
    assert extra["acc4"].calls == ["start", *["loss", "end"] * 4] and extra["acc4"].phases == [8]
    # Normalised by the global sample count before the backward: accumulation changes nothing.
    assert one.extras["samples"] == acc.extras["samples"] == 8
    assert one.extras["mean_logit_square"] > 0
    torch.testing.assert_close(acc.extras["mean_logit_square"], one.extras["mean_logit_square"], rtol=1e-6, atol=0)
    torch.testing.assert_close(acc.grad_norm, one.grad_norm, rtol=1e-5, atol=0)
    assert MeanLogitSquare(1.0).metrics(one.extras) == {"mean_logit_square": one.extras["mean_logit_square"]}
    # Its term is differentiated; the loss's own numbers are not moved by it.
    assert abs(one.grad_norm - results["none"].grad_norm) > 1e-4
    assert results["zero"].grad_norm == results["none"].grad_norm
    assert one.loss == results["none"].loss and one.items == results["none"].items == 64
    assert "mean_logit_square" not in results["none"].extras


def test_kto_reference_point_is_one_mean_over_the_global_batch():
    """KTO's ``z0`` (Ethayarajh et al. 2024): one mean of the KL estimates over every example of
    the global batch that has a KL document, not a mean of per-micro-batch means; micro-batches
    of unequal real counts (a row without a KL target) tell the two apart."""
    from paratrain.objectives.preference import PreferenceLoss

    g = torch.Generator().manual_seed(0)
    t, v = 6, 5
    logits = [torch.randn(2, t, v, generator=g) for _ in range(2)]
    batches, kl_rows = [], []
    for k in range(2):
        target = torch.full((2, 3, t), -1, dtype=torch.long)
        target[:, 0] = -100
        for row in range(2):
            if k == 1 and row == 1:
                continue  # this example's KL document has no target: not counted
            target[row, 0, 3:5] = torch.tensor([1 + row, 2 + k])
            target[row, 1, 3:5] = 1  # side 1: the KL document (the prompt with another completion)
            kl_rows.append((k, row))
        batches.append((torch.zeros(2, 2, t, dtype=torch.long), target))
    objective = PreferenceLoss("kto")
    objective.start(scale=1.0, device=torch.device("cpu"))
    objective.refs = [torch.tensor([[0.0, -20.0], [0.0, -30.0]]), torch.tensor([[0.0, -25.0], [0.0, -1.0]])]
    z0 = objective._kl(batches, lambda k: logits[k])
    gaps = []
    for k, row in kl_rows:
        logp = logits[k][row].log_softmax(-1)
        tokens = batches[k][1][row, 0]
        policy = sum(logp[i, tokens[i]] for i in range(t) if tokens[i] >= 0)
        gaps.append(float(policy) - float(objective.refs[k][row, 1]))
    want = max(0.0, sum(gaps) / len(gaps))
    assert len(gaps) == 3 and want > 0
    assert float(z0) == pytest.approx(want, rel=1e-6)
