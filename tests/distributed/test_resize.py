"""Changing the world size of a run: the composed pp x dp_shard x tp layout at world 8 resumed at
world 4, the adaptive batch across a resize, and the events.jsonl milestones of a start. Each run
is checked against the uninterrupted run of the same config, losses and grad_norm, plain SGD."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

import paratrain
from paratrain.batch.adaptive import BatchAdapter
from paratrain.batch.plan import plan_batch, replan_batch
from paratrain.config import BatchConfig, ConfigError
from paratrain.observability.events import read_events
from paratrain.testing.dist_utils import read_metrics, run_ranks
from paratrain.testing.resilience import SGD, TOY, column, run


def train_layouts(runs: list[list[str]]) -> list[dict]:
    """Several trainings in one process group (one spawn and one torch import per rank)."""
    dist.init_process_group("gloo")
    try:
        return [paratrain.train(paratrain.load_config(None, [*TOY, *SGD, *overrides])) for overrides in runs]
    finally:
        dist.destroy_process_group()


def assert_same_steps(rows: list[dict], want: list[dict], *, rtol: float) -> None:
    assert [r["step"] for r in rows] == [r["step"] for r in want]
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close(column(rows, key), column(want, key), rtol=rtol, atol=0, msg=lambda m: f"{key}: {m}")


# ----------------------------------------------------------------------------- pp x dp_shard x tp

WORLD8 = ["parallel.pp=2", "parallel.dp_shard=2", "parallel.tp=2"]  # 1 block per stage, FSDP2 + TP inside
WORLD4 = {"pp2-tp2": ["parallel.pp=2", "parallel.tp=2"], "fsdp2-tp2": ["parallel.dp_shard=2", "parallel.tp=2"]}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_pp_dp_shard_tp_at_world_8_equals_one_process_and_resumes_at_world_4(tmp_path):
    """pp = 2 x dp_shard = 2 x tp = 2 on 8 gloo ranks trains the single-process run's steps; its
    step-3 checkpoint (stages, FSDP2 shards, TP shards: DCP reshards) resumes at world 4 as
    pp 2 x tp 2 and as dp_shard 2 x tp 2, and steps 4-6 are again the reference's.

    Tolerance rtol 1e-5 on loss and grad_norm: TP and FSDP2 change the order of float32
    reductions (the matmul split over tp, the reduce-scatter over dp_shard), nothing else;
    measured differences are about 3e-7 relative."""
    want = run(str(tmp_path / "one"), 1)
    w8 = str(tmp_path / "w8")
    rows = run(w8, 8, WORLD8)
    assert_same_steps(rows, want, rtol=1e-5)
    assert rows[0]["world_size"] == 8 and rows[0]["accum_steps"] == 1

    src = os.path.join(w8, "checkpoints", "step-3")
    runs = [[*sets, f"run.out_dir='{tmp_path / name}'", f"checkpoint.resume='{src}'"] for name, sets in WORLD4.items()]
    run_ranks(train_layouts, 4, runs, timeout=600)
    for name in WORLD4:
        resumed = read_metrics(str(tmp_path / name))
        assert resumed[0]["world_size"] == 4 and resumed[0]["consumed_samples"] == 4 * 8
        assert_same_steps(resumed, want[3:], rtol=1e-5)


# ----------------------------------------------------------------------------- adaptive batch

ADAPTIVE = [
    "batch.micro_batch_size=2",
    "batch.adaptive=true",
    "batch.max_global_batch_size=12",  # reached at step 2's decision; 12 = 2 x 6 x 1 = 2 x 3 x 2 = 1 x 3 x 4
    "batch.adapt_every=2",
    "batch.noise_ema=0.5",
    "optim.lr_scaling='sqrt'",
    "data.workers=1",  # the loader's worker process, started again at the new position
    "run.steps=8",
    "checkpoint.interval=2",
]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_adaptive_batch_resized_mid_run_continues_exactly(tmp_path):
    """batch.adaptive at world 2 grows the global batch 8 -> 12 at step 2; the step-2 checkpoint
    resumed at world 1 and at world 4 continues with batch 12 (world 4: 12 samples over 4 ranks,
    so the micro-batch shrinks 2 -> 1, batching.replan_batch), the same sample positions and lr
    scale, and the losses and grad_norm of the uninterrupted world-2 run within 1e-5.

    The growth is capped (batch.max_global_batch_size) before the resize on purpose: the noise is
    measured on each rank's first micro-batch, so after a resize a further growth decision may
    differ (docs/batch-size.md); here every later decision is the cap's."""
    full = str(tmp_path / "w2")
    want = run(full, 2, ADAPTIVE)
    assert [r["global_batch_size"] for r in want] == [8, 8, *[12] * 6]
    src = os.path.join(full, "checkpoints", "step-2")
    for world, micro in ((1, 2), (4, 1)):
        out = str(tmp_path / f"w{world}")
        rows = run(out, world, [*ADAPTIVE, f"checkpoint.resume='{src}'"])
        assert rows[0]["world_size"] == world and rows[0]["micro_batch_size"] == micro
        assert rows[0]["accum_steps"] == 12 // (micro * world)
        assert [r["global_batch_size"] for r in rows] == [12] * 6
        assert [r["consumed_samples"] for r in rows] == [r["consumed_samples"] for r in want[2:]]
        torch.testing.assert_close(column(rows, "lr"), column(want[2:], "lr"), rtol=1e-6, atol=0)
        assert_same_steps(rows, want[2:], rtol=1e-5)
        # The noise averages went on from the checkpoint's (2 updates before the resize, 6 after).
        with open(os.path.join(out, "checkpoints", "step-8", "manifest.json")) as f:
            state = json.load(f)["train_state"]
        assert state["grad_noise"]["updates"] == 8 and state["world_sizes"] == [[0, 2], [2, world]]


