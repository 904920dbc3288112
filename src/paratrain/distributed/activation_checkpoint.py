"""Activation checkpointing per block (Chen et al. 2016, "Training deep nets with sublinear
memory cost"): keep less of the forward, recompute it in backward.

- ``full``: each block of ``model.layers`` keeps only its input; its whole forward runs again in
  backward (about one extra forward, activation memory of one block plus the block inputs).
- ``selective``: op-level selective activation checkpointing (torch's
  ``create_selective_checkpoint_contexts``; Korthikanti et al. 2022 recompute the cheap,
  memory-heavy part): the outputs of matmuls, attention and collectives are saved, the
  pointwise ops and norms (cheap to recompute, as large as the saved outputs together) are
  recomputed. Works on CPU and CUDA alike.

Recomputation replays the same kernels on the same inputs, so the loss and the gradients do not
change (dropout replays the same mask: torch restores the RNG state).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from paratrain.config import ConfigError
from paratrain.distributed.blocks import BLOCKS_ATTR, blocks_of


def _save_list() -> set:
    ops = torch.ops
    candidates = [
        ops.aten.mm.default,
        ops.aten.addmm.default,
        ops.aten.bmm.default,
        ops.aten.baddbmm.default,
        ops.aten._scaled_dot_product_flash_attention.default,
        ops.aten._scaled_dot_product_efficient_attention.default,
        ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        ops.aten._scaled_dot_product_cudnn_attention.default,
    ]
    # Tensor-parallel collectives: saving their outputs avoids communicating again in backward.
    functional = getattr(ops, "_c10d_functional", None)
    if functional is not None:
        for name in ("reduce_scatter_tensor", "all_reduce", "all_gather_into_tensor"):
            if hasattr(functional, name):
                candidates.append(getattr(functional, name).default)
    return set(candidates)


def _selective_policy(save: set):
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def apply_ac(model: nn.Module, *, mode: str, blocks_attr: str = BLOCKS_ATTR) -> None:
    """Wrap each block of ``model.<blocks_attr>`` (and of the lists in ``model.extra_checkpoint_blocks``)
    in place for ``mode`` ('none', 'full', 'selective')."""
    if mode == "none":
        return
    blocks = blocks_of(model, blocks_attr)
    if not blocks:
        raise ConfigError(
            f"parallel.activation_checkpointing = {mode!r} works per block and {type(model).__name__}"
            f" has no blocks in a `{blocks_attr}` ModuleDict/ModuleList; put them there or set it to 'none'"
        )
    kwargs = {}
    if mode == "selective":
        policy = _selective_policy(_save_list())
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, policy)
    # A model's other lists of repeated layers (an image-text model's vision encoder layers,
    # models/hf/vision.py), named in ``extra_checkpoint_blocks``, are checkpointed alike.
    for layers in (getattr(model, blocks_attr), *getattr(model, "extra_checkpoint_blocks", ())):
        for name, block in list(layers.named_children()):
            # Non-reentrant checkpointing: composes with FSDP2 and DTensor, and supports kwargs.
            # The wrapper's state-dict hooks strip its prefix, so parameter names do not change.
            layers.register_module(
                name,
                checkpoint_wrapper(
                    block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=True, **kwargs
                ),
            )
