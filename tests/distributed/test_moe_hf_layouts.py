"""transformers mixtures of experts (``model.hf``) with tensor and pipeline parallelism (docs/moe.md,
"Hugging Face MoE with tp and pp"; issue 24).

Fast: the pieces (the tp plan built from transformers' ``base_model_tp_plan`` leaves the sparse
blocks replicated and keeps the attention's and the dense MLPs' entries; the layouts pass the
preflight). Slow: whole runs of a tiny Qwen3-MoE (one sparse layer of two, embeddings untied here) and
Mixtral (every layer sparse) under plain SGD against one process (``loss``, ``aux_loss``,
``grad_norm``, tokens per expert, the final weights): tp 2 with and without accumulation, pp 2
1f1b, and pp 2 gpipe with accumulation and full activation checkpointing at world 2; tp 2 x ep 2
x DDP 2, tp 2 x ep 2 x FSDP2 2 and pp 2 x ep 2 x DDP 2 at world 4.
"""

from __future__ import annotations

import pytest

from paratrain.testing.hf_models import MOE_ARCHS, save_tiny
from paratrain.testing.moe_utils import assert_same_moe_run, hf_moe_runs

pytest.importorskip("transformers")

# ------------------------------------------------------------------------------ fast: the pieces


@pytest.mark.parametrize("arch", sorted(MOE_ARCHS))
def test_the_hf_tp_plan_keeps_sparse_blocks_replicated(tmp_path, arch):
    """transformers 5 up to 5.24 names the experts in its plan ("moe_tp_experts",
    "packed_colwise", ...; 5.25 no longer does): such entries are left out, the attention (and
    Qwen3-MoE's dense MLP layer) keep theirs."""
    import paratrain
    from paratrain.models.hf import hf_spec
    from paratrain.models.hf.parallel import hf_tp_plan

    src = save_tiny(arch, str(tmp_path / arch), weights=False)
    model = hf_spec(paratrain.load_config(None, [f"model.hf='{src}'"]).model).build()
    plan = hf_tp_plan(model, sequence_parallel=False, loss_parallel=False)
    sparse = [n for n, layer in model.layers.items() if hasattr(layer.mlp, "experts")]
    assert sparse and not any(k.startswith(f"layers.{n}.mlp") for n in sparse for k in plan)
    for n in model.layers:
        assert f"layers.{n}.self_attn.q_proj" in plan and f"layers.{n}.self_attn.o_proj" in plan
    dense = [n for n in model.layers if n not in sparse]
    assert all(f"layers.{n}.mlp.down_proj" in plan for n in dense)
    assert dense if arch == "qwen3_moe" else not dense


@pytest.mark.parametrize(
    "overrides, world",
    [
        (["parallel.tp=2"], 2),
        (["parallel.pp=2", "parallel.pp_schedule='1f1b'"], 2),
        (["parallel.tp=2", "parallel.dp_replicate=2", "parallel.ep=2"], 4),
        (["parallel.pp=2", "parallel.dp_replicate=2", "parallel.ep=2"], 4),
    ],
)
def test_hf_moe_tp_and_pp_layouts_pass_the_preflight(tmp_path, overrides, world):
    import paratrain
    from paratrain.preflight import check_run

    src = save_tiny("mixtral", str(tmp_path / "mixtral"), weights=False)
    cfg = [f"model.hf='{src}'", "data.factory='paratrain.testing.toy:toy_lm'", "batch.global_batch_size=8"]
    check_run(paratrain.load_config(None, [*cfg, "batch.micro_batch_size=4", *overrides]), world)


def test_hf_moe_with_a_zero_bubble_schedule_is_one_line(tmp_path):
    import paratrain
    from paratrain.config import ConfigError
    from paratrain.preflight import check_run

    src = save_tiny("mixtral", str(tmp_path / "mixtral"), weights=False)
    cfg = [
        f"model.hf='{src}'",
        "data.factory='paratrain.testing.toy:toy_lm'",
        "parallel.pp=2",
        "parallel.pp_schedule='zbv'",
    ]
    with pytest.raises(ConfigError, match="runs with parallel.pp_schedule = 'zbv' not yet; use 'gpipe'") as e:
        check_run(paratrain.load_config(None, cfg), 2)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------ slow: whole runs


@pytest.fixture(scope="module", params=sorted(MOE_ARCHS))
def reference(request, tmp_path_factory):
    """One process, one micro-batch of 8. Embeddings untied: parallel.pp refuses tied weights
    (Qwen3-MoE's tiny model ties them; tests/distributed/test_moe_hf.py trains that one)."""
    tmp = tmp_path_factory.mktemp(f"moe_hf_layouts_{request.param}")
    src = save_tiny(request.param, str(tmp / "src"), tie_word_embeddings=False)
    ref = hf_moe_runs(tmp, 1, src, {"ref": ["batch.micro_batch_size=8"]})["ref"]
    # The weights move, the balance loss is trained, and the routing is uneven (so counts can differ).
    assert ref["aux_loss"][0] > 0 and abs(ref["loss"][-1] - ref["loss"][0]) > 1e-3
    assert ref["tokens"][0][0] != ref["tokens"][0][1]
    return src, ref


def _check(runs: dict, ref: dict) -> None:
    for name, got in runs.items():
        try:
            assert_same_moe_run(got, ref, rtol=1e-5, atol_params=1e-6)
            assert set(got["params"]) == set(ref["params"])
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hf_moe_with_tp_and_pp_at_world_2_equals_one_process(tmp_path, reference):
    """tp 2: the sparse blocks replicated (each tp rank the same full gradient of the router and
    the experts, summed over nothing); pp 2 1f1b: Qwen3-MoE's sparse layer on the second stage
    only, Mixtral's one on each stage (the first stage's balance loss rides its output's backward)."""
    src, ref = reference
    runs = {
        "tp2": ["parallel.tp=2", "batch.micro_batch_size=8"],
        "tp2_acc2": ["parallel.tp=2", "batch.micro_batch_size=4"],
        "pp2_1f1b": ["parallel.pp=2", "parallel.pp_schedule='1f1b'", "batch.micro_batch_size=8"],
        # Full activation checkpointing recomputes the routers in backward: their stats count once.
        "pp2_gpipe_acc2_ac": [
            "parallel.pp=2",
            "parallel.pp_schedule='gpipe'",
            "batch.micro_batch_size=4",
            "parallel.activation_checkpointing='full'",
        ],
    }
    _check(hf_moe_runs(tmp_path, 2, src, runs), ref)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_hf_moe_with_ep_and_tp_or_pp_at_world_4_equals_one_process(tmp_path, reference):
    """tp 2 x ep 2 (experts sharded over ep, replicated over tp) with DDP and with FSDP2 over dp 2
    (the experts' rows then FSDP2-sharded over nothing: ep = dp), and pp 2 x ep 2 with DDP."""
    src, ref = reference
    runs = {
        "tp2_ep2_dp2": ["parallel.tp=2", "parallel.dp_replicate=2", "parallel.ep=2", "batch.micro_batch_size=4"],
        "tp2_ep2_fsdp2": ["parallel.tp=2", "parallel.dp_shard=2", "parallel.ep=2", "batch.micro_batch_size=4"],
        "pp2_ep2_dp2": ["parallel.pp=2", "parallel.dp_replicate=2", "parallel.ep=2", "batch.micro_batch_size=4"],
    }
    _check(hf_moe_runs(tmp_path, 4, src, runs), ref)
