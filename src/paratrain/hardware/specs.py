"""The ONE GPU data sheet: dense peaks, memory and links per device, with their sources.

Dense (no 2:4 sparsity) bf16 tensor-core peaks are the denominator of MFU in the PaLM paper,
torchtitan (``utils.get_peak_flops``) and Megatron: a measured matmul peak is lower and flatters
the MFU. ``observability/mfu.py`` matches a device by ``torch.cuda.get_device_name()`` (the more
specific names first); ``plan/profile.py`` builds its hardware profiles from the rows that carry
the full figures (memory, links, SMs). NVLink is the total bidirectional bandwidth / 2; the
network is one NIC per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPUSpec:
    match: str  # a substring of torch.cuda.get_device_name()
    bf16_flops: float  # dense tensor-core peak (fp16 the same)
    # The planner's figures; a row without them serves MFU only (profile = "").
    profile: str = ""
    fp32_flops: float = 0.0  # plain FP32 (paratrain does not enable TF32)
    memory_gib: float = 0.0
    hbm_gbps: float = 0.0
    nvlink_gbps: float = 0.0  # per direction
    nic_gbps: float = 0.0  # per GPU, GB/s
    sms: int = 0
    attention_efficiency: float = 0.0  # causal flash attention, fraction of the peak (plan/profile.py)
    sheet: str = ""
    network: str = ""


GPUS: tuple[GPUSpec, ...] = (
    GPUSpec("H100 PCIe", 756e12),
    GPUSpec("H100 NVL", 835e12),
    GPUSpec("GH200", 989e12),
    GPUSpec(
        "H100",  # SXM5 ("NVIDIA H100 80GB HBM3")
        989e12,
        profile="h100-sxm",
        fp32_flops=67e12,
        memory_gib=80,
        hbm_gbps=3350,
        nvlink_gbps=450,
        nic_gbps=50,
        sms=132,
        attention_efficiency=0.35,
        sheet="NVIDIA H100 Tensor Core GPU datasheet (H100 SXM)",
        network="NDR InfiniBand 400 Gb/s per GPU (DGX H100 datasheet)",
    ),
    GPUSpec(
        "H200",
        989e12,
        profile="h200",
        fp32_flops=67e12,
        memory_gib=141,
        hbm_gbps=4800,
        nvlink_gbps=450,
        nic_gbps=50,
        sms=132,
        attention_efficiency=0.35,
        sheet="NVIDIA H200 Tensor Core GPU datasheet (H200 SXM)",
        network="NDR InfiniBand 400 Gb/s per GPU (HGX H200)",
    ),
    GPUSpec(
        "B200",
        2250e12,
        profile="b200",
        fp32_flops=75e12,
        memory_gib=180,
        hbm_gbps=8000,
        nvlink_gbps=900,
        nic_gbps=50,
        sms=148,
        attention_efficiency=0.35,
        sheet="NVIDIA DGX B200 / HGX B200 datasheet (per GPU: 1/8 of the 8-GPU figures)",
        network="ConnectX-7 400 Gb/s per GPU (DGX B200 datasheet)",
    ),
    GPUSpec(
        "A100",
        312e12,
        profile="a100-80gb",
        fp32_flops=19.5e12,
        memory_gib=80,
        hbm_gbps=2039,
        nvlink_gbps=300,
        nic_gbps=25,
        sms=108,
        attention_efficiency=0.55,
        sheet="NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB)",
        network="HDR InfiniBand 200 Gb/s per GPU (DGX A100 datasheet)",
    ),
    GPUSpec("L40S", 362e12),
    GPUSpec("L4", 121e12),
    GPUSpec("RTX 4090", 165e12),  # fp32 accumulation
)


def gpu_by_name(device_name: str) -> GPUSpec | None:
    """The data-sheet row of a device by its name (the first, most specific, match); None if unknown."""
    return next((g for g in GPUS if g.match in device_name), None)


def datasheet_peak_flops(device_name: str, dtype: str = "bf16") -> float | None:
    """The data-sheet dense peak of a device by its name (bf16/fp16 tensor cores); None if unknown."""
    if dtype not in ("bf16", "fp16"):
        return None
    spec = gpu_by_name(device_name)
    return spec.bf16_flops if spec else None
