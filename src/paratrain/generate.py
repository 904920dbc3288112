"""Sample text from a trained byte-level model: ``paratrain generate OUT_DIR --prompt "def "``."""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file

from paratrain.config import ConfigError, load_config
from paratrain.models import build_model


def load_trained_model(out_dir: str) -> torch.nn.Module:
    cfg_path, weights = os.path.join(out_dir, "config.toml"), os.path.join(out_dir, "model.safetensors")
    for path in (cfg_path, weights):
        if not os.path.isfile(path):
            raise ConfigError(f"'{path}' not found; pass the run.out_dir of a finished `paratrain train` run")
    cfg = load_config(cfg_path)
    model = build_model(cfg.model)

    model.load_state_dict(load_file(weights))
    return model.eval()


def generate_text(
    out_dir: str, prompt: str, *, max_new_tokens: int = 200, temperature: float = 0.8, top_k: int = 40, seed: int = 0
) -> str:
    model = load_trained_model(out_dir)
    if not hasattr(model, "generate") or getattr(getattr(model, "cfg", None), "vocab_size", None) != 256:
        raise ConfigError("generate needs the built-in byte-level GPT (model.name = 'gpt', vocab_size 256)")
    idx = torch.tensor([list(prompt.encode("utf-8")) or [10]], dtype=torch.long)
    out = model.generate(
        idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=torch.Generator().manual_seed(seed)
    )
    return bytes(out[0].tolist()).decode("utf-8", errors="replace")
