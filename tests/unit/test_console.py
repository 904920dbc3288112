"""What a user sees on the console (issue 60): each objective's watched values beside the loss,
and every validation result when it is computed, not only on a progress line's step."""

from __future__ import annotations

import logging

import pytest

from paratrain.objectives.distill import DistillLoss
from paratrain.objectives.policy_gradient import PolicyGradientLoss
from paratrain.objectives.preference import PreferenceLoss
from paratrain.observability.metrics import MetricsWriter


def _row(step: int, **extra) -> dict:
    return {"step": step, "loss": 0.5, "tokens_per_s": 1000.0, "lr": 1e-3, "grad_norm": 1.0, **extra}


@pytest.fixture
def console():
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger("paratrain")
    level, log.level = log.level, logging.INFO
    log.addHandler(handler)
    yield lines
    log.removeHandler(handler)
    log.setLevel(level)


@pytest.mark.parametrize(
    ("objective", "values", "shown"),
    [
        (PreferenceLoss(), {"reward_accuracy": 0.75, "reward_margin": 0.25, "rewards_chosen": 0.1}, 2),
        (PolicyGradientLoss(), {"reward": 0.5, "reward_std": 0.25, "reward_len": 0.75, "clip_ratio": 0.0}, 3),
        (DistillLoss(kind="forward_kl", temperature=1.0, beta=0.0, top_k=0), {"student_ce": 2.5}, 1),
    ],
)
def test_each_objective_prints_its_watched_values(tmp_path, console, objective, values, shown):
    writer = MetricsWriter(str(tmp_path), enabled=True, total_steps=2, progress=True, watched=objective.watched)
    writer.log_step(_row(1, **values))
    writer.close()
    (line,) = console
    assert line.startswith("step 1/2  loss 0.5000")
    printed = [k for k in values if f"  {k} " in line]
    assert len(printed) == shown and "rewards_chosen" not in printed and "clip_ratio" not in printed, line


def test_every_validation_result_is_printed_when_computed(tmp_path, console):
    writer = MetricsWriter(str(tmp_path), enabled=True, total_steps=40, progress=True)  # a line every 2 steps
    for step in (1, 2, 3):
        val = {"val_loss": 1.25, "val_reward_accuracy": 0.5, "val_items": 9} if step in (2, 3) else {}
        writer.log_step(_row(step, **val))
    writer.close()
    assert console[0].startswith("step 2/40  loss 0.5000  tok/s 1000  val_loss 1.2500  val_reward_accuracy 0.5000")
    assert console[1] == "step 3/40  validation: val_loss 1.2500  val_reward_accuracy 0.5000"
    assert len(console) == 2
