"""The GPT trunk as a dual encoder for in-batch-negative training (docs/batch-math.md).

One trunk (the built-in GPT without its output layer) embeds the query and the document of each
row: ``[rows, 2, T]`` token ids in, ``(queries, documents, logit_scale)`` out. A sequence's
embedding is the mean of its final hidden states over its real tokens (not the padding, which
comes last, so under causal attention no real token sees it), projected to ``dim``. The learnable
scale is CLIP's (Radford et al. 2021): a log scale initialised at log(1/0.07), returned as the
scale itself and capped at 100, which the built-in ``info_nce`` multiplies the cosines by.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from paratrain.models.gpt.model import GPT, GPTConfig


class GPTEncoder(nn.Module):
    def __init__(self, cfg: GPTConfig, *, dim: int, pad_id: int):
        super().__init__()
        self.trunk = GPT(cfg)
        self.trunk.lm_head = None  # the trunk's forward then returns its normed hidden states
        self.proj = nn.Linear(cfg.d_model, dim, bias=False)
        nn.init.normal_(self.proj.weight, std=0.02)
        self.logit_scale = nn.Parameter(torch.tensor([math.log(1 / 0.07)]))  # 1-d: FSDP2 shards no 0-dim
        self.pad_id = pad_id

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.trunk(ids)
        real = (ids != self.pad_id).unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * real).sum(1) / real.sum(1).clamp(min=1)
        return self.proj(pooled)

    def forward(self, pairs: torch.Tensor):
        rows = pairs.shape[0]
        both = self.embed(pairs.reshape(rows * 2, -1)).reshape(rows, 2, -1)
        return both[:, 0], both[:, 1], self.logit_scale.exp().clamp(max=100.0)


def gpt_encoder(
    dim: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    d_model: int = 64,
    block_size: int = 128,
    vocab_size: int = 257,
    dropout: float = 0.0,
    pad_id: int = 256,
) -> GPTEncoder:
    """``model.factory = "paratrain.models.gpt.encoder:gpt_encoder"``; the defaults fit
    ``data.name = "code_search"`` (byte ids, ``PAD`` 256)."""
    cfg = GPTConfig(
        n_layer=n_layer, n_head=n_head, d_model=d_model, block_size=block_size, vocab_size=vocab_size, dropout=dropout
    )
    return GPTEncoder(cfg, dim=dim, pad_id=pad_id)
