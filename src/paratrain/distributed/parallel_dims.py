"""ParallelDims: the parallel degrees, their validation, and the named DeviceMesh (built lazily).

Mesh dimensions are ordered outermost to innermost ``pp, dp_replicate, dp_shard, cp, tp`` so
that tensor parallelism, the most communication-hungry, gets neighbouring ranks (same node), and
context parallelism's ring the next nearest, as in torchtitan. Only degrees above 1 become mesh
dimensions; the data-parallel ranks of all kinds are flattened into one ``dp`` sub-mesh, the one that loads distinct data and reduces the loss.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from paratrain.config import ConfigError, ParallelConfig

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int
    cp: int = 1  # context parallel (distributed/context_parallel.py)
    # Expert parallelism borrows its ranks from dp (not a mesh dimension of its own): see ep_mesh.
    ep: int = 1

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        dp_shard, dp_replicate = cfg.dp_shard, cfg.dp_replicate
        if dp_shard == -1:  # sharding fills the world (elastic jobs: any node count)
            fixed = (dp_replicate if dp_replicate > 0 else 1) * cfg.tp * cfg.pp * cfg.cp
            if world_size % fixed:
                raise ConfigError(
                    f"world size {world_size} is not divisible by dp_replicate x tp {cfg.tp} x pp {cfg.pp}"
                    f"{f' x cp {cfg.cp}' if cfg.cp > 1 else ''} = {fixed}"
                    " (parallel.dp_shard = -1 fills the rest); change the degrees or the number of processes"
                )
            dp_shard, dp_replicate = world_size // fixed, max(dp_replicate, 1)
        others = dp_shard * cfg.tp * cfg.pp * cfg.cp
        if dp_replicate == -1:
            if world_size % others:
                raise ConfigError(
                    f"world size {world_size} is not divisible by dp_shard {cfg.dp_shard} x tp {cfg.tp} x pp {cfg.pp}"
                    f"{f' x cp {cfg.cp}' if cfg.cp > 1 else ''} = {others}; change the degrees or the number of processes"
                )
            dp_replicate = world_size // others
        dims = cls(dp_replicate, dp_shard, cfg.tp, cfg.pp, world_size, cp=cfg.cp, ep=cfg.ep)
        dims.validate()
        return dims

    def validate(self) -> None:
        product = self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp
        if product != self.world_size:
            cp = f" x cp {self.cp}" if self.cp > 1 else ""
            raise ConfigError(
                f"parallel degrees dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x tp {self.tp}"
                f" x pp {self.pp}{cp} = {product} != world size {self.world_size}; make the product equal the"
                f" number of processes (parallel.dp_replicate = -1 fills it)"
            )
        if not isinstance(self.ep, int) or self.ep < 1 or self.dp % self.ep:
            raise ConfigError(
                f"parallel.ep = {self.ep} must divide the data-parallel degree dp_replicate x dp_shard = {self.dp}"
                " (expert-parallel ranks are borrowed from dp); use an ep that divides it"
            )
        if self.ep > 1 and self.cp > 1:
            raise ConfigError("parallel.ep > 1 with parallel.cp > 1 is not supported yet; set parallel.ep = 1")

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        # With cp > 1 FSDP2 shards over dp_shard x cp, also when dp_shard is 1 (torchtitan's choice).
        return self.dp_shard > 1 or self.cp > 1

    def degrees(self) -> dict[str, int]:
        # cp only when used: a layout without cp has the keys of metrics and checkpoints that lack it.
        return {name: getattr(self, name) for name in MESH_ORDER if name != "cp" or self.cp > 1}

    def describe(self) -> str:
        return " x ".join(f"{k} {v}" for k, v in self.degrees().items()) + f" = world {self.world_size}"

    @functools.cached_property
    def mesh(self) -> DeviceMesh | None:
        """The world mesh with only the degrees > 1 as named dimensions (None when world is 1)."""
        names = tuple(n for n in MESH_ORDER if getattr(self, n) > 1)
        if not names:
            return None
        # gloo, or c10d's 'fake' backend of the memory estimate on a machine without CUDA: a CPU mesh.
        device_type = "cuda" if dist.get_backend() != "gloo" and torch.cuda.is_available() else "cpu"
        mesh = init_device_mesh(device_type, tuple(getattr(self, n) for n in names), mesh_dim_names=names)
        dp_names = tuple(n for n in ("dp_replicate", "dp_shard") if n in names)
        if len(dp_names) == 2:
            # Keep the flattened mesh: slicing a flattened dim back out of the root is deprecated.
            self.__dict__["_dp_mesh"] = mesh[dp_names]._flatten("dp")
        if self.cp > 1:
            # FSDP2 shards over dp_shard x cp and the loss is reduced over them (docs/context-parallel.md).
            self.__dict__["_dp_cp_mesh"] = mesh[(*dp_names, "cp")]._flatten("dp_cp") if dp_names else mesh["cp"]
            if self.pp > 1:
                self.__dict__["_pp_dp_mesh"] = mesh[("pp", *dp_names, "cp")]._flatten("pp_dp_cp")
        elif self.pp > 1 and dp_names:
            # The step's one reduce of [loss sum, item count] spans the pipeline and dp ranks.
            self.__dict__["_pp_dp_mesh"] = mesh[("pp", *dp_names)]._flatten("pp_dp")
        return mesh

    @functools.cached_property
    def ep_mesh(self) -> DeviceMesh | None:
        """Expert parallelism's 2-D mesh ``(ep_replicate, ep)`` over the dp ranks (None at ep 1).

        The ep ranks are borrowed from the data-parallel ranks, as torchtitan does: ranks of one
        ep group load different batches, so sending each token to the rank that holds its expert
        is useful work, and no rank is spent on experts alone. The ``ep`` dimension is innermost
        (neighbouring dp ranks: the all_to_all is the chattiest collective); an expert's weights
        live on the ``dp / ep`` ranks of its ``ep_replicate`` group, over which its gradient is
        summed. With pp or tp the mesh is this rank's dp sub-mesh unflattened: ep groups never
        cross a pipeline stage or a tensor-parallel coordinate (each stage holds its own blocks'
        experts; the tp ranks of a group run the same tokens through the same, replicated experts).
        """
        if self.ep == 1:
            return None
        # (_unflatten, as for HSDP x cp in submesh: slicing a flattened dimension is deprecated.)
        return self.submesh("dp")._unflatten(0, (self.dp // self.ep, self.ep), ("ep_replicate", "ep"))

    # The sub-mesh each role uses (mesh dimension names; a tuple is a multi-dimensional mesh):
    #   data loading and loss reduction: "dp" (dp_replicate x dp_shard flattened; ranks of one
    #     TP or PP group share their dp coordinate, so they load the same batch);
    #   fsdp: "dp_shard", or ("dp_replicate", "dp_shard") for HSDP;
    #   ddp: "dp_replicate"; tp: "tp"; pp: "pp";
    #   cp: the context-parallel ring; dp_cp: dp x cp flattened, where FSDP2 shards and the loss is
    #     reduced when cp > 1 (the cp ranks of one dp rank hold parts of the same rows);
    #   pp_dp: pp x dp (x cp) flattened, the step's reduce of the loss sum and item count (only the
    #     last pipeline stage holds the loss; ranks of one TP group compute the same one).
    ROLES = {"data": "dp", "loss": "dp"}

    def fsdp_dims(self) -> tuple[str, ...]:
        """Mesh dimensions FSDP2 works on: shard only, or (replicate, shard) for HSDP."""
        if self.dp_shard == 1:
            return ()
        return ("dp_replicate", "dp_shard") if self.dp_replicate > 1 else ("dp_shard",)

    def submesh(self, role: str) -> DeviceMesh | None:
        """The sub-mesh of one role ('data', 'loss', 'dp', 'fsdp', 'dp_replicate', 'dp_shard', 'tp',
        'pp'); None when that role has a single rank."""
        role = self.ROLES.get(role, role)
        if role == "fsdp" and self.cp > 1 and self.dp_replicate > 1:
            if self.dp_shard == 1:
                return self.mesh[("dp_replicate", "cp")]  # HSDP: replicated over dp_replicate, sharded over cp
            if "_hsdp_cp_mesh" not in self.__dict__:
                # HSDP over dp_replicate x (dp_shard x cp): the flattened dp x cp mesh (dp_replicate
                # outermost) unflattened into 2-D, as torchtitan's dp_shard_cp (slicing a flattened
                # dimension back out of the root mesh is deprecated in torch 2.13).
                self.mesh  # built on first use, the flattened dp x cp mesh with it
                self.__dict__["_hsdp_cp_mesh"] = self.__dict__["_dp_cp_mesh"]._unflatten(
                    0, (self.dp_replicate, self.dp_shard * self.cp), ("dp_replicate", "dp_shard_cp")
                )
            return self.__dict__["_hsdp_cp_mesh"]
        if role == "dp_cp" or (role == "fsdp" and self.cp > 1):
            if self.cp == 1:
                return self.submesh("dp")
            self.mesh  # built on first use, the flattened dp x cp mesh with it
            return self.__dict__["_dp_cp_mesh"]
        if role == "fsdp":
            names = self.fsdp_dims()
            if not names or self.mesh is None:
                return None
            return self.mesh[names if len(names) > 1 else names[0]]
        if role == "pp_dp" and self.cp > 1 and self.pp == 1:
            return self.submesh("dp_cp")
        if role == "pp_dp":
            if self.cp == 1 and (self.pp == 1 or self.dp == 1):
                return self.submesh("pp" if self.dp == 1 else "dp")
            self.mesh  # built on first use, the flattened pp x dp mesh with it
            return self.__dict__["_pp_dp_mesh"]
        size = self.dp if role == "dp" else getattr(self, role)
        if size == 1 or self.mesh is None:
            return None
        if role == "dp" and (self.dp_replicate == 1 or self.dp_shard == 1):
            role = "dp_replicate" if self.dp_replicate > 1 else "dp_shard"
        elif role == "dp":
            return self.__dict__["_dp_mesh"]
        return self.mesh[role]

    def group(self, role: str) -> dist.ProcessGroup | None:
        sub = self.submesh(role)
        return None if sub is None else sub.get_group()

    def local_rank_in(self, role: str) -> int:
        sub = self.submesh(role)
        return 0 if sub is None else sub.get_local_rank()
