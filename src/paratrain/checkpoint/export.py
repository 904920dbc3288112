"""The model as one safetensors file: a checkpoint's weights (``paratrain export``, any layout) and a
run's final weights (``save_full_weights``, gathered from whatever layout trained them)."""

from __future__ import annotations

import json
import logging
import os
import re
import tomllib
import warnings

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from paratrain.checkpoint.manifest import CONFIG_FILE, MANIFEST, RUN_WEIGHTS, list_checkpoints, resolve_checkpoint
from paratrain.checkpoint.safe_load import load_metadata, safe_planner, safe_reader
from paratrain.config import ConfigError
from paratrain.distributed.expert_parallel import gather_expert_weights
from paratrain.distributed.pipeline_parallel import PipelineModel

log = logging.getLogger("paratrain")


def read_model_weights(checkpoint: str) -> tuple[dict[str, torch.Tensor], dict, str]:
    """A checkpoint's full model weights (any layout), its manifest and its resolved path.

    Runs in one process without a process group: the empty full-size tensors are made from the
    checkpoint's own metadata (global shapes and dtypes), so neither the model's code nor the
    layout that wrote it is needed; DCP gathers every shard into them.
    """
    path = resolve_checkpoint(checkpoint, checkpoint)  # verifies the checksums
    with open(os.path.join(path, MANIFEST)) as f:
        manifest = json.load(f)
    md = load_metadata(path)
    weights = {
        k.removeprefix("model."): torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in md.state_dict_metadata.items()
        if k.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }
    if not weights:
        raise ConfigError(f"checkpoint {path} holds no model tensors; pass a checkpoint written by paratrain train")
    with warnings.catch_warnings():  # no_dist is the intent here, which torch warns about anyway
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load({"model": weights}, storage_reader=safe_reader(path), planner=safe_planner(), no_dist=True)
    return weights, manifest, path


def read_export_source(source: str) -> tuple[dict[str, torch.Tensor], dict, str, str]:
    """(model weights, manifest, path, the config.toml that wrote them) of what ``paratrain export``
    is given: a step-N checkpoint, a checkpoints folder (its newest), or a finished run's
    ``run.out_dir`` (its final ``model.safetensors``; a ``step`` read from its metrics). A folder
    that holds none of them is one line naming what the run saved, not a damaged checkpoint."""
    from safetensors.torch import load_file

    if not os.path.isdir(source):
        raise ConfigError(f"{source}: no such folder; pass a step-N checkpoint folder or a finished run's run.out_dir")
    is_checkpoint = os.path.isfile(os.path.join(source, MANIFEST)) or list_checkpoints(source)
    run_weights, run_config = os.path.join(source, RUN_WEIGHTS), os.path.join(source, "config.toml")
    if not is_checkpoint and os.path.isfile(run_weights) and os.path.isfile(run_config):
        step = 0
        metrics = os.path.join(source, "metrics.jsonl")
        if os.path.isfile(metrics):
            with open(metrics) as f:
                rows = [line for line in f if line.strip()]
            step = json.loads(rows[-1]).get("step", 0) if rows else 0
        return load_file(run_weights), {"step": step}, source, run_config
    if not is_checkpoint and os.path.isfile(run_config):
        # A run.out_dir without its final weights (run.save_model = false, or cut short) whose
        # checkpoints are under it: their newest, as for the checkpoints folder itself.
        root = _checkpoint_root(source, run_config)
        if list_checkpoints(root):
            source, is_checkpoint = root, True
    if not is_checkpoint and not re.fullmatch(r"step-\d+", os.path.basename(os.path.normpath(source))):
        # Not a step-N folder cut short (that one is named as incomplete below): a run that saved nothing.
        raise ConfigError(
            f"{source} holds no checkpoint (no {MANIFEST}, no step-N folder) and no final {RUN_WEIGHTS}: the"
            " run saved neither (checkpoint.interval and checkpoint.at_end off, run.save_model = false, or it"
            " has not finished); pass a step-N folder, or the run.out_dir of a finished run"
        )
    weights, manifest, path = read_model_weights(source)
    return weights, manifest, path, os.path.join(path, CONFIG_FILE)


def _checkpoint_root(out_dir: str, run_config: str) -> str:
    """Where the run of ``run_config`` wrote its checkpoints: checkpoint.dir, else out_dir/checkpoints."""
    try:
        with open(run_config, "rb") as f:
            folder = tomllib.load(f).get("checkpoint", {}).get("dir", "")
    except (OSError, tomllib.TOMLDecodeError):
        folder = ""
    return folder or os.path.join(out_dir, "checkpoints")


def export_safetensors(checkpoint: str, to: str) -> dict:
    """Consolidate a checkpoint's (or a finished run's) model weights (any layout) into one safetensors file."""
    weights, manifest, path, _ = read_export_source(checkpoint)
    os.makedirs(os.path.dirname(os.path.abspath(to)), exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in weights.items()},
        to,
        metadata={"step": str(manifest["step"]), "source": os.path.abspath(path)},
    )
    return {
        "path": path,
        "step": manifest["step"],
        "tensors": len(weights),
        "parameters": sum(v.numel() for v in weights.values()),
    }


def save_full_weights(model: nn.Module, path: str, *, is_main: bool) -> dict | None:
    """Gather the full (unsharded, unwrapped) weights and write them from rank 0; returns them there."""
    # Every rank takes part: with sharded layouts this is a collective.
    if isinstance(model, PipelineModel):  # every stage's weights, gathered onto pp rank 0
        sd = model.full_state_dict()
    else:
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        sd = gather_expert_weights(model, sd)  # expert parallel: each ep rank holds some experts
    if is_main:
        # Tied weights (e.g. an HF model's embedding and lm_head) come out as one tensor under
        # two names; safetensors refuses shared memory, so the later names get a copy.
        seen: set[int] = set()
        out = {}
        for k, v in sd.items():
            v = v.contiguous()
            out[k] = v.clone() if v.data_ptr() in seen else v
            seen.add(v.data_ptr())
        save_file(out, path)
    return sd
