"""The sha256 manifest: a checkpoint is complete exactly when ``manifest.json`` exists (written
last, through an atomic rename), and intact exactly when the checksums match. Listing, finding the
newest intact checkpoint, and resolving ``checkpoint.resume``; what a run leaves in its
``run.out_dir``. Light on purpose (no torch): the launcher reads it before any worker starts.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re

from paratrain.config import ConfigError

log = logging.getLogger("paratrain")

MANIFEST = "manifest.json"
CONFIG_FILE = "config.toml"
FORMAT = "paratrain-checkpoint/1"
ELASTIC_ENV = "PARATRAIN_ELASTIC"  # set by `paratrain train --nnodes MIN:MAX` in its workers (resume_spec)

RUN_WEIGHTS = "model.safetensors"  # a finished run's final weights (trainer.finish)
# What a run leaves in run.out_dir (trainer.py): a folder with any of them, or with step-N
# checkpoints, holds a run; ``--overwrite`` removes them and the files beside them.
RUN_OUTPUTS = ("metrics.jsonl", "summary.json", RUN_WEIGHTS, "hf", "adapter")
RUN_FILES = ("config.toml", "metrics.png")
_STEP_DIR = re.compile(r"^step-(\d+)$")


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()  # Python 3.11: reads in blocks


def write_manifest(path: str, info: dict) -> dict:
    """Hash every file of the checkpoint folder and write manifest.json atomically (tmp + rename)."""
    files = {}
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if name == MANIFEST or name.startswith(MANIFEST) or not os.path.isfile(full):
            continue
        files[name] = {"sha256": _sha256(full), "bytes": os.path.getsize(full)}
    manifest = {"format": FORMAT, **info, "files": files}
    tmp = os.path.join(path, f".{MANIFEST}.tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, MANIFEST))
    return manifest


class CheckpointInvalid(ConfigError):
    """A checkpoint folder that is incomplete (no manifest) or damaged (checksums differ)."""


def verify_checkpoint(path: str) -> dict:
    """Return the manifest of a complete, intact checkpoint; raise CheckpointInvalid otherwise."""
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise CheckpointInvalid(f"checkpoint {path} does not exist; pass a step-N folder written by paratrain")
    if not os.path.isfile(mpath):
        raise CheckpointInvalid(f"checkpoint {path} is incomplete (no {MANIFEST}: killed while being written?)")
    try:
        with open(mpath) as f:
            manifest = json.load(f)
        files = manifest["files"]
        int(manifest["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointInvalid(f"checkpoint {path} has an unreadable {MANIFEST} ({e})")
    if manifest.get("format") != FORMAT:
        raise CheckpointInvalid(f"checkpoint {path} has format {manifest.get('format')!r}, expected {FORMAT!r}")
    if ".metadata" not in files:
        raise CheckpointInvalid(f"checkpoint {path}: its manifest lists no .metadata")
    for name, entry in files.items():
        full = os.path.join(path, name)
        if os.path.basename(name) != name or not os.path.isfile(full):
            raise CheckpointInvalid(f"checkpoint {path} is damaged: file {name} is missing")
        if _sha256(full) != entry.get("sha256"):
            raise CheckpointInvalid(f"checkpoint {path} is damaged: {name} does not match its sha256 in {MANIFEST}")
    return manifest


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, path) of every step-N folder under root, newest first (complete or not)."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found, reverse=True)


def find_latest(root: str) -> str | None:
    """The newest intact checkpoint under root; incomplete or damaged newer ones are reported and skipped.

    Raises ConfigError when checkpoints were written (a manifest exists) but none verifies: starting
    at step 0 would then overwrite and prune them, though on a network filesystem they may only be
    unreadable for a moment. Only incomplete folders (a kill during the first save) start at step 0.
    """
    refused = []
    for _, path in list_checkpoints(root):
        try:
            verify_checkpoint(path)
            return path
        except CheckpointInvalid as e:
            log.warning("warning: %s; skipping it, trying the previous checkpoint", e)
            refused.append((path, e))
    written = [(p, e) for p, e in refused if os.path.lexists(os.path.join(p, MANIFEST))]
    if written:
        why = "; ".join(f"{os.path.basename(p)}: {str(e).removeprefix(f'checkpoint {p} ')}" for p, e in refused)
        raise ConfigError(
            f"no checkpoint in {root} verifies ({why}); restore them (a network filesystem may be late), move"
            " them away to start at step 0, or pass --resume PATH"
        )
    return None


def resolve_checkpoint(spec: str, root: str, *, out_dir: str = "") -> str | None:
    """The checkpoint that ``checkpoint.resume = spec`` names: None for a fresh start.

    ``out_dir``: the run's folder, whose metrics.jsonl says whether a run was there; a 'latest'
    that finds no checkpoint where it records steps is refused, not started over (issue 55: a
    node that saw none of the checkpoints trained a finished job's 30 steps again, exit 0).
    """
    if not spec:
        return None
    if spec == "latest":
        path = find_latest(root)
        steps = recorded_steps(out_dir) if out_dir and path is None else 0
        if steps:
            raise ConfigError(
                f"--resume: no checkpoint in {root}, but {os.path.join(out_dir, 'metrics.jsonl')} records {steps}"
                " steps of a run; bring its checkpoints back (or set checkpoint.dir to them), or start over with"
                " --overwrite (removes that run's outputs)"
            )
        if path is None:
            log.info("checkpoint.resume = 'latest': no complete checkpoint in %s, starting at step 0", root)
        return path
    if os.path.isdir(spec) and not os.path.isfile(os.path.join(spec, MANIFEST)) and list_checkpoints(spec):
        path = find_latest(spec)  # a checkpoints root: its newest intact checkpoint
        if path is None:
            raise ConfigError(f"checkpoint.resume = {spec!r}: no complete checkpoint in it; pass a step-N folder")
        return path
    try:
        verify_checkpoint(spec)
    except CheckpointInvalid as e:
        raise ConfigError(f"checkpoint.resume = {spec!r}: {e}")
    return spec


def recorded_steps(out_dir: str) -> int:
    """The last step ``out_dir/metrics.jsonl`` records (0: no file, or no complete row)."""
    last = 0
    with contextlib.suppress(OSError), open(os.path.join(out_dir, "metrics.jsonl"), "rb") as f:
        for line in f:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                last = max(last, int(json.loads(line)["step"]))
    return last


def run_outputs(out_dir: str, checkpoint_dir: str = "") -> list[str]:
    """The outputs of a run found in ``out_dir`` (and its checkpoints), by name; [] for none.
    A metrics.jsonl without a row is none: a run that failed before its first step leaves
    nothing that refuses the same command again."""
    found = [n for n in RUN_OUTPUTS if os.path.exists(os.path.join(out_dir, n))]
    if "metrics.jsonl" in found and not recorded_steps(out_dir):
        found.remove("metrics.jsonl")
    checkpoints = checkpoint_dir or os.path.join(out_dir, "checkpoints")
    if list_checkpoints(checkpoints):
        found.append(checkpoint_dir or "checkpoints")
    return found


def clear_run_outputs(out_dir: str, checkpoint_dir: str = "") -> None:
    """``run.overwrite``: remove the old run's outputs and its checkpoints under ``out_dir`` (a
    ``checkpoint.dir`` of its own is the user's to clear; events.jsonl stays: it is appended to,
    and this run's first lines are in it already)."""
    import shutil

    for name in (*RUN_OUTPUTS, *RUN_FILES, "checkpoints" if not checkpoint_dir else ""):
        path = os.path.join(out_dir, name) if name else ""
        if path and os.path.isdir(path):
            shutil.rmtree(path)
        elif path and os.path.exists(path):
            os.remove(path)
