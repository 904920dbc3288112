"""``paratrain verify``: does this layout compute what one process computes?

It runs the config's layout and the single-process reference (world 1, every parallel degree 1,
the same global batch, seed and data) for K steps through the launcher, then compares the
per-step losses of the two ``metrics.jsonl`` files and, at the end, every parameter of the two
``model.safetensors`` files. The relative difference of a parameter is ``||a - b|| / ||b||``
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
from paratrain.launch import LaunchSpec, launch
from paratrain.layout import check_layout


def _toml_str(path: str) -> str:
    return json.dumps(path)  # a JSON string is a valid TOML basic string


def _read_losses(out_dir: str) -> list[float]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f if line.strip()]


def reference_overrides() -> list[str]:
    """What turns any layout into the single-process reference run."""
    return [
        "parallel.dp_replicate=1",
        "parallel.dp_shard=1",
        "parallel.tp=1",
        "parallel.pp=1",
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
    dims, _ = check_layout(cfg, spec.world_size)  # refuse an impossible layout before starting
    ref_cfg = load_config(config, [*overrides, *reference_overrides()])
    check_layout(ref_cfg, 1)
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
        rc = launch(run_spec, "paratrain.worker", [config] + [a for s in sets for a in ("--set", s)])
        if rc != 0:
            print(f"paratrain: error: the {name} run failed with exit code {rc}", file=sys.stderr)
            return rc

    ref_losses = _read_losses(os.path.join(root, "reference"))
    losses = _read_losses(os.path.join(root, "layout"))
    ok = len(losses) == len(ref_losses) == steps
    print(f"{'step':>4}  {'reference loss':>16}  {'layout loss':>16}  {'rel diff':>9}", file=out)
    first_step = None
    for i, (a, b) in enumerate(zip(losses, ref_losses), start=1):
        d = abs(a - b) / abs(b) if b else abs(a - b)
        bad = not math.isfinite(d) or d > tol
        if bad and first_step is None:
            first_step = i
        print(f"{i:>4}  {b:>16.8f}  {a:>16.8f}  {d:>9.2e}{'  <- past tolerance' if bad else ''}", file=out)
    params_ok, first_param = compare_parameters(
        os.path.join(root, "layout", "model.safetensors"),
        os.path.join(root, "reference", "model.safetensors"),
        tol,
        out,
    )
    ok = ok and first_step is None and params_ok
    if ok:
        print("verify: OK, the layout matches the single-process reference", file=out)
        return 0
    what = []
    if first_step is not None:
        what.append(f"the loss diverges from step {first_step}")
    if first_param is not None:
        what.append(f"first parameter past tolerance: {first_param}")
    print(f"verify: FAILED, {'; '.join(what) or 'the runs differ in length'}", file=out)
    return 1
