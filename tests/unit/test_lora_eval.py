"""LoRA dropout is a training-time draw: the validation loss is the model's without it."""

from __future__ import annotations

import os

import torch

import paratrain
from paratrain.launch.eval_worker import eval_checkpoint

BASE = [
    "model.args={n_layer = 1, n_head = 2, d_model = 16, block_size = 16}",
    "data.args={block_size = 16, max_bytes = 20_000}",
    "batch.global_batch_size=4",
    "run.steps=2",
    "run.progress=false",
    "metrics.plot=false",
    "run.save_model=false",
    "optim.lr=0.05",
    "optim.warmup_steps=0",
    "eval.interval=1",
    "eval.samples=8",
    "checkpoint.at_end=true",
    "model.lora.target_modules='all-linear'",
    "model.lora.r=4",
]


def test_lora_dropout_is_off_in_the_validation_loss(tmp_path):
    out = str(tmp_path / "run")
    summary = paratrain.train(paratrain.load_config(None, [*BASE, f"run.out_dir='{out}'", "model.lora.dropout=0.5"]))
    # The trained adapters (B moved off zero, so dropout on their input would change the output),
    # evaluated by a config without dropout: the same number to float rounding.
    ref = eval_checkpoint(
        paratrain.load_config(None, [*BASE, f"run.out_dir='{tmp_path / 'eval'}'", "model.lora.dropout=0"]),
        os.path.join(out, "checkpoints", "step-2"),
    )
    torch.testing.assert_close(summary["final_val_loss"], ref["val_loss"], rtol=1e-6, atol=0)
