"""Start a job through torchrun's own launcher (torch.distributed.run and its elastic agent)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from paratrain.config import ConfigError


@dataclass(frozen=True)
class LaunchSpec:
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""
    max_restarts: int = 0

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    def validate(self) -> None:
        if self.nproc_per_node < 1 or self.nnodes < 1:
            raise ConfigError("--nproc-per-node and --nnodes must be >= 1")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ConfigError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
        if self.max_restarts < 0:
            raise ConfigError("--max-restarts must be >= 0")


def torchrun_args(spec: LaunchSpec, module: str, module_args: list[str]) -> list[str]:
    args = [
        "--nproc-per-node",
        str(spec.nproc_per_node),
        "--nnodes",
        str(spec.nnodes),
        "--max-restarts",
        str(spec.max_restarts),
    ]
    if spec.rdzv_endpoint:
        # c10d rendezvous: ranks follow arrival order, --node-rank is only a hint to it.
        args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", spec.rdzv_endpoint, "--node-rank", str(spec.node_rank)]
    else:
        args += ["--standalone"]  # one node, rendezvous on a free local port
    return args + ["--module", module, *module_args]


def launch(spec: LaunchSpec, module: str, module_args: list[str]) -> int:
    """Run ``python -m module module_args`` on ``spec``'s processes; returns the exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    spec.validate()
    if spec.max_restarts > 0:
        # pytorch#135712: on torch 2.13 restarted workers often hang in init_process_group when
        # they share the agent's rendezvous TCP store; a store of their own avoids it.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    args = get_args_parser().parse_args(torchrun_args(spec, module, module_args))
    try:
        run(args)
    except ChildFailedError as e:
        codes = sorted({f.exitcode for f in e.failures.values()})
        first_rank = min(e.failures)  # keyed by global rank
        print(
            f"paratrain: error: worker rank {first_rank} failed with exit code {codes[0]} (see its log above)",
            file=sys.stderr,
        )
        return 2 if codes == [2] else 1
    return 0
