"""Impossible layouts are refused by the CLI before any process starts: exit 2, one clear line."""

from __future__ import annotations

import pytest

from paratrain.cli import main
from paratrain.testing.dist_utils import paratrain_cli

BASE = [
    "--set",
    "model.args={n_layer = 2, n_head = 4, d_model = 32, block_size = 16, vocab_size = 32}",
    "--set",
    "data.args.block_size=16",
]

CASES = [
    (4, ["parallel.tp=3"], "world size 4 is not divisible by dp_shard 1 x tp 3"),
    (4, ["parallel.dp_replicate=2", "parallel.dp_shard=4"], "= 8 != world size 4"),
    (2, ["parallel.tp=2", "model.args.n_head=3"], "parallel.tp = 2 does not divide model.args.n_head = 3"),
    (
        2,
        ["parallel.tp=2", "model.args.n_head=2", "model.args.d_model=33"],
        "parallel.tp = 2 does not divide model.args.d_model = 33",
    ),
    (
        2,
        ["parallel.tp=2", "parallel.sequence_parallel=true", "model.args.block_size=17"],
        "parallel.tp = 2 does not divide model.args.block_size = 17",
    ),
    (2, ["parallel.sequence_parallel=true"], "parallel.sequence_parallel = true needs tensor parallelism"),
    (2, ["parallel.cpu_offload=true"], "parallel.cpu_offload = true offloads FSDP2 shards; set parallel.dp_shard > 1"),
    (
        2,
        ["parallel.tp=2", "model.factory='paratrain.testing.toy:tiny_lm'", "model.args={}"],
        "parallel.tp = 2 needs a tensor-parallel plan for model.factory",
    ),
    (2, ["parallel.tp_plan={head = 'diagonal'}"], "parallel.tp_plan.head = 'diagonal' is not a tensor-parallel style"),
    (
        2,
        ["parallel.tp_plan={head = 'colwise'}", "parallel.tp_plan_factory='paratrain.testing.toy:tiny_lm'"],
        "parallel.tp_plan and parallel.tp_plan_factory are both set",
    ),
    (2, ["parallel.activation_checkpointing='some'"], "parallel.activation_checkpointing = 'some' is not allowed"),
    # Feature combinations that cannot be exact are refused too (trainer.check_feature_combinations).
    (2, ["batch.adaptive=true", "parallel.dp_shard=2"], "batch.adaptive = true needs each rank's own gradient"),
    (2, ["optim.lr_scaling='adascale'", "precision.dtype='fp16'"], "would read loss-scaled gradients"),
    (2, ["optim.lr_scaling='adascale'", "parallel.pp=2"], "cannot measure the gradient noise across pipeline stages"),
    (2, ["batch.micro_batch_size='auto'", "parallel.pp=2"], "cannot estimate a pipeline step yet"),
    (2, ["comm.compression='bf16'", "parallel.pp=2"], "is not applied to pipeline stages"),
    (1, ["data.args.block_size=32"], "data.args.block_size = 32 is longer than the model's context"),
]


@pytest.mark.parametrize("nproc,sets,message", CASES, ids=[c[2][:40] for c in CASES])
def test_impossible_layout_exits_2_with_one_line(capsys, nproc, sets, message):
    args = ["train", "configs/debug.toml", "--nproc-per-node", str(nproc), *BASE]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("paratrain: error: ")
    assert message in err


def test_verify_refuses_an_impossible_layout_before_starting():
    r = paratrain_cli(
        "verify",
        "configs/debug.toml",
        "--nproc-per-node",
        "2",
        "--set",
        "parallel.tp=2",
        "--set",
        "model.args.n_head=3",
        timeout=120,
    )
    assert r.returncode == 2
    assert r.stderr.strip() == (
        "paratrain: error: parallel.tp = 2 does not divide model.args.n_head = 3 (attention"
        " heads are split whole across the tp ranks); use a tp that divides 3 or a n_head"
        " that is a multiple of 2"
    )


@pytest.mark.parametrize(("degree", "what"), [("pp", "a pipeline"), ("cp", "a context-parallel")])
def test_find_batch_refuses_a_pipeline_or_context_parallel_layout_in_one_line(capsys, degree, what):
    """The estimate cannot run a pipeline schedule (it once ended in torch's PipeliningMetadataError
    traceback) nor a context-parallel ring (it measured whole rows, as at cp = 1), as `train` with
    micro_batch_size = 'auto' refuses both."""
    args = ["find-batch", "configs/debug.toml", "--nproc-per-node", "2", *BASE, "--set", f"parallel.{degree}=2"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"find-batch cannot estimate {what} step yet" in err


@pytest.mark.parametrize("command", ["find-batch", "plan"])
@pytest.mark.parametrize("loss", ["preference", "grpo"])
def test_estimates_refuse_the_losses_they_do_not_price_in_one_line(capsys, command, loss):
    """As `train` with micro_batch_size = 'auto' refuses them: the estimate once ran their step
    anyway and ended in a traceback (DynamicOutputShapeException, an AttributeError of GRPO's rows)."""
    args = [command, "configs/debug.toml", "--nproc-per-node", "2", *BASE, "--set", f"loss.name='{loss}'"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{command} does not estimate loss.name = '{loss}' yet" in err
