"""The ONE blocks rule: a model's repeated blocks are the children of ``model.<blocks_attr>``.

The ModelSpec names the attribute (``blocks_attr``, ``"layers"`` by convention). FSDP2 wrapping,
``replicate``, activation checkpointing, per-block compile, the pipeline split, ``ModelSpec.blocks``
and the whole planner read blocks through this module, so a user spec's ``blocks_attr`` is
honoured everywhere (no part reads ``model.layers`` behind the spec's back).
"""

from __future__ import annotations

from torch import nn

BLOCKS_ATTR = "layers"  # the documented convention for user models


def blocks_of(model: nn.Module, blocks_attr: str = BLOCKS_ATTR) -> list[tuple[str, nn.Module]]:
    """``[(name, block), ...]``: the children of ``model.<blocks_attr>`` (ModuleDict, ModuleList or
    Sequential), the unit of FSDP sharding, activation checkpointing and compile; empty when the
    model has no such attribute."""
    layers = getattr(model, blocks_attr, None)
    if not isinstance(layers, nn.Module):
        return []
    return list(layers.named_children())


def blocks_container(model: nn.Module, blocks_attr: str = BLOCKS_ATTR) -> nn.Module | None:
    """The container itself when it is one the pipeline can split (ModuleList/ModuleDict/Sequential)."""
    layers = getattr(model, blocks_attr, None)
    return layers if isinstance(layers, (nn.ModuleList, nn.ModuleDict, nn.Sequential)) else None
