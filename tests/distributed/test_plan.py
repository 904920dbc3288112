"""`paratrain plan`: enumeration against the trainer's preflight, the memory extrapolation against the
full estimate, the cost terms, calibration, the CLI, the best layout training, an 8B plan, and an anchor."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from paratrain.config import ConfigError, load_config
from paratrain.distributed.parallel_dims import ParallelDims
from paratrain.plan import calibrate, get_profile, plan
from paratrain.plan.cost import ModelStats, gemm_seconds, step_cost
from paratrain.plan.enumerate import Layout, candidate_layouts, cp_degrees, enumerate_layouts, meta_model
from paratrain.plan.memory import MemoryModel, estimate_layout_peak, in_flight
from paratrain.plan.planner import nothing_fits_error
from paratrain.preflight import check_run
from paratrain.testing.dist_utils import REPO, paratrain_cli, read_metrics, run_ranks

DEBUG = os.path.join(REPO, "configs", "debug.toml")
MAIN = os.path.join(REPO, "configs", "main.toml")
GIB = 1 << 30


def big_gpt(n_layer: int = 32, seq: int = 4096, gbs: int = 256) -> list[str]:
    """A Llama-3-8B-like GPT: 32 layers, d_model 4096, 32 heads, 128256-token vocabulary."""
    return [
        f"model.args={{n_layer={n_layer}, n_head=32, d_model=4096, block_size={seq}, vocab_size=128256}}",
        f"data.args={{block_size={seq}, max_bytes=100000}}",
        f"batch.global_batch_size={gbs}",
        "precision.dtype='bf16'",
    ]


def test_enumerated_layouts_pass_the_trainers_preflight():
    """Every layout offered passes check_run itself (every checkpointing mode, the real model);
    every candidate is either offered or counted under a reason."""
    cfg = load_config(DEBUG)
    layouts, refused = enumerate_layouts(cfg, world_size=4, nproc_per_node=4)
    assert layouts and refused
    for layout in layouts:
        check_run(layout.apply(cfg), 4)  # raises on a layout the trainer would refuse
    n = sum(1 for _ in candidate_layouts(cfg, world_size=4, nproc_per_node=4, n_blocks=2))
    assert len(layouts) + sum(refused.values()) == n
    assert {lay.activation_checkpointing for lay in layouts} == {"none", "selective", "full"}
    assert any(lay.pp > 1 for lay in layouts) and any(lay.tp > 1 for lay in layouts)
    # The --set lines select exactly the layout.
    lay = next(lay for lay in layouts if lay.pp > 1 and lay.dp_shard > 1)
    assert load_config(DEBUG, lay.set_lines()).parallel == lay.apply(cfg).parallel


@pytest.mark.slow  # about 60 s: four full fake-tensor estimates of a 6-block model
def test_memory_extrapolation_matches_the_full_estimate():
    """Extrapolated in blocks (1, 2 -> 6), at the layout's own micro-batch: within 2% of the full
    model's fake-tensor estimate, for DDP+accumulation, FSDP with checkpointing, TP, and FSDP x TP
    with full checkpointing at micro-batch 16 (where the old line through micro-batches 1 and 2
    was 43% under a measured run: the moment of the peak moves with the micro-batch)."""
    torch.set_num_threads(1)
    cfg = load_config(MAIN, ["model.args={n_layer=6, n_head=4, d_model=128, block_size=128}"])
    mem = MemoryModel(cfg, model=meta_model(cfg), n_blocks=6)
    for layout in (
        Layout(2, 1, 1, 1, 4),  # per-rank 16: accumulation of 4
        Layout(1, 2, 1, 1, 4, "full", False),
        Layout(1, 1, 2, 1, 4, "selective"),
        Layout(1, 2, 2, 1, 16, "full"),
    ):
        predicted = mem.peak(layout).peak_bytes
        dims = ParallelDims(layout.dp_replicate, layout.dp_shard, layout.tp, 1, layout.world_size)
        full = estimate_layout_peak(layout.apply(cfg), dims, layout.micro_batch_size, dataset=mem.dataset)
        # Within 2%, except FSDP x TP with resharding: +6.7%, on the safe side (the slope from 1
        # to 2 blocks holds a unit's unsharded parameters too).
        over = 0.10 if layout.tp > 1 and layout.dp_shard > 1 else 0.02
        assert -0.02 * full <= predicted - full <= over * full, (layout.short(), predicted, full)


def test_memory_estimate_does_not_depend_on_what_ran_before():
    """Under TP, DTensor runs each new op shape under the fake mode it finds (ours) and caches it:
    the first estimate of a process at new shapes counted those tensors (+47% at tp 4 on the
    main GPT). The estimate tracks only the step's second iteration, so it is the same whether
    or not the shapes are new. The shapes here are used by no other test."""
    cfg = load_config(
        DEBUG, ["model.args={n_layer=1, n_head=4, d_model=64, block_size=40}", "data.args={block_size=40}"]
    )
    cfg.parallel.tp, cfg.parallel.activation_checkpointing = 2, "full"
    cfg.batch.global_batch_size, cfg.batch.micro_batch_size = 8, 8
    dims = ParallelDims(1, 1, 2, 1, 2)
    first, second = (estimate_layout_peak(cfg, dims, 8) for _ in range(2))  # 6% apart before
    assert first == second


def test_pipeline_in_flight_and_bubble():
    assert in_flight("gpipe", rank=0, pp=4, v=1, n=8) == 8
    assert in_flight("1f1b", rank=0, pp=4, v=1, n=8) == 4 and in_flight("1f1b", rank=3, pp=4, v=1, n=8) == 1
    assert in_flight("interleaved1f1b", rank=0, pp=2, v=2, n=8) == (2 + 2 + 1) / 2
    # The 1F1B bubble over the whole step is (p-1)/(n+p-1) of it.
    cfg = load_config(MAIN, ["batch.micro_batch_size=1", "batch.global_batch_size=8"])
    stats = ModelStats.of(meta_model(cfg), cfg)
    hw = get_profile("h100-sxm")
    c = step_cost(Layout(1, 1, 1, 2, 1, pp_schedule="1f1b"), cfg=cfg, stats=stats, hw=hw, ranks_per_node=8)
    busy = sum(v for k, v in c.terms.items() if k not in ("pp_bubble", "pp_p2p", "optimizer", "dp_grad_reduce"))
    n, p = 8, 2
    assert c.terms["pp_bubble"] / (busy + c.terms["pp_bubble"]) == pytest.approx((p - 1) / (n + p - 1))
    i = step_cost(
        Layout(1, 1, 1, 2, 1, pp_schedule="interleaved1f1b", pp_virtual_stages=2),
        cfg=cfg,
        stats=stats,
        hw=hw,
        ranks_per_node=8,
    )
    assert i.terms["pp_bubble"] == pytest.approx(c.terms["pp_bubble"] / 2, rel=0.05)
    # Full checkpointing recomputes twice under a zero-bubble schedule (input and weight passes).
    full = {
        schedule: step_cost(
            Layout(1, 1, 1, 2, 1, "full", pp_schedule=schedule, pp_virtual_stages=v),
            cfg=cfg,
            stats=stats,
            hw=hw,
            ranks_per_node=8,
        ).terms["recompute"]
        for schedule, v in (("1f1b", 1), ("zbv", 2), ("interleaved1f1b", 2))
    }
    assert full["zbv"] == pytest.approx(2 * full["1f1b"], rel=0.05)
    assert full["interleaved1f1b"] == pytest.approx(full["1f1b"], rel=0.05)


def test_gemm_waves_and_exposed_fsdp():
    """A GEMM fills the GPU in waves of 256 x 128 tiles: one whole wave costs its FLOPs at the
    achievable rate, one tile more costs a second wave. FSDP's collectives hide behind the blocks'
    compute up to the per-layer overlap; slower links expose more of them."""
    hw = get_profile("h100-sxm")
    rate = hw.achievable_flops("bf16")
    full = gemm_seconds(256, 128 * 132, 8192, hw=hw, rate=rate, elem_bytes=2)
    assert full == pytest.approx(2 * 256 * 128 * 132 * 8192 / rate)
    assert gemm_seconds(256, 128 * 133, 8192, hw=hw, rate=rate, elem_bytes=2) == pytest.approx(2 * full, rel=0.02)
    thin = gemm_seconds(16384, 8, 4096, hw=hw, rate=rate, elem_bytes=2)  # reads 128 MiB for 1 GFLOP
    assert thin == pytest.approx(16384 * 4096 * 2 / (hw.hbm_gbps * 1e9), rel=0.01)
    cfg = load_config(MAIN, ["precision.dtype='bf16'"])
    stats = ModelStats.of(meta_model(cfg), cfg)
    layout = Layout(1, 8, 1, 1, 4)
    fast = step_cost(layout, cfg=cfg, stats=stats, hw=hw, ranks_per_node=8).terms["fsdp_comm"]
    slow_hw = dataclasses.replace(hw, intra_busbw_gbps=hw.intra_busbw_gbps / 1000)
    slow = step_cost(layout, cfg=cfg, stats=stats, hw=slow_hw, ranks_per_node=8).terms["fsdp_comm"]
    assert 0 < fast < slow


def test_the_steps_end_costs_per_parameter_tensor():
    """Off CUDA torch's AdamW loops over the parameter tensors, and on DTensors (FSDP, TP) each op
    propagates shardings first: the CPU profile charges a fixed time per tensor, more when sharded,
    so FSDP's optimizer term is the larger one although its shard is half; GPU profiles add none."""
    cfg = load_config(MAIN)
    stats = ModelStats.of(meta_model(cfg), cfg)
    assert stats.tensors == sum(1 for _ in meta_model(cfg).parameters()) and stats.block_tensors > 0
    cpu = dataclasses.replace(get_profile("cpu"), cores=2)
    ddp, fsdp = (
        step_cost(lay, cfg=cfg, stats=stats, hw=cpu, ranks_per_node=2).terms["optimizer"]
        for lay in (Layout(2, 1, 1, 1, 16), Layout(1, 2, 1, 1, 16))
    )
    halved = stats.total_params / 2 * 32 / (cpu.hbm_gbps * 1e9)  # AdamW's traffic over half the parameters
    per_tensor = cpu.dtensor_optimizer_tensor_overhead_s - cpu.optimizer_tensor_overhead_s
    assert fsdp - ddp == pytest.approx(stats.tensors * per_tensor - halved)
    assert fsdp > ddp
    gpu = get_profile("h100-sxm")
    assert gpu.optimizer_tensor_overhead_s == gpu.dtensor_optimizer_tensor_overhead_s == 0
    # The memory traffic is the optimiser's own: plain SGD moves half of AdamW's bytes.
    sgd = load_config(MAIN, ["optim.name='sgd'", "optim.beta1=0.0"])
    adamw_s, sgd_s = (
        step_cost(Layout(8, 1, 1, 1, 4), cfg=c, stats=stats, hw=gpu, ranks_per_node=8).terms["optimizer"]
        for c in (cfg, sgd)
    )
    assert sgd_s == pytest.approx(adamw_s * 16 / 32)


