"""``paratrain verify``: does this layout compute what one process computes?

It runs the config's layout and the single-process reference (world 1, every parallel degree 1,
the same global batch, seed and data) for K steps through the launcher, then compares the
per-step losses and gradient norms of the two ``metrics.jsonl`` files and, at the end, every
parameter of the two ``model.safetensors`` files. The gradient norm (the whole model's, before
clipping) is what catches a layout whose gradient is off by a constant factor (a dropped dp
factor, a pipeline schedule's own 1/n): AdamW divides that factor out of every update and
clipping rescales it, so losses and post-Adam parameters can match while the gradient is wrong. The relative difference of a parameter is ``||a - b|| / ||b||``
(a norm over the whole tensor: robust to the few elements near zero). The first parameter past
the tolerance is named (in the order of the weights file, alphabetical). Exit 0 within tolerance, 1 otherwise (2 for bad
input, as everywhere). Run it before spending a cluster-day on a new layout.

``--layouts accum,ddp,fsdp,tp,pp,cp`` (or ``all``) instead runs a set of layouts of the config's
objective, a built-in or the user's own plug-in (docs/objectives.md), each against one process
that holds the whole global batch in one micro-batch, under plain SGD (the config's lr; no
momentum, decay, clipping or schedule: AdamW would hide a gradient off by a constant factor).
Each layout is world 1 or 2 with accumulation, so a normaliser formed per micro-batch or per rank
shows. A layout the run refuses (the objective does not declare it, preflight/support.py) is
listed with the refusal and skipped. A layout passes when its loss, gradient norm, item count and
parameters are within ``--tol``. The table gives, per layout, the worst difference over the
steps relative to the column's largest value (a value crossing zero is no false alarm) of the
loss, the gradient norm and every other column the objectives log (their terms and values:
``rewards_chosen``, ``kl``, ``aux_loss``..., naming the worst: the term that breaks), and of the
parameters at the end.
"""

from __future__ import annotations

import io
import json
import math
import os
import sys

from safetensors import safe_open
from safetensors.torch import load_file

from paratrain.config import ConfigError, load_config, plain_sgd
from paratrain.launch.agent import LaunchSpec, launch
from paratrain.preflight import check_run


def _toml_str(path: str) -> str:
    return json.dumps(path)  # a JSON string is a valid TOML basic string


def _read_rows(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a - b)


def compare_steps(rows: list[dict], ref_rows: list[dict], tol: float, out=sys.stdout) -> tuple[int | None, int | None]:
    """Print the per-step table; returns the first step whose loss, and whose grad_norm, is past tol."""
    print(
        f"{'step':>4}  {'reference loss':>16}  {'layout loss':>16}  {'rel diff':>9}"
        f"  {'ref grad_norm':>14}  {'grad_norm':>14}  {'rel diff':>9}",
        file=out,
    )
    first_loss = first_grad = None
    for i, (row, ref) in enumerate(zip(rows, ref_rows), start=1):
        dl, dg = _rel(row["loss"], ref["loss"]), _rel(row["grad_norm"], ref["grad_norm"])
        bad_loss, bad_grad = not math.isfinite(dl) or dl > tol, not math.isfinite(dg) or dg > tol
        if bad_loss and first_loss is None:
            first_loss = i
        if bad_grad and first_grad is None:
            first_grad = i
        print(
            f"{i:>4}  {ref['loss']:>16.8f}  {row['loss']:>16.8f}  {dl:>9.2e}"
            f"  {ref['grad_norm']:>14.8f}  {row['grad_norm']:>14.8f}  {dg:>9.2e}"
            f"{'  <- past tolerance' if bad_loss or bad_grad else ''}",
            file=out,
        )
    return first_loss, first_grad


def reference_overrides() -> list[str]:
    """What turns any layout into the single-process reference run."""
    return [
        "parallel.dp_replicate=1",
        "parallel.dp_shard=1",
        "parallel.tp=1",
        "parallel.pp=1",
        "parallel.cp=1",
        "parallel.ep=1",  # borrowed from dp (distributed/expert_parallel.py): one process has none
        "parallel.sequence_parallel=false",
        "parallel.cpu_offload=false",
    ]


