"""What the mixture-of-experts layout tests read back of a run and compare (tests/test_moe.py for
the built-in GPT, tests/test_moe_hf.py for model.hf): one definition for both."""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file

from tests.dist_utils import read_metrics

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
