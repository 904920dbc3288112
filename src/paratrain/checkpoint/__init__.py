"""Checkpoints that lose nothing: sharded DCP save, manifest, resume, safe loading, export.

- safe_load.py     restricted unpickler and safe DCP reader/planner (no code runs on load)
- manifest.py      sha256 manifest: write, verify, list, find the latest, resolve checkpoint.resume
- state.py         what is saved: the Stateful adapters (model, optimiser, dataclasses) and RNG states
- checkpointer.py  when and where: the Checkpointer saves a dict of Stateful objects, resumes, prunes
- export.py        a checkpoint's model as one safetensors file
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    # The same names, for readers and type checkers (and tests/unit/test_structure.py's import graph).
    from paratrain.checkpoint.checkpointer import (
        Checkpointer,
        CheckpointSaveError,
        build_checkpointer,
        config_changes,
        resume_spec,
    )

    # typing only, as above
    from paratrain.checkpoint.export import export_safetensors, read_model_weights

    # typing only, as above
    from paratrain.checkpoint.manifest import (
        CheckpointInvalid,
        find_latest,
        list_checkpoints,
        resolve_checkpoint,
        verify_checkpoint,
        write_manifest,
    )

    # typing only, as above
    from paratrain.checkpoint.safe_load import load_metadata, safe_planner, safe_reader

    # typing only, as above
    from paratrain.checkpoint.state import DataclassState, ModelState, OptimizerState, rng_state, set_rng_state

# Where each name lives. The package imports them on first use only (PEP 562): its modules pull
# torch.distributed.checkpoint, DTensor and pipelining, which the launcher (``paratrain train``
# before any worker starts) needs none of; it reads manifest.py's constants and run_outputs only.
_HOMES = {
    "checkpointer": ("Checkpointer", "CheckpointSaveError", "build_checkpointer", "config_changes", "resume_spec"),
    "export": ("export_safetensors", "read_model_weights"),
    "manifest": (
        "CheckpointInvalid",
        "find_latest",
        "list_checkpoints",
        "resolve_checkpoint",
        "verify_checkpoint",
        "write_manifest",
    ),
    "safe_load": ("load_metadata", "safe_planner", "safe_reader"),
    "state": ("DataclassState", "ModelState", "OptimizerState", "rng_state", "set_rng_state"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}

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


def __getattr__(name: str):
    if name not in _HOME_OF:
        raise AttributeError(f"module 'paratrain.checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"paratrain.checkpoint.{_HOME_OF[name]}"), name)
    globals()[name] = value
    return value