# Below this root-mean-square a tensor is compared as zero: a parameter whose gradient is zero by
# symmetry (an attention key bias, which softmax ignores; CLIP's k_proj.bias in a LLaVA) keeps its
# zero init plus rounding noise of 1e-15, and relative to its own norm that noise is O(1) between
# layouts (paratrain verify of configs/vlm.toml: 0.7 on ddp, losses within 4e-8).
NEGLIGIBLE_RMS = 1e-8


def rel_diff(a, b) -> float:
    a, b = a.double(), b.double()
    den = max(b.norm().item(), NEGLIGIBLE_RMS * b.numel() ** 0.5)
    num = (a - b).norm().item()
    return num / den if den > 0 else num


def compare_parameters(
    layout_file: str, reference_file: str, tol: float, out=sys.stdout
) -> tuple[bool, str | None, float]:
    """Compare two model.safetensors; returns (all within tol, first parameter past it, the largest
    relative difference)."""

    ref = load_file(reference_file)
    got = load_file(layout_file)
    with safe_open(reference_file, "pt") as f:  # the file's order (sorted names)
        names = list(f.keys())
    missing = [n for n in names if n not in got]
    extra = [n for n in got if n not in ref]
    if missing or extra:
        print(f"parameters differ in names: missing {missing[:5]}, extra {extra[:5]}", file=out)
        return False, (missing or extra)[0], math.inf
    first, worst, worst_name = None, 0.0, None
    for n in names:
        if got[n].shape != ref[n].shape:
            print(f"parameter {n}: shape {tuple(got[n].shape)} != reference {tuple(ref[n].shape)}", file=out)
            return False, n, math.inf
        d = rel_diff(got[n], ref[n])
        if not math.isfinite(d) or d > tol:
            first = first or n
        if not math.isfinite(d) or d > worst:
            worst, worst_name = d, n
    print(f"parameters: {len(names)} compared, largest relative difference {worst:.2e} ({worst_name})", file=out)
    return first is None, first, worst


def verify(
    config: str, overrides: list[str], *, spec, steps: int, tol: float, out_dir: str = "", out=sys.stdout
) -> int:
    """Run layout and reference, print the comparison; returns the exit code."""

    if steps < 1:
        raise ConfigError("--steps must be >= 1")
    if not tol > 0:
        raise ConfigError("--tol must be > 0")
    cfg = load_config(config, overrides)
    dims, _ = check_run(cfg, spec.world_size)  # refuse an impossible layout before starting
    ref_cfg = load_config(config, [*overrides, *reference_overrides()])
    check_run(ref_cfg, 1)
    root = out_dir or os.path.join(cfg.run.out_dir, "verify")
    # Both runs start fresh and leave no checkpoints (they would share checkpoint.dir).
    common = [
        f"run.steps={steps}",
        "run.save_model=true",
        "run.progress=false",
        "metrics.plot=false",
        "checkpoint.interval=0",
        "checkpoint.at_end=false",
        "checkpoint.resume=''",
    ]
    runs = {
        "layout": (spec, [*overrides, *common, f"run.out_dir={_toml_str(os.path.join(root, 'layout'))}"]),
        "reference": (
            LaunchSpec(),
            [*overrides, *reference_overrides(), *common, f"run.out_dir={_toml_str(os.path.join(root, 'reference'))}"],
        ),
    }
    print(
        f"verify: {dims.describe()} against the single-process reference, {steps} steps,"
        f" tolerance {tol:.0e} (outputs in {root})",
        file=out,
        flush=True,
    )
    for name, (run_spec, sets) in runs.items():
        rc = launch(run_spec, "paratrain.launch.worker", [config] + [a for s in sets for a in ("--set", s)])
        if rc != 0:
            print(f"paratrain: error: the {name} run failed with exit code {rc}", file=sys.stderr)
            return rc

    ref_rows = _read_rows(os.path.join(root, "reference"))
    rows = _read_rows(os.path.join(root, "layout"))
    ok = len(rows) == len(ref_rows) == steps
    first_step, first_grad = compare_steps(rows, ref_rows, tol, out)
    params_ok, first_param, _ = compare_parameters(
        os.path.join(root, "layout", "model.safetensors"),
        os.path.join(root, "reference", "model.safetensors"),
        tol,
        out,
    )
    ok = ok and first_step is None and first_grad is None and params_ok
    if ok:
        print("verify: OK, the layout matches the single-process reference", file=out)
        return 0
    what = []
    if first_grad is not None:
        what.append(f"the gradient norm differs from step {first_grad}")
    if first_step is not None:
        what.append(f"the loss diverges from step {first_step}")
    if first_param is not None:
        what.append(f"first parameter past tolerance: {first_param}")
    print(f"verify: FAILED, {'; '.join(what) or 'the runs differ in length'}", file=out)
    return 1