def test_calibration_replaces_the_profile(tmp_path):
    compute = {
        "matmul": [{"dtype": "fp32", "flops_per_s": 5e10, "device_type": "cpu"}],
        "memcpy": {"memory_traffic_gbps": 7.0},
    }
    comm = {
        "world_size": 2,
        "nodes": ["a", "a"],
        "results": [  # 100 us + 0.1 us per byte, and one timing spoiled by another process
            {"op": "all_reduce", "bytes": 1000, "time_s": 2e-4},
            {"op": "all_reduce", "bytes": 2000, "time_s": 3e-4},
            {"op": "all_reduce", "bytes": 4000, "time_s": 5e-3},
            {"op": "all_reduce", "bytes": 8000, "time_s": 9e-4},
            {"op": "all_reduce", "bytes": 16000, "time_s": 1.7e-3},
        ],
    }
    (tmp_path / "c.json").write_text(json.dumps(compute))
    (tmp_path / "m.json").write_text(json.dumps(comm))
    hw = calibrate(get_profile("cpu"), [str(tmp_path / "c.json"), str(tmp_path / "m.json")])
    assert hw.achievable_flops("fp32") == 5e10 and hw.hbm_gbps == 7.0
    # The latency-bandwidth line through the measurements, not bent by the outlier (plus what a
    # collective costs more inside a step, measured apart).
    sync = hw.collective_sync_s
    assert hw.collective_s("all_reduce", 4000, 2, inter=False) == pytest.approx(5e-4 + sync)
    assert hw.collective_s("all_reduce", 32000, 2, inter=False) == pytest.approx(3.3e-3 + sync)  # its bandwidth
    # Another group size keeps the measured bus bandwidth: time scales with the bus factor.
    assert hw.collective_s("all_reduce", 2000, 4, inter=False) == pytest.approx(3e-4 * 1.5 + sync)
    for bad in ("{}", '{"matmul": [{"dtype": "fp32"}]}', '{"results": [{"op": "all_reduce"}], "world_size": 2}'):
        (tmp_path / "bad.json").write_text(bad)
        with pytest.raises(ConfigError, match="--calibrate"):
            calibrate(get_profile("cpu"), [str(tmp_path / "bad.json")])


