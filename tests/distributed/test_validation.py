"""Validation loss ([eval]): layout-invariant, exact across a resume with loader workers,
`paratrain eval` at another world size, val splits and data.val_factory."""

from __future__ import annotations

import json
import os

import pytest
import torch

from paratrain.config import ConfigError, DataConfig, load_config
from paratrain.data.datasets import build_dataset, build_val_dataset
from paratrain.data.stdlib_bytes import stdlib_corpus
from paratrain.distributed.process_group import free_port
from paratrain.testing.dist_utils import (
    REPO,
    error_lines,
    eval_rank,
    paratrain_cli,
    read_metrics,
    run_ranks,
    train_rank,
)

# A tiny GPT on a slice of the standard library; SGD without momentum or clipping, so a
# gradient off by a constant factor would show in the weights and so in val_loss.
BASE = [
    "run.steps=2",
    "run.progress=false",
    "run.save_model=false",
    "metrics.plot=false",
    "model.args={n_layer=2,n_head=2,d_model=32,block_size=16}",
    "data.args={block_size=16,max_bytes=60000,val_bytes=4000}",
    "batch.global_batch_size=8",
    "batch.micro_batch_size=2",
    "optim.name='sgd'",
    "optim.beta1=0.0",
    "optim.weight_decay=0.0",
    "optim.grad_clip=0.0",
    "optim.lr=0.5",
    "optim.warmup_steps=0",
    "eval.interval=1",
    "eval.samples=32",
]

LAYOUTS = {
    2: {
        "dp2": ["parallel.dp_replicate=2"],
        "fsdp2": ["parallel.dp_replicate=1", "parallel.dp_shard=2"],
        "tp2": ["parallel.dp_replicate=1", "parallel.tp=2"],
        "pp2": ["parallel.dp_replicate=1", "parallel.pp=2", "eval.micro_batch_size=2"],
    },
    4: {
        "dp4": ["parallel.dp_replicate=4", "eval.micro_batch_size=1"],
        "fsdp2_tp2": ["parallel.dp_replicate=1", "parallel.dp_shard=2", "parallel.tp=2"],
        "pp2_dp2": ["parallel.dp_replicate=2", "parallel.pp=2"],
    },
}


def train_layouts(runs: list[tuple[int, list[str]]]) -> list[dict]:
    """One rank of several runs in a row (one process start for all: the CPU is shared)."""
    out = []
    for port, overrides in runs:
        os.environ["MASTER_PORT"] = str(port)  # a fresh store for each run's process group
        out.append(train_rank(overrides))
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("val_ref"))
    run_ranks(train_rank, 1, [*BASE, f"run.out_dir='{out}'", "metrics.tensorboard=true"])
    return out


