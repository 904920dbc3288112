"""The parallelisms' checks that need only the config: the launcher's preflight runs them before
any process starts (preflight/__init__.py ``check_run``), and the modules that apply each
parallelism use the same tables.

Light on purpose: torch (``nn`` only) and paratrain's config, none of torch.distributed's
pipelining, FSDP2, DTensor or checkpoint modules that the ``apply_*`` modules import (``paratrain
train`` reads this in the launcher, which then only starts the workers; tests/e2e/test_startup.py).
Each check sits here, not in its parallelism's module: ``check_pp_layout`` and the schedule table
for pipeline_parallel.py, ``STYLE_NAMES`` for tensor_parallel.py, ``check_parallel_layout`` for
parallelize.py, ``check_compression`` for grad_compression.py (each re-exports its own).
"""

from __future__ import annotations

import math

from torch import nn

from paratrain.config import CommConfig, ConfigError, ParallelConfig
from paratrain.distributed.blocks import BLOCKS_ATTR, blocks_container
from paratrain.distributed.parallel_dims import ParallelDims

# ----------------------------------------------------------------------------- the layout (parallelize.py)


def check_parallel_layout(dims: ParallelDims, *, parallel: ParallelConfig) -> None:
    """Every check of the parallel layout that needs only the config: run in the launcher, before
    any process or process group starts. Raises ConfigError naming the key and the fix."""
    if parallel.sequence_parallel and dims.tp == 1:
        raise ConfigError(
            "parallel.sequence_parallel = true needs tensor parallelism; set parallel.tp > 1"
            " or parallel.sequence_parallel = false"
        )
    if parallel.cpu_offload and dims.dp_shard == 1:
        raise ConfigError(
            "parallel.cpu_offload = true offloads FSDP2 shards; set parallel.dp_shard > 1"
            " or parallel.cpu_offload = false"
        )
    if parallel.tp_plan and parallel.tp_plan_factory:
        raise ConfigError("parallel.tp_plan and parallel.tp_plan_factory are both set; keep one of them")
    for pattern, style in parallel.tp_plan.items():
        if style not in STYLE_NAMES:
            raise ConfigError(
                f"parallel.tp_plan.{pattern} = {style!r} is not a tensor-parallel style;"
                f" use one of {', '.join(STYLE_NAMES)}"
            )


# ----------------------------------------------------------------------------- tensor parallel

# Style names a [parallel.tp_plan] table may use, and what each one is.
STYLE_NAMES = {
    "colwise": "split output features; input replicated, output sharded on the last dim",
    "rowwise": "split input features; input sharded on the last dim, output replicated (all-reduce)",
    "colwise_gather": "colwise with the output gathered (replicated), e.g. an output layer",
    "sequence": "a norm/pointwise module on sequence-sharded activations (dim 1)",
    "rowwise_to_sequence": "rowwise whose output is reduce-scattered along the sequence (dim 1)",
    "sequence_to_colwise": "colwise whose input comes sequence-sharded (dim 1) and is all-gathered",
}


# ----------------------------------------------------------------------------- pipeline parallel

# name -> (torch class name, stages per rank it needs: None = any, style of the stage-to-rank map)
SCHEDULES: dict[str, tuple[str, int | None, str]] = {
    "gpipe": ("ScheduleGPipe", 1, "loop"),
    "1f1b": ("Schedule1F1B", 1, "loop"),
    "interleaved1f1b": ("ScheduleInterleaved1F1B", None, "loop"),
    "looped_bfs": ("ScheduleLoopedBFS", None, "loop"),
    "interleaved_zb": ("ScheduleInterleavedZeroBubble", None, "loop"),
    "zbv": ("ScheduleZBVZeroBubble", 2, "v"),
    "dualpipev": ("ScheduleDualPipeV", 2, "v"),
}


# ----------------------------------------------------------------------------- layout checks


def virtual_stages(cfg: ParallelConfig) -> int:
    """Stages per pipeline rank: the configured value, or what the schedule needs."""
    if cfg.pp_virtual_stages:
        return cfg.pp_virtual_stages
    return SCHEDULES[cfg.pp_schedule][1] or 2


