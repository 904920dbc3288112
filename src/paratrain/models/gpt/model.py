"""A small decoder-only transformer (GPT-2 shape, pre-norm, no weight tying).

Blocks live in ``layers``, a ModuleDict keyed "0", "1", ...: a pipeline stage deletes the
blocks it does not own and keeps the others' names (torchtitan does the same), and the
embedding, final norm and output layer may be None on stages that do not hold them.
Attention derives its head count from the projected width, so a tensor-parallel shard with
``n_head / tp`` local heads runs the same forward.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from paratrain.config import ConfigError
from paratrain.data.packing import document_block_mask, document_mask, split_packed
from paratrain.models.gpt.moe import MoE, MoEConfig


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    mlp_ratio: int = 4
    dropout: float = 0.0
    bias: bool = True
    # Packed documents' attention: "sdpa" (a boolean mask, every path) or "flex" (FlexAttention
    # with a block mask that skips the blocks no document fills; trains on GPU only: torch 2.13
    # has no FlexAttention backward on CPU).
    attention: str = "sdpa"
    # Mixture of experts (models/gpt/moe.py, docs/moe.md): a table {n_experts, top_k,
    # n_shared_experts, every, aux_loss_weight, norm_topk}; None: every block's MLP is dense.
    moe: MoEConfig | dict | None = None

    def __post_init__(self):
        if self.attention not in ("sdpa", "flex"):
            raise ConfigError(f"model.args.attention = {self.attention!r} is unknown; use 'sdpa' or 'flex'")
        if isinstance(self.moe, dict) or (self.moe is not None and not isinstance(self.moe, MoEConfig)):
            self.moe = MoEConfig.from_args(self.moe)


class Attention(nn.Module):
    # Context parallel: ``fn(q, k, v, positions=...)`` over the whole sequence from this rank's
    # part of it (distributed/context_parallel.py, installed by parallel.py's gpt_cp_attention).
    cp_attention = None

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_head
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        # No key bias: q.(k + b) shifts every score of a query by the same q.b, which softmax
        # ignores, so its exact gradient is zero and what backward computes is rounding noise
        # that Adam would blow up to lr-sized steps, differently for each layout.
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, mask=None, cache=None) -> torch.Tensor:
        """``mask``: packed documents' boolean attention mask or FlexAttention BlockMask
        (data/packing.py); None: causal. Under context parallel: the position ids (B, T).
        ``cache``: the sampler's ``(k, v) -> (all keys, all values)`` of this layer (KVCache),
        with ``mask`` the boolean (B, 1, T, cached + T) of the keys each new token sees."""
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        if cache is not None:
            k, v = cache(k, v)
        if self.cp_attention is not None:
            y = self.cp_attention(q, k, v, positions=mask, dropout_p=self.dropout if self.training else 0.0)
        elif isinstance(mask, BlockMask):
            if torch.is_grad_enabled() and x.device.type == "cpu":
                raise ConfigError(
                    "model.args.attention = 'flex' trains on GPU only (torch has no FlexAttention backward"
                    " on CPU); use model.args.attention = 'sdpa' here"
                )
            # Compiled on GPU, where it becomes one fused kernel; eager elsewhere (forward only).
            y = (_compiled_flex() if q.is_cuda else flex_attention)(q, k, v, block_mask=mask)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, dropout_p=self.dropout if self.training else 0.0
            )
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


@functools.cache
def _compiled_flex():
    # Without torch.compile, flex_attention runs an unfused reference that materialises the
    # whole score matrix (torch's own warning); compiled once per process, as torchtitan does.
    return torch.compile(flex_attention)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc_in = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=cfg.bias)
        self.fc_out = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, moe: bool = False):
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.d_model)
        self.mlp = MoE(cfg.moe, cfg.d_model, lambda: MLP(cfg)) if moe else MLP(cfg)

    def forward(self, x: torch.Tensor, mask=None, cache=None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), mask, cache=cache)  # a keyword: tp plans prepare (x, mask)
        return x + self.mlp(self.mlp_norm(x))


class KVCache:
    """The keys and values of every layer so far, for the sampler of reinforcement learning
    (objectives/rl/rollout.py): each forward appends its new tokens' along the sequence."""

    def __init__(self):
        self.kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def layer(self, key: str):
        def update(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if key in self.kv:
                old_k, old_v = self.kv[key]
                k, v = torch.cat([old_k, k], 2), torch.cat([old_v, v], 2)
            self.kv[key] = (k, v)
            return k, v

        return update


class GPT(nn.Module):
    # True: forward stops before lm_head, whose logits a chunked loss makes itself (loss.py).
    return_hidden = False
    cp_attention = None  # set with each block's (Attention.cp_attention)

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model)
        self.layers = nn.ModuleDict(
            {str(i): Block(cfg, moe=cfg.moe is not None and cfg.moe.is_moe_block(i)) for i in range(cfg.n_layer)}
        )
        self.norm = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # GPT-2 init: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = (
                    0.02 / math.sqrt(2 * self.cfg.n_layer)
                    if name.endswith(("o_proj.weight", "fc_out.weight"))
                    else 0.02
                )
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def new_cache(self) -> KVCache:
        return KVCache()

    def forward(
        self, idx: torch.Tensor, positions: torch.Tensor | None = None, *, cache=None, key_mask=None
    ) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, vocab); on a middle pipeline stage, hidden -> hidden.

        Packed documents (B, 2, T) carry their position ids (data/packing.py): each document
        gets positions from 0 and attends to itself only. A pipeline stage gets the ids (or the
        hidden states) and the ``positions`` (B, T) apart: only the first stage sees the input.

        ``cache``: the sampler's KVCache (objectives/rl/rollout.py, as ``model.hf``'s DynamicCache): ``idx``
        holds the new tokens only, at ``positions`` (B, T), and ``key_mask`` (B, cached + T)
        marks the cached and new slots each row may attend to (not its prompt's padding).
        """
        if cache is not None:
            return self._cached_forward(idx, positions, cache, key_mask)
        if positions is None:
            idx, positions = split_packed(idx)
        if self.cp_attention is not None:
            mask = positions  # the ring builds its masks per chunk pair from the global positions
        elif positions is None:
            mask = None
        elif self.cfg.attention == "flex" and not (self.training and self.cfg.dropout):
            mask = document_block_mask(positions)
        # FlexAttention has no dropout: with dropout in training the documents' dense mask goes
        # to scaled_dot_product_attention, whose dropout is keyed by the sample (paratrain/randomness.py).
        else:
            mask = document_mask(positions)
        if self.tok_emb is not None:
            if positions is None:
                x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
            else:
                # (T, B) in, (T, B, d) out, then (B, T, d): the embedding's sequence dim stays dim 0,
                # as the tensor-parallel plan shards it under sequence parallelism.
                x = self.tok_emb(idx) + self.pos_emb(positions.clamp(min=0).t()).transpose(0, 1)
        else:
            x = idx
        for block in self.layers.values():
            x = block(x, mask)
        if self.norm is not None:
            x = self.norm(x)
        if self.lm_head is not None and not self.return_hidden:
            x = self.lm_head(x)
        return x

    def _cached_forward(self, idx: torch.Tensor, positions: torch.Tensor, cache: KVCache, key_mask: torch.Tensor):
        # Each new token sees the slots up to its own (slots are the buffer's columns: the
        # prompts, padded to one width, then one per new token) that key_mask lets it see.
        seen, t = key_mask.shape[1], idx.shape[1]
        slots = torch.arange(seen, device=idx.device)
        causal = slots[None, :] <= (seen - t + torch.arange(t, device=idx.device))[:, None]  # (T, S)
        mask = causal[None, None] & key_mask.bool()[:, None, None, :]
        x = self.tok_emb(idx.t()).transpose(0, 1) + self.pos_emb(positions.t()).transpose(0, 1)
        for key, block in self.layers.items():
            x = block(x, mask, cache=cache.layer(key))
        return self.lm_head(self.norm(x))

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.cfg.block_size :])[:, -1, :] / max(temperature, 1e-6)
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


def build_gpt(**kwargs) -> GPT:
    return GPT(GPTConfig(**kwargs))


def gpt_flops_per_token(*, matmul_params: int, n_layer: int, d_model: int, seq_len: int) -> float:
    """PaLM appendix B (Chowdhery et al. 2022): 6N + 12 L d T FLOPs per token for a forward and
    backward; N counts the parameters that multiply (embeddings are lookups and left out; the
    output projection is a matmul and kept), the attention products over the whole T x T square."""
    return 6.0 * matmul_params + 12.0 * n_layer * d_model * seq_len


def gpt_flops(model: GPT):
    """``f(seq_len) -> training FLOPs per token`` of a whole (not yet split) GPT."""
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    matmul = sum(p.numel() for p in model.parameters() if id(p) not in lookups)
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        # A token runs top_k of the n_experts routed experts: the others' weights are not active.
        expert = sum(p.numel() for p in moe.experts[0].parameters())
        matmul -= (moe.cfg.n_experts - moe.cfg.top_k) * expert
    cfg = model.cfg
    return lambda seq_len: gpt_flops_per_token(
        matmul_params=matmul, n_layer=cfg.n_layer, d_model=cfg.d_model, seq_len=seq_len
    )
