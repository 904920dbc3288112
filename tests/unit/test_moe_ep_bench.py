"""benchmarks/parallel/moe_ep.py's logic that its figures rest on (no timing, no process started): the dense
twin has the MoE's active parameters, every layout it launches passes the preflight as the layout
it claims, the all_to_all bytes it compares against are plan/cost.py's formula per step, and a
run whose own files contradict its layout is refused."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from paratrain.config import load_config
from paratrain.preflight import check_run
from paratrain.testing.dist_utils import REPO
from paratrain.testing.moe_ep import a2a_formula, layouts, overrides, param_counts, read_run


def bench_args(**kw) -> argparse.Namespace:
    args = dict(n_layer=2, n_head=4, d_model=32, seq=16, batch=8, experts=4, top_k=2, shared=0, steps=5)
    return argparse.Namespace(**{**args, **kw})


@pytest.mark.parametrize("shared", [0, 1])
def test_dense_twin_has_the_active_parameters(shared):
    a = bench_args(shared=shared)
    counts = param_counts(a)
    d, k = a.d_model, a.top_k + shared
    # Per MoE layer the active part differs from the dense MLP of width k x 4 d only by the
    # router (experts x d, no bias) and the k - 1 extra output biases of k MLPs against one.
    assert counts["moe_active"] - counts["dense"] == a.n_layer * (a.experts * d + (k - 1) * d)
    assert counts["moe_layers"] == a.n_layer
    assert counts["moe_total"] > counts["moe_active"]


@pytest.mark.parametrize("world", [2, 4])
def test_every_layout_passes_the_preflight_as_claimed(world, tmp_path):
    a = bench_args()
    eps = {2: [1, 2], 4: [1, 2, 4]}[world]
    assert layouts(world, a) == [(f"moe ep {ep}", ep, True) for ep in eps] + [("dense", 1, False)]
    for _, ep, moe in layouts(world, a):
        cfg = load_config(os.path.join(REPO, "configs", "debug.toml"), overrides(a, world, ep, moe, str(tmp_path)))
        dims, plan = check_run(cfg, world)
        assert (cfg.parallel.ep, dims.dp_replicate, plan.global_batch_size, plan.accum_steps) == (ep, world, 8, 1)
        assert ("moe" in cfg.model.args) == moe
        if not moe:
            assert cfg.model.args["mlp_ratio"] == 4 * a.top_k


def test_a2a_formula_is_the_planners_per_step():
    a = bench_args(d_model=128, seq=64, batch=32)
    # world 2, ep 2: 1024 tokens per rank, 2 slots, 128 floats of 4 bytes, half to the other rank,
    # dispatch + combine, forward + backward, 2 layers: 4 MiB.
    assert a2a_formula(a, 2, 2, moe_layers=2) == 2 * 2 * 2 * 1024 * 2 * 128 * 4 / 2 == 4 * 2**20
    assert a2a_formula(a, 4, 1, moe_layers=2) == 0
    assert a2a_formula(a, 4, 4, moe_layers=2) == 2 * 2 * 2 * 512 * 2 * 128 * 4 * 3 / 4


def fake_run(out, *, world: int, ep: int, held: int, steps: int = 5) -> None:
    """A run's files as the trainer and the worker write them (only the fields read)."""
    os.makedirs(out)
    with open(os.path.join(out, "config.toml"), "w") as f:
        f.write(f"[parallel]\nep = {ep}\n[model.args]\nmoe = {{n_experts = 4}}\n")
    batch = {"dp": world, "micro_batch_size": 8 // world, "accum_steps": 1}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump({"world_size": world, "batch": batch}, f)
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        for i in range(steps):  # loop iterations 1 s (warm-up), then 0.5 s
            row = {"world_size": world, "global_batch_size": 8, "time": i if i < 4 else 3 + 0.5 * (i - 3)}
            f.write(json.dumps({**row, "aux_loss": 0.1, "loss": 2.0}) + "\n")
    for r in range(world):
        with open(os.path.join(out, f"rank{r}.json"), "w") as f:
            json.dump(
                {"params": 4, "grads": 4, "optim": 8 * r, "local_experts": [held], "rss_peak": 1, "a2a_bytes": 10}, f
            )


def test_a_run_is_read_only_when_it_ran_as_claimed(tmp_path):
    a = bench_args()
    fake_run(tmp_path / "ok", world=2, ep=2, held=2)
    run = read_run(str(tmp_path / "ok"), a=a, world=2, ep=2, moe=True)
    assert (run["step_s"], run["state"], run["a2a"]) == (0.5, 16, 2)  # warm-up out; worst rank; per step
    # The config says ep 2 but every rank kept all 4 experts: ep did not happen.
    fake_run(tmp_path / "no-ep", world=2, ep=2, held=4)
    with pytest.raises(SystemExit, match="experts per rank"):
        read_run(str(tmp_path / "no-ep"), a=a, world=2, ep=2, moe=True)
