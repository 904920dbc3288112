"""Gradient and optimiser-state bytes per rank, LoRA against full fine-tuning, counted from the
real tensors after one AdamW step, and their formula (benchmarks/memory/lora_memory.py and
tests/distributed/test_lora_memory.py)."""

from __future__ import annotations

import os
import tempfile

GPT_ARGS = dict(n_layer=4, d_model=128, n_head=4, vocab_size=256, block_size=64)


LLAMA_ARGS = dict(vocab_size=512, hidden_size=128, intermediate_size=512, num_hidden_layers=4)


SEQ = 32


def local_numel(t) -> int:
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).numel()


def local_bytes(t) -> int:
    from torch.distributed.tensor import DTensor

    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def measure(model_cfg: dict, layout: dict, batch: int) -> dict:
    """One AdamW step of the model of ``model_cfg`` under ``layout`` on this rank: local counts."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from paratrain.config import LoraConfig, ModelConfig, OptimConfig, ParallelConfig
    from paratrain.distributed.parallel_dims import ParallelDims
    from paratrain.distributed.parallelize import parallelize
    from paratrain.models import build
    from paratrain.optim import build_optimizer

    vocab = model_cfg.pop("vocab")  # the token ids' range
    lora = LoraConfig(**model_cfg.pop("lora")) if "lora" in model_cfg else LoraConfig()
    cfg = ModelConfig(**model_cfg, lora=lora)
    torch.manual_seed(0)
    model, spec = build(cfg)
    psi = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    pcfg = ParallelConfig(**layout)
    dims = ParallelDims.from_config(pcfg, dist.get_world_size() if dist.is_initialized() else 1)
    model = parallelize(
        model,
        dims,
        cfg=pcfg,
        device=torch.device("cpu"),
        spec=spec,
    )
    opt = build_optimizer(model, OptimConfig())
    g = torch.Generator().manual_seed(1)  # the same batch on every rank: only memory is measured
    x = torch.randint(0, vocab, (batch, SEQ), generator=g)
    logits = model(x)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x.reshape(-1)).backward()
    params = list(model.parameters())
    out = {
        "psi": psi,
        "trained": trained,
        "trained_local": sum(local_numel(p) for p in params if p.requires_grad),
        "frozen_with_grad": sum(1 for p in params if not p.requires_grad and p.grad is not None),
        "grads": sum(local_bytes(p.grad) for p in params if p.grad is not None),
    }
    opt.step()
    states = [s for s in opt.state.values()]
    out["state"] = sum(local_bytes(s[k]) for s in states for k in ("exp_avg", "exp_avg_sq"))
    out["step_counters"] = sum(local_bytes(s["step"]) for s in states)
    out["state_tensors"] = len(states)
    return out


def measure_rank(cases: dict, batch: int) -> dict:
    """One rank (under paratrain.testing.dist_utils.run_ranks): every case's bytes on this rank."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        return {key: measure(dict(model), dict(layout), batch) for key, (model, layout) in cases.items()}
    finally:
        dist.destroy_process_group()


def run_world(n: int, cases: dict, batch: int) -> dict:
    """Every case at world ``n`` (the tests' spawn-and-collect harness): results by rank."""
    from paratrain.testing.dist_utils import run_ranks

    return dict(enumerate(run_ranks(measure_rank, n, cases, batch, timeout=600)))


def models(tmp: str, r: int, targets: list[str]) -> dict[str, dict]:
    """Model configs by name: the base (full fine-tuning) and its LoRA twin differ by [model.lora] only."""
    from paratrain.testing.hf_models import save_tiny

    llama = save_tiny("llama", os.path.join(tmp, "llama"), weights=False, **LLAMA_ARGS)  # init from the seed
    lora = dict(r=r, alpha=2 * r, target_modules=list(targets))
    return {
        "llama": {"hf": llama, "vocab": LLAMA_ARGS["vocab_size"]},
        "gpt": {"name": "gpt", "args": dict(GPT_ARGS), "vocab": GPT_ARGS["vocab_size"]},
        "lora": lora,
    }


def measure_all(worlds: list[int], r: int, targets: list[str], batch: int = 2) -> list[dict]:
    """One row per (model, world, layout): full and LoRA bytes on rank 0 (and the worst rank)."""
    with tempfile.TemporaryDirectory() as tmp:
        m = models(tmp, r, targets)
        rows = []
        for n in worlds:
            layouts = {"single": {}} if n == 1 else {"DDP": {"dp_replicate": n}, "FSDP2": {"dp_shard": n}}
            cases = {}
            for name in ("llama", "gpt"):
                for layout, lay in layouts.items():
                    cases[(name, layout, "full")] = (m[name], lay)
                    cases[(name, layout, "lora")] = ({**m[name], "lora": m["lora"]}, lay)
            results = run_world(n, cases, batch)
            for name in ("llama", "gpt"):
                for layout in layouts:
                    full = [res[(name, layout, "full")] for res in results.values()]
                    lora = [res[(name, layout, "lora")] for res in results.values()]
                    rows.append({"model": name, "world": n, "layout": layout, "full": full, "lora": lora})
        return rows


def formula_bytes(rank: dict, n: int, layout: str) -> tuple[int, int]:
    """(gradient, state) bytes of the formula: 4 and 8 per trained parameter the rank holds."""
    held = rank["trained"] / (n if layout == "FSDP2" else 1)
    return int(4 * held), int(8 * held)


def check(rows: list[dict]) -> list[str]:
    """Every rank's measured gradient and moment bytes equal the formula's; no frozen weight has a gradient."""
    bad = []
    for row in rows:
        for kind in ("full", "lora"):
            for rank, got in enumerate(row[kind]):
                want = formula_bytes(got, row["world"], row["layout"])
                where = f"{row['model']} {row['layout']} world {row['world']} rank {rank} {kind}"
                if (got["grads"], got["state"]) != want:
                    bad.append(f"{where}: grads+state {got['grads']}+{got['state']} != formula {want[0]}+{want[1]}")
                if got["frozen_with_grad"]:
                    bad.append(f"{where}: {got['frozen_with_grad']} frozen parameters got a gradient")
    return bad
