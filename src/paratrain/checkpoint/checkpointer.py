"""The Checkpointer: sharded DCP save of a dict of ``Stateful`` objects, manifest, resume, prune.

A checkpoint is one folder ``<checkpoint.dir>/step-N`` written with torch.distributed.checkpoint
(DCP): every rank writes its own shard file, the coordinator writes ``.metadata``. It holds the
model, the optimiser, the LR scheduler, the loop's TrainState (step, consumed_samples, whatever
else the trainer adds), the RNG states of every rank (``rng_rank{r}``) and the resolved
``config.toml``. Rank 0 then hashes every file and writes ``manifest.json`` LAST, through an
atomic rename: a checkpoint is complete exactly when its manifest exists, and it is intact
exactly when the checksums match. DCP's own ``.metadata`` is not enough for that: it is renamed
into place when the shards are written, but says nothing about a shard truncated later.

What is saved (the Stateful adapters that make any layout load into any other, the RNG states)
is state.py's.

Loading never unpickles untrusted data. DCP (torch 2.13) reads ``.metadata`` with plain
``pickle.load`` and non-tensor values with ``torch.load(weights_only=False)``; both can run code
from a crafted checkpoint. :class:`SafeFileSystemReader` reads the metadata with an unpickler
that admits only DCP's own metadata classes, and :class:`SafeLoadPlanner` loads non-tensor
values with ``weights_only=True``. The manifest's checksums are verified before any of it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import json
import logging
import os
import re
import shutil
import time
import tomllib
import uuid
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from paratrain.checkpoint.manifest import (
    _STEP_DIR,
    CONFIG_FILE,
    ELASTIC_ENV,
    MANIFEST,
    list_checkpoints,
    resolve_checkpoint,
    write_manifest,
)
from paratrain.checkpoint.safe_load import load_metadata, safe_planner, safe_reader
from paratrain.checkpoint.state import DataclassState, ModelState, OptimizerState, rng_state, set_rng_state
from paratrain.config import CheckpointConfig, ConfigError, to_toml
from paratrain.distributed.json_collectives import all_gather_json, broadcast_json

log = logging.getLogger("paratrain")


def config_changes(saved: dict, now: dict) -> list[str]:
    """The keys that define a run's math (model, data, loss, optimiser, seed, steps, global batch)
    whose values differ between two parsed config.toml files, sorted."""
    changed = []
    for section in ("model", "data", "loss", "optim"):
        for k in set(saved.get(section, {})) | set(now.get(section, {})):
            if saved.get(section, {}).get(k) != now.get(section, {}).get(k):
                changed.append(f"{section}.{k}")
    for section, k in (("run", "seed"), ("run", "steps"), ("batch", "global_batch_size")):
        if saved.get(section, {}).get(k) != now.get(section, {}).get(k):
            changed.append(f"{section}.{k}")
    return sorted(changed)


# How to fix a checkpoint that does not fit the config's model, for a run that resumes it.
RESUME_FIX = (
    "resume with the config that wrote it (its config.toml is in the checkpoint folder) or start a new run.out_dir"
)


class Checkpointer:
    """Saves and restores one rank's share of a run. Every method is called on every rank.

    ``stateful`` maps names to ``Stateful`` objects (state_dict/load_state_dict), each saved under
    its name: model, optimiser, scheduler, the loop's TrainState, fp16's GradScaler... An object
    the checkpoint lacks (an older run) keeps its state. Each rank's RNG states are added as
    ``rng_rank{r}``. ``train_state`` (the TrainState) gives the step and the manifest's summary.
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        *,
        out_dir: str,
        config_toml: str,
        stateful: dict[str, Stateful],
        train_state,
        layout: dict,
        rank: int,
        world_size: int,
        device: torch.device,
        timeout_s: float,
        base: dict | None = None,
        overwrite: bool = False,
        mismatch_fix: str = RESUME_FIX,
    ):
        self.cfg = cfg
        self.mismatch_fix = mismatch_fix  # the end of the line for a checkpoint of another model
        self.out_dir, self.overwrite = out_dir, overwrite  # run.overwrite: a resume may start over
        # A LoRA run's frozen base ({"sha256", "of"}, rank 0): written into each manifest, and a
        # checkpoint of adapters trained on another base is refused on resume.
        self.base = base
        self.root = cfg.dir or os.path.join(out_dir, "checkpoints")
        self.config_toml = config_toml
        self.stateful = {k: v for k, v in stateful.items() if v is not None}
        self.state = train_state
        self.layout = layout
        self.rank, self.world_size, self.device = rank, world_size, device
        self.timeout_s = timeout_s
        self.last_saved_step = -1
        # Which run wrote a checkpoint (its manifest's run_id): a resumed run takes over the id of
        # the checkpoint it resumed, and prunes only checkpoints of its own id.
        self.run_id = uuid.uuid4().hex
        self._written: set[str] = set()  # folders this process created (partial ones may be removed)
        self._pending_path: tuple[int, str] = (-1, "")
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
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))

    def _barrier(self, what: str) -> None:
        """A monitored barrier names the ranks that do not arrive instead of hanging (gloo)."""

        if self.world_size == 1:
            return
        try:
            dist.monitored_barrier(
                group=self.group, timeout=datetime.timedelta(seconds=self.timeout_s), wait_all_ranks=True
            )
        except RuntimeError as e:
            raise RuntimeError(f"ranks did not arrive at {what} within dist.timeout_s = {self.timeout_s:g}: {e}") from e

    # ---------------------------------------------------------------- state dicts

    def _key(self, name: str) -> str:
        """Objects whose state differs per rank (``per_rank = True``) are saved once per rank."""
        return f"{name}_rank{self.rank}" if getattr(self.stateful[name], "per_rank", False) else name

    def _app_state(self) -> dict:
        return {
            **{self._key(k): v.state_dict() for k, v in self.stateful.items()},
            f"rng_rank{self.rank}": rng_state(self.device),
        }

    # ---------------------------------------------------------------- save

    def after_step(self, step: int) -> float | None:
        """Save if ``step`` is due; returns the seconds the save held up training (None if none)."""
        if self.cfg.interval > 0 and step % self.cfg.interval == 0:
            return self.save(step)
        return None

    def at_end(self, step: int, *, force: bool = False) -> float | None:
        """After the last step: save if checkpoint.at_end (or ``force``: preempted, synchronously)."""
        blocked = None
        if (self.cfg.at_end or force) and step != self.last_saved_step:
            blocked = self.save(step, sync=force)
        self.wait()
        return blocked

    def save(self, step: int, *, sync: bool = False) -> float | None:
        """Save ``step``; ``sync``: return only once it is complete, whatever checkpoint.async_save says.

        Returns the seconds training was held up, or None when the save failed and
        ``checkpoint.on_error = 'warn'`` let training go on (see :meth:`_failed`).
        """
        t0 = time.perf_counter()
        self.wait()  # one save in flight at a time (waiting for it also holds training up)
        path = os.path.join(self.root, f"step-{step}")
        self._barrier(f"the checkpoint of step {step}")
        error = _guarded(lambda: self._prepare(path)) if self.rank == 0 else None
        if self.world_size > 1:  # also a barrier: the folder is fresh before anyone writes into it
            error = broadcast_json(error, src=0, group=self.group)
        if error:
            return self._failed(step, path, error)
        writer = dcp.FileSystemWriter(path)
        app = self._app_state()
        info = {
            "step": step,
            "run_id": self.run_id,
            "train_state": dataclasses.asdict(self.state),
            "world_size": self.world_size,
            "layout": self.layout,
            "torch_version": torch.__version__,
            "time": time.time(),
            **({"base": self.base} if self.base else {}),
        }
        asynchronous = self.cfg.async_save and not sync
        if asynchronous:
            # async_save copies the state to CPU memory (the blocking part) and writes it from a
            # background thread; the manifest follows once the coordinator's write is done.
            fut = dcp.async_save(app, storage_writer=writer, process_group=self.group)
            self._pending = self._finalizer.submit(self._finalize, fut, path, info) if self.rank == 0 else fut
            self._pending_path = (step, path)
        else:

            def write() -> None:
                dcp.save(app, storage_writer=writer, process_group=self.group)
                if self.rank == 0:
                    self._finalize(None, path, info)

            error = self._agree(_guarded(write))  # every rank returns with the checkpoint complete, or fails
            if error:
                return self._failed(step, path, error)
        blocked = time.perf_counter() - t0
        self.blocked_s.append(blocked)
        self.last_saved_step = step
        log.info(
            "checkpoint step %d -> %s (%s, training blocked %.3f s)",
            step,
            path,
            "async" if asynchronous else "sync",
            blocked,
        )
        return blocked

    def _prepare(self, path: str) -> None:
        """Rank 0: a fresh step-N folder holding the resolved config."""
        if os.path.lexists(path):
            manifest = _read_manifest(path)
            if os.path.isfile(os.path.join(path, MANIFEST)) and (manifest or {}).get("run_id") != self.run_id:
                # A complete checkpoint of another run, or one whose manifest cannot be read (it
                # may be anyone's): never delete it here; keep it under another name. _prune
                # deletes a damaged one once it is older than every checkpoint kept.
                aside = f"{path}.replaced-{int(time.time())}"
                os.replace(path, aside)
                if manifest is None:
                    log.warning(
                        "warning: %s is damaged (its %s cannot be read); moved it to %s, which checkpoint.keep"
                        " prunes with the older checkpoints",
                        path,
                        MANIFEST,
                        aside,
                    )
                else:
                    log.warning(
                        "warning: %s belongs to another run (run_id %s); moved it to %s",
                        path,
                        manifest.get("run_id"),
                        aside,
                    )
            else:  # a partial folder left by a killed attempt at this step, or our own
                shutil.rmtree(path)
        os.makedirs(path)
        self._written.add(path)
        with open(os.path.join(path, CONFIG_FILE), "w") as f:
            f.write(self.config_toml)

    def _agree(self, error: str | None) -> str | None:
        """The first rank's error, on every rank (None when every rank succeeded)."""
        if self.world_size == 1:
            return error
        return next((e for e in all_gather_json(error, group=self.group) if e), None)

    def _failed(self, step: int, path: str, error: str) -> None:
        """A save that failed: drop its partial folder, keep the previous checkpoints; stop or warn."""
        if self.rank == 0 and path in self._written and not os.path.isfile(os.path.join(path, MANIFEST)):
            shutil.rmtree(path, ignore_errors=True)  # frees what a full disk took; it has no manifest
        previous = [
            os.path.basename(p) for _, p in list_checkpoints(self.root) if os.path.isfile(os.path.join(p, MANIFEST))
        ]
        line = (
            f"the checkpoint of step {step} could not be written to {path} ({error});"
            f" previous complete checkpoints: {', '.join(previous) or 'none'}"
        )
        if self.cfg.on_error == "warn":
            log.warning("warning: %s; training goes on (checkpoint.on_error = 'warn')", line)
            return None
        raise CheckpointSaveError(
            f"{line}; free space or fix the folder's permissions and resume (checkpoint.on_error = 'warn' trains on)"
        )

    def _owner(self, path: str) -> str | None:
        return (_read_manifest(path) or {}).get("run_id")

    def _finalize(self, fut, path: str, info: dict) -> None:
        """Rank 0, after DCP wrote every shard and .metadata: manifest last, then prune."""
        if fut is not None:
            fut.result()
        write_manifest(path, info)
        self._prune()

    def _prune(self) -> None:
        """Delete the checkpoints beyond ``keep``: only this run's own (its run_id in the manifest)."""
        if self.cfg.keep <= 0:
            return
        complete = [(s, p) for s, p in list_checkpoints(self.root) if os.path.isfile(os.path.join(p, MANIFEST))]
        if not complete:
            return
        keep = {p for _, p in complete[: self.cfg.keep]}
        oldest_kept = complete[: self.cfg.keep][-1][0]
        for s, p in list_checkpoints(self.root):
            # Older complete checkpoints beyond `keep`, and partial folders older than a kept one,
            # when this run wrote them (a checkpoint of another run, or a damaged one, stays).
            if p not in keep and s < oldest_kept:
                complete_p = os.path.isfile(os.path.join(p, MANIFEST))
                if (complete_p and self._owner(p) == self.run_id) or (not complete_p and p in self._written):
                    shutil.rmtree(p, ignore_errors=True)
        for s, p in _replaced(self.root):
            # Folders _prepare moved aside: this run's own, or damaged ones (an unreadable manifest:
            # nothing can resume from them) go with the checkpoints of their step; another run's stay.
            if s < oldest_kept:
                manifest = _read_manifest(p)
                if manifest is None or manifest.get("run_id") == self.run_id:
                    shutil.rmtree(p, ignore_errors=True)

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete, manifest included (every rank calls it)."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        error = _guarded(pending.result)
        error = self._agree(error)
        if error:
            self._failed(*self._pending_path, error)

    def close(self) -> None:
        """Wait for a save in flight; called in a finally block, so it reports rather than raises."""
        try:
            if self._pending is not None:  # alone: the other ranks may be gone (no collective here)
                pending, self._pending = self._pending, None
                error = _guarded(pending.result)
                if error:
                    raise CheckpointSaveError(error)
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
                # What the user asked to resume (--resume), with no checkpoint where the run's
                # metrics record steps, is refused; not under --overwrite, which starts over, and
                # not in a restarted or elastic attempt (a fallback: resume_spec), whose rows may
                # be its failed predecessor's, written before any checkpoint.
                out_dir = self.out_dir if self.cfg.resume and not fallback and not self.overwrite else ""
                path = resolve_checkpoint(spec, self.root, out_dir=out_dir)
                if path is None and fallback:
                    path = resolve_checkpoint(fallback, self.root, out_dir=out_dir)
                choice[0] = {"path": path}
                if path is not None:
                    self._check_base(path)
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
        self.run_id = self._owner(path) or self.run_id  # this run continues that one: its checkpoints are ours
        self.last_saved_step = self.state.step
        return self.state.step

    def load(self, path: str) -> None:

        md = load_metadata(path)
        keys = md.state_dict_metadata.keys()
        self._warn_config_changes(path)
        app = self._app_state()
        for name, obj in self.stateful.items():
            if getattr(obj, "per_rank", False):
                continue  # below
            if not any(key == name or key.startswith(name + ".") for key in keys):
                # Absent from the checkpoint (an older run; fp32 before, for the GradScaler): keep as is.
                del app[name]
            elif getattr(obj, "partial", False):  # fields the checkpoint lacks keep their defaults
                # A dict field takes the checkpoint's keys: DCP flattens a dict into one entry per
                # key and loads only the keys it is asked for, so a fresh run's empty dict (the
                # adaptive batch's noise averages) would come back empty.
                app[name] = {
                    k: (_template(md, f"{name}.{k}") or v) if isinstance(v, dict) else v
                    for k, v in app[name].items()
                    if f"{name}.{k}" in keys or any(key.startswith(f"{name}.{k}.") for key in keys)
                }
        # One line, before DCP's "Size mismatch" on every rank.
        check_shapes(md, app.get("model", {}), path=path, fix=self.mismatch_fix)
        check_optimizer_state(md, app.get("optim", {}), path=path)  # before DCP's "Missing key" traceback
        own = f"rng_rank{self.rank}"
        src = own if any(k.startswith(own + ".") for k in keys) else "rng_rank0"
        if src != own:
            # More ranks than the checkpoint had: take rank 0's streams (the trainer seeds every
            # rank alike, so this is exact unless user code made per-rank random streams).
            log.info("checkpoint %s has no RNG state for rank %d; using rank 0's", path, self.rank)
        app[src] = app.pop(own)
        per_rank = {}  # name -> the key loaded for it (this rank's, else rank 0's at another world size)
        for name, obj in self.stateful.items():
            if getattr(obj, "per_rank", False):
                mine = app.pop(self._key(name))
                key = next((k for k in (f"{name}_rank{self.rank}", f"{name}_rank0") if _has(keys, k)), None)
                if key is not None:
                    # Its tensors are known from the metadata only (e.g. PowerSGD's per-bucket state).
                    app[key] = _template(md, key) or mine
                    per_rank[name] = key
        dcp.load(app, storage_reader=safe_reader(path), planner=safe_planner(), process_group=self.group)
        for name, obj in self.stateful.items():  # in order: the model before its optimiser
            if name in per_rank:
                obj.load_state_dict(app[per_rank[name]], own=per_rank[name].endswith(f"_rank{self.rank}"))
            elif name in app:
                obj.load_state_dict(app[name])
        set_rng_state(app[src], self.device)
        log.info(
            "resumed from %s at step %d (%d samples consumed)",
            path,
            self.state.step,
            getattr(self.state, "consumed_samples", -1),
        )

    def _check_base(self, path: str) -> None:
        """Adapters trained on one base are meaningless on another: refuse, naming both hashes."""
        if not self.base:
            return
        with open(os.path.join(path, MANIFEST)) as f:
            saved = json.load(f).get("base") or {}
        if saved.get("sha256") not in (None, self.base["sha256"]):
            raise ConfigError(
                f"checkpoint {path} holds adapters trained on base weights sha256 {saved['sha256']}"
                f" ({saved.get('of', '?')}), but this run's base is sha256 {self.base['sha256']} ({self.base['of']});"
                " resume with the base it was trained on (its config.toml is in the checkpoint folder) or start a"
                " new run.out_dir"
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
        changed = config_changes(saved, now)
        if changed:
            log.warning(
                "warning: resuming from %s with changed %s; the run will not continue the same trajectory",
                path,
                ", ".join(changed),
            )


def _read_manifest(path: str) -> dict | None:
    """The manifest of a checkpoint folder as a dict; None when it is missing, empty or not a JSON object."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


_REPLACED_DIR = re.compile(r"^step-(\d+)\.replaced-\d+$")


def _replaced(root: str) -> list[tuple[int, str]]:
    """(step, path) of the ``step-N.replaced-<time>`` folders under root."""
    if not os.path.isdir(root):
        return []
    return sorted(
        (int(m.group(1)), os.path.join(root, name))
        for name in os.listdir(root)
        if (m := _REPLACED_DIR.match(name)) and os.path.isdir(os.path.join(root, name))
    )


def _has(keys, name: str) -> bool:
    return any(k == name or k.startswith(name + ".") for k in keys)


def _template(md, prefix: str) -> dict:
    """A nested dict shaped like the checkpoint's entries under ``prefix``: empty tensors of the
    saved shapes and dtypes, None for other values (DCP fills both in)."""
    out: dict = {}
    for k, m in md.state_dict_metadata.items():
        if not k.startswith(prefix + "."):
            continue
        *parents, leaf = k[len(prefix) + 1 :].split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = torch.empty(m.size, dtype=m.properties.dtype) if isinstance(m, TensorStorageMetadata) else None
    return out


def check_shapes(md, model_sd: dict, *, path: str, fix: str = RESUME_FIX) -> None:
    """Refuse a checkpoint whose model tensors differ from this model's (names and global shapes);
    ``fix`` ends the line (eval has its own: it starts no run)."""
    saved = {
        k.removeprefix("model."): list(m.size)
        for k, m in md.state_dict_metadata.items()
        if k.startswith("model.") and isinstance(m, TensorStorageMetadata)
    }
    for name, t in model_sd.items():
        if not isinstance(t, torch.Tensor):
            continue
        shape = list(t.shape)  # a DTensor's shape is its global shape
        if name not in saved:
            raise ConfigError(
                f"checkpoint {path} has no parameter {name} (shape {shape} in this config's model); {fix}"
            )
        if saved[name] != shape:
            raise ConfigError(
                f"checkpoint {path}: parameter {name} has shape {saved[name]} there but {shape} in this"
                f" config's model; {fix}"
            )


def check_optimizer_state(md, optim_sd: dict, *, path: str) -> None:
    """Refuse a checkpoint that lacks a state this optimiser keeps (another optim.name, or momentum
    where there was none): DCP would stop every rank with "Missing key in checkpoint state_dict"."""
    saved = md.state_dict_metadata.keys()
    for key in optim_sd:  # flat (checkpoint/state.py): "state.<parameter>.<state>", "param_groups...."
        if key.startswith("state.") and f"optim.{key}" not in saved:
            parameter, state = key[len("state.") :].rsplit(".", 1)
            raise ConfigError(
                f"checkpoint {path} holds no optimiser state {state!r} of {parameter}, which this config's optimiser"
                " keeps (optim.name or optim.beta1 changed?); resume with the optimiser that wrote it (its config.toml"
                " is in the checkpoint folder) or start a new run.out_dir"
            )


class CheckpointSaveError(RuntimeError):
    """A checkpoint that could not be written (full or unwritable folder): one line, exit code 1."""


def _guarded(fn) -> str | None:
    """Run ``fn``; None if it succeeded, else the first underlying error as one line.

    DCP wraps the writers' errors in CheckpointException, a BaseException (not an Exception) whose
    text is every rank's traceback: the first failure's own line is what a person needs.
    """
    try:
        fn()
        return None
    except CheckpointException as e:
        first = next(iter(e.failures.values()), None)
        exc = first[0] if isinstance(first, tuple) else first
        return f"{type(exc).__name__}: {exc}".splitlines()[0] if exc is not None else "CheckpointException"
    except OSError as e:
        return f"{type(e).__name__}: {e}".splitlines()[0]


def resume_spec(cfg: CheckpointConfig) -> tuple[str, str]:
    """(spec, fallback) for Checkpointer.resume: checkpoint.resume; but in workers that torchrun
    restarted after a failure, the newest complete checkpoint of this run first (it is newer
    than the one the job was started from), checkpoint.resume only if there is none."""
    if os.environ.get(ELASTIC_ENV):
        # An elastic job (--nnodes MIN:MAX): torch elastic restarts the workers on a membership
        # change without counting a restart (TORCHELASTIC_RESTART_COUNT stays 0), so every
        # start continues the newest complete checkpoint, as --resume would.
        return "latest", cfg.resume
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
    base: dict | None = None,
    model_keys=None,
) -> Checkpointer:
    """The Checkpointer of a run (``cfg`` is the whole resolved Config, saved with each checkpoint).

    ``stateful``: more objects whose state is the same on every rank (e.g. fp16's GradScaler: its
    overflow check follows the all-reduced gradients); None values are skipped. A LoRA run passes
    ``model_keys`` (the model entries that train: only those are saved) and ``base`` (its frozen
    base's hash, for the manifest and the check on resume).
    """
    return Checkpointer(
        cfg.checkpoint,
        out_dir=cfg.run.out_dir,
        config_toml=to_toml(cfg),
        stateful={
            "model": ModelState(model, keep=model_keys),
            "optim": OptimizerState(model, optimizer),
            "scheduler": scheduler,
            "train_state": DataclassState(state),
            **{k: v for k, v in (stateful or {}).items() if v is not None},
        },
        train_state=state,
        layout=layout,
        rank=rank,
        world_size=world_size,
        device=device,
        timeout_s=cfg.dist.timeout_s,
        base=base,
        overwrite=cfg.run.overwrite,
    )
