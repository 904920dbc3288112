"""Checkpoints that lose nothing: sharded DCP save, manifest, resume, safe loading, export.

- safe_load.py     restricted unpickler and safe DCP reader/planner (no code runs on load)
- manifest.py      sha256 manifest: write, verify, list, find the latest, resolve checkpoint.resume
- state.py         what is saved: the Stateful adapters (model, optimiser, dataclasses) and RNG states
- checkpointer.py  when and where: the Checkpointer saves a dict of Stateful objects, resumes, prunes
- export.py        a checkpoint's model as one safetensors file
"""

from paratrain.checkpoint.checkpointer import (
    Checkpointer,
    CheckpointSaveError,
    build_checkpointer,
    config_changes,
    resume_spec,
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
from paratrain.checkpoint.state import DataclassState, ModelState, OptimizerState, rng_state, set_rng_state

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
