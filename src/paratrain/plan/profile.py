"""Hardware profiles of ``paratrain plan``: data-sheet figures with their sources, or the user's own.

A profile holds what the cost model needs of one device and its links:

- ``peak_flops``: dense FLOP/s per device by training dtype, from the data sheet (what MFU is
  measured against). ``matmul_efficiency``: the fraction of it large matrix multiplies reach in
  practice; achievable FLOP/s = peak x efficiency. ``--calibrate`` with a ``paratrain bench
  compute --json`` file replaces the achievable figure by the measured matmul FLOP/s.
- ``hbm_gbps``: memory bandwidth (the optimiser step is memory-bound); calibrated from the
  memory-copy figure (traffic = 2 x bytes copied).
- ``intra_busbw_gbps`` / ``inter_busbw_gbps``: bus bandwidth (nccl-tests' definition, see
  hardware/collectives.py) of a collective inside a node (NVLink) and across nodes (InfiniBand/RoCE, one
  NIC per GPU); ``latency_s`` per collective. Calibrated from ``paratrain bench comm --json``
  files: a latency-bandwidth line fitted to the measured times by message size replaces the formula.
- ``block_overhead_s``: fixed time of one block's forward or backward pass that does not
  shrink with the work (kernel launches, Python and autograd dispatch): it is what makes tiny
  micro-batches slow. ``tp_block_overhead_s`` replaces it under tensor parallelism (every op on a
  DTensor propagates shardings in Python first) and ``fsdp_unit_overhead_s`` is added per FSDP
  unit and collective (FSDP2's hooks, copy-in and copy-out). On a GPU these run ahead of the
  kernels and hide behind them once the kernels are large, so the GPU profiles add nothing; the
  CPU pays them in full (calibrated at world 1 by benchmarks/parallel/plan_accuracy.py).
- ``optimizer_tensor_overhead_s`` / ``dtensor_optimizer_tensor_overhead_s``: the end of the step
  (gradient norm, clipping, AdamW, zero_grad) per parameter tensor, plain and sharded (FSDP or
  TP: each op on a DTensor propagates shardings in Python). On CPU torch's AdamW loops over the
  tensors one by one (foreach is its default on CUDA only, torch/optim/optimizer.py
  ``_default_to_fused_or_foreach``): 30-33 us a tensor plain and 186-203 us as DTensors at world
  1 (benchmarks/parallel/plan_accuracy.py, two runs), about 12 ms a step for the main GPT under FSDP. On
  a GPU the foreach kernels take whole lists of tensors and the host runs ahead: the GPU
  profiles add nothing.
- ``collective_sync_s``: what a collective costs inside a step beyond its isolated `bench comm`
  time: the ranks arrive at different moments, and on a CPU the backend's threads compete with
  the compute for the same cores. Added to every collective priced. On this 2-core machine it is
  measured in place by benchmarks/parallel/plan_accuracy.py: a tiny tensor-parallel GPT at the world size
  (4 all-reduces per block) against the same at world 1 (1.5-2.5 ms a collective at world 2);
  the GPU profiles add nothing (NCCL runs on its own SMs; not measured here).

Link figures are the data sheet's per-direction NVLink bandwidth and NIC line rate times 0.8,
the fraction nccl-tests' bus bandwidth typically reaches of the link (an assumption, stated
once here; calibrate to replace it).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

from paratrain.config import ConfigError
from paratrain.hardware.bench_comm import is_comm_report, read_comm_json
from paratrain.hardware.bench_compute import is_compute_report, read_compute_json
from paratrain.hardware.collectives import bus_factor, fit_line
from paratrain.hardware.specs import GPUS, GPUSpec

GIB = 1 << 30
LINK_EFFICIENCY = 0.8  # nccl-tests busbw / link rate, typical on NVLink and InfiniBand (assumption)
# cuBLAS reaches roughly 70% of the dense data-sheet peak on large bf16 GEMMs on A100/H100 (e.g.
# `paratrain bench compute` at n = 8192, and NVIDIA's own "Matrix Multiplication Background"
# guide, which shows ~0.7 of peak for large aligned shapes); calibrate to replace it.
GPU_MATMUL_EFFICIENCY = 0.7
# Causal attention as FlashAttention-2 (what SDPA runs on these GPUs) computes it: FA2 reaches
# about 35% of an H100's peak (Shah et al. 2024, "FlashAttention-3", sec. 1) and 50-73% of an
# A100's in the forward, less in the backward (Dao 2023, "FlashAttention-2", sec. 4): 0.35 on
# Hopper and Blackwell, 0.55 on Ampere.
ATTENTION_SOURCE = "FlashAttention-2 efficiency: Shah et al. 2024 (FA3 paper) on H100, Dao 2023 (FA2 paper) on A100"


@dataclass(frozen=True)
class Profile:
    name: str
    peak_flops: dict[str, float]  # dtype -> dense FLOP/s per device (data sheet)
    matmul_efficiency: float
    memory_gib: float
    hbm_gbps: float
    intra_busbw_gbps: float
    inter_busbw_gbps: float
    latency_s: float
    inter_latency_s: float
    # Fraction of the backward pass that gradient communication can hide behind (separate CUDA
    # streams overlap it; on CPU, gloo's threads compete with compute for the same cores).
    overlap: float
    block_overhead_s: float
    sources: dict[str, str]
    tp_block_overhead_s: float = 0.0  # 0: the same as block_overhead_s
    fsdp_unit_overhead_s: float = 0.0
    optimizer_tensor_overhead_s: float = 0.0
    dtensor_optimizer_tensor_overhead_s: float = 0.0
    # What a collective costs inside a step beyond its isolated `bench comm` time (see above).
    collective_sync_s: float = 0.0
    # Ranks per node that share one compute resource (the CPU profile: cores); 0 = one device each.
    cores: int = 0
    # Streaming multiprocessors: a GEMM runs in waves of output tiles over them (tile and wave
    # quantization, NVIDIA's "Matrix Multiplication Background" guide); 0 = no such effect (CPU).
    sms: int = 0
    # Fraction of the peak a causal flash-attention kernel reaches over its forward and backward;
    # 0 = attention priced as MFU counts it (the whole T x T square) at the matmul rate.
    attention_efficiency: float = 0.0
    # Calibrated: measured matmul FLOP/s by dtype, and collective times by (op, group size, inter).
    measured_flops: dict[str, float] = field(default_factory=dict)
    comm_table: dict[tuple[str, int, bool], list[tuple[int, float]]] = field(default_factory=dict)
    calibrated_from: tuple[str, ...] = ()

    def achievable_flops(self, dtype: str) -> float:
        if dtype in self.measured_flops:
            return self.measured_flops[dtype]
        return self.peak(dtype) * self.matmul_efficiency

    def peak(self, dtype: str) -> float:
        return self.peak_flops.get(dtype) or self.peak_flops["fp32"]

    def collective_s(self, op: str, nbytes: float, group: int, *, inter: bool) -> float:
        """Seconds of one collective of ``nbytes`` (nccl-tests' size convention) on ``group`` ranks."""
        if group <= 1 or nbytes <= 0:
            return 0.0
        measured = self._measured_s(op, nbytes, group, inter=inter)
        if measured is not None:
            return measured + self.collective_sync_s
        busbw = (self.inter_busbw_gbps if inter else self.intra_busbw_gbps) * 1e9
        latency = self.inter_latency_s if inter else self.latency_s
        return latency + self.collective_sync_s + nbytes * bus_factor(op, group) / busbw

    def _measured_s(self, op: str, nbytes: float, group: int, *, inter: bool) -> float | None:
        """From a calibration: the latency-bandwidth line fitted to the measured times (see
        ``fit_line``); other group sizes keep the measured bus bandwidth (busbw is the per-link
        figure, nearly independent of the group)."""
        rows = [k for k in self.comm_table if k[0] == op and k[2] == inter] or [
            k for k in self.comm_table if k[0] == op
        ]
        if not rows:
            return None
        key = min(rows, key=lambda k: (abs(k[1] - group), -k[1]))
        latency, per_byte = fit_line(self.comm_table[key])
        t = latency + per_byte * nbytes
        if key[1] != group:
            t *= bus_factor(op, group) / bus_factor(op, key[1])
        return t

    def describe(self) -> str:
        lines = [
            f"hardware profile '{self.name}'"
            + (f" calibrated from {', '.join(self.calibrated_from)}" if self.calibrated_from else "")
        ]
        flops = ", ".join(f"{d} {v / 1e12:.4g}" for d, v in self.peak_flops.items())
        lines.append(f"  peak dense TFLOP/s: {flops} ({self.sources['flops']})")
        for d in self.peak_flops:
            how = "measured matmul" if d in self.measured_flops else f"x {self.matmul_efficiency} matmul efficiency"
            lines.append(f"  achievable {d}: {self.achievable_flops(d) / 1e12:.4g} TFLOP/s ({how})")
        if self.sms:
            lines.append(f"  GEMMs in waves of 256x128 tiles over {self.sms} SMs, memory-bound below the ridge")
        if self.attention_efficiency:
            lines.append(
                f"  causal flash attention at {self.attention_efficiency:g} of peak ({self.sources.get('attention', '')})"
            )
        lines.append(f"  memory {self.memory_gib:g} GiB, bandwidth {self.hbm_gbps:g} GB/s ({self.sources['memory']})")
        lines.append(
            f"  busbw intra-node {self.intra_busbw_gbps:g} GB/s, inter-node {self.inter_busbw_gbps:g} GB/s,"
            f" latency {self.latency_s * 1e6:g}/{self.inter_latency_s * 1e6:g} us ({self.sources['links']})"
        )
        if self.comm_table:
            groups = sorted({(op, n, "inter" if x else "intra") for op, n, x in self.comm_table})
            lines.append(f"  measured collectives: {', '.join(f'{op}@{n} {x}' for op, n, x in groups)}")
        lines.append(
            f"  block overhead {self.block_overhead_s * 1e6:g} us per pass"
            f" ({(self.tp_block_overhead_s or self.block_overhead_s) * 1e6:g} under TP),"
            f" FSDP {self.fsdp_unit_overhead_s * 1e6:g} us per unit and collective, optimizer"
            f" {self.optimizer_tensor_overhead_s * 1e6:g} us per tensor"
            f" ({self.dtensor_optimizer_tensor_overhead_s * 1e6:g} as DTensors),"
            f" {self.collective_sync_s * 1e6:g} us per collective in a step, overlap {self.overlap:g}"
            f" ({self.sources['overhead']})"
        )
        return "\n".join(lines)


def _gpu(g: GPUSpec) -> Profile:
    sheet, network = g.sheet, g.network
    return Profile(
        name=g.profile,
        peak_flops={"bf16": g.bf16_flops, "fp16": g.bf16_flops, "fp32": g.fp32_flops},
        matmul_efficiency=GPU_MATMUL_EFFICIENCY,
        memory_gib=g.memory_gib,
        hbm_gbps=g.hbm_gbps,
        intra_busbw_gbps=g.nvlink_gbps * LINK_EFFICIENCY,
        inter_busbw_gbps=g.nic_gbps * LINK_EFFICIENCY,
        latency_s=10e-6,
        inter_latency_s=20e-6,
        overlap=1.0,
        block_overhead_s=60e-6,
        sms=g.sms,
        attention_efficiency=g.attention_efficiency,
        sources={
            "flops": f"{sheet}: dense (non-sparse) Tensor Core bf16/fp16, plain FP32 (paratrain does not enable TF32)",
            "memory": sheet,
            "links": f"{sheet} NVLink per direction; {network}; x {LINK_EFFICIENCY} (typical nccl-tests busbw)",
            "overhead": "about 12 kernels per block pass x ~5 us CUDA launch latency (assumption)",
            "attention": ATTENTION_SOURCE,
        },
    )


# The planner's GPU profiles: the data-sheet rows of hardware/specs.py that carry full figures.
PROFILES: dict[str, Profile] = {g.profile: _gpu(g) for g in GPUS if g.profile}


def cpu_profile() -> Profile:
    """This machine. Rough figures; `--calibrate` with `bench compute`/`bench comm` files is meant."""
    cores = os.cpu_count() or 1
    mem = 0.0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = int(line.split()[1]) * 1024 / GIB
    except OSError:
        mem = 8.0
    return Profile(
        name="cpu",
        # One AVX2 core: 2 FMA units x 8 fp32 lanes x 2 FLOPs x ~3 GHz (bf16 runs at about the
        # same rate through fp32 units on most x86 CPUs).
        peak_flops={"fp32": 96e9, "bf16": 96e9, "fp16": 96e9},
        matmul_efficiency=0.5,
        memory_gib=mem,
        hbm_gbps=10.0,
        intra_busbw_gbps=2.0,
        inter_busbw_gbps=1.0,
        latency_s=100e-6,
        inter_latency_s=200e-6,
        overlap=0.0,
        block_overhead_s=1e-3,
        tp_block_overhead_s=15e-3,
        fsdp_unit_overhead_s=1.5e-3,
        optimizer_tensor_overhead_s=33e-6,
        dtensor_optimizer_tensor_overhead_s=200e-6,
        collective_sync_s=1.5e-3,
        cores=cores,
        sources={
            "flops": "one AVX2 core, 32 FLOP/cycle at ~3 GHz (estimate; calibrate with bench compute)",
            "memory": "/proc/meminfo (the whole machine: ranks share it); bandwidth a DDR4 channel (estimate)",
            "links": "gloo over loopback TCP (estimate; calibrate with bench comm); 1.5 ms more per collective inside a step, measured in place at world 2 (benchmarks/parallel/plan_accuracy.py)",
            "overhead": "eager dispatch of a small block pass ~1 ms, ~15 ms on DTensors, FSDP2 ~1.5 ms per unit and collective, the step's end 33 us per parameter tensor (200 us on DTensors), measured here at world 1 (benchmarks/parallel/plan_accuracy.py)",
        },
    )


def profile_names() -> list[str]:
    return [*PROFILES, "cpu"]


def get_profile(name: str) -> Profile:
    if name == "cpu":
        return cpu_profile()
    if name not in PROFILES:
        raise ConfigError(f"--hardware {name!r} is unknown; use one of {', '.join(profile_names())}")
    return PROFILES[name]


def calibrate(profile: Profile, paths: list[str]) -> Profile:
    """Replace the profile's figures by those of `paratrain bench compute/comm --json` files."""
    measured, table, hbm = dict(profile.measured_flops), dict(profile.comm_table), profile.hbm_gbps
    for path in paths:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"--calibrate {path}: cannot read it as JSON ({e}); pass a `paratrain bench ... --json` file"
            )
        try:
            if is_compute_report(data):
                rows, traffic = read_compute_json(data)
                measured.update({dtype: flops for _, dtype, flops in rows})
                hbm = traffic or hbm
            elif is_comm_report(data):
                n, inter, rows = read_comm_json(data)
                for op, nbytes, seconds in rows:
                    table.setdefault((op, n, inter), []).append((nbytes, seconds))
            else:
                raise ConfigError(
                    f"--calibrate {path}: neither a `paratrain bench compute --json` nor a `bench comm --json` file"
                )
        except (KeyError, TypeError, ValueError) as e:  # a field missing or of the wrong type
            raise ConfigError(
                f"--calibrate {path}: a row lacks or mangles {e}; regenerate it with `paratrain bench ... --json`"
            ) from None
    table = {k: sorted(v) for k, v in table.items()}
    return dataclasses.replace(
        profile,
        measured_flops=measured,
        comm_table=table,
        hbm_gbps=hbm,
        calibrated_from=(*profile.calibrated_from, *paths),
    )