@pytest.mark.slow  # > 12 s: make test stays under 10 minutes
def test_cli_json_ranked_and_nothing_fits():
    r = paratrain_cli("plan", DEBUG, "--nproc-per-node", "2", "--hardware", "cpu", "--top", "3", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    times = [lay["step_time_s"] for lay in out["layouts"]]
    assert len(times) == 3 and times == sorted(times)
    for lay in out["layouts"]:
        assert lay["peak_bytes"] <= out["usable_bytes"] and set(lay["terms"]) >= {"compute", "pp_bubble", "tp_comm"}
        assert all(s.count("=") == 1 and "." in s.split("=")[0] for s in lay["set"])
    assert "hardware profile 'cpu'" in r.stderr and out["refused"]
    r = paratrain_cli("plan", DEBUG, "--nproc-per-node", "2", "--hardware", "cpu", "--memory-gib", "0.0001")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("paratrain: error")]
    assert "no layout fits" in line and "--memory-gib" in line


def train_debug_rank(overrides: list[str]) -> dict:
    import paratrain

    return paratrain.train(paratrain.load_config(DEBUG, overrides))


@pytest.mark.slow
def test_best_layout_at_world_4_trains(tmp_path):
    result = plan(load_config(DEBUG), world_size=4, nproc_per_node=4, profile=get_profile("cpu"), top=1, progress=False)
    best = result.layouts[0].layout
    # Plain SGD, compared with one process: the proposed layout trains the same run.
    sgd = ["optim.name='sgd'", "optim.beta1=0.0", "optim.weight_decay=0.0", "optim.grad_clip=0.0", "optim.lr=0.5"]
    common = ["run.steps=2", "run.progress=false", "run.save_model=false", *sgd]
    out, ref = str(tmp_path / "run"), str(tmp_path / "ref")
    run_ranks(train_debug_rank, 4, [f"run.out_dir='{out}'", *common, *best.set_lines()])
    run_ranks(train_debug_rank, 1, [f"run.out_dir='{ref}'", *common])
    rows, want = read_metrics(out), read_metrics(ref)
    assert len(rows) == 2
    for key in ("loss", "grad_norm"):  # 1e-4: sharded and tensor-parallel sums reorder float32 additions
        got, exp = [r[key] for r in rows], [r[key] for r in want]
        torch.testing.assert_close(got, exp, rtol=1e-4, atol=0, msg=lambda m, k=key: f"{best} {k}: {m}")


