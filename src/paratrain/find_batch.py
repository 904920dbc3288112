"""Find the largest micro-batch that fits in memory: ``batch.micro_batch_size = "auto"`` and
``paratrain find-batch``.

Two ways to decide whether a micro-batch size fits, one search and one answer format:

* **trial** (a CUDA device): run short real training steps (forward, backward, optimiser step)
  at growing sizes, recover from ``torch.OutOfMemoryError`` and free everything after each
  (gc, ``empty_cache``, ``reset_peak_memory_stats``). Every rank tries the same size and the
  ranks agree through one ``all_reduce(MIN)`` of "it fitted", so they all take the same path
  through the search and no rank desynchronises.
* **estimate** (CPU, planning for a device you don't have, ``--memory-gib``): run the same
  step on fake tensors (``FakeTensorMode``) under ``torch.distributed._tools.mem_tracker.
  MemTracker``, which counts parameters, gradients, optimiser state and activations without
  allocating any of them, and compare the peak with the budget.

Both run the *real* step: the model from the config, ``parallelize`` (so FSDP, TP and
activation checkpointing, once enabled, are what is measured), the optimiser and ``train_step``,
twice (the first step creates the optimiser state; the second is the steady state), with
``min(2, accumulation)`` micro-batches (accumulated gradients live through later backwards).

Replicated data parallelism (DDP) does not change what one rank holds apart from its gradient
buckets, so trials and estimates run one replica (``dp_replicate`` = 1, no gradient all-reduce
inside the step: an out-of-memory error on one rank cannot leave the others waiting in a
collective) and add DDP's buckets (one gradient's worth, kept for the whole run when gradients
are bucket views) explicitly.

The search (:func:`search_micro_batch`) runs over the divisors of the per-rank batch, since
accumulation keeps ``batch.global_batch_size`` and so the micro-batch must divide the per-rank
batch: grow by doubling from 1 until a size does not fit, then bisect between the last fit and
the first failure; at most ``max_trials`` (12) trials. It assumes the peak grows with the size.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from paratrain.batching import BatchPlan, plan_batch
from paratrain.config import Config, ConfigError, to_toml
from paratrain.distributed.parallel_dims import ParallelDims

log = logging.getLogger("paratrain")

MAX_TRIALS = 12
GIB = 1 << 30


# ----------------------------------------------------------------------------- results


@dataclass
class Trial:
    micro_batch_size: int
    fits: bool
    peak_bytes: int | None  # None when the trial ran out of memory
    note: str = ""


@dataclass
class SearchResult:
    micro_batch_size: int | None  # None: not even 1 fits
    peak_bytes: int | None
    budget_bytes: int
    usable_bytes: int
    method: str
    budget_source: str
    per_rank_batch_size: int
    trials: list[Trial] = field(default_factory=list)

    @property
    def accum_steps(self) -> int | None:
        return None if self.micro_batch_size is None else self.per_rank_batch_size // self.micro_batch_size

    def table(self) -> str:
        lines = [
            f"find-batch: {self.method}; budget {self.budget_bytes / GIB:.3f} GiB per rank ({self.budget_source}),"
            f" usable {self.usable_bytes / GIB:.3f} GiB after the margin;"
            f" candidates: divisors of the per-rank batch {self.per_rank_batch_size}",
            f"  {'micro_batch':>11}  {'peak_MiB':>10}  fits",
        ]
        for t in self.trials:
            peak = "OOM" if t.peak_bytes is None else f"{t.peak_bytes / 2**20:.1f}"
            lines.append(
                f"  {t.micro_batch_size:>11}  {peak:>10}  {'yes' if t.fits else 'no'}{'  ' + t.note if t.note else ''}"
            )
        if self.micro_batch_size is None:
            lines.append("  -> not even micro_batch_size 1 fits")
        else:
            lines.append(
                f"  -> micro_batch_size {self.micro_batch_size} x accum_steps {self.accum_steps}"
                f" (peak {self.peak_bytes / 2**20:.1f} MiB)"
            )
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "micro_batch_size": self.micro_batch_size,
            "peak_bytes": self.peak_bytes,
            "accum_steps": self.accum_steps,
            "budget_bytes": self.budget_bytes,
            "usable_bytes": self.usable_bytes,
            "method": self.method,
            "per_rank_batch_size": self.per_rank_batch_size,
            "trials": [dataclasses.asdict(t) for t in self.trials],
        }


def nothing_fits_error(result: SearchResult, dims: ParallelDims) -> ConfigError:
    one = next((t for t in result.trials if t.micro_batch_size == 1), None)
    peak = "out of memory" if one is None or one.peak_bytes is None else f"peak {one.peak_bytes / GIB:.2f} GiB"
    return ConfigError(
        f"batch.micro_batch_size = 'auto': not even a micro-batch of 1 fits ({peak} > usable"
        f" {result.usable_bytes / GIB:.2f} GiB per rank); try a layout that holds less per rank: more"
        f" parallel.dp_shard (FSDP, now {dims.dp_shard}), parallel.tp (now {dims.tp}), activation"
        f" checkpointing, or a larger batch.memory_gib / more memory"
    )


# ----------------------------------------------------------------------------- the search


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search_micro_batch(
    try_size: Callable[[int], Trial], *, per_rank_batch_size: int, max_trials: int = MAX_TRIALS
) -> tuple[int | None, list[Trial]]:
    """Largest divisor of ``per_rank_batch_size`` for which ``try_size`` fits (None if not 1).

    Doubling from 1, then bisection among the divisors between the last fit and the first
    failure. ``try_size`` must give the same answer on every rank (see :func:`agreed`).
    """
    cands = divisors(per_rank_batch_size)
    trials: list[Trial] = []
    lo, hi = -1, len(cands)  # indices: largest known fit, smallest known failure

    def attempt(i: int) -> bool:
        t = try_size(cands[i])
        trials.append(t)
        return t.fits

    # 1. Growing sizes: 1, then the smallest divisor at least twice the last fit.
    i = 0
    while len(trials) < max_trials and i < hi:
        if not attempt(i):
            hi = i
            break
        lo = i
        i = next((j for j in range(i + 1, len(cands)) if cands[j] >= 2 * cands[lo]), len(cands))
        if i >= len(cands):
            break
    # 2. Bisection among the divisors strictly between the last fit and the first failure (a
    #    proper divisor is at most half the per-rank batch, so doubling always reaches the last).
    while lo >= 0 and hi - lo > 1 and hi < len(cands) and len(trials) < max_trials:
        mid = (lo + hi) // 2
        if attempt(mid):
            lo = mid
        else:
            hi = mid
    return (cands[lo] if lo >= 0 else None), trials


def guarded(trial: Callable[[int], Trial], *, device: torch.device | None = None) -> Callable[[int], Trial]:
    """Turn an out-of-memory error of ``trial`` into a failed Trial and free what it held."""

    def run(m: int) -> Trial:
        oom = False
        try:
            result = trial(m)
        except torch.OutOfMemoryError:  # also torch.cuda.OutOfMemoryError
            oom = True
        # Outside the except block: the exception (and the frames holding tensors) is gone. A
        # full gc pass costs most of a second with torch loaded: only where memory is at stake.
        if oom or (device is not None and device.type == "cuda"):
            free_memory(device)
        return Trial(m, False, None, "out of memory") if oom else result

    return run


def agreed(trial: Callable[[int], Trial], group=None) -> Callable[[int], Trial]:
    """Every rank runs ``trial`` and all take the answer of the worst rank (MIN of 'fits', MAX of peak)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return trial

    def run(m: int) -> Trial:
        t = trial(m)
        # One collective for both: MIN over (fits, -peak) gives min fits and max peak. A CPU tensor
        # works on gloo and on the 'cpu:gloo,cuda:nccl' backend.
        flags = torch.tensor([int(t.fits), -(t.peak_bytes if t.peak_bytes is not None else 2**62)], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
        fits, peak = bool(flags[0].item()), -int(flags[1].item())
        note = t.note if fits == t.fits else (t.note or "another rank did not fit")
        return Trial(m, fits, None if peak >= 2**62 else peak, note)

    return run


def free_memory(device: torch.device | None) -> None:
    gc.collect()
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# ----------------------------------------------------------------------------- one step


def replica_dims(dims: ParallelDims) -> ParallelDims:
    """The layout of one DDP replica: what one rank holds does not depend on dp_replicate."""
    return ParallelDims(1, dims.dp_shard, dims.tp, dims.pp, dims.world_size // dims.dp_replicate)


class StepRunner:
    """Builds and runs the real training step at a trial micro-batch size."""

    def __init__(
        self,
        cfg: Config,
        dims: ParallelDims,
        *,
        device: torch.device,
        model: nn.Module | None = None,
        dataset=None,
        loss=None,
        iterations: int = 2,
    ):
        from paratrain.loss import build_loss

        self.cfg, self.full_dims, self.device = cfg, dims, device
        self.dims = replica_dims(dims)
        self.user_model = model
        self._dataset = dataset
        self.loss_fn = loss if loss is not None and hasattr(loss, "count") else build_loss(cfg.loss, loss)
        self.iterations = iterations
        self.per_rank = plan_batch(
            global_batch_size=cfg.batch.global_batch_size, micro_batch_size=0, dp=dims.dp
        ).per_rank_batch_size

    @property
    def dataset(self):
        if self._dataset is None:  # built on first use: an injected measure never needs it
            from paratrain.data import build_dataset

            self._dataset = build_dataset(self.cfg.data)
        return self._dataset

    def batches(self, m: int) -> list:
        from paratrain.trainer import load_batches

        n = m * min(2, self.per_rank // m)
        return load_batches(self.dataset, [i % len(self.dataset) for i in range(n)], m)

    def build(self, fake_mode=None) -> tuple[nn.Module, torch.optim.Optimizer]:
        from paratrain.distributed.parallelize import parallelize
        from paratrain.models import build_model
        from paratrain.optim import build_optimizer

        with torch.random.fork_rng(devices=[]):  # trials must not move the run's RNG
            if self.user_model is not None:
                if fake_mode is not None:
                    with fake_mode, FakeCopyMode(fake_mode):
                        model = copy.deepcopy(self.user_model)
                else:
                    model = copy.deepcopy(self.user_model)
            elif fake_mode is not None:
                # Fake parameters are created on the device: Module.to cannot move them (torch 2.13).
                with fake_mode, torch.device(self.device):
                    model = build_model(self.cfg.model)
            else:
                model = build_model(self.cfg.model)
            with fake_mode or contextlib.nullcontext():
                model = parallelize(
                    model,
                    self.dims,
                    cfg=self.cfg.parallel,
                    device=self.device,
                    comm=self.cfg.comm,
                    precision=self.cfg.precision,
                    compile_enabled=False,
                )
                optimizer = build_optimizer(model, self.cfg.optim)
        return model, optimizer

    def run(self, model: nn.Module, optimizer: torch.optim.Optimizer, batches: list) -> None:
        from paratrain.precision import build_precision
        from paratrain.step import train_step

        # The step's own mixed precision: autocast changes the activations' dtype, so the memory.
        precision = build_precision(self.cfg.precision, device=self.device, fsdp_enabled=self.dims.dp_shard > 1)
        model.train()
        for _ in range(self.iterations):
            train_step(
                model,
                optimizer,
                batches,
                loss_fn=self.loss_fn,
                dp=self.dims.dp,
                dp_group=self.dims.group("dp"),
                grad_clip=self.cfg.optim.grad_clip,
                device=self.device,
                precision=precision,
                # The trainer's FSDP2 sync policy: ZeRO-3 reduce-scatters every micro-batch, else
                # unsharded gradients accumulate (a block's worth of fp32 each, trainer.py).
                sync_each_micro_batch=self.cfg.parallel.reshard_after_forward,
            )

    def ddp_extra_bytes(self, model: nn.Module, m: int, grads_at_peak: int) -> int:
        """What DDP adds to one replica's peak: its gradient buckets, one gradient's worth, live all run.

        With one micro-batch the gradients are views of the buckets, so only the part of them not
        already allocated at the peak is extra. With accumulation, the micro-batches under
        ``no_sync`` accumulate into ordinary gradients (``zero_grad(set_to_none=True)`` dropped the
        views) which coexist with the buckets during the last backward: all of it is extra.
        (Checked against MemTracker on a real 2-rank gloo DDP step: within 0.1%, test_batch_size.py.)
        """
        if self.full_dims.dp_replicate == 1:
            return 0
        buckets = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        return buckets if self.per_rank // m >= 2 else max(0, buckets - grads_at_peak)


try:
    from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # pragma: no cover - torch too old for the estimator
    MemTracker = None


if MemTracker is not None:

    class _StepMemTracker(MemTracker):
        """MemTracker that allows the root module to run several forwards per step.

        MemTracker refuses a second forward of the root module (it takes it for the next
        iteration); accumulation and our two iterations do exactly that. The peak is global and
        kept, only the per-module statistics restart.
        """

        def _pre_fw_hook(self, module, inputs):
            if module in self.memory_tracking and not self._mod_tracker.is_bw:
                name = self._mod_tracker.get_known_fqn(module)
                if set(self._mod_tracker.parents) - {name} == {"Global"}:
                    self.reset_mod_stats()
            super()._pre_fw_hook(module, inputs)

        def peak(self) -> tuple[int, int]:
            """(peak total bytes, gradient bytes at that moment), the largest device."""
            snap = self.get_tracker_snapshot("peak")
            if not snap:
                return 0, 0
            dev = max(snap, key=lambda d: snap[d]["Total"])
            return snap[dev]["Total"], snap[dev].get(_MemRefType.GRAD, 0)

    class _FakeScalars(TorchDispatchMode):
        """``.item()`` on a fake tensor has no value; the step only needs *a* number to go on.

        The counts it reads are made non-zero (1), which is all train_step checks; memory does
        not depend on these values.
        """

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                return 1.0 if args[0].is_floating_point() else 1
            return func(*args, **(kwargs or {}))


def estimate_peak(runner: StepRunner, m: int) -> int:
    """Peak bytes of one rank for micro-batch ``m``, on fake tensors (nothing is allocated)."""
    if MemTracker is None:
        raise ConfigError("the memory estimate needs torch >= 2.5 (MemTracker); upgrade torch or use a CUDA trial")
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    runner.dims.mesh  # build the device mesh outside fake mode: it reads real rank tensors
    model, optimizer = runner.build(fake)
    batches = runner.batches(m)
    tracker = _StepMemTracker()
    tracker.track_external(model, optimizer)
    with fake, tracker, _FakeScalars():
        runner.run(model, optimizer, batches)
    peak, grads_at_peak = tracker.peak()
    return peak + runner.ddp_extra_bytes(model, m, grads_at_peak)


def measure_peak(runner: StepRunner, m: int) -> int:
    """The same step on real tensors: MemTracker on CPU, the CUDA allocator's peak on a GPU."""
    runner.dims.mesh
    if runner.device.type == "cuda":
        free_memory(runner.device)
        base = torch.cuda.memory_allocated(runner.device)
        model, optimizer = runner.build()
        runner.run(model, optimizer, runner.batches(m))
        torch.cuda.synchronize(runner.device)
        peak = torch.cuda.max_memory_allocated(runner.device) - base
        grads = 0
    else:
        model, optimizer = runner.build()
        batches = runner.batches(m)
        tracker = _StepMemTracker()
        tracker.track_external(model, optimizer)
        with tracker:
            runner.run(model, optimizer, batches)
        peak, grads = tracker.peak()
    extra = runner.ddp_extra_bytes(model, m, grads)
    del model, optimizer
    return peak + extra


# ----------------------------------------------------------------------------- budget and entry points


def available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_budget(*, memory_gib: float, device: torch.device, local_processes: int) -> tuple[int, str]:
    """Per-rank budget in bytes and where it comes from."""
    if memory_gib > 0:
        return int(memory_gib * GIB), "batch.memory_gib"
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, f"memory of {torch.cuda.get_device_name(device)}"
    local = max(1, local_processes)
    return available_ram_bytes() // local, f"available RAM / {local} local process{'es' if local > 1 else ''}"


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
            agreed(checked, group) if agree else checked, per_rank_batch_size=runner.per_rank, max_trials=max_trials
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


def estimate_ranks(dims: ParallelDims) -> list[int]:
    """Ranks whose memory can differ: one per pipeline stage (pp is the outermost mesh dim)."""
    per_stage = dims.world_size // dims.pp
    return [s * per_stage for s in range(dims.pp)]


def estimate_without_group(
    cfg: Config, dims: ParallelDims, *, device: torch.device, local_processes: int, model=None, dataset=None, loss=None
) -> SearchResult:
    """The estimate in a process without a process group: fake groups emulate the layout's ranks."""
    rep = replica_dims(dims)
    results = []
    for rank in estimate_ranks(rep):
        with fake_process_group(rep.world_size, rank):
            results.append(
                find_micro_batch(
                    cfg,
                    dims,
                    device=device,
                    method="estimate",
                    local_processes=local_processes,
                    model=model,
                    dataset=dataset,
                    loss=loss,
                    agree=False,
                )
            )
    # The rank that fits least decides.
    return min(results, key=lambda r: (r.micro_batch_size or 0, -(r.peak_bytes or 0)))


def resolve_auto_micro_batch(
    cfg: Config, *, dims: ParallelDims, device: torch.device, model=None, dataset=None, loss=None
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
        reply = [result.micro_batch_size, result.table(), result]
    else:
        reply = [None, None, None]
        if rank == 0:
            if rep.world_size == 1:
                result = find_micro_batch(
                    cfg,
                    dims,
                    device=device,
                    method="estimate",
                    local_processes=local,
                    model=model,
                    dataset=dataset,
                    loss=loss,
                    agree=False,
                )
            else:
                result = _estimate_in_subprocess(cfg, dims, model=model, dataset=dataset, loss=loss)
            reply = [result.micro_batch_size, result.table(), result]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(reply, src=0)
    mbs, table, result = reply
    for line in table.splitlines():
        log.info("%s", line)
    if mbs is None:
        raise nothing_fits_error(result, dims)
    return plan_batch(global_batch_size=cfg.batch.global_batch_size, micro_batch_size=mbs, dp=dims.dp)


def _estimate_in_subprocess(cfg: Config, dims: ParallelDims, *, model, dataset, loss) -> SearchResult:
    if model is not None or dataset is not None or loss is not None:
        raise ConfigError(
            "batch.micro_batch_size = 'auto' with dp_shard/tp/pp > 1 and model/dataset/loss objects"
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
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    trials = [Trial(**t) for t in data["trials"]]
    return SearchResult(
        data["micro_batch_size"],
        data["peak_bytes"],
        data["budget_bytes"],
        data["usable_bytes"],
        data["method"],
        "subprocess",
        data["per_rank_batch_size"],
        trials,
    )


def cli_find_batch(cfg: Config, *, world_size: int, local_processes: int, estimate: bool, as_json: bool) -> int:
    """`paratrain find-batch`: real trials on a local CUDA device, else the fake-tensor estimate."""
    from paratrain.distributed.process_group import resolve_device
    from paratrain.trainer import check_layout

    dims, _ = check_layout(cfg, world_size)
    device = resolve_device(cfg.dist, 0)
    use_trial = (
        not estimate and device.type == "cuda" and cfg.batch.memory_gib <= 0 and replica_dims(dims).world_size == 1
    )
    if use_trial:
        # Replicas of one process hold the same memory on every GPU: one GPU answers for all.
        result = find_micro_batch(cfg, dims, device=device, method="trial", local_processes=local_processes)
    else:
        result = estimate_without_group(cfg, dims, device=device, local_processes=local_processes)
    print(result.table(), file=sys.stderr if as_json else sys.stdout)
    if as_json:
        print(json.dumps(result.to_json()))
    if result.micro_batch_size is None:
        raise nothing_fits_error(result, dims)
    return 0
