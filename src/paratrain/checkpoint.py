"""Checkpoints that lose nothing: sharded DCP save, manifest, resume, safe loading, export.

A checkpoint is one folder ``<checkpoint.dir>/step-N`` written with torch.distributed.checkpoint
(DCP): every rank writes its own shard file, the coordinator writes ``.metadata``. It holds the
model, the optimiser, the LR scheduler, the loop's TrainState (step, consumed_samples, whatever
else the trainer adds), the RNG states of every rank (``rng_rank{r}``) and the resolved
``config.toml``. Rank 0 then hashes every file and writes ``manifest.json`` LAST, through an
atomic rename: a checkpoint is complete exactly when its manifest exists, and it is intact
exactly when the checksums match. DCP's own ``.metadata`` is not enough for that: it is renamed
into place when the shards are written, but says nothing about a shard truncated later.

Why the model and optimiser go through ``torch.distributed.checkpoint.state_dict``
(get/set_state_dict): they key every tensor by its fully qualified name with DDP's ``module.``
prefix removed and every DTensor shard described by its global shape, so a checkpoint written by
one layout (2 DDP ranks, FSDP, TP) loads into any other, DCP resharding on load.

Loading never unpickles untrusted data. DCP (torch 2.13) reads ``.metadata`` with plain
``pickle.load`` and non-tensor values with ``torch.load(weights_only=False)``; both can run code
from a crafted checkpoint. :class:`SafeFileSystemReader` reads the metadata with an unpickler
that admits only DCP's own metadata classes, and :class:`SafeLoadPlanner` loads non-tensor
values with ``weights_only=True``. The manifest's checksums are verified before any of it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
import time
import tomllib
from typing import Any

import torch
import torch.distributed as dist

from paratrain.config import CheckpointConfig, ConfigError, to_toml
from paratrain.distributed.json_collectives import broadcast_json

log = logging.getLogger("paratrain")

MANIFEST = "manifest.json"
CONFIG_FILE = "config.toml"
FORMAT = "paratrain-checkpoint/1"
_STEP_DIR = re.compile(r"^step-(\d+)$")


# ----------------------------------------------------------------------------- safe loading

# Every global a DCP ``.metadata`` pickle of torch 2.13 refers to (found by recording the
# find_class calls while loading real paratrain checkpoints; DTensor shards of FSDP/TP are
# described by the same chunk classes): DCP's metadata dataclasses, torch.Size,
# dtypes, layouts (by name, through torch.serialization._get_layout), and pathlib paths (the
# checkpoint_id in StorageMeta). Constructing any of them runs no user-chosen code.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only DCP metadata classes, torch.Size and dtypes."""

    def __init__(self, file, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise ConfigError(
            f"checkpoint {self.where} refers to {module}.{name}, which DCP metadata never contains;"
            " refusing to load it (unpickling it could run code): use a checkpoint you trust"
        )


def load_metadata(path: str, *, rank: int | None = None):
    """Read a DCP ``.metadata`` file (or a rank's ``__R.metadata``) with the restricted unpickler."""
    from torch.distributed.checkpoint.metadata import Metadata

    name = ".metadata" if rank is None else f"__{rank}.metadata"
    file = os.path.join(path, name)
    try:
        with open(file, "rb") as f:
            md = _MetadataUnpickler(f, file).load()
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - truncated or garbled: one clear line
        raise ConfigError(
            f"checkpoint metadata {file} cannot be read ({type(e).__name__}: {e}); the checkpoint is damaged"
        )
    if not isinstance(md, Metadata):
        raise ConfigError(f"checkpoint metadata {file} holds a {type(md).__name__}, not DCP Metadata; refusing it")
    return md


def _reader_class():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        """FileSystemReader whose metadata comes through the restricted unpickler, never plain pickle."""

        def read_metadata(self, *args: Any, **kwargs: Any):
            md = load_metadata(os.fspath(self.path), rank=kwargs.get("rank"))
            for info in (md.storage_data or {}).values():
                # Shards are files of this folder, never paths that lead out of it.
                rel = os.fspath(getattr(info, "relative_path", ""))
                if not rel or os.path.basename(rel) != rel or rel in (".", ".."):
                    raise ConfigError(
                        f"checkpoint {self.path}: its metadata points at {rel!r}, outside the"
                        " checkpoint folder; refusing it"
                    )
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return SafeFileSystemReader


def _planner_class():
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DefaultLoadPlanner that loads non-tensor values with torch.load(weights_only=True)."""

        def load_bytes(self, read_item, value) -> None:
            from torch.distributed.checkpoint._nested_dict import set_element

            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeLoadPlanner


def safe_reader(path: str):
    return _reader_class()(path)


def safe_planner(**kwargs):
    return _planner_class()(**kwargs)


# ----------------------------------------------------------------------------- manifest


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


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
    """The newest intact checkpoint under root; incomplete or damaged newer ones are reported and skipped."""
    for _, path in list_checkpoints(root):
        try:
            verify_checkpoint(path)
            return path
        except CheckpointInvalid as e:
            log.warning("warning: %s; skipping it, trying the previous checkpoint", e)
    return None


def resolve_checkpoint(spec: str, root: str) -> str | None:
    """The checkpoint that ``checkpoint.resume = spec`` names: None for a fresh start."""
    if not spec:
        return None
    if spec == "latest":
        path = find_latest(root)
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


# ----------------------------------------------------------------------------- RNG states


def rng_state(device: torch.device) -> dict:
    """Python, numpy and torch RNG states as values torch.load(weights_only=True) accepts."""
    import numpy as np

    np_state = np.random.get_state(legacy=False)
    state = {
        "python": random.getstate(),
        "numpy": {
            **np_state,
            "state": {"key": np_state["state"]["key"].tolist(), "pos": int(np_state["state"]["pos"])},
        },
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    import numpy as np

    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np_state = dict(state["numpy"])
    np_state["state"] = {"key": np.asarray(np_state["state"]["key"], dtype=np.uint32), "pos": np_state["state"]["pos"]}
    np.random.set_state(np_state)
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


# ----------------------------------------------------------------------------- save and resume


class Checkpointer:
    """Saves and restores one rank's share of a run. Every method is called on every rank.

    ``state`` is the trainer's TrainState dataclass: it is saved with ``dataclasses.asdict`` and
    restored field by field, so fields added later (e.g. a batch size that changes during the
    run) are checkpointed without touching this module; a field missing from an older
    checkpoint keeps its default.
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        *,
        out_dir: str,
        config_toml: str,
        model,
        optimizer,
        scheduler,
        state,
        layout: dict,
        rank: int,
        world_size: int,
        device: torch.device,
        timeout_s: float,
        stateful: dict | None = None,
    ):
        self.cfg = cfg
        self.root = cfg.dir or os.path.join(out_dir, "checkpoints")
        self.config_toml = config_toml
        self.model, self.optimizer, self.scheduler, self.state = model, optimizer, scheduler, state
        # Other objects with state_dict/load_state_dict whose state is the same on every rank
        # (e.g. fp16's GradScaler: its overflow check follows the all-reduced gradients).
        self.stateful = {k: v for k, v in (stateful or {}).items() if v is not None}
        self.layout = layout
        self.rank, self.world_size, self.device = rank, world_size, device
        self.timeout_s = timeout_s
        self.last_saved_step = -1
        self.blocked_s: list[float] = []  # time each save held up training
        self._pending: concurrent.futures.Future | None = None
        self._finalizer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt") if rank == 0 else None
        # A gloo group of our own (made now, by every rank at the same point): DCP's planning
        # collectives run in a background thread during an async save, concurrently with the
        # training collectives on the default group, and a process group must not be used by two
        # threads at once. Gloo also serves monitored_barrier and keeps DCP's object collectives
        # off NCCL.
        self.group = None
        if dist.is_initialized():
            import datetime

            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))

    def _barrier(self, what: str) -> None:
        """A monitored barrier names the ranks that do not arrive instead of hanging (gloo)."""
        import datetime

        if self.world_size == 1:
            return
        try:
            dist.monitored_barrier(
                group=self.group, timeout=datetime.timedelta(seconds=self.timeout_s), wait_all_ranks=True
            )
        except RuntimeError as e:
            raise RuntimeError(f"ranks did not arrive at {what} within dist.timeout_s = {self.timeout_s:g}: {e}") from e

    # ---------------------------------------------------------------- state dicts

    def _app_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {
            "model": model_sd,
            "optim": optim_sd,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else {},
            "train_state": dataclasses.asdict(self.state),
            f"rng_rank{self.rank}": rng_state(self.device),
            **{f"stateful.{k}": v.state_dict() for k, v in self.stateful.items()},
        }

    # ---------------------------------------------------------------- save

    def after_step(self, step: int) -> float | None:
        """Save if ``step`` is due; returns the seconds the save held up training (None if none)."""
        if self.cfg.interval > 0 and step % self.cfg.interval == 0:
            return self.save(step)
        return None

    def at_end(self, step: int) -> float | None:
        blocked = None
        if self.cfg.at_end and step != self.last_saved_step:
            blocked = self.save(step)
        self.wait()
        return blocked

    def save(self, step: int) -> float:
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        self.wait()  # one save in flight at a time (waiting for it also holds training up)
        path = os.path.join(self.root, f"step-{step}")
        self._barrier(f"the checkpoint of step {step}")
        if self.rank == 0:
            if os.path.exists(path):  # a partial folder left by a killed attempt at this step
                shutil.rmtree(path)
            os.makedirs(path)
            with open(os.path.join(path, CONFIG_FILE), "w") as f:
                f.write(self.config_toml)
        if self.world_size > 1:
            dist.barrier(group=self.group)  # the folder is fresh before anyone writes into it
        writer = dcp.FileSystemWriter(path)
        app = self._app_state()
        info = {
            "step": step,
            "train_state": dataclasses.asdict(self.state),
            "world_size": self.world_size,
            "layout": self.layout,
            "torch_version": torch.__version__,
            "time": time.time(),
        }
        if self.cfg.async_save:
            # async_save copies the state to CPU memory (the blocking part) and writes it from a
            # background thread; the manifest follows once the coordinator's write is done.
            fut = dcp.async_save(app, storage_writer=writer, process_group=self.group)
            self._pending = self._finalizer.submit(self._finalize, fut, path, info) if self.rank == 0 else fut
        else:
            dcp.save(app, storage_writer=writer, process_group=self.group)
            if self.rank == 0:
                self._finalize(None, path, info)
            if self.world_size > 1:
                dist.barrier(group=self.group)  # every rank returns with the checkpoint complete
        blocked = time.perf_counter() - t0
        self.blocked_s.append(blocked)
        self.last_saved_step = step
        log.info(
            "checkpoint step %d -> %s (%s, training blocked %.3f s)",
            step,
            path,
            "async" if self.cfg.async_save else "sync",
            blocked,
        )
        return blocked

    def _finalize(self, fut, path: str, info: dict) -> None:
        """Rank 0, after DCP wrote every shard and .metadata: manifest last, then prune."""
        if fut is not None:
            fut.result()
        write_manifest(path, info)
        self._prune()

    def _prune(self) -> None:
        if self.cfg.keep <= 0:
            return
        complete = [(s, p) for s, p in list_checkpoints(self.root) if os.path.isfile(os.path.join(p, MANIFEST))]
        if not complete:
            return
        keep = {p for _, p in complete[: self.cfg.keep]}
        oldest_kept = complete[: self.cfg.keep][-1][0]
        for s, p in list_checkpoints(self.root):
            # Older complete checkpoints beyond `keep`, and partial folders older than a kept one.
            if p not in keep and s < oldest_kept:
                shutil.rmtree(p, ignore_errors=True)

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete, manifest included."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        """Wait for a save in flight; called in a finally block, so it reports rather than raises."""
        try:
            self.wait()
        except Exception as e:  # noqa: BLE001 - do not mask the error that ended training
            log.warning(
                "warning: the checkpoint in flight failed (%s: %s); it has no manifest and will be skipped",
                type(e).__name__,
                e,
            )
        finally:
            if self._finalizer is not None:
                self._finalizer.shutdown(wait=True)

    # ---------------------------------------------------------------- resume

    def resume(self, spec: str, fallback: str = "") -> int | None:
        """Restore from the checkpoint ``spec`` names ('latest', a path, '' for none), else from
        ``fallback``'s; returns the step resumed at (None: a fresh start)."""
        if not spec and not fallback:
            return None
        choice: list[Any] = [None]
        if self.rank == 0:  # one rank hashes the files; every rank learns the verdict
            try:
                path = resolve_checkpoint(spec, self.root)
                if path is None and fallback:
                    path = resolve_checkpoint(fallback, self.root)
                choice[0] = {"path": path}
                if path is not None:
                    self._warn_newer(path)
            except ConfigError as e:
                choice[0] = {"error": str(e)}
        if self.world_size > 1:
            choice[0] = broadcast_json(choice[0], src=0)  # JSON, not a pickle (docs/security.md)
        if "error" in choice[0]:
            raise ConfigError(choice[0]["error"])
        path = choice[0]["path"]
        if path is None:
            return None
        self.load(path)
        self.last_saved_step = self.state.step
        return self.state.step

    def load(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        md = load_metadata(path)
        keys = md.state_dict_metadata.keys()
        self._warn_config_changes(path)
        app = self._app_state()
        # Train-state fields the checkpoint does not have keep their defaults.
        app["train_state"] = {
            k: v
            for k, v in app["train_state"].items()
            if f"train_state.{k}" in keys or any(key.startswith(f"train_state.{k}.") for key in keys)
        }
        own = f"rng_rank{self.rank}"
        src = own if any(k.startswith(own + ".") for k in keys) else "rng_rank0"
        if src != own:
            # More ranks than the checkpoint had: take rank 0's streams (the trainer seeds every
            # rank alike, so this is exact unless user code made per-rank random streams).
            log.info("checkpoint %s has no RNG state for rank %d; using rank 0's", path, self.rank)
        app[src] = app.pop(own)
        for k in self.stateful:  # absent from the checkpoint (an older run, fp32 before): keep as is
            if not any(key.startswith(f"stateful.{k}.") for key in keys):
                app.pop(f"stateful.{k}", None)
        dcp.load(app, storage_reader=safe_reader(path), planner=safe_planner(), process_group=self.group)
        set_state_dict(self.model, self.optimizer, model_state_dict=app["model"], optim_state_dict=app["optim"])
        if self.scheduler is not None and app["scheduler"]:
            self.scheduler.load_state_dict(app["scheduler"])
        for k, v in app["train_state"].items():
            setattr(self.state, k, v)
        for k, obj in self.stateful.items():
            if f"stateful.{k}" in app:
                obj.load_state_dict(app[f"stateful.{k}"])
        set_rng_state(app[src], self.device)
        log.info(
            "resumed from %s at step %d (%d samples consumed)",
            path,
            self.state.step,
            getattr(self.state, "consumed_samples", -1),
        )

    def _warn_newer(self, path: str) -> None:
        """Complete checkpoints newer than the one resumed belong to another trajectory."""
        m = _STEP_DIR.match(os.path.basename(os.path.normpath(path)))
        newer = [
            p
            for s, p in list_checkpoints(self.root)
            if m and s > int(m.group(1)) and os.path.isfile(os.path.join(p, MANIFEST))
        ]
        if newer:
            log.warning(
                "warning: resuming from %s while newer checkpoints exist (%s); they will be overwritten"
                " as the run reaches their steps, and 'latest' would pick them after a failure before that",
                path,
                ", ".join(os.path.basename(p) for p in newer),
            )

    def _warn_config_changes(self, path: str) -> None:
        """The math of a run is its model, data, loss, optimiser, seed and global batch: say if they changed."""
        if self.rank != 0:
            return
        try:
            with open(os.path.join(path, CONFIG_FILE), "rb") as f:
                saved = tomllib.load(f)
            now = tomllib.loads(self.config_toml)
        except (OSError, tomllib.TOMLDecodeError):
            return
        changed = []
        for section in ("model", "data", "loss", "optim"):
            for k in set(saved.get(section, {})) | set(now.get(section, {})):
                if saved.get(section, {}).get(k) != now.get(section, {}).get(k):
                    changed.append(f"{section}.{k}")
        for section, k in (("run", "seed"), ("run", "steps"), ("batch", "global_batch_size")):
            if saved.get(section, {}).get(k) != now.get(section, {}).get(k):
                changed.append(f"{section}.{k}")
        if changed:
            log.warning(
                "warning: resuming from %s with changed %s; the run will not continue the same trajectory",
                path,
                ", ".join(sorted(changed)),
            )


def truncate_metrics(out_dir: str, step: int) -> None:
    """Drop metrics.jsonl rows after ``step`` (written after the checkpoint, before a failure)."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line if line.endswith("\n") else line + "\n")
            except (ValueError, KeyError, TypeError):
                break  # a torn last line
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)


def resume_spec(cfg: CheckpointConfig) -> tuple[str, str]:
    """(spec, fallback) for Checkpointer.resume: checkpoint.resume; but in workers that torchrun
    restarted after a failure, the newest complete checkpoint of this run first (it is newer
    than the one the job was started from), checkpoint.resume only if there is none."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        log.info(
            "restart %s of the worker group: resuming from the newest complete checkpoint",
            os.environ["TORCHELASTIC_RESTART_COUNT"],
        )
        return "latest", cfg.resume
    return cfg.resume, ""


