"""The expert-parallel benchmark's model, layouts, run overrides and the reading of a finished run
(benchmarks/parallel/moe_ep.py and tests/unit/test_moe_ep_bench.py)."""

from __future__ import annotations

import json
import os
import statistics
import sys

WARMUP = 3  # steps left out of each run's median (first-call allocations, thread pools)


MIB = 2**20


def model_args(a, *, moe: bool) -> dict:
    """The GPT's ``model.args``: the MoE one, or the dense one of the same active FLOPs per token."""
    args = dict(n_layer=a.n_layer, n_head=a.n_head, d_model=a.d_model, block_size=a.seq)
    if moe:
        args["moe"] = dict(n_experts=a.experts, top_k=a.top_k, n_shared_experts=a.shared, aux_loss_weight=0.01)
    else:
        args["mlp_ratio"] = (a.top_k + a.shared) * 4  # 4: the GPT's (and each expert's) mlp_ratio
    return args


def toml_inline(d: dict) -> str:
    items = ", ".join(f"{k} = {toml_inline(v) if isinstance(v, dict) else json.dumps(v)}" for k, v in d.items())
    return "{" + items + "}"


def param_counts(a) -> dict:
    """Parameters of the MoE GPT (all; active per token) and of the dense GPT, from built models."""
    import torch

    from paratrain.models.gpt import build_gpt
    from paratrain.models.gpt.moe import MoE

    torch.manual_seed(0)
    common = dict(vocab_size=256)  # the byte corpus
    moe = build_gpt(**common, **model_args(a, moe=True))
    dense = build_gpt(**common, **model_args(a, moe=False))
    total = sum(p.numel() for p in moe.parameters())
    layers = [m for m in moe.modules() if isinstance(m, MoE)]
    per_expert = sum(p.numel() for p in layers[0].experts[0].parameters())
    inactive = len(layers) * (a.experts - a.top_k) * per_expert
    return dict(
        moe_total=total,
        moe_active=total - inactive,
        dense=sum(p.numel() for p in dense.parameters()),
        moe_layers=len(layers),
    )


def layouts(world: int, a) -> list[tuple[str, int, bool]]:
    """(name, ep, moe) of one world: every ep dividing world and the experts, then the dense GPT."""
    eps = [ep for ep in (1, 2, 4, 8) if ep <= world and world % ep == 0 and a.experts % ep == 0]
    return [(f"moe ep {ep}", ep, True) for ep in eps] + [("dense", 1, False)]


def overrides(a, world: int, ep: int, moe: bool, out: str) -> list[str]:
    return [
        f"run.out_dir='{out}'",
        f"run.steps={a.steps}",
        "run.progress=false",
        "run.save_model=false",
        "metrics.plot=false",
        f"model.args={toml_inline(model_args(a, moe=moe))}",
        f"data.args={{block_size = {a.seq}, max_bytes = 400000}}",
        f"batch.global_batch_size={a.batch}",
        f"batch.micro_batch_size={a.batch // world}",  # one micro-batch per rank: no accumulation
        f"parallel.dp_replicate={world}",
        f"parallel.ep={ep}",
        "optim.warmup_steps=2",
    ]


def read_run(out: str, *, a, world: int, ep: int, moe: bool) -> dict:
    """The run's step time, memory and bytes, after checking from its own files that it ran as claimed."""
    import tomllib

    with open(os.path.join(out, "config.toml"), "rb") as f:
        cfg = tomllib.load(f)
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]  # noqa: SIM115
    claims = {
        "world_size": (summary["world_size"], world),
        "rows' world_size": ({r["world_size"] for r in rows}, {world}),
        "parallel.ep": (cfg["parallel"]["ep"], ep),
        # ep as it ran: the routed experts each rank holds (n_experts / ep), on every rank
        "experts per rank": ({tuple(r["local_experts"]) for r in ranks}, {(a.experts // ep,) if moe else ()}),
        "dp": (summary["batch"]["dp"], world),
        "global batch": ({r["global_batch_size"] for r in rows}, {a.batch}),
        "micro batch": (summary["batch"]["micro_batch_size"], a.batch // world),
        "accum": (summary["batch"]["accum_steps"], 1),
        "steps": (len(rows), a.steps),
        "moe": ("moe" in cfg["model"]["args"], moe),
        "aux_loss logged": (all("aux_loss" in r for r in rows), moe),
    }
    wrong = {k: v for k, v in claims.items() if v[0] != v[1]}
    if wrong:
        sys.exit(f"run in {out} is not what it claims (measured, claimed): {wrong}")
    stamps = [r["time"] for r in rows]
    return dict(
        step_s=statistics.median([b - t for t, b in zip(stamps, stamps[1:])][WARMUP:]),
        state=max(r["params"] + r["grads"] + r["optim"] for r in ranks),
        rss=max(r["rss_peak"] for r in ranks),
        a2a=max(r["a2a_bytes"] for r in ranks) / a.steps,
        final_loss=rows[-1]["loss"],
    )


def a2a_formula(a, world: int, ep: int, moe_layers: int) -> float:
    """plan/cost.py's forward + backward bytes per rank and MoE layer, x the layers, per step."""
    from paratrain.plan.cost import moe_all_to_all_bytes

    fwd, bwd = moe_all_to_all_bytes(tokens=a.batch // world * a.seq, top_k=a.top_k, d_model=a.d_model, ep=ep)
    return (fwd + bwd) * moe_layers