def test_val_loss_reaches_summary_and_tensorboard(reference):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # an optional extra

    rows = read_metrics(reference)
    val = {r["step"]: r["val_loss"] for r in rows}
    summary = json.load(open(os.path.join(reference, "summary.json")))
    assert summary["final_val_loss"] == val[2] and summary["best_val_loss"] == min(val.values())
    acc = EventAccumulator(os.path.join(reference, "tensorboard"))
    acc.Reload()
    assert {e.step: e.value for e in acc.Scalars("train/val_loss")} == pytest.approx(val, rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_val_loss_is_layout_invariant(tmp_path, reference, world):
    ref_rows = read_metrics(reference)
    ref_val = [r["val_loss"] for r in ref_rows]
    assert len(ref_val) == 2 and all(0 < v < 10 for v in ref_val)
    names = list(LAYOUTS[world])
    runs = [
        (free_port(), [*BASE, *LAYOUTS[world][name], f"run.out_dir='{tmp_path / name}'", "dist.timeout_s=120"])
        for name in names
    ]
    run_ranks(train_layouts, world, runs, timeout=600)
    for name in names:
        rows = read_metrics(str(tmp_path / name))
        tol = 1e-5 if name.startswith("dp") else 1e-4
        got = [r["val_loss"] for r in rows]
        torch.testing.assert_close(got, ref_val, rtol=tol, atol=0, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close([r["grad_norm"] for r in rows], [r["grad_norm"] for r in ref_rows], rtol=tol, atol=0)
        summary = json.load(open(tmp_path / name / "summary.json"))
        assert summary["final_val_loss"] == got[-1] and summary["best_val_loss"] == min(got)


def test_eval_does_not_change_training(tmp_path, reference):
    out = str(tmp_path / "no_eval")
    run_ranks(train_rank, 1, [*BASE, "eval.interval=0", f"run.out_dir='{out}'"])
    assert [r["loss"] for r in read_metrics(out)] == [r["loss"] for r in read_metrics(reference)]
    assert all("val_loss" not in r for r in read_metrics(out))


@pytest.mark.slow
def test_resume_with_loader_workers_is_exact(tmp_path):
    """Uninterrupted vs stopped at step 2 and resumed, with data.workers = 2 (and validation)."""
    common = [
        *BASE,
        "run.steps=4",
        "eval.interval=2",
        "data.workers=2",
        "optim.name='adamw'",
        "optim.lr=0.01",
        "checkpoint.interval=2",
    ]
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    run_ranks(train_rank, 1, [*common, f"run.out_dir='{full}'"])
    # The same run stopped after step 2 (a sample budget: the lr schedule still spans 4 steps),
    # then resumed from the checkpoint of step 2.
    run_ranks(train_rank, 1, [*common, f"run.out_dir='{part}'", "run.max_samples=16"])
    ckpt = os.path.join(part, "checkpoints", "step-2")
    run_ranks(train_rank, 1, [*common, f"run.out_dir='{part}'", f"checkpoint.resume='{ckpt}'"])
    a, b = read_metrics(full), read_metrics(part)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r.get("val_loss") for r in a] == [r.get("val_loss") for r in b]
    assert a[-1]["val_loss"] is not None and a[1]["val_loss"] is not None


@pytest.mark.slow
def test_paratrain_eval_at_another_world_size(tmp_path):
    out = str(tmp_path / "run")
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[run]\nout_dir = '{out}'\n")
    args = [*BASE, "checkpoint.at_end=true"]
    sets = [a for o in args for a in ("--set", o)]
    res = paratrain_cli("train", str(cfg), *sets, timeout=300)
    assert res.returncode == 0, res.stderr
    final_val = json.load(open(os.path.join(out, "summary.json")))["final_val_loss"]
    # Another run.steps than the run's, as docs/validation.md's journey evaluates a run of
    # configs/debug.toml: no "will not continue the same trajectory" warning (eval continues none).
    res = paratrain_cli(
        "eval",
        str(cfg),
        "--checkpoint",
        "latest",
        "--json",
        "--nproc-per-node",
        "2",
        *sets,
        "--set",
        "run.steps=5",
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert "warning" not in res.stderr + res.stdout
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert result["step"] == 2 and result["world_size"] == 2 and result["samples"] == 32
    torch.testing.assert_close(result["val_loss"], final_val, rtol=1e-5, atol=0)
    # A bad path: exit 2 and one line, before any process starts.
    res = paratrain_cli("eval", str(cfg), "--checkpoint", str(tmp_path / "nope"), *sets)
    assert res.returncode == 2 and "no such checkpoint folder" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    # A config of another model: eval's own fix (it said "... or start a new run.out_dir", which eval has none of).
    res = paratrain_cli("eval", str(cfg), "--checkpoint", "latest", *sets, "--set", "model.args.d_model=48")
    assert res.returncode == 2 and "has shape" in res.stderr and "run.out_dir" not in res.stderr, res.stderr
    assert "evaluate it with the config that wrote it" in res.stderr and len(error_lines(res.stderr)) == 1


def test_paratrain_eval_of_grpo_is_one_line(tmp_path):
    """GRPO has no validation set (its data are prompts): the worker built the model and loaded the
    checkpoint before 'data.name has no `split` argument', which named no fix."""
    grpo = os.path.join(REPO, "configs", "grpo.toml")
    res = paratrain_cli("eval", grpo, "--set", f"run.out_dir='{tmp_path}'", cwd=REPO)
    assert res.returncode == 2 and "loss.name = 'grpo' has no validation loss yet" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_stdlib_val_split_is_held_out_and_train_is_unchanged():
    train = build_dataset(DataConfig(args={"block_size": 16, "max_bytes": 50_000}))
    val = build_val_dataset(DataConfig(args={"block_size": 16, "max_bytes": 50_000, "val_bytes": 1000}))
    old = stdlib_corpus(50_000 + 1000)
    assert bytes(train.data.to(torch.uint8).tolist()) == old[:50_000]  # the training bytes of before
    assert len(val) == (1000 - 1) // 16  # all of it (multiple_of = 1)
    assert bytes(val.dataset.data.to(torch.uint8).tolist()) == old[50_000:]


def test_val_factory_and_sample_counts(tmp_path):
    cfg = DataConfig(factory="paratrain.testing.toy:toy_lm", val_factory="paratrain.testing.toy:toy_lm", args={"n": 40})
    val = build_val_dataset(cfg, 0, multiple_of=16)
    assert len(val) == 32  # all 40, rounded down to whole global batches
    assert len(build_val_dataset(cfg, 16, multiple_of=16)) == 16
    with pytest.raises(ConfigError, match="fewer than eval.samples = 48"):
        build_val_dataset(cfg, 48, multiple_of=16)
    with pytest.raises(ConfigError, match="has no `split` argument"):
        build_val_dataset(DataConfig(factory="paratrain.testing.toy:toy_lm"))
    with pytest.raises(ConfigError, match="eval.samples = 20 is not a multiple of batch.global_batch_size"):
        load_config(None, ["eval.samples=20", "batch.global_batch_size=8"])
    with pytest.raises(ConfigError, match="data.val_factory"):
        load_config(None, ["data.val_factory='paratrain.testing.toy:nope'"])


def test_eval_micro_batch_must_divide_and_match_pipeline():
    from paratrain.preflight import check_run

    with pytest.raises(ConfigError, match="eval.micro_batch_size = 3 does not divide the per-rank batch 4"):
        check_run(load_config(None, ["batch.global_batch_size=8", "eval.micro_batch_size=3"]), 2)
    over = ["batch.global_batch_size=8", "batch.micro_batch_size=2", "eval.micro_batch_size=1", "parallel.pp=2"]
    over += ["model.args={n_layer=2,n_head=2,d_model=32,block_size=16}", "parallel.dp_replicate=1"]
    with pytest.raises(ConfigError, match="with parallel.pp > 1 set it to 0"):
        check_run(load_config(None, over), 2)


@pytest.mark.slow  # > 12 s: make test stays under 10 minutes
def test_eval_of_a_pipeline_checkpoint_at_pp2_and_pp1(tmp_path, reference):
    """A pp = 2 run validates like the one-process reference (loss, grad_norm under plain SGD,
    val_loss), and its checkpoint, evaluated at pp = 2 and at pp = 1, gives that val_loss."""
    out = str(tmp_path / "run")
    sets = [*BASE, f"run.out_dir='{out}'", "checkpoint.at_end=true"]
    run_ranks(train_rank, 2, [*sets, "parallel.pp=2"])
    rows, ref_rows = read_metrics(out), read_metrics(reference)
    for key in ("loss", "grad_norm", "val_loss"):  # 1e-4: the pipeline sums in another order
        got, ref = [r[key] for r in rows], [r[key] for r in ref_rows]
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=0, msg=lambda m, k=key: f"{k}: {m}")
    want = rows[-1]
    ckpt = os.path.join(out, "checkpoints", "step-2")
    for world, layout in ((2, ["parallel.pp=2"]), (1, [])):
        results = run_ranks(eval_rank, world, [*sets, *layout], ckpt)
        assert [r["step"] for r in results] == [2] * world and results[0]["layout"]["pp"] == world
        torch.testing.assert_close(results[0]["val_loss"], want["val_loss"], rtol=1e-5, atol=0)


def train_then_eval(runs: list[tuple[int, int, list[str], str]]) -> list[dict]:
    """One rank of several runs, each trained then its checkpoint evaluated by `paratrain eval`
    (one process start for all: the CPU is shared); returns the eval results."""
    out = []
    for train_port, eval_port, overrides, checkpoint in runs:
        os.environ["MASTER_PORT"] = str(train_port)  # a fresh store for each process group
        train_rank(overrides)
        os.environ["MASTER_PORT"] = str(eval_port)
        out.append(eval_rank(overrides, checkpoint))
    return out


@pytest.mark.slow  # > 12 s: make test stays under 10 minutes
def test_v_schedules_validate_like_the_reference(tmp_path):
    """zbv and dualpipev (two adjacent stages on one rank): val_loss during training and
    `paratrain eval` of their checkpoint (forward only before any training step) equal the
    one-process reference's. Before the fix, eval crashed in torch's runtime."""
    sets = [*BASE, "model.args={n_layer=4,n_head=2,d_model=32,block_size=16}", "checkpoint.at_end=true"]
    ref = str(tmp_path / "ref")
    run_ranks(train_rank, 1, [*sets, f"run.out_dir='{ref}'"])
    ref_rows = read_metrics(ref)
    names = ("zbv", "dualpipev")
    runs = [
        (
            free_port(),
            free_port(),
            [
                *sets,
                "parallel.dp_replicate=1",
                "parallel.pp=2",
                f"parallel.pp_schedule='{s}'",
                f"run.out_dir='{tmp_path / s}'",
            ],
            str(tmp_path / s / "checkpoints" / "step-2"),
        )
        for s in names
    ]
    results = run_ranks(train_then_eval, 2, runs, timeout=300)[0]
    for s, result in zip(names, results):
        rows = read_metrics(str(tmp_path / s))
        for key in ("loss", "val_loss", "grad_norm"):
            got, want = [r[key] for r in rows], [r[key] for r in ref_rows]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=0, msg=lambda m, s=s, k=key: f"{s} {k}: {m}")
        assert result["step"] == 2 and result["layout"]["pp"] == 2
        want = ref_rows[-1]["val_loss"]
        torch.testing.assert_close(result["val_loss"], want, rtol=1e-5, atol=0, msg=lambda m, s=s: f"{s} eval: {m}")