@pytest.mark.slow
def test_8b_on_64_gpus_plans_and_fits():
    """The 8B plan's search finds fitting layouts and skips no faster one that fits. It asks for
    the two best (62 fake-tensor runs, 72 s on the idle machine), not docs/plan.md's five (142
    runs, 196 s): the search still goes on past the first fit, in about a third of the time (a
    time is a figure, never a threshold a loaded machine could break)."""
    cfg = load_config(DEBUG, big_gpt())
    memory = MemoryModel(cfg, model=meta_model(cfg), n_blocks=32)
    hw = get_profile("h100-sxm")
    result = plan(cfg, world_size=64, nproc_per_node=8, profile=hw, top=2, memory=memory, progress=False)
    assert len(result.layouts) == 2
    for p in result.layouts:
        assert p.memory.peak_bytes <= result.usable_bytes <= 80 * GIB
    # No shortcut skipped a faster layout that fits: HSDP (8 replicas of FSDP over 8) at micro-batch 1
    # fits (64 GiB), the fastest layout that does; a sibling shortcut that took one sibling's
    # unsharded parameters for every sibling's refused it once.
    known = Layout(8, 8, 1, 1, 1)
    assert memory.peak(known).peak_bytes <= result.usable_bytes
    stats = ModelStats.of(meta_model(cfg), cfg)
    fastest = step_cost(known, cfg=cfg, stats=stats, hw=hw, ranks_per_node=8).step_time_s
    assert result.layouts[0].cost.step_time_s <= fastest


