"""`paratrain plan`: the best layout for a model and a cluster, predicted without the cluster.

enumerate.py lists the layouts the trainer's preflight accepts, cost.py prices their step
time term by term on a hardware profile (profile.py), memory.py estimates each one's peak
memory per rank with find-batch's fake-tensor estimator, planner.py ranks them. docs/plan.md.
"""

from __future__ import annotations

import json
import sys

from paratrain.config import Config, ConfigError
from paratrain.plan.planner import PlanResult, nothing_fits_error, plan
from paratrain.plan.profile import calibrate, get_profile, profile_names

__all__ = ["PlanResult", "cli_plan", "plan", "profile_names", "get_profile", "calibrate"]


def cli_plan(
    cfg: Config,
    *,
    nproc_per_node: int,
    nnodes: int,
    hardware: str,
    calibrate_files: list[str],
    memory_gib: float,
    top: int,
    as_json: bool,
) -> int:
    if nproc_per_node < 1 or nnodes < 1:
        raise ConfigError("--nproc-per-node and --nnodes must be >= 1")
    if memory_gib < 0:
        raise ConfigError("--memory-gib must be >= 0 (GiB per rank; 0: the hardware profile's memory)")
    if top < 1:
        raise ConfigError("--top must be >= 1")
    profile = get_profile(hardware)
    if calibrate_files:
        profile = calibrate(profile, calibrate_files)
    result = plan(
        cfg,
        world_size=nproc_per_node * nnodes,
        nproc_per_node=nproc_per_node,
        profile=profile,
        memory_gib=memory_gib,
        top=top,
    )
    print(result.table(), file=sys.stderr if as_json else sys.stdout)
    if as_json:
        print(json.dumps(result.to_json()))
    if not result.layouts:
        raise nothing_fits_error(result)
    return 0
