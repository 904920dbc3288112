"""The acceptance test: a layout (processes x accumulation) never changes the math."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from paratrain.testing.dist_utils import plain_sgd, read_metrics, run_ranks, train_rank

TOY = [
    "model.args={n_layer = 2, n_head = 2, d_model = 32, block_size = 16, vocab_size = 32}",
    "data.factory='paratrain.testing.toy:toy_lm'",
    "data.args={n = 64, seq_len = 16, vocab = 32}",
    "batch.global_batch_size=8",
    "run.steps=10",
    "run.progress=false",
    "metrics.plot=false",
    "optim.lr=3e-3",
    "optim.warmup_steps=2",
]
# The layouts compared to 1e-5 train under plain SGD: their rounding differences stay at rounding size over
# the 10 steps, where AdamW turns a near-zero gradient's sign into a step of lr and grows them step by step.
EXACT = plain_sgd(0.3)


def run_layout(tmp_path, name: str, world: int, micro: int, extra: list[str] = ()) -> tuple[list[float], dict]:
    out = str(tmp_path / name)
    summaries = run_ranks(train_rank, world, [*TOY, f"batch.micro_batch_size={micro}", f"run.out_dir='{out}'", *extra])
    # Every rank agrees on the (all-reduced) loss.
    for s in summaries[1:]:
        assert s["losses"] == summaries[0]["losses"]
    assert summaries[0]["batch"]["accum_steps"] == 8 // (micro * world)
    return summaries[0]["losses"], load_file(os.path.join(out, "model.safetensors"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_layout(tmp_path_factory.mktemp("ref"), "ref", 1, 8, EXACT)


@pytest.mark.parametrize("world,micro", [(1, 2), (2, 2), (2, 4)], ids=["1proc-acc4", "2proc-acc2", "2proc-acc1"])
def test_layout_invariance(tmp_path, reference, world, micro):
    ref_losses, ref_params = reference
    losses, params = run_layout(tmp_path, "run", world, micro, EXACT)
    assert len(losses) == 10
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert params.keys() == ref_params.keys()
    for k in ref_params:
        torch.testing.assert_close(params[k], ref_params[k], rtol=1e-5, atol=1e-7, msg=lambda m: f"{k}: {m}")


def test_four_ranks_match_reference(tmp_path, reference):
    losses, _ = run_layout(tmp_path, "w4", 4, 1, EXACT)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference[0]), rtol=1e-5, atol=0)


def eval_loss(params: dict) -> float:
    """The true loss (mean over every target token) of trained weights on one fixed batch."""
    from paratrain.models import build_gpt
    from paratrain.testing.toy import toy_lm

    model = build_gpt(n_layer=2, n_head=2, d_model=32, block_size=16, vocab_size=32)
    model.load_state_dict(params)
    data = toy_lm(n=64, seq_len=16, vocab=32)
    x, y = data.x[:32], data.y[:32]
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100).item()


def test_mean_of_micro_batch_means_breaks_invariance(tmp_path):
    """The same data through the 2024 bug (averaging micro-batch means) depends on the layout.

    The logged loss of step 1 differs by definition (it is a different average), so the proof is
    what training produced: the weights, and the true loss of those weights on one fixed batch.
    """
    # The probe stops this loss at the start (a mean per micro-batch); accepted to see what it trains.
    bug = ["loss.name='paratrain.testing.toy:mean_of_means'", "run.layout_dependent=true"]
    one, one_params = run_layout(tmp_path, "acc1", 1, 8, bug)
    four, four_params = run_layout(tmp_path, "acc4", 1, 2, bug)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(torch.tensor(four), torch.tensor(one), rtol=1e-5, atol=0)
    # The trained weights differ, far beyond the tolerance the correct layouts meet above ...
    worst = max(((four_params[k] - one_params[k]).norm() / one_params[k].norm()).item() for k in one_params)
    assert worst > 1e-3, worst
    # ... and so does the true loss of those weights on a fixed evaluation batch, while the
    # correct loss gives the same weights whatever the accumulation (test_layout_invariance).
    e1, e4 = eval_loss(one_params), eval_loss(four_params)
    assert abs(e1 - e4) / e1 > 1e-4, (e1, e4)


# ----------------------------------------------------------------------------- gradient scale

SGD = [*plain_sgd(0.3), "run.steps=4"]  # a dropped dp factor or a schedule's 1/n left on shows
FAULT = ["model.factory='paratrain.testing.toy:gpt_scaled_grad'"]  # x2 on every rank of a multi-process job
# The bitwise variant (run.bitwise, issue 59): the same layouts, zero tolerance. A fault of any size
# fails it: the gradient x (1 + 2^-21), which the 1e-5 comparison cannot see.
BITWISE = ["run.bitwise=true", "run.bitwise_grain=2"]
NUDGED = [
    FAULT[0],
    "model.args={n_layer = 2, n_head = 2, d_model = 32, block_size = 16, vocab_size = 32, factor = 1.000000476837158}",
]


def train_many(runs: list[list[str]]) -> list[list[float]]:
    """On each rank: one process group, several trainings; per run its losses."""
    import torch.distributed as dist

    import paratrain

    dist.init_process_group("gloo")
    try:
        return [paratrain.train(paratrain.load_config(None, [*TOY, *overrides]))["losses"] for overrides in runs]
    finally:
        dist.destroy_process_group()


def assert_same_run(got: dict, ref: dict, *, rtol: float = 1e-5) -> None:
    """Layout run ``got`` computes what reference ``ref`` does: grad norms, losses, weights."""
    assert len(got["losses"]) == len(ref["losses"])
    torch.testing.assert_close(
        torch.tensor(got["grad_norms"]),
        torch.tensor(ref["grad_norms"]),
        rtol=rtol,
        atol=0,
        msg=lambda m: f"grad_norm: {m}",
    )
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=rtol, atol=0)
    for k in ref["params"]:
        torch.testing.assert_close(got["params"][k], ref["params"][k], rtol=rtol, atol=1e-7, msg=lambda m: f"{k}: {m}")


def sgd_runs(tmp_path, world: int, runs: dict[str, list[str]]) -> dict[str, dict]:
    sets = [[*SGD, *extra, f"run.out_dir='{tmp_path / name}'"] for name, extra in runs.items()]
    per_rank = run_ranks(train_many, world, sets)
    out = {}
    for i, name in enumerate(runs):
        assert all(r[i] == per_rank[0][i] for r in per_rank)  # every rank logs the same loss
        out[name] = {
            "losses": per_rank[0][i],
            "grad_norms": [row["grad_norm"] for row in read_metrics(str(tmp_path / name))],
            "params": load_file(str(tmp_path / name / "model.safetensors")),
        }
    return out


def test_sgd_gradient_matches_and_a_constant_factor_is_caught(tmp_path):
    """DDP x accumulation under plain SGD: the same grad norms and weights as one process; a
    layout whose gradient is doubled (src/paratrain/testing/toy.py:gpt_scaled_grad) fails the same comparison,
    while under AdamW its losses would pass."""
    adamw = ["optim.name='adamw'", "optim.lr=3e-3"]
    one = ["batch.micro_batch_size=8"]
    refs = sgd_runs(tmp_path / "w1", 1, {"ref": one, "adamw": [*one, *adamw], "ref_bitwise": [*one, *BITWISE]})
    ref = refs["ref"]
    runs = sgd_runs(
        tmp_path / "w2",
        2,
        {
            "acc2": ["batch.micro_batch_size=2"],
            "acc2_doubled": ["batch.micro_batch_size=2", *FAULT],
            "adamw_doubled": ["batch.micro_batch_size=2", *FAULT, *adamw],
            "acc2_bitwise": ["batch.micro_batch_size=2", *BITWISE],
            "acc2_nudged_bitwise": ["batch.micro_batch_size=2", *NUDGED, *BITWISE],
        },
    )
    assert abs(ref["losses"][-1] - ref["losses"][0]) > 1e-3  # the weights really move at this lr
    assert_same_run(runs["acc2"], ref)
    with pytest.raises(AssertionError, match="grad_norm"):
        assert_same_run(runs["acc2_doubled"], ref)
    assert runs["acc2_doubled"]["grad_norms"][0] == pytest.approx(2 * ref["grad_norms"][0], rel=1e-5)
    # The blind spot this closes: AdamW trains the doubled gradient to (nearly) the same losses. Its drift
    # between these layouts measured at most 1.7e-7 over the 4 steps (AMD EPYC, torch 2.13 CPU), under 1e-4.
    torch.testing.assert_close(
        torch.tensor(runs["adamw_doubled"]["losses"]), torch.tensor(refs["adamw"]["losses"]), rtol=1e-4, atol=0
    )
    # The bitwise variant: DDP x accumulation gives one process's bits; the nudged gradient passes
    # the 1e-5 comparison and fails this one.
    assert_bitwise(runs["acc2_bitwise"], refs["ref_bitwise"])
    assert_same_run(runs["acc2_nudged_bitwise"], refs["ref_bitwise"])
    with pytest.raises(AssertionError, match="not bitwise"):
        assert_bitwise(runs["acc2_nudged_bitwise"], refs["ref_bitwise"])


def assert_bitwise(got: dict, ref: dict) -> None:
    """Zero tolerance: the same losses, grad norms and weights, bit for bit."""
    apart = [k for k in ("losses", "grad_norms") if got[k] != ref[k]]
    apart += [k for k in ref["params"] if not torch.equal(got["params"][k], ref["params"][k])]
    assert not apart, f"not bitwise equal: {apart[:5]}"
