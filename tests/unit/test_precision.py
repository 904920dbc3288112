"""Mixed precision, compile, bench compute and MFU."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch._dynamo.utils import counters

import paratrain
from paratrain.config import ConfigError, HardwareConfig, ModelConfig, PrecisionConfig
from paratrain.distributed.compile import apply_compile
from paratrain.models import build_gpt, spec_of
from paratrain.models.gpt import gpt_flops_per_token
from paratrain.observability.mfu import resolve_peak_flops
from paratrain.precision import build_mp_policy, check_device_supports, check_precision
from paratrain.testing.dist_utils import paratrain_cli, plain_sgd, read_metrics

TOY = [
    "model.args={n_layer = 2, n_head = 2, d_model = 32, block_size = 16, vocab_size = 32}",
    "data.factory='paratrain.testing.toy:toy_lm'",
    "data.args={n = 64, seq_len = 16, vocab = 32}",
    "batch.global_batch_size=8",
    "batch.micro_batch_size=4",
    "run.steps=4",
    "run.progress=false",
    "run.save_model=false",
    "metrics.plot=false",
    "optim.lr=3e-3",
    "optim.warmup_steps=1",
]


# Precision comparisons need a loss that moves: the same 8 samples every step (n = 8 = the
# global batch) at lr 1e-2 fall from 3.46 to 2.62 in 6 steps, where random tokens barely move.
MOVING = ["data.args={n = 8, seq_len = 16, vocab = 32}", "optim.lr=1e-2", "run.steps=6"]


def _train(tmp_path, name: str, extra: list[str] = ()) -> tuple[list[float], list[dict]]:
    """One process, in the test process (world 1 needs no spawn)."""
    out = tmp_path / name
    s = paratrain.train(paratrain.load_config(None, [*TOY, f"run.out_dir='{out}'", *extra]))
    return s["losses"], read_metrics(str(out))


def deviation_over_change(losses: list[float], ref: list[float]) -> float:
    """The largest per-step loss difference as a fraction of the reference's loss change over the
    run: a bound relative to the loss itself (2% of 3.5 = 0.07) can exceed the whole change."""
    change = abs(ref[0] - ref[-1])
    assert change > 0.5, ref  # the loss moved: there is something to compare against
    return max(abs(a - b) for a, b in zip(losses, ref)) / change


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("fp32"), "fp32", MOVING)


def test_bf16_autocast_trains_close_to_fp32(tmp_path, fp32):
    losses, rows = _train(tmp_path, "bf16", [*MOVING, "precision.dtype='bf16'"])
    ref, _ = fp32
    assert losses != ref  # autocast did something
    assert deviation_over_change(losses, ref) < 0.05  # measured 0.007
    assert "loss_scale" not in rows[0]  # no scaler for bf16


def test_fp16_uses_a_grad_scaler_and_logs_it(tmp_path, fp32):
    losses, rows = _train(tmp_path, "fp16", [*MOVING, "precision.dtype='fp16'"])
    assert losses != fp32[0]
    assert deviation_over_change(losses, fp32[0]) < 0.05  # measured 0.0004
    assert rows[-1]["loss_scale"] == 65536.0 and rows[-1]["skipped_steps"] == 0


def test_fp16_overflow_skips_the_step_and_lowers_the_scale(tmp_path):
    # A loss scale of 1e30 overflows fp16 gradients: each step is skipped and the scale halved.
    _, rows = _train(
        tmp_path, "fp16-overflow", ["precision.dtype='fp16'", "precision.fp16_init_scale=1e30", "run.save_model=true"]
    )
    assert [r["skipped_steps"] for r in rows] == [1, 2, 3, 4]
    assert [r["loss_scale"] for r in rows] == pytest.approx([1e30 / 2 ** (k + 1) for k in range(4)], rel=1e-6)
    # Every step skipped: the weights are still the initial ones.
    from safetensors.torch import load_file

    torch.manual_seed(0)
    init = build_gpt(n_layer=2, n_head=2, d_model=32, block_size=16, vocab_size=32).state_dict()
    saved = load_file(str(tmp_path / "fp16-overflow" / "model.safetensors"))
    for k, v in init.items():
        torch.testing.assert_close(saved[k], v, rtol=0, atol=0)


def test_precision_errors_are_clear():
    with pytest.raises(ConfigError, match="precision.dtype = 'fp16'.*bf16"):
        check_precision(PrecisionConfig(dtype="fp16"), dp_shard=2)
    with pytest.raises(ConfigError, match="autocast is not available on meta"):
        check_device_supports(PrecisionConfig(dtype="bf16"), torch.device("meta"))
    check_device_supports(PrecisionConfig(dtype="fp16"), torch.device("cpu"))  # torch 2.13 has CPU fp16 autocast
    with pytest.raises(ConfigError, match="precision.dtype"):
        paratrain.load_config(None, ["precision.dtype='fp8'"])
    with pytest.raises(ConfigError, match="contradicts comm.compression"):
        check_precision(PrecisionConfig(reduce_dtype="fp16"), compression="bf16")


def test_cli_refuses_bad_precision_with_exit_2():
    r = paratrain_cli("train", "configs/debug.toml", "--set", "precision.dtype='int4'")
    assert r.returncode == 2 and "precision.dtype" in r.stderr and "Traceback" not in r.stderr


def test_fsdp_mixed_precision_policy():
    assert build_mp_policy(PrecisionConfig()) is None  # fp32 everywhere: FSDP2's default
    p = build_mp_policy(PrecisionConfig(dtype="bf16"))
    assert p.param_dtype == torch.bfloat16 and p.reduce_dtype == torch.float32  # fp32 reduction by default
    p = build_mp_policy(PrecisionConfig(dtype="fp32"), compression="bf16")
    assert p.param_dtype == torch.float32 and p.reduce_dtype == torch.bfloat16  # comm.compression under FSDP2


# ----------------------------------------------------------------------------- compile


@pytest.mark.slow  # 30 s of inductor builds: the fast tier's budget; the slow tier compiles every layout
def test_compile_runs_and_matches_eager(tmp_path, caplog):
    """inductor works on this CPU machine (gcc): each block is compiled, the losses are eager's.

    Without proof that compilation happened, an eager fallback would compare eager with eager:
    dynamo's counters must show the probe's graph (distributed/compile.py) and the blocks' (one graph for
    both: the same code), compiled through AOTAutograd, with no graph break."""
    # Plain SGD: inductor's kernels round differently from eager's, and AdamW would grow that over the 6 steps.
    sgd = [*MOVING, *plain_sgd(0.3)]
    eager, _ = _train(tmp_path, "eager", sgd)
    counters.clear()
    losses, _ = _train(tmp_path, "compiled", [*sgd, "train.compile=true"])
    assert counters["frames"]["ok"] >= 2 and counters["stats"]["unique_graphs"] >= 2, dict(counters["stats"])
    assert counters["aot_autograd"]["ok"] >= 2, dict(counters["aot_autograd"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager), rtol=1e-5, atol=0)


def test_compile_falls_back_with_a_warning(monkeypatch, caplog):
    import paratrain.distributed.compile as comp

    def no_compiler(device):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")

    monkeypatch.setattr(comp, "_inductor_probe", no_compiler)
    model = build_gpt(n_layer=2, n_head=2, d_model=16, block_size=8, vocab_size=16)
    with caplog.at_level(logging.WARNING, logger="paratrain"):
        assert apply_compile(model, device=torch.device("cpu")) is False
    assert "running eagerly" in caplog.text and "No working C++ compiler" in caplog.text
    assert all(getattr(b, "_compiled_call_impl", None) is None for b in model.layers.values())


def test_compile_keeps_parameter_names():
    model = build_gpt(n_layer=2, n_head=2, d_model=16, block_size=8, vocab_size=16)
    before = list(model.state_dict())
    for block in model.layers.values():
        block.compile()  # what apply_compile does; lazy, so nothing is compiled here
    assert list(model.state_dict()) == before


# ----------------------------------------------------------------------------- MFU and bench compute


def build_flops_per_token(model):
    """The count MFU uses: the model's ModelSpec's (6 x parameters for a model we do not know)."""
    return spec_of(ModelConfig(), model).flops_per_token(model)


def test_gpt_flops_follow_palm_appendix_b():
    model = build_gpt(n_layer=2, n_head=2, d_model=32, block_size=16, vocab_size=32)
    total = sum(p.numel() for p in model.parameters())
    embeddings = 32 * 32 + 16 * 32  # token and position lookups do no matmul
    f = build_flops_per_token(model)
    assert f(16) == 6 * (total - embeddings) + 12 * 2 * 32 * 16
    assert gpt_flops_per_token(matmul_params=10, n_layer=1, d_model=2, seq_len=3) == 60 + 72
    user = torch.nn.Linear(4, 3)
    assert build_flops_per_token(user)(1) == 6 * 15  # 6 x params for a model we do not know


def test_mfu_logged_with_a_stated_peak(tmp_path):
    _, rows = _train(tmp_path, "mfu", ["run.steps=2", "hardware.peak_flops=1e12"])
    for r in rows:
        assert r["mfu"] == pytest.approx(r["model_flops_per_s"] / 1e12)
        assert r["model_flops_per_s"] == pytest.approx(
            r["tokens"]
            * build_flops_per_token(build_gpt(n_layer=2, n_head=2, d_model=32, block_size=16, vocab_size=32))(16)
            / r["step_time_s"]
        )


def test_bench_compute_feeds_mfu(tmp_path):
    js = tmp_path / "compute.json"
    r = paratrain_cli("bench", "compute", "--n", "128", "--copy-mib", "4", "--runs", "2", "--json", str(js))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "TFLOP/s" in r.stdout and "GB/s" in r.stdout
    report = json.loads(js.read_text())
    mm = report["matmul"][0]
    assert mm["dtype"] == "fp32" and mm["flops_per_s_min"] <= mm["flops_per_s"] <= mm["flops_per_s_max"]
    assert report["memcpy"]["memcpy_gbps"] > 0
    peak, source = resolve_peak_flops(HardwareConfig(compute_bench=str(js)), device=torch.device("cpu"), dtype="fp32")
    assert peak == mm["flops_per_s"] and "bench compute" in source
    with pytest.raises(ConfigError, match="no matmul figure for cpu/bf16"):
        resolve_peak_flops(HardwareConfig(compute_bench=str(js)), device=torch.device("cpu"), dtype="bf16")
    assert (
        resolve_peak_flops(
            HardwareConfig(peak_flops=5.0, compute_bench=str(js)), device=torch.device("cpu"), dtype="fp32"
        )[0]
        == 5.0
    )
    assert resolve_peak_flops(HardwareConfig(), device=torch.device("cpu"), dtype="fp32")[0] is None


def test_datasheet_peak_by_device_name():
    from paratrain.observability.mfu import datasheet_peak_flops

    assert datasheet_peak_flops("NVIDIA H100 80GB HBM3") == 989e12  # SXM
    assert datasheet_peak_flops("NVIDIA H100 PCIe") == 756e12  # the more specific name wins
    assert datasheet_peak_flops("NVIDIA H200") == 989e12 and datasheet_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert datasheet_peak_flops("NVIDIA L40S") == 362e12 and datasheet_peak_flops("NVIDIA L4") == 121e12
    assert datasheet_peak_flops("Some CPU") is None and datasheet_peak_flops("NVIDIA H100", "fp32") is None
