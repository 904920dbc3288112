"""``train.compile``: torch.compile each block of the model, or fall back with a warning.

Compiling block by block (not the whole model) is what torchtitan does: every block has the
same code, so dynamo traces one graph and reuses it for each layer, compile time stays flat
with depth, and the blocks remain separate modules for FSDP2 and activation checkpointing to
wrap. ``nn.Module.compile()`` compiles in place, so parameter names (state dicts, checkpoints)
do not gain the ``_orig_mod.`` prefix that ``torch.compile(module)`` adds.

Compilation is lazy: a platform that cannot compile (no C++ compiler for inductor's CPU
kernels, an unsupported Python, no Triton for the GPU) would fail at the first forward, in the
middle of the first step. A tiny probe compiled up front turns that into a warning and an
eager run.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist
from torch import nn

from paratrain.distributed.blocks import BLOCKS_ATTR, blocks_of

log = logging.getLogger("paratrain")


def _inductor_probe(device: torch.device) -> None:
    """Compile and run a tiny function on ``device``; raises whatever the platform raises."""
    fn = torch.compile(lambda a: torch.nn.functional.gelu(a * 2.0 + 1.0), dynamic=False)
    out = fn(torch.ones(8, device=device))
    expected = torch.nn.functional.gelu(torch.full((8,), 3.0, device=device))
    if not torch.allclose(out, expected):
        raise RuntimeError("the compiled probe computed a wrong result")


def compile_available(device: torch.device) -> tuple[bool, str]:
    """(True, "") when torch.compile works here, else (False, why)."""
    if not torch._dynamo.is_dynamo_supported():
        return False, "torch.compile is not supported on this Python/platform"
    try:
        _inductor_probe(device)
    except Exception as e:  # noqa: BLE001 - any failure means: run eagerly
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return False, f"{type(e).__name__}: {first[:300]}"
    return True, ""


def apply_compile(model: nn.Module, *, device: torch.device, blocks_attr: str = BLOCKS_ATTR) -> bool:
    """Compile each block of ``model`` in place (``model.<blocks_attr>`` values, else the whole model).

    Returns True when compiled; False (after a warning) when the platform cannot compile.
    """
    ok, why = compile_available(device)
    if not ok:
        log.warning("train.compile = true but torch.compile does not work here (%s); running eagerly", why)
        return False
    # Compiled graphs name the process groups of their collectives (tensor and sequence parallel,
    # expert and context parallel all-to-alls), and neither dynamo's guards nor the compile caches
    # check those names against this process's groups: a graph compiled for an earlier model in
    # this process (a second train() through the API), or loaded from inductor's on-disk FX graph
    # and AOTAutograd caches (written by another job on the machine), failed with "Could not
    # resolve the process group registered under the name 13", or reached another group of another
    # size (a gloo allgather size mismatch; src/paratrain/testing/sweep.py, world 4, dp 2 x tp 2 sp x ep 2). So
    # each model compiles from scratch when it has process groups: no cache across models or jobs.
    torch._dynamo.reset()
    if dist.is_initialized() and dist.get_world_size() > 1:
        from torch._functorch import config as functorch_config
        from torch._inductor import config as inductor_config

        inductor_config.fx_graph_cache = False
        functorch_config.enable_autograd_cache = False
    blocks = [block for _, block in blocks_of(model, blocks_attr)]
    for block in blocks or [model]:
        block.compile()
    log.info("compiled %s with torch.compile", f"{len(blocks)} blocks" if blocks else "the whole model")
    return True


@contextlib.contextmanager
def run_eagerly(model: nn.Module):
    """Blocks compiled in place (``train.compile``, ``nn.Module.compile``) run eagerly in the body:
    a forward before the first step (the layout probe's halves, the draw detector's no-grad pass)
    would otherwise cost a compile of its own (another batch shape, another grad mode) and could
    make later compiles dynamic, changing the run's kernels."""
    compiled = [(m, m._compiled_call_impl) for m in model.modules() if getattr(m, "_compiled_call_impl", None)]
    for m, _ in compiled:
        m._compiled_call_impl = None
    try:
        yield
    finally:
        for m, impl in compiled:
            m._compiled_call_impl = impl
