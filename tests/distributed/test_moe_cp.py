"""A mixture of experts under context parallel (models/gpt/moe.py ``sequence_balance_loss`` with
a cp group; docs/moe.md, docs/context-parallel.md): each cp rank holds part of every sequence, so
the expert counts of the sequence-wise balance loss are summed over the cp ranks and each rank
differentiates its tokens' share. Whole runs against one process under plain SGD: loss, aux_loss,
grad_norm, tokens per expert and the final weights (tests/distributed/test_moe.py's comparison)."""

from __future__ import annotations

import pytest

from paratrain.testing.moe_utils import MOE_GPT, assert_same_moe_run, moe_runs, read_moe_run


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return moe_runs(tmp_path_factory.mktemp("moe_cp_ref"), 1, {"ref": ["batch.micro_batch_size=8"]})["ref"]


# The fast case: one MoE block of width 16, two steps of 4 rows, the reference in this process.
SMALL = [
    "model.args={n_layer = 1, n_head = 2, d_model = 16, block_size = 16, vocab_size = 32,"
    " moe = {n_experts = 4, top_k = 2, n_shared_experts = 1, aux_loss_weight = 0.1}}",
    "data.args={n = 16, seq_len = 16, vocab = 32}",
    "batch.global_batch_size=4",
    "run.steps=2",
]


def test_small_moe_gpt_at_cp2_equals_one_process(tmp_path):
    """The expert counts of each sequence summed over its two cp ranks: loss, aux_loss, grad_norm,
    tokens per expert and final weights of one process (fails without that sum)."""
    import paratrain

    ref = str(tmp_path / "ref")
    paratrain.train(paratrain.load_config(None, [*MOE_GPT, *SMALL, "batch.micro_batch_size=4", f"run.out_dir='{ref}'"]))
    want = read_moe_run(ref)
    assert want["aux_loss"][0] > 0
    got = moe_runs(tmp_path, 2, {"cp2": [*SMALL, "parallel.cp=2", "batch.micro_batch_size=2"]})["cp2"]
    assert_same_moe_run(got, want)


@pytest.mark.slow  # two launches: 85 s at load 13 on the shared 2 cores (the world-2 MoE tests are slow too)
def test_moe_gpt_at_cp2_equals_one_process(tmp_path, reference):
    assert reference["aux_loss"][0] > 0
    got = moe_runs(tmp_path, 2, {"cp2": ["parallel.cp=2", "batch.micro_batch_size=4"]})["cp2"]
    assert_same_moe_run(got, reference)


@pytest.mark.slow
def test_moe_gpt_at_cp_composed_at_world_4_equals_one_process(tmp_path, reference):
    runs = moe_runs(
        tmp_path,
        4,
        {
            "cp2_alltoall_dp_shard2": [
                "parallel.cp=2",
                "parallel.cp_attention='alltoall'",  # two heads: one per cp rank
                "parallel.dp_shard=2",
                "batch.micro_batch_size=2",
            ],
            "cp2_dp_replicate2_ac": [
                "parallel.cp=2",
                "parallel.dp_replicate=2",
                "batch.micro_batch_size=2",
                "parallel.activation_checkpointing='full'",
            ],
            "cp4_ring": ["parallel.cp=4", "batch.micro_batch_size=8"],
        },
    )
    for name, got in runs.items():
        try:
            assert_same_moe_run(got, reference)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
