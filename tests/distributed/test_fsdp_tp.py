"""Sharded data parallel (FSDP2, HSDP), tensor/sequence parallel, activation checkpointing and
their composition, each against the single-process reference (per-step losses and final
weights). Layouts of one world size share one set of spawned processes to keep this quick."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from paratrain.testing.dist_utils import plain_sgd, read_metrics, run_ranks

# src/paratrain/testing/toy.py:gpt_scaled_grad is a layout whose gradient is off by a constant factor (x2 on every
# rank of a multi-process job), which plain SGD shows: the comparison must fail on it. Plain SGD also keeps the
# layouts' rounding differences at rounding size over the steps, where AdamW turns a near-zero gradient's sign
# into a step of lr and lets them grow past the tolerance on some machines' kernels.
SGD = plain_sgd(0.3)
DOUBLED = ["model.factory='paratrain.testing.toy:gpt_scaled_grad'"]
CLIP = ["optim.grad_clip=0.05"]  # below every step's norm: each step is clipped

GPT = [
    "model.args={n_layer = 2, n_head = 4, d_model = 32, block_size = 16, vocab_size = 31}",
    "data.factory='paratrain.testing.toy:toy_lm'",
    "data.args={n = 64, seq_len = 16, vocab = 31}",
    "batch.global_batch_size=8",
    "run.steps=3",
    "run.progress=false",
    "metrics.plot=false",
    *SGD,
]
# A user's model (src/paratrain/testing/toy.py) with its tensor-parallel plan given as a TOML table.
USER = [
    *GPT,
    "model.factory='paratrain.testing.toy:tiny_lm'",
    "model.args={vocab = 32, d = 32, hidden = 64, n_layer = 2}",
]
USER_PLAN = [
    "parallel.tp_plan={emb = 'rowwise', 'layers.*.fc1' = 'colwise', 'layers.*.fc2' = 'rowwise',"
    " head = 'colwise_gather'}"
]

# vocab_size 31 is split unevenly by tp = 2 and by FSDP.
# name -> (reference name, overrides). Micro-batches of 2 (1 at dp 4) so every layout accumulates.
WORLD1 = {
    "ref": [*GPT, "batch.micro_batch_size=2"],
    "ac_full": [*GPT, "batch.micro_batch_size=2", "parallel.activation_checkpointing='full'"],
    "ac_selective": [*GPT, "batch.micro_batch_size=2", "parallel.activation_checkpointing='selective'"],
    "user_ref": [*USER, "batch.micro_batch_size=2"],
    # Clipping under plain SGD (the update is lr x the clipped gradient): a norm taken per shard
    # or per tp rank instead of over the whole model clips by another factor.
    "clip_ref": [*GPT, *CLIP, "batch.micro_batch_size=2"],
}
WORLD2 = {
    "dp_shard2": ("ref", [*GPT, "parallel.dp_shard=2", "batch.micro_batch_size=2"]),
    "dp_shard2_no_reshard": (
        "ref",
        [*GPT, "parallel.dp_shard=2", "parallel.reshard_after_forward=false", "batch.micro_batch_size=2"],
    ),
    "tp2": ("ref", [*GPT, "parallel.tp=2", "batch.micro_batch_size=2"]),
    "clip_dp_shard2": ("clip_ref", [*GPT, *CLIP, "parallel.dp_shard=2", "batch.micro_batch_size=2"]),
    "clip_tp2": ("clip_ref", [*GPT, *CLIP, "parallel.tp=2", "batch.micro_batch_size=2"]),
    "sgd_dp_shard2_doubled": ("ref", [*GPT, *DOUBLED, "parallel.dp_shard=2", "batch.micro_batch_size=2"]),
    "tp2_gathered_logits": ("ref", [*GPT, "parallel.tp=2", "parallel.loss_parallel=false", "batch.micro_batch_size=4"]),
    "tp2_sp": ("ref", [*GPT, "parallel.tp=2", "parallel.sequence_parallel=true", "batch.micro_batch_size=2"]),
    "user_tp2_plan_table": ("user_ref", [*USER, *USER_PLAN, "parallel.tp=2", "batch.micro_batch_size=2"]),
    "user_tp2_plan_factory_ac": (
        "user_ref",
        [
            *USER,
            "parallel.tp_plan_factory='paratrain.testing.toy:tiny_lm_tp_plan'",
            "parallel.tp=2",
            "batch.micro_batch_size=2",
            "parallel.activation_checkpointing='full'",
        ],
    ),
}
WORLD4 = {
    "hsdp_2x2": ("ref", [*GPT, "parallel.dp_replicate=2", "parallel.dp_shard=2", "batch.micro_batch_size=1"]),
    "hsdp_2x2_no_reshard": (
        "ref",
        [
            *GPT,
            "parallel.dp_replicate=2",
            "parallel.dp_shard=2",
            "batch.micro_batch_size=1",
            "parallel.reshard_after_forward=false",
        ],
    ),
    "dp_shard2_tp2": ("ref", [*GPT, "parallel.dp_shard=2", "parallel.tp=2", "batch.micro_batch_size=2"]),
    "dp_shard2_tp2_sp_ac_selective": (
        "ref",
        [
            *GPT,
            "parallel.dp_shard=2",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
            "batch.micro_batch_size=2",
            "parallel.activation_checkpointing='selective'",
        ],
    ),
    "dp_replicate2_tp2_ac_full": (
        "ref",
        [
            *GPT,
            "parallel.dp_replicate=2",
            "parallel.tp=2",
            "batch.micro_batch_size=2",
            "parallel.activation_checkpointing='full'",
        ],
    ),
    "dp_shard4_cpu_offload": (
        "ref",
        [*GPT, "parallel.dp_shard=4", "parallel.cpu_offload=true", "batch.micro_batch_size=1"],
    ),
}


def train_layouts(runs: dict, root: str) -> dict:
    """On each rank: one process group, then every layout in turn (train() reuses the group)."""
    import torch.distributed as dist

    import paratrain
    from paratrain.distributed.parallel_dims import ParallelDims

    dist.init_process_group("gloo")
    out = {}
    if dist.get_world_size() == 4:  # where each rank of dp_shard 2 x tp 2 sits, by role
        dims = ParallelDims(dp_replicate=1, dp_shard=2, tp=2, pp=1, world_size=4)
        out["roles"] = {role: dims.local_rank_in(role) for role in ("data", "loss", "fsdp", "tp")}
    try:
        for name, overrides in runs.items():
            summary = paratrain.train(paratrain.load_config(None, [*overrides, f"run.out_dir='{root}/{name}'"]))
            out[name] = {"losses": summary["losses"], "layout": summary["layout"]}
    finally:
        dist.destroy_process_group()
    return out


def run_world(world: int, runs: dict, root) -> dict:
    per_rank = run_ranks(train_layouts, world, runs, str(root), timeout=600)
    for other in per_rank[1:]:  # every rank reports the same (dp-reduced) loss
        for name in runs:
            assert other[name]["losses"] == per_rank[0][name]["losses"], name
    out = {
        name: (
            per_rank[0][name]["losses"],
            load_file(os.path.join(root, name, "model.safetensors")),
            per_rank[0][name]["layout"],
            [row["grad_norm"] for row in read_metrics(os.path.join(root, name))],
        )
        for name in runs
    }
    out["roles"] = [r.get("roles") for r in per_rank]
    return out


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    return run_world(1, WORLD1, tmp_path_factory.mktemp("world1"))


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return run_world(2, {k: v[1] for k, v in WORLD2.items()}, tmp_path_factory.mktemp("world2"))


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return run_world(4, {k: v[1] for k, v in WORLD4.items()}, tmp_path_factory.mktemp("world4"))


def assert_matches(got, ref):
    losses, params, _, grad_norms = got
    ref_losses, ref_params, _, ref_grad_norms = ref
    assert len(losses) == len(ref_losses) == 3
    # The logged norm is the whole model's (global over shards).
    torch.testing.assert_close(
        torch.tensor(grad_norms), torch.tensor(ref_grad_norms), rtol=1e-4, atol=0, msg=lambda m: f"grad_norm: {m}"
    )
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-4, atol=0)
    assert params.keys() == ref_params.keys()  # the gathered weights keep the model's names
    for k in ref_params:
        torch.testing.assert_close(params[k], ref_params[k], rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")


def test_clipping_clips_the_reference(references):
    """The clipped reference is another run than the unclipped one (the clip is at work), so the
    clipped layouts' comparison with it checks the global norm the clip divides by."""
    clipped, plain = references["clip_ref"], references["ref"]
    assert clipped[0][0] == pytest.approx(plain[0][0], rel=1e-6)  # step 1: before any update
    assert all(n > 0.05 for n in clipped[3])  # every step's norm is over the clip
    assert clipped[0][1] != pytest.approx(plain[0][1], rel=1e-4)  # a clipped update moved less