def llama3_8b(tmp_path) -> str:
    """A transformers Llama-3-8B config (no weights): 32 layers, width 4096, SwiGLU 14336, 32 query
    and 8 key/value heads, vocabulary 128256, untied head."""
    from transformers import LlamaConfig

    LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    ).save_pretrained(tmp_path)
    return str(tmp_path)


def test_llama3_8b_on_8_h100_lands_near_torchtitans_measurement(tmp_path):
    """torchtitan (docs/performance.md, Table 1; arXiv:2410.06511) trains Llama 3.1 8B on 8 H100
    (96 GiB HBM2e at 2.4 TB/s, 500 W) with FSDP over the 8, bf16, sequence 8192, local batch 2,
    selective activation checkpointing: 5,762 tokens/s per GPU eager (33.7% MFU), 6,667 compiled
    (39.0%). Priced on that hardware, that layout lands at about 50%: the model's terms are all
    lower bounds of what a real step adds (docs/plan.md), so it may sit above the measurement but
    not below it, and not more than ~1.5x above. The old flat model (every matmul, attention
    included, at 0.7 of peak; the GPT block's pointwise ops) lands at 59% and fails the band."""
    cfg = load_config(
        DEBUG,
        [
            "model.args={}",
            f"model.hf='{llama3_8b(tmp_path)}'",
            "data.args={block_size=8192, max_bytes=100000}",
            "batch.global_batch_size=16",
            "precision.dtype='bf16'",
        ],
    )
    stats = ModelStats.of(meta_model(cfg), cfg)
    assert stats.flops_per_token == pytest.approx(5.79e10, rel=0.01)  # 6 x 7.5e9 + 12 x 32 x 4096 x 8192
    titan = dataclasses.replace(get_profile("h100-sxm"), hbm_gbps=2400.0, memory_gib=96)
    layout = Layout(1, 8, 1, 1, 2, "selective", True)
    cost = step_cost(layout, cfg=cfg, stats=stats, hw=titan, ranks_per_node=8)
    print(f"\nLlama-3-8B on torchtitan's 8 H100: MFU {cost.mfu:.1%}, terms {cost.terms}")
    assert 0.33 <= cost.mfu <= 0.52, cost.mfu
    # The fault this test must catch: the old flat model.
    flat = dataclasses.replace(titan, sms=0, attention_efficiency=0.0)
    gpt_pointwise = dataclasses.replace(stats, pointwise=(40.0 * 4096, 0.0))
    old = step_cost(layout, cfg=cfg, stats=gpt_pointwise, hw=flat, ranks_per_node=8)
    assert old.mfu > 0.52, old.mfu


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipeline_stage_memory_matches_a_real_run(schedule):
    """Each pipeline rank's modelled peak against the live tensor bytes of a real pp = 2 run of the
    main GPT (benchmarks/parallel/plan_pipeline_memory.py): within 10%. Without the receive buffers, the
    gradients accumulated over the pipeline micro-batches and with logits on the first stage, the
    last 1F1B stage was 18% under and the first GPipe stage 17% over."""
    from paratrain.testing.pipeline_memory import measured, modelled

    layout = Layout(1, 1, 1, 2, 4, pp_schedule=schedule)
    for meas, model in zip(measured(layout), modelled(layout), strict=True):
        assert abs(model / meas - 1) <= 0.10, (schedule, meas, model)


