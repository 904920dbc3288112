"""`paratrain plan`'s cost model against published Llama-3-8B throughputs on H100s (issue 58, item 3).

Each row is a published measurement with its setup as the source states it; the planner prices
that setup (model shape, sequence, global and local batch, parallel degrees, activation
checkpointing) through its own entry points: the layout goes through the trainer's preflight
(`preflight.check_run`, as `paratrain plan` does for every candidate) and is priced by
`plan.cost.step_cost` on a hardware profile. It prints predicted against published tokens/s per
GPU and MFU (PaLM appendix B's count, 5.79e10 FLOPs per token at sequence 8192, over the
data-sheet dense bf16 peak of 989 TFLOP/s) and their ratio, then the cost terms of each row.
What the planner's config cannot express (torch.compile, float8 GEMMs, Megatron's partial
recompute) is named per row: those rows are priced as the nearest bf16 eager setup, so their
ratio measures what that setting buys, not an error of the model. Not a calibration: no figure
of the model is fitted to these tables.

Sources (exact rows quoted in docs/plan.md, "Against published tables"):

- torchtitan: benchmarks/llama3_h100_202412_torchtitan.md in github.com/pytorch/torchtitan
  (was docs/performance.md, moved by #1296), Tables 1 and 3: Llama 3.1 8B, FSDP, local batch 2,
  sequence 8192 (train_configs/llama3_8b.toml at the commit it names, 9dec370), selective per-op
  activation checkpointing, bf16 mixed precision (fp32 reduce), H100 SXM with 96 GiB HBM2e at
  2.4 TB/s and a 500 W power limit, 400 Gb/s RDMA per GPU.
- Megatron-Bridge: docs/performance-summary-archive.md in github.com/NVIDIA-NeMo/Megatron-Bridge,
  25.11 and 25.09 containers, System DGX-H100, LLAMA3_8B (FP8 only: no bf16 row for Llama-3-8B on
  H100 is published there).
- NeMo 24.07: docs/source/performance/performance_summary.md in github.com/NVIDIA/NeMo (at
  8e3d65dcfe), DGX-H100, FP8, LLAMA3-8B with CP 2.

Also prices the 8B-shaped GPT of docs/plan.md's example on 64 H100s (8 nodes) at the layout
`paratrain plan` chose there, and, with --search, runs `plan()` itself on each distinct setup
(fake-tensor memory estimates of the 8B transformers model at sequence 8192: about two minutes
each on this 2-core machine, and the fastest layouts do not fit, so a search takes tens of
minutes; it was not run to the end here).

    PYTHONPATH=src python benchmarks/parallel/plan_vs_published.py [--search] [--json FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEBUG = os.path.join(ROOT, "configs", "debug.toml")
BF16_PEAK = 989e12  # H100 SXM dense bf16, the denominator of every MFU here (torchtitan's too)


@dataclass(frozen=True)
class Row:
    source: str
    name: str
    world: int
    global_batch: int
    micro_batch: int  # per rank and micro-batch
    seq: int
    dp_replicate: int
    dp_shard: int
    cp: int
    checkpointing: str  # the planner's nearest mode
    hardware: str  # "titan": torchtitan's H100s (2.4 TB/s HBM2e, 96 GiB); "dgx": the data sheet's
    tokens_per_gpu: float  # published tokens/s per GPU
    cannot_express: str = ""  # what of the published setup the planner does not price
    published_tflops: float = 0.0  # the source's own model TFLOP/s per GPU, where it gives one


TITAN = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
MB = "Megatron-Bridge docs/performance-summary-archive.md"
ROWS = (
    Row(TITAN, "T1 FSDP", 8, 16, 2, 8192, 1, 8, 1, "selective", "titan", 5762),
    Row(TITAN, "T1 FSDP + compile", 8, 16, 2, 8192, 1, 8, 1, "selective", "titan", 6667, "torch.compile"),
    Row(TITAN, "T1 FSDP + compile + Float8", 8, 16, 2, 8192, 1, 8, 1, "selective", "titan", 8532, "compile, float8"),
    Row(TITAN, "T3 FSDP, 128 GPUs", 128, 256, 2, 8192, 1, 128, 1, "selective", "titan", 5605),
    Row(TITAN, "T3 FSDP + compile, 128", 128, 256, 2, 8192, 1, 128, 1, "selective", "titan", 6514, "torch.compile"),
    Row(
        TITAN, "T3 + compile + Float8, 128", 128, 256, 2, 8192, 1, 128, 1, "selective", "titan", 8380, "compile, float8"
    ),
    # FSDP 8 = Megatron-FSDP over the 8 GPUs; GA 16. The row does not state checkpointing.
    Row(MB, "25.11 FP8-CS, FSDP 8", 8, 128, 1, 8192, 1, 8, 1, "none", "dgx", 14451, "FP8 (current scaling)", 744),
    Row(MB, "25.09 (FP8), FSDP 8", 8, 128, 1, 8192, 1, 8, 1, "none", "dgx", 14079, "FP8", 725),
    Row(
        "NeMo 24.07 performance_summary.md",
        "FP8, CP 2, DDP",
        8,
        128,
        1,
        8192,
        4,
        1,
        2,
        "none",
        "dgx",
        12273,
        "FP8",
        711,
    ),
)


def llama3_8b(path: str) -> str:
    """A transformers Llama-3-8B config, no weights: 32 layers, width 4096, SwiGLU 14336, 32 query
    and 8 key/value heads (GQA), vocabulary 128256, untied head (Llama 3.1 8B has the same shape)."""
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
    ).save_pretrained(path)
    return path


def row_config(row: Row, model_dir: str, *, compile_: bool):
    from paratrain.config import load_config

    return load_config(
        DEBUG,
        [
            "model.args={}",
            f"model.hf='{model_dir}'",
            f"data.args={{block_size={row.seq}, max_bytes=100000}}",
            f"batch.global_batch_size={row.global_batch}",
            "precision.dtype='bf16'",
            "precision.reduce_dtype='fp32'",
            f"train.compile={str(compile_).lower()}",  # accepted, not priced (see the docstring)
        ],
    )


def profile_of(row: Row):
    from paratrain.plan import get_profile

    hw = get_profile("h100-sxm")
    if row.hardware == "titan":  # their H100s: HBM2e, 2.4 TB/s, 96 GiB (the benchmark's Hardware section)
        hw = dataclasses.replace(hw, hbm_gbps=2400.0, memory_gib=96)
    return hw


def price(row: Row, model_dir: str) -> dict:
    from paratrain.plan.cost import ModelStats, step_cost
    from paratrain.plan.enumerate import Layout, meta_model
    from paratrain.preflight import check_run

    cfg = row_config(row, model_dir, compile_="compile" in row.cannot_express)
    layout = Layout(row.dp_replicate, row.dp_shard, 1, 1, row.micro_batch, row.checkpointing, True, cp=row.cp)
    assert layout.world_size == row.world, row
    check_run(layout.apply(cfg), row.world)  # the trainer would accept it (raises otherwise)
    stats = ModelStats.of(meta_model(cfg), cfg)
    cost = step_cost(layout, cfg=cfg, stats=stats, hw=profile_of(row), ranks_per_node=8)
    predicted = cost.tokens_per_s / row.world
    # What FP8 GEMMs would change if the planner priced them: the matmuls at the FP8 data-sheet
    # peak (2x bf16 on an H100) x the same 0.7, attention kept at its bf16 rate. A what-if for
    # the explanation, not a feature of the planner.
    hw = profile_of(row)
    fp8 = dataclasses.replace(
        hw,
        peak_flops={**hw.peak_flops, "bf16": 2 * hw.peak_flops["bf16"]},
        attention_efficiency=hw.attention_efficiency / 2,
    )
    fp8_cost = step_cost(layout, cfg=cfg, stats=stats, hw=fp8, ranks_per_node=8)
    return {
        "row": f"{row.source.split()[0]} {row.name}",
        "layout": layout.short(),
        "accumulation": row.global_batch // (row.micro_batch * layout.dp),
        "predicted_tokens_per_gpu": predicted,
        "published_tokens_per_gpu": row.tokens_per_gpu,
        "ratio": predicted / row.tokens_per_gpu,
        "predicted_mfu": cost.mfu,
        "published_mfu": row.tokens_per_gpu * stats.flops_per_token / BF16_PEAK,
        "published_tflops": row.published_tflops,
        "flops_per_token": stats.flops_per_token,
        "step_time_s": cost.step_time_s,
        "published_step_time_s": row.global_batch * row.seq / (row.world * row.tokens_per_gpu),
        "compute_only_mfu": cost.mfu * cost.step_time_s / cost.terms["compute"],
        "fp8_whatif_tokens_per_gpu": fp8_cost.tokens_per_s / row.world,
        "dominant": cost.dominant,
        "terms": cost.terms,
        "cannot_express": row.cannot_express,
    }


def gpt_8b_on_64() -> dict:
    """docs/plan.md's example: the 8B-shaped built-in GPT (GELU MLP 4d, LayerNorm, MHA), context
    4096, global batch 256, on 8 x 8 H100 (data sheet), at the layout `plan` chose: HSDP r8 s8 mb1."""
    from paratrain.config import load_config
    from paratrain.plan import get_profile
    from paratrain.plan.cost import ModelStats, step_cost
    from paratrain.plan.enumerate import Layout, meta_model

    cfg = load_config(DEBUG, gpt_8b_sets())
    layout = Layout(8, 8, 1, 1, 1, "none", True)
    stats = ModelStats.of(meta_model(cfg), cfg)
    cost = step_cost(layout, cfg=cfg, stats=stats, hw=get_profile("h100-sxm"), ranks_per_node=8)
    return {
        "row": "paratrain docs/plan.md 8B GPT, 64 GPUs",
        "layout": layout.short(),
        "predicted_tokens_per_gpu": cost.tokens_per_s / 64,
        "predicted_mfu": cost.mfu,
        "flops_per_token": stats.flops_per_token,
        "step_time_s": cost.step_time_s,
        "compute_only_mfu": cost.mfu * cost.step_time_s / cost.terms["compute"],
        "dominant": cost.dominant,
        "terms": cost.terms,
    }


def gpt_8b_sets() -> list[str]:
    return [
        "model.args={n_layer=32, n_head=32, d_model=4096, block_size=4096, vocab_size=128256}",
        "data.args={block_size=4096, max_bytes=100000}",
        "batch.global_batch_size=256",
        "precision.dtype='bf16'",
    ]


def search(row: Row, model_dir: str) -> str:
    """`plan()` itself on the row's config and world: its best layout that fits the memory."""
    from paratrain.plan import plan

    cfg = row_config(row, model_dir, compile_=False)
    result = plan(cfg, world_size=row.world, nproc_per_node=8, profile=profile_of(row), top=1)
    if not result.layouts:
        return "nothing fits"
    best = result.layouts[0]
    return (
        f"{best.layout.short()}: {best.cost.tokens_per_s / row.world:.0f} tokens/s/GPU, MFU {best.cost.mfu:.1%},"
        f" peak {best.memory.peak_bytes / 2**30:.1f} GiB ({result.seconds:.0f} s)"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--search", action="store_true", help="also run plan() on each distinct setup (minutes)")
    ap.add_argument("--json", default="", help="write the rows here")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = llama3_8b(tmp)
        rows = [price(row, model_dir) for row in ROWS]
        print(
            f"{'row':<44} {'layout':<28} {'predicted':>9} {'published':>9} {'ratio':>6}"
            f" {'MFU pred':>8} {'MFU pub':>8} {'fp8 if':>7}  not priced"
        )
        for r in rows:
            print(
                f"{r['row']:<44} {r['layout']:<28} {r['predicted_tokens_per_gpu']:>9.0f}"
                f" {r['published_tokens_per_gpu']:>9.0f} {r['ratio']:>6.2f} {r['predicted_mfu']:>8.1%}"
                f" {r['published_mfu']:>8.1%} {r['fp8_whatif_tokens_per_gpu']:>7.0f}  {r['cannot_express'] or '-'}"
            )
        print(
            "(MFU: PaLM's FLOPs per token over the bf16 data-sheet peak, published FP8 rows too; fp8 if: the"
            " prediction with the matmuls at the FP8 peak, a what-if)"
        )
        print("\ncost terms (s per step), published step, MFU if the compute term were the whole step:")
        for r in rows:
            terms = ", ".join(f"{k} {v:.3f}" for k, v in r["terms"].items() if v > 5e-4)
            print(
                f"  {r['row']:<44} step {r['step_time_s']:.3f} (published {r['published_step_time_s']:.3f}),"
                f" compute-only MFU {r['compute_only_mfu']:.1%}: {terms}"
            )
        extra = gpt_8b_on_64()
        terms = ", ".join(f"{k} {v:.3f}" for k, v in extra["terms"].items() if v > 5e-4)
        print(
            f"\n{extra['row']}: {extra['layout']}, {extra['predicted_tokens_per_gpu']:.0f} tokens/s/GPU,"
            f" MFU {extra['predicted_mfu']:.1%} ({extra['flops_per_token']:.3g} FLOPs/token; compute-only"
            f" {extra['compute_only_mfu']:.1%});"
            f" step {extra['step_time_s']:.3f} s: {terms}"
        )
        if args.search:
            seen = set()
            for row in ROWS:
                key = (row.world, row.global_batch, row.hardware)
                if key not in seen:
                    seen.add(key)
                    print(f"plan() at world {row.world}, global batch {row.global_batch}: {search(row, model_dir)}")
                    sys.stdout.flush()
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rows": rows, "gpt_8b_on_64": extra}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