# The layouts of ``--layouts``: (world size, parallel overrides, micro-batches per global batch
# over the whole world). Two or more micro-batches per rank, so a per-micro-batch normaliser shows;
# data parallel with two ranks, so a per-rank one does.
LAYOUTS = {
    "accum": (1, [], 4),
    "ddp": (2, ["parallel.dp_replicate=2"], 4),
    "fsdp": (2, ["parallel.dp_shard=2"], 4),
    "tp": (2, ["parallel.tp=2"], 2),
    "pp": (2, ["parallel.pp=2", "parallel.pp_microbatches=2"], 2),
    "cp": (2, ["parallel.cp=2"], 2),
}
# Columns that differ between layouts by design (the layout, times, memory), never compared.
_LAYOUT_COLUMNS = {
    "step", "lr", "world_size", "micro_batch_size", "accum_steps", "global_batch_size", "consumed_samples",
    "epoch", "time", "mfu", "comm_bytes", "straggler", "memory_rank", "tokens", "loss_scale",
}  # fmt: skip


_JUDGED = ("steps", "loss", "grad_norm", "items")


def compared_columns(row: dict) -> list[str]:
    """The columns of a metrics row that every layout must reproduce: the loss, the gradient norm,
    the item count and every value the objectives log."""
    return [
        k
        for k, v in row.items()
        if isinstance(v, (int, float)) and k not in _LAYOUT_COLUMNS and not k.endswith(("_s", "_per_s", "_gib"))
    ]


def worst_columns(rows: list[dict], ref_rows: list[dict]) -> dict[str, float]:
    """Per compared column, the largest difference over the steps relative to the column's largest
    reference value (inf for a missing one): a value that crosses zero (a DPO reward at step 1,
    -4e-5) would make a step's own relative difference large from rounding alone, as a parameter's
    near-zero elements would (hence its norm-wise difference above)."""
    diff: dict[str, float] = {}
    size: dict[str, float] = {}
    for row, ref in zip(rows, ref_rows):
        for k in compared_columns(ref):
            d = abs(row[k] - ref[k]) if isinstance(row.get(k), (int, float)) else math.inf
            diff[k] = max(diff.get(k, 0.0), d if math.isfinite(d) else math.inf)
            size[k] = max(size.get(k, 0.0), abs(ref[k]))
    return {k: (d / size[k] if size[k] else d) for k, d in diff.items()}