def test_nothing_fits_names_the_smallest_need():
    cfg = load_config(DEBUG)
    result = plan(
        cfg, world_size=2, nproc_per_node=2, profile=get_profile("cpu"), memory_gib=1e-5, top=1, progress=False
    )
    assert not result.layouts
    msg = str(nothing_fits_error(result))
    assert "no layout fits" in msg and "GiB" in msg and "\n" not in msg


def test_zero_bubble_with_selective_checkpointing_is_refused():
    """Found by training the plan's layouts: the weight pass of a zero-bubble schedule is a second
    backward, which selective checkpointing refuses at run time; the preflight now refuses it."""
    cfg = load_config(MAIN, ["parallel.pp=2", "parallel.pp_schedule='interleaved_zb'", "batch.micro_batch_size=8"])
    check_run(cfg, 2)
    cfg.parallel.activation_checkpointing = "selective"
    with pytest.raises(ConfigError, match="selective"):
        check_run(cfg, 2)
    # And the plan does not offer it (its verdict cache once shared one verdict across the modes).
    layouts, _ = enumerate_layouts(load_config(MAIN), world_size=4, nproc_per_node=4)
    zero_bubble = [lay for lay in layouts if lay.pp_schedule in ("interleaved_zb", "zbv", "dualpipev") and lay.pp > 1]
    assert zero_bubble and not any(lay.activation_checkpointing == "selective" for lay in zero_bubble)


def test_a_model_without_blocks_is_not_offered_activation_checkpointing():
    """Checkpointing wraps each block, which a model without a blocks list does not have (apply_ac
    refuses it when the model is built, after the preflight): the plan of such a model (the code
    search's dual encoder, configs/code_search.toml) once offered those layouts and stopped with
    exit 2 at the first it estimated."""
    over = [
        "model.factory='paratrain.testing.toy:mlp'",
        "model.args={}",
        "data.factory='paratrain.testing.toy:regression'",
        "data.args={}",
        "loss.name='mse'",
    ]
    cfg = load_config(DEBUG, over)
    layouts, refused = enumerate_layouts(cfg, world_size=2, nproc_per_node=2)
    assert layouts and {lay.activation_checkpointing for lay in layouts} == {"none"}
    assert any("works per block" in reason for reason in refused)
    result = plan(cfg, world_size=2, nproc_per_node=2, profile=get_profile("cpu"), top=1, progress=False)
    assert result.layouts


