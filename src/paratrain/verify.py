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
"""

from __future__ import annotations

import json
import math
import os
import sys

from safetensors import safe_open
from safetensors.torch import load_file

from paratrain.config import ConfigError, load_config
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


def rel_diff(a, b) -> float:
    a, b = a.double(), b.double()
    den = b.norm().item()
    num = (a - b).norm().item()
    return num / den if den > 0 else num


def compare_parameters(layout_file: str, reference_file: str, tol: float, out=sys.stdout) -> tuple[bool, str | None]:
    """Compare two model.safetensors; returns (all within tol, first parameter past it)."""

    ref = load_file(reference_file)
    got = load_file(layout_file)
    with safe_open(reference_file, "pt") as f:  # the file's order (sorted names)
        names = list(f.keys())
    missing = [n for n in names if n not in got]
    extra = [n for n in got if n not in ref]
    if missing or extra:
        print(f"parameters differ in names: missing {missing[:5]}, extra {extra[:5]}", file=out)
        return False, (missing or extra)[0]
    first, worst, worst_name = None, 0.0, None
    for n in names:
        if got[n].shape != ref[n].shape:
            print(f"parameter {n}: shape {tuple(got[n].shape)} != reference {tuple(ref[n].shape)}", file=out)
            return False, n
        d = rel_diff(got[n], ref[n])
        if not math.isfinite(d) or d > tol:
            first = first or n
        if not math.isfinite(d) or d > worst:
            worst, worst_name = d, n
    print(f"parameters: {len(names)} compared, largest relative difference {worst:.2e} ({worst_name})", file=out)
    return first is None, first


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
    params_ok, first_param = compare_parameters(
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
