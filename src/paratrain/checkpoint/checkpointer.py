"""The Checkpointer: sharded DCP save of a dict of ``Stateful`` objects, manifest, resume, prune.

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
import datetime
import logging
import os
import random
import shutil
import time
import tomllib
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from paratrain.checkpoint.manifest import (
    _STEP_DIR,
    CONFIG_FILE,
    MANIFEST,
    list_checkpoints,
    resolve_checkpoint,
    write_manifest,
)
from paratrain.checkpoint.safe_load import load_metadata, safe_planner, safe_reader
from paratrain.config import CheckpointConfig, ConfigError, to_toml
from paratrain.distributed.json_collectives import broadcast_json

log = logging.getLogger("paratrain")


def rng_state(device: torch.device) -> dict:
    """Python, numpy and torch RNG states as values torch.load(weights_only=True) accepts."""

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

    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np_state = dict(state["numpy"])
    np_state["state"] = {"key": np.asarray(np_state["state"]["key"], dtype=np.uint32), "pos": np_state["state"]["pos"]}
    np.random.set_state(np_state)
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


class ModelState(Stateful):
    """The model through DCP's get/set_model_state_dict: names without DDP's ``module.`` prefix,
    DTensor shards described by their global shape, so any layout loads into any other."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict(self) -> dict:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state_dict: dict) -> None:
        set_model_state_dict(self.model, state_dict)


class OptimizerState(Stateful):
    """The optimiser, keyed by parameter names (get/set_optimizer_state_dict), resharded on load."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state_dict: dict) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state_dict)


class DataclassState(Stateful):
    """A dataclass (the trainer's TrainState) saved with ``asdict`` and restored field by field:
    fields added later are checkpointed without touching this module, and a field an older
    checkpoint lacks keeps its default (``partial``: the Checkpointer loads only what it has)."""

    partial = True

    def __init__(self, obj):
        self.obj = obj

    def state_dict(self) -> dict:
        return dataclasses.asdict(self.obj)

    def load_state_dict(self, state_dict: dict) -> None:
        for k, v in state_dict.items():
            setattr(self.obj, k, v)


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
    ):
        self.cfg = cfg
        self.root = cfg.dir or os.path.join(out_dir, "checkpoints")
        self.config_toml = config_toml
        self.stateful = {k: v for k, v in stateful.items() if v is not None}
        self.state = train_state
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

    def _app_state(self) -> dict:
        return {
            **{k: v.state_dict() for k, v in self.stateful.items()},
            f"rng_rank{self.rank}": rng_state(self.device),
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

        md = load_metadata(path)
        keys = md.state_dict_metadata.keys()
        self._warn_config_changes(path)
        app = self._app_state()
        for name, obj in self.stateful.items():
            if not any(key == name or key.startswith(name + ".") for key in keys):
                # Absent from the checkpoint (an older run; fp32 before, for the GradScaler): keep as is.
                del app[name]
            elif getattr(obj, "partial", False):  # fields the checkpoint lacks keep their defaults
                app[name] = {
                    k: v
                    for k, v in app[name].items()
                    if f"{name}.{k}" in keys or any(key.startswith(f"{name}.{k}.") for key in keys)
                }
        own = f"rng_rank{self.rank}"
        src = own if any(k.startswith(own + ".") for k in keys) else "rng_rank0"
        if src != own:
            # More ranks than the checkpoint had: take rank 0's streams (the trainer seeds every
            # rank alike, so this is exact unless user code made per-rank random streams).
            log.info("checkpoint %s has no RNG state for rank %d; using rank 0's", path, self.rank)
        app[src] = app.pop(own)
        dcp.load(app, storage_reader=safe_reader(path), planner=safe_planner(), process_group=self.group)
        for name, obj in self.stateful.items():  # in order: the model before its optimiser
            if name in app:
                obj.load_state_dict(app[name])
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
        changed = config_changes(saved, now)
        if changed:
            log.warning(
                "warning: resuming from %s with changed %s; the run will not continue the same trajectory",
                path,
                ", ".join(changed),
            )


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
    """The Checkpointer of a run (``cfg`` is the whole resolved Config, saved with each checkpoint).

    ``stateful``: more objects whose state is the same on every rank (e.g. fp16's GradScaler: its
    overflow check follows the all-reduced gradients); None values are skipped.
    """
    return Checkpointer(
        cfg.checkpoint,
        out_dir=cfg.run.out_dir,
        config_toml=to_toml(cfg),
        stateful={
            "model": ModelState(model),
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
    )
