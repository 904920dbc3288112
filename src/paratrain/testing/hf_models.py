"""Tiny random transformers causal LMs saved to a directory (no network): Llama, Qwen2, Qwen3 (tied)."""

from __future__ import annotations

import os

import torch

# The tiny width and depth, shared with the tiny LLaVA's vision tower (testing/vlm_models.py).
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
COMMON = dict(TINY, vocab_size=128, num_key_value_heads=2, max_position_embeddings=64)
# Qwen2.5-0.5B's shape (its config.json: 494M parameters, 136M of them the tied embedding), for
# the GPU benchmarks, which build it with random weights (nothing is downloaded).
QWEN2_05B = dict(
    model_type="qwen2",
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)
ARCHS = {
    "llama": dict(model_type="llama", **COMMON),
    # Qwen2: grouped-query attention with biases on q/k/v.
    "qwen2": dict(model_type="qwen2", **COMMON),
    # Qwen3: tied embeddings and per-head q/k norms (its plan's replicated_with_grad_allreduce).
    "qwen3": dict(model_type="qwen3", head_dim=8, tie_word_embeddings=True, **COMMON),
}
# Not in ARCHS (every layout test runs those): Gemma 3 keeps a non-persistent buffer
# (embed_tokens.embed_scale) the weights do not hold, which loading refuses.
REFUSED_ARCHS = {
    "gemma3": dict(model_type="gemma3_text", head_dim=8, **COMMON),
    # A mixture of experts model.hf does not support (docs/moe.md).
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, **COMMON),
    # OLMoE: its config has no base_model_pp_plan, which HFCausalLM needs.
    "olmoe": dict(model_type="olmoe", num_experts=4, num_experts_per_tok=2, pad_token_id=1, eos_token_id=2, **COMMON),
}
# Mixtures of experts (tests/distributed/test_moe_hf.py): Qwen3-MoE (every second layer sparse, tied
# embeddings) and Mixtral (every layer sparse; checkpoints name the block block_sparse_moe and
# the experts w1/w2/w3). The router's balance loss is on (output_router_logits), weighted 0.5.
MOE = dict(output_router_logits=True, router_aux_loss_coef=0.5, num_experts_per_tok=2, **COMMON)
MOE_ARCHS = {
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        head_dim=8,
        num_experts=4,
        moe_intermediate_size=16,
        decoder_sparse_step=2,
        tie_word_embeddings=True,
        **MOE,
    ),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, **MOE),
}


def save_tiny(
    arch: str, path: str, *, weights: bool = True, seed: int = 0, tokenizer: bool = False, **overrides
) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    args = {**(ARCHS | REFUSED_ARCHS | MOE_ARCHS)[arch], **overrides}
    config = AutoConfig.for_model(args.pop("model_type"), **args)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    os.makedirs(path, exist_ok=True)
    if weights:
        # Small shards so the index and several files are exercised.
        model.save_pretrained(path, max_shard_size="20KB")
    else:
        config.save_pretrained(path)
    if tokenizer:
        save_tokenizer(path, vocab=config.vocab_size)
    return path


def save_tokenizer(path: str, *, vocab: int) -> None:
    """A byte-level BPE with no merges: ids are bytes (0..255 fit a vocab of 256)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab={chr(i): i for i in range(vocab)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
