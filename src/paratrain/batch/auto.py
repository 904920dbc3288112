"""Entry points of the search: ``find_micro_batch``, the in-job ``resolve_auto_micro_batch`` and the
estimate in a subprocess or under fake process groups.

See find_batch/__init__.py for the whole picture.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from paratrain.batch.measure import (
    StepRunner,
    agreed,
    estimate_peak,
    guarded,
    measure_peak,
    memory_budget,
    replica_dims,
)
from paratrain.batch.plan import BatchPlan, plan_batch
from paratrain.batch.search import MAX_TRIALS, SearchResult, Trial, nothing_fits_error, search_micro_batch
from paratrain.config import Config, ConfigError, to_toml
from paratrain.distributed.json_collectives import broadcast_json
from paratrain.distributed.parallel_dims import ParallelDims

log = logging.getLogger("paratrain")


def find_micro_batch(
    cfg: Config,
    dims: ParallelDims,
    *,
    device: torch.device,
    method: str,
    local_processes: int = 1,
    model=None,
    dataset=None,
    loss=None,
    measure: Callable[[int], int] | None = None,
    agree: bool = True,
    group: dist.ProcessGroup | None = None,
    max_trials: int = MAX_TRIALS,
) -> SearchResult:
    """Search the largest fitting micro-batch; ``method`` is 'estimate' or 'trial'.

    ``measure(m) -> peak bytes`` replaces the step (tests inject an allocator limit or an
    out-of-memory error through it). With a process group, every rank must call this with the
    same config: they agree after each trial (``group`` None = the default group), unless
    ``agree`` is False (one rank searching for all).
    """
    budget, source = memory_budget(memory_gib=cfg.batch.memory_gib, device=device, local_processes=local_processes)
    usable = int(budget * (1 - cfg.batch.memory_margin))
    runner = StepRunner(cfg, dims, device=device, model=model, dataset=dataset, loss=loss)
    if (why := runner.norm_problem()) is not None:  # BatchNorm groups no micro-batch can hold
        raise ConfigError(why)
    if measure is None:
        step = estimate_peak if method == "estimate" else measure_peak

        def measure(m: int) -> int:
            return step(runner, m)

    def trial(m: int) -> Trial:
        peak = measure(m)
        return Trial(m, peak <= usable, peak)

    fraction = None
    if method == "trial" and device.type == "cuda" and cfg.batch.memory_gib <= 0:
        # Make the margin real: the allocator refuses beyond it, so a trial that would eat into
        # the margin runs out of memory like one that exceeds the device.
        fraction = usable / budget
        torch.cuda.set_per_process_memory_fraction(fraction, device)
    try:
        checked = guarded(trial, device=device)
        best, trials = search_micro_batch(
            agreed(checked, group) if agree else checked,
            per_rank_batch_size=runner.per_rank,
            max_trials=max_trials,
            allowed=runner.allows,
        )
    finally:
        if fraction is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
    peak = next((t.peak_bytes for t in trials if t.micro_batch_size == best), None) if best else None
    label = {"estimate": "estimate on fake tensors (MemTracker)", "trial": f"real trial steps on {device.type}"}[method]
    return SearchResult(best, peak, budget, usable, label, source, runner.per_rank, trials)


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int):
    """A process group of ``world_size`` in which nothing crosses processes (c10d's 'fake' backend)."""
    if world_size == 1:
        yield
        return
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _estimate(cfg: Config, dims: ParallelDims, **kw) -> SearchResult:
    """The fake-tensor estimate one process makes for every rank (no other rank searches: no agreement)."""
    return find_micro_batch(cfg, dims, method="estimate", agree=False, **kw)


def estimate_without_group(
    cfg: Config, dims: ParallelDims, *, device: torch.device, local_processes: int, model=None, dataset=None, loss=None
) -> SearchResult:
    """The estimate in a process without a process group: a fake group emulates one replica's ranks.

    Rank 0 answers for every rank: the ranks of one replica differ in memory only by pipeline
    stage, and pipeline layouts are refused before this (find-batch, and 'auto' in preflight:
    the estimate cannot run a schedule under fake groups). FSDP's and TP's shards are torch.chunk
    pieces, of which rank 0's is the largest.
    """
    rep = replica_dims(dims)
    with fake_process_group(rep.world_size, 0):
        return _estimate(
            cfg, dims, device=device, local_processes=local_processes, model=model, dataset=dataset, loss=loss
        )


def resolve_auto_micro_batch(
    cfg: Config,
    *,
    dims: ParallelDims,
    device: torch.device,
    model=None,
    dataset=None,
    loss=None,
    user_objects: Sequence[str] = (),
) -> BatchPlan:
    """``micro_batch_size = 'auto'`` inside a running job: the same answer on every rank.

    On CUDA every rank runs trials on one replica and the ranks agree (MIN) after each; without
    CUDA rank 0 estimates on fake tensors and broadcasts. Layouts other than replicas of one
    process (FSDP/TP/PP) need fake process groups, which cannot coexist with the job's own: rank 0
    runs that estimate in a fresh `paratrain find-batch --estimate` process.
    """
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    rep = replica_dims(dims)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if device.type == "cuda" and rep.world_size == 1:
        # A trial step of one replica has no collective inside, so an out-of-memory error on one
        # rank cannot leave the others waiting; the ranks agree after each trial.
        result = find_micro_batch(
            cfg, dims, device=device, method="trial", local_processes=local, model=model, dataset=dataset, loss=loss
        )
        reply = {"table": result.table(), "result": {**result.to_json(), "budget_source": result.budget_source}}
    else:
        reply = None
        if rank == 0:
            if rep.world_size == 1:
                result = _estimate(
                    cfg, dims, device=device, local_processes=local, model=model, dataset=dataset, loss=loss
                )
            else:
                result = _estimate_in_subprocess(cfg, dims, user_objects=user_objects)
            reply = {"table": result.table(), "result": {**result.to_json(), "budget_source": result.budget_source}}
        if dist.is_initialized() and dist.get_world_size() > 1:
            reply = broadcast_json(reply, src=0)  # JSON, not a pickle (docs/security.md)
    table, result = reply["table"], SearchResult.from_json(reply["result"])
    mbs = result.micro_batch_size
    for line in table.splitlines():
        log.info("%s", line)
    if mbs is None:
        raise nothing_fits_error(result, dims)
    return plan_batch(global_batch_size=cfg.batch.global_batch_size, micro_batch_size=mbs, dp=dims.dp)


def _estimate_in_subprocess(cfg: Config, dims: ParallelDims, *, user_objects) -> SearchResult:
    # The config rebuilds its own model, data and loss in the new process; objects handed to
    # train() cannot follow them there.
    if user_objects:
        raise ConfigError(
            f"batch.micro_batch_size = 'auto' with dp_shard/tp/pp > 1 and {'/'.join(user_objects)} objects"
            " passed to train() cannot be estimated in a separate process; run `paratrain find-batch`"
            " on a config with factories and set batch.micro_batch_size to its answer"
        )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "config.toml")
        with open(path, "w") as f:
            f.write(to_toml(cfg))
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "paratrain",
                "find-batch",
                path,
                "--estimate",
                "--json",
                "--nproc-per-node",
                str(dims.world_size),
                "--local-processes",
                os.environ.get("LOCAL_WORLD_SIZE", "1"),
            ],
            capture_output=True,
            text=True,
        )
    if proc.returncode not in (0, 2) or not proc.stdout.strip():
        raise RuntimeError(f"the memory estimate failed:\n{proc.stderr}")
    return SearchResult.from_json({**json.loads(proc.stdout.strip().splitlines()[-1]), "budget_source": "subprocess"})