def verify_layouts(
    config: str, overrides: list[str], names: list[str], *, steps: int, tol: float, out_dir: str = "", out=sys.stdout
) -> int:
    """``--layouts``: every named layout against the one-process reference (module docstring)."""
    if steps < 1:
        raise ConfigError("--steps must be >= 1")
    if not tol > 0:
        raise ConfigError("--tol must be > 0")
    names = list(LAYOUTS) if names == ["all"] else names
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        raise ConfigError(f"--layouts: unknown {', '.join(unknown)}; choose from all, {', '.join(LAYOUTS)}")
    cfg = load_config(config, overrides)
    gbs, sgd = cfg.batch.global_batch_size, plain_sgd(cfg.optim.lr)
    root = out_dir or os.path.join(cfg.run.out_dir, "verify")
    common = [*overrides, *reference_overrides(), *sgd, f"run.steps={steps}", "run.save_model=true"]
    common += ["run.progress=false", "metrics.plot=false", "checkpoint.interval=0", "checkpoint.at_end=false"]
    common += ["checkpoint.resume=''"]
    runs = {"reference": (1, [*common, f"batch.micro_batch_size={gbs}"])}
    check_run(load_config(config, runs["reference"][1]), 1)  # a refused reference: exit 2 before any run
    refused: dict[str, str] = {}
    for name in names:
        world, parallel, pieces = LAYOUTS[name]
        if gbs % pieces:
            refused[name] = f"batch.global_batch_size = {gbs} is not {pieces} micro-batches"
            continue
        sets = [*common, *parallel, f"batch.micro_batch_size={gbs // pieces}"]
        try:
            check_run(load_config(config, sets), world)
        except ConfigError as e:  # not a layout this objective declares: said, then skipped
            refused[name] = str(e)
            continue
        runs[name] = (world, sets)
    if len(runs) == 1:  # every layout refused: nothing to compare, so no run and no "OK"
        for name, why in refused.items():
            print(f"{name:<7} refused: {why}", file=out)
        print("verify: nothing verified, every layout asked for is refused", file=out)
        return 1
    print(
        f"verify: {cfg.loss.name} on {', '.join(n for n in runs if n != 'reference')} against one"
        f" process, plain SGD (lr {cfg.optim.lr:g}), {steps} steps, tolerance {tol:.0e} (outputs in {root})",
        file=out,
        flush=True,
    )
    crashed: dict[str, int] = {}
    for name, (world, sets) in runs.items():
        run_dir = os.path.join(root, name)
        argv = [config] + [a for s in [*sets, f"run.out_dir={_toml_str(run_dir)}"] for a in ("--set", s)]
        rc = launch(LaunchSpec(nproc_per_node=world), "paratrain.launch.worker", argv)
        if rc != 0 and name == "reference":
            print(f"paratrain: error: the one-process reference failed with exit code {rc}", file=sys.stderr)
            return rc
        if rc != 0:  # the others are still worth running: the table says which layouts fail
            crashed[name] = rc
    return _layout_table(runs, refused, crashed, root, steps=steps, tol=tol, out=out)


def _layout_table(
    runs: dict, refused: dict[str, str], crashed: dict[str, int], root: str, *, steps: int, tol: float, out
) -> int:
    ref_rows = _read_rows(os.path.join(root, "reference"))
    print(f"{'layout':<7} {'world':>5}  {'loss':>9}  {'grad_norm':>9}  {'params':>9}  worst other column", file=out)
    failed = [f"{name} (exit code {rc})" for name, rc in crashed.items()]
    for name, (world, _) in runs.items():
        if name == "reference" or name in crashed:
            continue
        rows = _read_rows(os.path.join(root, name))
        worst = worst_columns(rows, ref_rows) if len(rows) == len(ref_rows) == steps else {"steps": math.inf}
        params_ok, _, params = compare_parameters(
            os.path.join(root, name, "model.safetensors"),
            os.path.join(root, "reference", "model.safetensors"),
            tol,
            io.StringIO(),
        )
        others = {k: v for k, v in worst.items() if k not in _JUDGED}
        other = max(others.items(), key=lambda kv: kv[1], default=None)
        # Judged: the loss, the gradient, the count and the weights. The other columns locate a
        # failure (the term that breaks); a value formed by cancellation (a DPO margin: a difference
        # of differences of sums of hundreds) can show float rounding past --tol on its own.
        bad = [k for k in _JUDGED if not worst.get(k, 0.0) <= tol] + ([] if params_ok else ["parameters"])
        print(
            f"{name:<7} {world:>5}  {worst.get('loss', math.inf):>9.2e}  {worst.get('grad_norm', math.inf):>9.2e}"
            f"  {params:>9.2e}  {f'{other[0]} {other[1]:.2e}' if other else '-'}{'  <- ' + ', '.join(bad) if bad else ''}",
            file=out,
        )
        if bad:
            failed.append(f"{name} ({', '.join(bad)})")
    for name, rc in crashed.items():
        print(f"{name:<7} failed with exit code {rc} (its error is above)", file=out)
    for name, why in refused.items():
        print(f"{name:<7} refused: {why}", file=out)
    if failed:
        print(f"verify: FAILED past tolerance {tol:.0e}: {'; '.join(failed)}", file=out)
        return 1
    print("verify: OK, every layout run matches the single-process reference", file=out)
    return 0