@pytest.mark.slow  # about 20 s: six tiny trainings
def test_gpu_check_script_runs_on_cpu():
    """benchmarks/gpu/gpu_plan.py (the GPU check, for a task lent a device) works end to end here."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "src"), "OMP_NUM_THREADS": "1"}
    script = os.path.join(REPO, "benchmarks", "gpu", "gpu_plan.py")
    args = ["--dry-run-cpu", "--global-batch", "8", "--min-micro-batch", "4", "--steps", "3"]
    out = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Spearman of step times over 6 layouts" in out.stdout, out.stdout[-2000:]


# ----------------------------------------------------------------------------- context parallel

# A long row on a small model: activations dominate, and one head (tp cannot split it).
LONG = [
    "model.args={n_layer=2, n_head=1, d_model=64, block_size=2048}",
    "data.args={block_size=2048, max_bytes=100000}",
    "batch.global_batch_size=2",
    "batch.micro_batch_size=1",
]


def test_cp_is_enumerated_where_the_row_splits():
    """cp degrees divide the world and split the row into 2 x cp chunks; each cp layout passes the
    trainer's preflight and its --set lines select it."""
    cfg = load_config(DEBUG)  # block_size 32: cp 2 and 4 both split it
    layouts, refused = enumerate_layouts(cfg, world_size=4, nproc_per_node=4)
    cps = {lay.cp for lay in layouts}
    assert cps == {1, 2, 4}
    lay = next(lay for lay in layouts if lay.cp == 2 and lay.dp_shard == 2)
    assert lay.world_size == 4 and "c2" in lay.short()
    check_run(lay.apply(cfg), 4)
    assert load_config(DEBUG, lay.set_lines()).parallel == lay.apply(cfg).parallel
    # block_size 36 = 2 x 18: cp 2 splits it into 4 chunks of 9, cp 4 would need 8 equal chunks.
    odd = load_config(
        DEBUG, ["model.args={n_layer=2, n_head=2, d_model=32, block_size=36}", "data.args={block_size=36}"]
    )
    assert {c for _, c in cp_degrees(odd, 4)} == {1, 2}


def test_cp_memory_falls_as_one_over_cp():
    """The predicted peak per rank of a long row at cp = 2 and 4 is close to 1/cp of one process's
    (activations and the FSDP2 shards over cp both fall as 1/cp)."""
    cfg = load_config(DEBUG, LONG)
    model = meta_model(cfg)
    memory = MemoryModel(cfg, model=model, n_blocks=2)
    peaks = {cp: memory.peak(Layout(1, 1, 1, 1, 1, cp=cp)).peak_bytes for cp in (1, 2, 4)}
    for cp in (2, 4):
        ratio = peaks[cp] / peaks[1]
        assert 0.9 / cp < ratio < 1.15 / cp, (cp, ratio, peaks)
    assert memory.lower_bound(Layout(1, 1, 1, 1, 1, cp=2)) == memory.lower_bound(Layout(1, 2, 1, 1, 1))


def test_cp_cost_terms():
    """A cp rank computes 1/cp of the tokens (matmuls and attention alike), pays the ring's hops
    (all-to-all's when chosen), and its gradients go to FSDP2 over dp_shard x cp."""
    cfg = load_config(DEBUG, LONG)
    stats = ModelStats.of(meta_model(cfg), cfg)
    hw = dataclasses.replace(get_profile("cpu"), cores=8, overlap=0.0)

    def cost(lay, c=cfg):
        return step_cost(lay, cfg=c, stats=stats, hw=hw, ranks_per_node=8)

    one, two = cost(Layout(1, 1, 1, 1, 1)), cost(Layout(1, 1, 1, 1, 1, cp=2))
    assert one.terms["cp_comm"] == 0 and two.terms["cp_comm"] > 0
    torch.testing.assert_close(two.terms["compute"], one.terms["compute"] / 2, rtol=1e-9, atol=0)
    assert two.terms["fsdp_comm"] > 0 and two.terms["dp_grad_reduce"] == 0  # FSDP2 over the cp ranks
    # The ring by hand: per layer and micro-batch, cp - 1 forward hops of K and V, cp - 1 backward
    # hops of K, V, dK, dV (fp32) and one of dK, dV home; 2 micro-batches of 1 row, 2 layers.
    chunk = 1 * 1024 * 64
    hop = lambda n: hw.collective_s("send_recv", n, 2, inter=False)  # noqa: E731
    ring = 2 * 2 * (hop(2 * chunk * 4) + hop(4 * chunk * 4) + hop(2 * chunk * 4))
    torch.testing.assert_close(two.terms["cp_comm"], ring, rtol=1e-9, atol=0)
    a2a_cfg = load_config(DEBUG, [*LONG, "parallel.cp_attention='alltoall'"])
    a2a = cost(Layout(1, 1, 1, 1, 1, cp=2), a2a_cfg).terms["cp_comm"]
    want = 2 * 2 * 8 * hw.collective_s("all_to_all", chunk * 4, 2, inter=False)
    torch.testing.assert_close(a2a, want, rtol=1e-9, atol=0)