@pytest.mark.parametrize("mode", ["ac_full", "ac_selective"])
def test_activation_checkpointing_changes_no_loss(references, mode):
    assert_matches(references[mode], references["ref"])


FAULTS = {"sgd_dp_shard2_doubled"}  # layouts that must fail the comparison


@pytest.mark.parametrize("name", [n for n in WORLD2 if n not in FAULTS])
def test_two_ranks_match_reference(references, world2, name):
    assert_matches(world2[name], references[WORLD2[name][0]])


def test_a_doubled_gradient_fails_the_comparison(references, world2):
    """The comparison can fail: FSDP2 with the gradient x2 (the test-only gpt_scaled_grad) is
    caught by the grad_norm of step 1, before any loss could differ."""
    got, ref = world2["sgd_dp_shard2_doubled"], references["ref"]
    with pytest.raises(AssertionError, match="grad_norm"):
        assert_matches(got, ref)
    assert got[3][0] == pytest.approx(2 * ref[3][0], rel=1e-5)
    assert got[0][0] == pytest.approx(ref[0][0], rel=1e-6)  # step 1's loss: before any update


@pytest.mark.parametrize("name", list(WORLD4))
def test_four_ranks_match_reference(references, world4, name):
    assert_matches(world4[name], references[WORLD4[name][0]])
    if name == "hsdp_2x2":
        assert world4[name][2] == {"pp": 1, "dp_replicate": 2, "dp_shard": 2, "tp": 1}


