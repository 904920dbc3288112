"""What the mixture-of-experts layout tests read back of a run and compare (tests/distributed/test_moe.py for
the built-in GPT, tests/distributed/test_moe_hf.py for model.hf): one definition for both."""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file

from paratrain.models.gpt.moe import MoE, MoEConfig
from paratrain.testing.dist_utils import plain_sgd, read_metrics, run_ranks

MOE_METRICS = ("loss", "aux_loss", "grad_norm")


def read_moe_run(out_dir) -> dict:
    """A finished run's per-step loss, aux_loss, grad_norm, (fewest, most) tokens per expert, and
    its final weights (``model.safetensors``)."""
    rows = read_metrics(str(out_dir))
    run = {k: [r[k] for r in rows] for k in MOE_METRICS}
    run["tokens"] = [(r["expert_tokens_min"], r["expert_tokens_max"]) for r in rows]
    run["params"] = load_file(os.path.join(str(out_dir), "model.safetensors"))
    return run


def assert_same_moe_run(got: dict, ref: dict, *, rtol: float = 1e-5, atol_params: float = 1e-7) -> None:
    """Two :func:`read_moe_run` results: the metrics within ``rtol``, the same token counts, the
    final weights within ``rtol`` / ``atol_params``."""
    for key in MOE_METRICS:
        torch.testing.assert_close(
            torch.tensor(got[key]), torch.tensor(ref[key]), rtol=rtol, atol=0, msg=lambda m: f"{key}: {m}"
        )
    assert got["tokens"] == ref["tokens"]
    for k in ref["params"]:
        torch.testing.assert_close(
            got["params"][k], ref["params"][k], rtol=rtol, atol=atol_params, msg=lambda m: f"{k}: {m}"
        )


# The built-in GPT with a mixture of experts (tests of models/gpt/moe.py and of ep, cp with MoE).

D = 16


def make_moe(seed: int = 0, **kw) -> MoE:
    from paratrain.models.gpt.model import MLP, GPTConfig

    torch.manual_seed(seed)
    cfg = MoEConfig(**{"n_experts": 4, "top_k": 2, "aux_loss_weight": 0.5, **kw})
    moe = MoE(cfg, D, lambda: MLP(GPTConfig(d_model=D, mlp_ratio=2)))
    for p in moe.parameters():  # larger than the GPT's init: routing far from uniform, outputs O(1)
        torch.nn.init.normal_(p, std=0.5)
    return moe


MOE_GPT = [
    "model.args={n_layer = 2, n_head = 2, d_model = 32, block_size = 16, vocab_size = 32,"
    " moe = {n_experts = 4, top_k = 2, n_shared_experts = 1, aux_loss_weight = 0.1}}",
    "data.factory='paratrain.testing.toy:toy_lm'",
    "data.args={n = 64, seq_len = 16, vocab = 32}",
    "batch.global_batch_size=8",
    "run.progress=false",
    "metrics.plot=false",
    "run.steps=3",
    *plain_sgd(0.1),
]


def moe_runs(tmp_path, world: int, runs: dict[str, list[str]]) -> dict[str, dict]:
    run_ranks(
        train_runs, world, [[*MOE_GPT, *extra, f"run.out_dir='{tmp_path / name}'"] for name, extra in runs.items()]
    )
    return {name: read_moe_run(tmp_path / name) for name in runs}


# transformers mixtures of experts under model.hf (tests of models/hf/moe.py).

HF_MOE_BASE = [
    "data.factory='paratrain.testing.toy:toy_lm'",
    "data.args={n = 64, seq_len = 16, vocab = 128}",
    "batch.global_batch_size=8",
    "run.progress=false",
    "metrics.plot=false",
    "metrics.rank_stats_every=0",
]


def train_runs(runs: list[list[str]]) -> None:
    import torch.distributed as dist

    import paratrain

    dist.init_process_group("gloo")
    try:
        for overrides in runs:
            paratrain.train(paratrain.load_config(None, overrides))
    finally:
        dist.destroy_process_group()


def hf_moe_runs(tmp_path, world: int, src: str, runs: dict[str, list[str]]) -> dict[str, dict]:
    """Train each run (3 steps of plain SGD) on ``world`` gloo ranks; its metrics and final weights."""
    base = [*HF_MOE_BASE, f"model.hf='{src}'", "run.steps=3", *plain_sgd(0.5)]  # a run's own run.steps wins (later)
    run_ranks(train_runs, world, [[*base, *extra, f"run.out_dir='{tmp_path / name}'"] for name, extra in runs.items()])
    return {name: read_moe_run(tmp_path / name) for name in runs}