def _ring_bytes_rank(b: int, h: int, t: int, d: int) -> int:
    import torch.distributed as dist

    import paratrain.distributed.context_parallel as cpmod

    dist.init_process_group("gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    sent, exchange = [0], cpmod._exchange

    def counting(send, group, **kw):
        sent[0] += send.numel() * send.element_size()
        return exchange(send, group, **kw)

    cpmod._exchange = counting
    g = torch.Generator().manual_seed(0)
    q, k, v = (cpmod.shard_sequence(torch.randn(b, h, t, d, generator=g), dim=2, cp=cp, rank=rank) for _ in range(3))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    cpmod.ring_attention(q, k, v, group=dist.group.WORLD).sum().backward()
    dist.destroy_process_group()
    return sent[0]


@pytest.mark.slow  # ranks started: 4-20 s, and the cost terms have their own fast test
@pytest.mark.parametrize("cp", [2, 4])
def test_ring_bytes_formula_matches_what_the_ring_sends(cp):
    """The plan's ring formula against the bytes the ring hands to its point-to-point exchange (one
    attention layer, forward and backward, float32), on every rank."""
    from paratrain.plan.cost import ring_bytes

    b, h, t, d = 2, 2, 32, 8
    fwd, bwd = ring_bytes(mb=b, local_seq=t // cp, width=h * d, cp=cp, act_bytes=4)
    assert run_ranks(_ring_bytes_rank, cp, b, h, t, d) == [fwd + bwd] * cp


@pytest.mark.slow  # about 60 s: every layout of a world of 2 estimated until one fits
def test_long_row_that_fits_only_at_cp2_is_planned_with_cp2():
    """A 2048-token row whose every cp = 1 layout at world 2 (data parallel, FSDP, pipeline, any
    checkpointing) exceeds 11 MiB per rank: `paratrain plan` ranks a cp = 2 layout first and shows cp."""
    usable_mib = 11.0
    margin = load_config(DEBUG).batch.memory_margin
    sets = [a for s in LONG for a in ("--set", s)]
    r = paratrain_cli(
        "plan", DEBUG, *sets, "--nproc-per-node", "2", "--hardware", "cpu", "--top", "2", "--json",
        "--memory-gib", f"{usable_mib / 1024 / (1 - margin):.6f}",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert all("parallel.cp=2" in lay["set"] for lay in out["layouts"]), out["layouts"]
    assert out["refused"].get("peak memory exceeds the usable memory per rank", 0) > 0
    table = r.stderr.splitlines()
    first = next(i for i, line in enumerate(table) if "layout" in line and "step_s" in line) + 1
    assert " c2 " in table[first], table[first]
    # Without the budget a cp = 1 layout is faster (no ring on the critical path).
    result = plan(
        load_config(DEBUG, LONG), world_size=2, nproc_per_node=2, profile=get_profile("cpu"), top=1, progress=False
    )
    assert result.layouts[0].layout.cp == 1
