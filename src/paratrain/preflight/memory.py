"""The memory guard: a model that cannot fit stops before its first allocation (issue 55, item 3).

``n_layer = 100000`` grew to 7.5 GB in 148 s and ended in an allocator traceback; a million
blocks printed nothing for minutes. Before the model is built, each rank counts what the model
holds from a build on the meta device (no memory), the built-in GPT from 1 and 2 blocks
extrapolated (blocks are identical; a mixture of experts by whole periods of ``moe.every``
blocks), and compares

    weights + gradients + optimiser state (AdamW 2, SGD with momentum 1 per trainable weight),
    in the parameters' own dtype, divided by the shards of the layout (dp_shard x cp x tp x pp)

with what the rank has: CUDA's free memory of its device (``torch.cuda.mem_get_info``), on CPU
the host's MemAvailable divided among the node's ranks, or less where the process's address
space is capped (``ulimit -v``, RLIMIT_AS). This is a lower bound (activations, buffers of the
parallelisms, the allocator's slack and frozen models are not counted): the guard refuses only
what cannot fit, with no margin, and a run it lets through can still run out of memory on its
activations (``paratrain find-batch`` estimates those). The ranks agree, so every rank of a
refused job exits 2 with the same line.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import resource

import torch
import torch.distributed as dist

from paratrain.config import Config, ConfigError
from paratrain.distributed.json_collectives import all_gather_json
from paratrain.distributed.parallel_dims import ParallelDims
from paratrain.models import build

log = logging.getLogger("paratrain")

WHOLE_UP_TO = 64  # blocks of the built-in GPT counted whole on meta; beyond, extrapolated


def check_memory(cfg: Config, dims: ParallelDims, *, device: torch.device) -> None:
    """Refuse (ConfigError on every rank) a model whose weights, gradients and optimiser state
    cannot fit this rank's memory; call it before the model is built."""
    line = refusal(cfg, dims, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        line = next((x for x in all_gather_json(line, device=device) if x), None)
    if line:
        raise ConfigError(line)


def refusal(cfg: Config, dims: ParallelDims, *, device: torch.device) -> str | None:
    """This rank's refusal line, or None when the model fits (or cannot be counted)."""
    counted = model_bytes(cfg)
    # FSDP2's CPU offload keeps the weights, gradients and optimiser state in host memory: the
    # host is what they must fit.
    have = available_bytes(torch.device("cpu") if cfg.parallel.cpu_offload else device)
    if counted is None or have is None:
        return None
    n_params, weights, trainable = counted
    states = 2 if cfg.optim.name == "adamw" else 1 if cfg.optim.beta1 > 0 else 0
    shards = dims.dp_shard * dims.cp * dims.tp * dims.pp
    whole = weights + trainable * (1 + states)  # weights + gradients + optimiser state
    need = whole // shards
    free, where = have
    if need <= free:
        return None
    smaller = "fewer blocks (model.args.n_layer)" if _is_gpt(cfg) else "a smaller model"
    lora = "" if cfg.model.lora.enabled else ", or train LoRA adapters (model.lora.enabled)"
    optimiser = {"adamw": "AdamW's", "sgd": "SGD's"}.get(cfg.optim.name, cfg.optim.name)
    what = f"weights, gradients and {optimiser} state" if trainable else "weights"
    return (
        f"the model needs at least {_size(need)} per rank before any activation ({n_params / 1e9:.3g}B parameters:"
        f" {what}, over {shards} shard(s)) but {where}; use {smaller}, shard it over at least"
        f" {math.ceil(whole / max(free, 1))} such ranks (parallel.dp_shard, FSDP; or tp, pp){lora}"
    )


def model_bytes(cfg: Config) -> tuple[int, int, int] | None:
    """(parameters, bytes of all weights, bytes of the trainable ones) of the config's model, from
    meta builds; None for a model that cannot be built on meta (then nothing is guarded)."""
    moe, n_layer = cfg.model.args.get("moe"), cfg.model.args.get("n_layer")
    period = moe.get("every", 1) if isinstance(moe, dict) else 1
    try:
        if _is_gpt(cfg) and isinstance(n_layer, int) and n_layer > max(WHOLE_UP_TO, 2 * period):
            one, two = _count(cfg, n_layer=period), _count(cfg, n_layer=2 * period)
            periods = n_layer // period - 1  # whole periods beyond the first: the rest is not counted
            return tuple(a + periods * (b - a) for a, b in zip(one, two))
        return _count(cfg)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - a factory that cannot run on meta: not guarded
        log.debug("memory guard: cannot build the model on the meta device (%s); not checked", e)
        return None


def available_bytes(device: torch.device) -> tuple[int, str] | None:
    """(bytes this rank may use, the line's words for it); None where it cannot be known."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        share = max(1, local // max(torch.cuda.device_count(), 1))  # ranks sharing one device
        return free // share, f"{device} has {_size(free)} free" + (f" for {share} ranks" if share > 1 else "")
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            host = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    have, where = (
        host // local,
        f"this host has {_size(host)} available (MemAvailable)" + (f" for {local} ranks" if local > 1 else ""),
    )
    cap = resource.getrlimit(resource.RLIMIT_AS)[0]
    if cap != resource.RLIM_INFINITY and cap - _address_space() < have:
        have = max(cap - _address_space(), 0)
        where = f"this process may map {_size(have)} more (address space capped at {_size(cap)}, ulimit -v)"
    return have, where


def _count(cfg: Config, **args) -> tuple[int, int, int]:
    model_cfg = dataclasses.replace(cfg.model, args={**cfg.model.args, **args})
    with torch.device("meta"):
        model, _ = build(model_cfg)
    params = list(model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    weights += sum(b.numel() * b.element_size() for b in model.buffers())
    trainable = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    return sum(p.numel() for p in params), weights, trainable


def _address_space() -> int:
    """Bytes of address space this process maps now (VmSize), which RLIMIT_AS caps."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    except (OSError, StopIteration, ValueError):
        return 0


def _is_gpt(cfg: Config) -> bool:
    return not cfg.model.factory and not cfg.model.hf and cfg.model.name == "gpt"


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return ""