def build_checkpointer(
    cfg,
    *,
    model,
    optimizer,
    scheduler,
    state,
    layout: dict,
    rank: int,
    world_size: int,
    device: torch.device,
    stateful: dict | None = None,
) -> Checkpointer:
    """The Checkpointer of a run (``cfg`` is the whole resolved Config, saved with each checkpoint)."""
    return Checkpointer(
        cfg.checkpoint,
        out_dir=cfg.run.out_dir,
        config_toml=to_toml(cfg),
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        state=state,
        layout=layout,
        rank=rank,
        world_size=world_size,
        device=device,
        timeout_s=cfg.dist.timeout_s,
        stateful=stateful,
    )


# ----------------------------------------------------------------------------- export


def export_safetensors(checkpoint: str, to: str) -> dict:
    """Consolidate a checkpoint's model weights (any layout) into one safetensors file.

    Runs in one process without a process group: the empty full-size tensors are made from the
    checkpoint's own metadata (global shapes and dtypes), so neither the model's code nor the
    layout that wrote it is needed; DCP gathers every shard into them.
    """
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

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
    dcp.load({"model": weights}, storage_reader=safe_reader(path), planner=safe_planner(), no_dist=True)
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


__all__ = [
    "Checkpointer",
    "CheckpointInvalid",
    "build_checkpointer",
    "export_safetensors",
    "find_latest",
    "list_checkpoints",
    "load_metadata",
    "resolve_checkpoint",
    "resume_spec",
    "safe_planner",
    "safe_reader",
    "truncate_metrics",
    "verify_checkpoint",
    "write_manifest",
]