def test_tp_group_shares_data_rank(world4):
    """Mesh (dp_shard, tp) = (2, 2): ranks 0,1 form a TP group and load dp slice 0; 2,3 slice 1."""
    roles = world4["roles"]
    assert [r["data"] for r in roles] == [0, 0, 1, 1]
    assert [r["loss"] for r in roles] == [0, 0, 1, 1] and [r["fsdp"] for r in roles] == [0, 0, 1, 1]
    assert [r["tp"] for r in roles] == [0, 1, 0, 1]


def test_activation_checkpointing_recomputes_each_block():
    """The wrapper is really there: a block's forward runs again in backward; names unchanged."""
    from paratrain.distributed.activation_checkpoint import apply_ac
    from paratrain.models import build_gpt

    for mode in ("full", "selective"):
        torch.manual_seed(0)
        model = build_gpt(n_layer=2, n_head=2, d_model=16, block_size=8, vocab_size=16)
        names = list(model.state_dict())
        calls = []
        inner = model.layers["0"]
        inner.register_forward_pre_hook(lambda *a: calls.append(1))  # recomputation stops early: count entries
        apply_ac(model, mode=mode)
        assert list(model.state_dict()) == names
        model(torch.randint(0, 16, (2, 8))).sum().backward()
        assert len(calls) == 2, mode


def test_tp_plan_table_expands_patterns():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from paratrain.config import ConfigError
    from paratrain.distributed.tensor_parallel import plan_from_table
    from paratrain.testing.toy import tiny_lm

    plan = plan_from_table(tiny_lm(n_layer=3), {"layers.*.fc1": "colwise", "layers.*.fc2": "rowwise"})
    assert sorted(plan) == [f"layers.{i}.fc{j}" for i in range(3) for j in (1, 2)]
    assert isinstance(plan["layers.2.fc1"], ColwiseParallel) and isinstance(plan["layers.0.fc2"], RowwiseParallel)
    with pytest.raises(ConfigError, match=r"parallel.tp_plan.blocks\.\*: the pattern matches no module"):
        plan_from_table(tiny_lm(), {"blocks.*": "colwise"})