def _schedule_problem(schedule: str, *, n: int, pp: int, stages: int) -> str | None:
    """Why ``n`` pipeline micro-batches per step do not suit ``schedule`` (None when they do).

    torch 2.13's own conditions (its schedules raise ValueError otherwise); gpipe, looped_bfs,
    interleaved_zb and zbv take any n >= 1 (zbv and interleaved_zb checked at n = 1, pp = 2).
    """
    if schedule == "1f1b" and n < pp:
        return f"1f1b needs at least pp = {pp}"
    if schedule == "dualpipev" and n < stages:
        return f"dualpipev needs at least pp x 2 = {stages}"
    if schedule in ("interleaved1f1b", "interleaved_zb"):
        rounds = max(1, n // pp)
        if n % rounds:
            return f"{schedule} needs a multiple of its rounds, max(1, n // pp) = {rounds}"
    return None


def pp_microbatches(cfg: ParallelConfig, *, pp: int, micro_batch_size: int, accum_steps: int) -> int:
    """Pipeline micro-batches per micro-batch: the configured count or the fewest that work."""
    stages = pp * virtual_stages(cfg)
    if cfg.pp_microbatches:
        return cfg.pp_microbatches
    for m in range(1, micro_batch_size + 1):
        # At least pp in flight per step, else some stage idles for the whole step.
        if (
            micro_batch_size % m == 0
            and m * accum_steps >= pp
            and _schedule_problem(cfg.pp_schedule, n=m * accum_steps, pp=pp, stages=stages) is None
        ):
            return m
    raise ConfigError(
        f"no parallel.pp_microbatches dividing batch.micro_batch_size = {micro_batch_size} gives"
        f" {cfg.pp_schedule} enough pipeline micro-batches at pp = {pp}; raise batch.micro_batch_size"
        f" (e.g. to {micro_batch_size * pp})"
    )


ZERO_BUBBLE = ("interleaved_zb", "zbv", "dualpipev")


def too_few_blocks(cfg: ParallelConfig, *, pp: int, n_blocks: int) -> str:
    """The line for more pipeline stages than blocks (every stage needs one), naming only what the
    user can change: zbv and dualpipev fix 2 stages per rank, gpipe and 1f1b one, and an unset
    parallel.pp_virtual_stages is the schedule's default (it said "lower parallel.pp or
    parallel.pp_virtual_stages" to a zbv user who had set no virtual stages)."""
    v, fixed = virtual_stages(cfg), SCHEDULES[cfg.pp_schedule][1]
    per_rank = "the schedule's" if fixed else ("parallel.pp_virtual_stages" if cfg.pp_virtual_stages else "the default")
    fixes = [f"parallel.pp <= {n_blocks // v}" if n_blocks // v >= 2 else "parallel.pp = 1"]
    if fixed is None and n_blocks // pp >= 2:
        fixes.append(f"parallel.pp_virtual_stages <= {n_blocks // pp}")
    elif v > 1 and pp <= n_blocks:
        fixes.append("a schedule of one stage per rank ('1f1b' or 'gpipe')")
    fixes.append(f"a model of at least {pp * v} blocks")
    return (
        f"parallel.pp = {pp} x {v} stage(s) per rank ({per_rank} for pp_schedule = '{cfg.pp_schedule}')"
        f" gives {pp * v} pipeline stages but the model has {n_blocks} blocks (every stage needs one);"
        f" use {' or '.join(fixes)}"
    )


def check_pp_layout(
    cfg: ParallelConfig,
    *,
    pp: int,
    micro_batch_size: int,
    accum_steps: int,
    n_blocks: int | None,
    dp_replicate: int = 1,
    dp_shard: int = 1,
) -> None:
    """Refuse an impossible pipeline layout with one line naming the key and the fix.

    Runs before any process group exists (``preflight.check_run``). ``n_blocks`` is the length
    of the model's ``layers`` (None when unknown: then apply_pp checks it at start).
    """
    v = virtual_stages(cfg)
    kind = SCHEDULES[cfg.pp_schedule][1]
    if v < 1:
        raise ConfigError(
            f"parallel.pp_virtual_stages = {cfg.pp_virtual_stages} must be >= 1 (or 0 for the schedule's default)"
        )
    if kind is not None and v != kind:
        fix = "use parallel.pp_schedule = 'interleaved1f1b' for several stages per rank" if kind == 1 else "leave it 0"
        raise ConfigError(
            f"parallel.pp_virtual_stages = {v} does not suit parallel.pp_schedule = '{cfg.pp_schedule}',"
            f" which runs {kind} stage(s) per rank; set it to {kind} or {fix}"
        )
    if cfg.pp_schedule in ZERO_BUBBLE and dp_shard == 1 and dp_replicate > 1:
        # Zero-bubble schedules compute weight gradients in a separate pass with autograd.grad,
        # which never runs the accumulation hooks DDP reduces from: the replicas drift apart
        # (1e-3 relative loss error after two steps against the reference, CPU/gloo, torch 2.13).
        raise ConfigError(
            f"parallel.pp_schedule = '{cfg.pp_schedule}' splits the backward into input and weight passes,"
            f" whose gradients replicated data parallel (parallel.dp_replicate = {dp_replicate}) does not reduce;"
            " use 'gpipe', '1f1b' or 'interleaved1f1b', or shard instead (parallel.dp_shard)"
        )
    if cfg.pp_schedule in ZERO_BUBBLE and dp_shard > 1 and cfg.reshard_after_forward:
        # With FSDP2 resharding after forward, the gradients of the deferred weight passes come
        # out wrong (2e-4 relative loss error after two steps); kept unsharded (ZeRO-2-like) they
        # match the reference exactly, FSDP and HSDP alike.
        raise ConfigError(
            f"parallel.pp_schedule = '{cfg.pp_schedule}' with parallel.dp_shard = {dp_shard} needs"
            " parallel.reshard_after_forward = false (its deferred weight passes need the unsharded"
            " parameters); set it, or use 'gpipe', '1f1b' or 'interleaved1f1b'"
        )
    if cfg.pp_schedule in ZERO_BUBBLE and cfg.activation_checkpointing == "selective":
        # The deferred weight pass is a second backward through the block, which torch's selective
        # checkpointing refuses ("Trying to backward an extra time", torch 2.13; found by
        # benchmarks/parallel/plan_accuracy.py training every layout `paratrain plan` proposed).
        raise ConfigError(
            f"parallel.pp_schedule = '{cfg.pp_schedule}' runs a second backward for the weights, which"
            " parallel.activation_checkpointing = 'selective' does not allow; use 'full' or 'none', or"
            " 'gpipe', '1f1b' or 'interleaved1f1b'"
        )
    if cfg.pp_microbatches < 0:
        raise ConfigError(
            f"parallel.pp_microbatches = {cfg.pp_microbatches} must be >= 1 (or 0 for the schedule's default)"
        )
    stages = pp * v
    if n_blocks is not None and stages > n_blocks:
        raise ConfigError(too_few_blocks(cfg, pp=pp, n_blocks=n_blocks))
    m = pp_microbatches(cfg, pp=pp, micro_batch_size=micro_batch_size, accum_steps=accum_steps)
    if micro_batch_size % m:
        raise ConfigError(
            f"parallel.pp_microbatches = {m} does not divide batch.micro_batch_size = {micro_batch_size};"
            f" set it to a divisor of {micro_batch_size}"
        )
    problem = _schedule_problem(cfg.pp_schedule, n=m * accum_steps, pp=pp, stages=stages)
    if problem:
        raise ConfigError(
            f"parallel.pp_microbatches = {m} x accum_steps {accum_steps} = {m * accum_steps} pipeline micro-batches"
            f" per step: {problem}; raise parallel.pp_microbatches (or set it to 0)"
        )
    points = cfg.pp_split_points
    if points:
        if not all(isinstance(p, int) and not isinstance(p, bool) for p in points):
            raise ConfigError(f"parallel.pp_split_points = {points!r} must be a list of block indices (integers)")
        if len(points) != stages - 1:
            raise ConfigError(
                f"parallel.pp_split_points = {points} has {len(points)} entries but {stages} stages need"
                f" {stages - 1}; give one block index per stage boundary, or [] to balance by parameter count"
            )
        upper = n_blocks if n_blocks is not None else math.inf
        if any(b <= a for a, b in zip([0, *points], [*points, upper])):
            limit = f"1 .. {n_blocks - 1}" if n_blocks is not None else ">= 1"
            raise ConfigError(
                f"parallel.pp_split_points = {points} must be strictly increasing block indices within {limit}"
                f" (every stage needs a block); fix them or use [] to balance by parameter count"
            )


def check_untied(model: nn.Module, *, blocks_attr: str = BLOCKS_ATTR) -> None:
    """Refuse parameters shared between blocks or head/tail modules (e.g. tied embeddings).

    Every stage holds its own copy of its modules, so a parameter tied across two of them would
    become two parameters, trained apart, on different stages.
    """
    owners: dict[int, str] = {}
    units = [(f"{blocks_attr}.{k}", m) for k, m in _blocks(model, blocks_attr)._modules.items()]
    units += [(k, m) for k, m in model._modules.items() if k != blocks_attr and m is not None]
    for unit, module in units:
        for name, p in module.named_parameters(remove_duplicate=False):
            first = owners.setdefault(id(p), f"{unit}.{name}")
            if not first.startswith(unit + "."):
                raise ConfigError(
                    f"parallel.pp > 1 cannot split a model whose parameter {first} is shared with {unit}.{name}"
                    " (tied weights); untie them or set parallel.pp = 1"
                )


def _blocks(model: nn.Module, blocks_attr: str) -> nn.Module:
    layers = blocks_container(model, blocks_attr)
    if layers is None:
        raise ConfigError(
            f"parallel.pp > 1 needs a model whose blocks are in a '{blocks_attr}' ModuleList/ModuleDict/Sequential"
            f" ({type(model).__name__} has none); restructure the model or set parallel.pp = 1"
        )
    return layers


# ----------------------------------------------------------------------------- gradient compression


def check_compression(cfg: CommConfig, *, dp_replicate: int, dp_shard: int, tp: int = 1, pp: int = 1) -> None:
    """Refuse, before any process starts, a compression the layout cannot apply."""
    if cfg.compression != "none" and pp > 1 and dp_shard == 1:
        raise ConfigError(
            f"comm.compression = {cfg.compression!r} is not applied to pipeline stages;"
            " set comm.compression = 'none' with parallel.pp > 1 (or shard with parallel.dp_shard)"
        )
    if cfg.compression != "none" and tp > 1 and dp_shard == 1 and dp_replicate > 1:
        # dp_replicate x tp runs torch's FSDP2-based replicate (DDP cannot hold DTensors), which
        # takes no DDP communication hook.
        raise ConfigError(
            f"comm.compression = {cfg.compression!r} needs DDP or FSDP2; with parallel.tp = {tp}"
            " shard the data-parallel dimension (parallel.dp_shard) or set comm.compression = 'none'"
        )
    if cfg.compression == "powersgd":
        if dp_shard > 1:
            raise ConfigError(
                f"comm.compression = 'powersgd' cannot work with parallel.dp_shard = {dp_shard}: FSDP2's"
                " reduce-scatter takes no communication hook; use comm.compression = 'bf16' or set parallel.dp_shard = 1"
            )
        if cfg.powersgd_start_step < 2:
            # DDP rebuilds its buckets after the first iteration, and PowerSGD's error feedback is
            # keyed by bucket: torch refuses a start before the second step.
            raise ConfigError(
                f"comm.powersgd_start_step = {cfg.powersgd_start_step} must be >= 2 (PowerSGD with"
                " error feedback can only start once DDP's buckets are final)"
            )


# run.bitwise (distributed/bitwise.py, docs/bitwise.md): here, not there, because the launcher's
# preflight runs it and bitwise.py imports FSDP2 and DTensor (tests/e2e/test_startup.py).
def check_grains(*, grain: int, micro_batch_size: int, per_rank: int, dp: int, eval_micro_batch_size: int = 0) -> None:
    """The layouts whose tree is the one tree: one line (ConfigError) for any other.
    ``eval_micro_batch_size``: validation's micro-batch, run in grains too (0: not checked)."""
    if grain <= 0:
        raise ConfigError("run.bitwise = true needs run.bitwise_grain, the rows of each backward: set it to an int > 0")
    if micro_batch_size % grain:
        raise ConfigError(
            f"run.bitwise_grain = {grain} must divide batch.micro_batch_size = {micro_batch_size}: set the micro-batch"
            f" to a multiple of {grain} (or a smaller grain)"
        )
    if eval_micro_batch_size % grain:
        raise ConfigError(
            f"run.bitwise_grain = {grain} must divide eval.micro_batch_size = {eval_micro_batch_size} (validation runs"
            f" in grains too): set it to a multiple of {grain}, or 0 (the training micro-batch)"
        )
    grains = per_rank // grain
    if not _power_of_two(grains) or not _power_of_two(dp):
        raise ConfigError(
            f"run.bitwise sums the grains in one binary tree: the grains per rank ({per_rank} rows / run.bitwise_grain"
            f" = {grains}) and the data-parallel ranks ({dp}) must be powers of two; change"
            " batch.global_batch_size, run.bitwise_grain or the number of processes"
        )


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