def test_replan_batch_keeps_the_batch_and_refuses_what_dp_cannot_split():
    assert replan_batch(global_batch_size=12, micro_batch_size=2, dp=4).micro_batch_size == 1
    assert replan_batch(global_batch_size=12, micro_batch_size=2, dp=2).accum_steps == 3
    assert replan_batch(global_batch_size=24, micro_batch_size=4, dp=8).micro_batch_size == 3
    with pytest.raises(ConfigError, match="dp = 8 data-parallel ranks cannot split evenly"):
        replan_batch(global_batch_size=12, micro_batch_size=2, dp=8)


def test_adaptive_cap_follows_the_plan_it_starts_from():
    """Built from the config's plan at world 4 (micro 2 x dp 4 = steps of 8) but started from a
    resumed batch of 12 (micro 1 x 3 x dp 4): the cap 24 is counted in steps of 4, so the batch
    can still grow to 24 (it stopped at 12 before: accumulation 3 was the old cap's)."""
    cfg = BatchConfig(global_batch_size=8, micro_batch_size=2, adaptive=True, max_global_batch_size=24)
    adapter = BatchAdapter(
        cfg, plan=plan_batch(global_batch_size=8, micro_batch_size=2, dp=4), dp_group=None, grow=True
    )
    adapter.start(replan_batch(global_batch_size=12, micro_batch_size=2, dp=4))
    assert (adapter.max_accum, adapter.max_global) == (6, 24)


# ----------------------------------------------------------------------------- events.jsonl


def test_events_record_each_start_and_the_resume(tmp_path):
    """A run and its resume on one rank: each start leaves its milestones, in order, and the
    resume names the checkpoint's step."""
    out = str(tmp_path / "run")
    run(out, 1, ["run.steps=3", "checkpoint.interval=0"])
    run(out, 1, ["run.steps=4", "checkpoint.interval=0", "checkpoint.resume='latest'"])
    events = read_events(out)
    names = ["worker_start", "train_called", "process_group_ready", "checkpoint_loaded", "first_step_done"]
    assert [e["event"] for e in events] == names * 2
    first, second = events[:5], events[5:]
    for start in (first, second):
        times = [e["time"] for e in start]
        assert times == sorted(times) and start[0]["rank"] == 0 and start[0]["world_size"] == 1
    assert first[3]["step"] is None and first[4]["step"] == 1
    assert second[3]["step"] == 3 and second[3]["load_s"] > 0 and second[4]["step"] == 4
