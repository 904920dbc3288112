"""Checkpoints that lose nothing: sharded DCP save, manifest, resume, safe loading, export.

- safe_load.py     restricted unpickler and safe DCP reader/planner (no code runs on load)
- manifest.py      sha256 manifest: write, verify, list, find the latest, resolve checkpoint.resume
- checkpointer.py  the Checkpointer: a dict of Stateful objects, save/resume/prune
- export.py        a checkpoint's model as one safetensors file
"""

from paratrain.checkpoint.checkpointer import (
    Checkpointer,
    CheckpointSaveError,
    DataclassState,
    ModelState,
    OptimizerState,
    build_checkpointer,
    config_changes,
    resume_spec,
    rng_state,
    set_rng_state,
)
from paratrain.checkpoint.export import export_safetensors, read_model_weights
from paratrain.checkpoint.manifest import (
    CheckpointInvalid,
    find_latest,
    list_checkpoints,
    resolve_checkpoint,
    verify_checkpoint,
    write_manifest,
)
from paratrain.checkpoint.safe_load import load_metadata, safe_planner, safe_reader

__all__ = [
    "Checkpointer",
    "CheckpointSaveError",
    "CheckpointInvalid",
    "DataclassState",
    "ModelState",
    "OptimizerState",
    "build_checkpointer",
    "config_changes",
    "export_safetensors",
    "read_model_weights",
    "find_latest",
    "list_checkpoints",
    "load_metadata",
    "resolve_checkpoint",
    "resume_spec",
    "rng_state",
    "set_rng_state",
    "safe_planner",
    "safe_reader",
    "verify_checkpoint",
    "write_manifest",
]
