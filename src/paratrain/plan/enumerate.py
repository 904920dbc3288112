"""Every layout of a config at a world size, each passed through the trainer's own preflight.

A layout is what may change without changing the math (ARCHITECTURE.md): the parallel
degrees, the micro-batch (a divisor of the per-rank batch: the global batch is kept), the
pipeline schedule and its stages per rank, activation checkpointing and FSDP's resharding.
Each candidate config goes through ``preflight.check_run`` (the checks `paratrain train` runs
before starting a process); a refused candidate is counted under its reason, never proposed.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from paratrain.batch.plan import divisors
from paratrain.config import Config, ConfigError
from paratrain.distributed.pipeline_parallel import SCHEDULES, check_untied
from paratrain.models import build, spec_of
from paratrain.models.spec import ModelSpec
from paratrain.preflight import check_run

AC_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    micro_batch_size: int
    activation_checkpointing: str = "none"
    reshard_after_forward: bool = True
    pp_schedule: str = "1f1b"
    pp_virtual_stages: int = 1
    cp: int = 1  # context parallel (docs/context-parallel.md)
    # Expert parallel (docs/moe.md): None for a model without experts (the key is left as
    # configured); for a mixture of experts every candidate names its ep, 1 included.
    ep: int | None = None

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def shard(self) -> int:
        """The ranks FSDP2 shards over: dp_shard x cp (a cp group's ranks hold the same parameters)."""
        return self.dp_shard * self.cp

    def set_lines(self) -> list[str]:
        """The `--set` lines that select this layout (ready to paste)."""
        lines = [
            f"parallel.dp_replicate={self.dp_replicate}",
            f"parallel.dp_shard={self.dp_shard}",
            f"parallel.tp={self.tp}",
            f"parallel.pp={self.pp}",
            f"parallel.cp={self.cp}",
            *([f"parallel.ep={self.ep}"] if self.ep is not None else []),
            f"batch.micro_batch_size={self.micro_batch_size}",
            f"parallel.activation_checkpointing='{self.activation_checkpointing}'",
        ]
        if self.shard > 1:
            lines.append(f"parallel.reshard_after_forward={'true' if self.reshard_after_forward else 'false'}")
        if self.pp > 1:
            lines += [
                f"parallel.pp_schedule='{self.pp_schedule}'",
                f"parallel.pp_virtual_stages={self.pp_virtual_stages}",
            ]
        return lines

    def short(self) -> str:
        cp = f" c{self.cp}" if self.cp > 1 else ""
        ep = f" e{self.ep}" if self.ep is not None else ""
        s = f"r{self.dp_replicate} s{self.dp_shard}{cp}{ep} t{self.tp} p{self.pp} mb{self.micro_batch_size} ac:{self.activation_checkpointing}"
        if self.shard > 1:
            s += f" reshard:{'y' if self.reshard_after_forward else 'n'}"
        if self.pp > 1:
            s += f" {self.pp_schedule}x{self.pp_virtual_stages}"
        return s

    def apply(self, cfg: Config) -> Config:
        """``cfg`` with this layout (the same as passing ``set_lines`` to --set); shares the other sections."""
        keys = ["dp_replicate", "dp_shard", "tp", "pp", "cp", "activation_checkpointing", "reshard_after_forward"]
        if self.ep is not None:  # else a model without experts: its ep stays as configured
            keys.append("ep")
        if self.pp > 1:  # else no pipeline: its schedule stays as configured
            keys += ["pp_schedule", "pp_virtual_stages"]
        parallel = dataclasses.replace(cfg.parallel, **{k: getattr(self, k) for k in keys})
        batch = dataclasses.replace(cfg.batch, micro_batch_size=self.micro_batch_size)
        return dataclasses.replace(cfg, parallel=parallel, batch=batch)


def meta_build(cfg: Config) -> tuple[nn.Module | None, ModelSpec]:
    """The config's model on the meta device (no memory) and its spec; the model is None if its
    factory cannot run there. The spec is the one the trainer uses (a factory's own ModelSpec
    included), so the planner reads blocks through ``spec.blocks`` as the trainer does."""
    try:
        with torch.device("meta"):
            return build(cfg.model)
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001 - a user factory that needs real tensors
        return None, spec_of(cfg.model)


def meta_model(cfg: Config) -> nn.Module | None:
    """The config's model on the meta device, or None (see :func:`meta_build`)."""
    return meta_build(cfg)[0]


def count_blocks(model: nn.Module | None, spec: ModelSpec) -> int | None:
    """The model's block count through its spec; None for a model without blocks (or none built)."""
    blocks = spec.blocks(model) if model is not None else []
    return len(blocks) if blocks else None


def reason_of(err: ConfigError) -> str:
    """A refusal's reason without its numbers, so that refusals of one kind count together."""
    text = str(err).split(";")[0]
    return re.sub(r"\d+", "N", text).strip()


def cp_degrees(cfg: Config, world_size: int):
    """(tp, cp) pairs: cp divides what tp leaves of the world, and the row splits into 2 x cp
    equal chunks (the head-tail split); other cp degrees are not candidates at all."""
    block = cfg.data.args.get("block_size") or cfg.model.args.get("block_size")
    for tp in divisors(world_size):
        for cp in divisors(world_size // tp):
            if cp == 1 or (isinstance(block, int) and block % (2 * cp) == 0):
                yield tp, cp


def moe_experts(cfg: Config) -> int | None:
    """The built-in GPT's routed experts per MoE layer (``model.args.moe``), None without experts,
    as its spec describes them on the meta device, when no model is at hand (a built model's spec
    says it for any model: :func:`enumerate_layouts`). A bad table is left to the preflight, which
    names the key."""
    moe = cfg.model.args.get("moe")
    if moe is None or cfg.model.hf or cfg.model.factory or not isinstance(moe, dict):
        return None
    try:
        model, spec = meta_build(cfg)
    except ConfigError:
        return None
    layers = spec.expert_layers(model) if model is not None else []
    return layers[0].n_experts if layers else None


def ep_degrees(n_experts: int | None, dp: int) -> list[int | None]:
    """Expert-parallel degrees of a layout with ``dp`` data-parallel ranks: ep divides both the
    experts and dp (its ranks are borrowed from dp, distributed/parallel_dims.py ``ep_mesh``).
    What else the preflight refuses (ep with tp, pp or cp; FSDP2 with bf16) it refuses per layout."""
    if n_experts is None:
        return [None]
    return [ep for ep in divisors(dp) if n_experts % ep == 0]


def candidate_layouts(
    cfg: Config, *, world_size: int, nproc_per_node: int, n_blocks: int | None, n_experts: int | None = None
):
    """Every combination of the layout knobs (before any check); ``n_experts``: the routed experts
    per MoE layer (None: :func:`moe_experts` of the config)."""
    gbs = cfg.batch.global_batch_size
    n_experts = n_experts if n_experts is not None else moe_experts(cfg)
    for tp, cp in cp_degrees(cfg, world_size):
        for pp in divisors(world_size // (tp * cp)):
            for dp_shard in divisors(world_size // (tp * cp * pp)):
                dp_replicate = world_size // (tp * cp * pp * dp_shard)
                dp = dp_replicate * dp_shard
                if gbs % dp:
                    yield None, "batch.global_batch_size = N is not divisible by dp = N"
                    continue
                for mb, ep in itertools.product(divisors(gbs // dp), ep_degrees(n_experts, dp)):
                    for ac in AC_MODES:
                        for reshard in (True, False) if dp_shard * cp > 1 else (True,):
                            scheds = [("1f1b", 1)]
                            if pp > 1:
                                scheds = []
                                for name, (_, stages, _) in SCHEDULES.items():
                                    vs = (
                                        [stages]
                                        if stages
                                        else [v for v in (2, 4) if n_blocks is None or pp * v <= n_blocks]
                                    )
                                    scheds += [(name, v) for v in vs]
                            for sched, v in scheds:
                                layout = Layout(dp_replicate, dp_shard, tp, pp, mb, ac, reshard, sched, v, cp, ep)
                                if tp > nproc_per_node:
                                    # Tensor parallelism puts collectives on every layer's critical path:
                                    # across nodes they would run at network speed (Megatron-LM keeps tp
                                    # within a node, Narayanan et al. 2021 §3.3).
                                    yield layout, "parallel.tp = N exceeds the GPUs of a node"
                                else:
                                    yield layout, None


class _Blocks(nn.Module):
    """A parameter-free stand-in with the model's block count, for the pipeline checks.

    The preflight reads two things of a model: the number of its blocks and
    whether parameters are tied across blocks (``check_untied``), which depends on the model
    alone. Walking an 8B model's parameters for each of thousands of layouts took minutes, so
    the tie check runs once (:func:`enumerate_layouts`) and the preflight gets this stand-in.
    """

    def __init__(self, n_blocks: int, blocks_attr: str):
        super().__init__()
        setattr(self, blocks_attr, nn.ModuleList(nn.Module() for _ in range(n_blocks)))


def enumerate_layouts(
    cfg: Config,
    *,
    world_size: int,
    nproc_per_node: int,
    model: nn.Module | None = None,
    spec: ModelSpec | None = None,
) -> tuple[list[Layout], Counter]:
    """(layouts that pass the trainer's preflight, Counter of refusal reasons)."""
    if model is None:
        model, spec = meta_build(cfg)
    spec = spec or spec_of(cfg.model, model)  # the real model's (the stand-in has no plan of its own)
    n_blocks = count_blocks(model, spec)
    # A mixture of experts as its spec describes it (the GPT's or a model.hf one): ep is enumerated.
    experts = spec.expert_layers(model) if model is not None else []
    stand_in, untied = None, None
    if n_blocks is not None:
        stand_in = _Blocks(n_blocks, spec.blocks_attr)
        try:
            check_untied(model, blocks_attr=spec.blocks_attr)
        except ConfigError as e:
            untied = reason_of(e)
    valid, refused = [], Counter()
    verdicts: dict[Layout, str | None] = {}
    for layout, reason in candidate_layouts(
        cfg,
        world_size=world_size,
        nproc_per_node=nproc_per_node,
        n_blocks=n_blocks,
        n_experts=experts[0].n_experts if experts else None,
    ):
        if reason is None and layout.pp > 1 and untied:
            reason = untied
        if reason is None and layout.activation_checkpointing != "none" and model is not None and n_blocks is None:
            # apply_ac's refusal, which the preflight cannot see (it reads the built model): the
            # plan once offered these layouts and stopped at estimating the first of them.
            reason = (
                f"parallel.activation_checkpointing = '{layout.activation_checkpointing}' works per block and"
                f" {type(model).__name__} has no blocks in a `{spec.blocks_attr}` ModuleDict/ModuleList"
            )
        if reason is None:
            # Only the pipeline checks read activation checkpointing (zero-bubble schedules refuse
            # selective; tests/distributed/test_plan.py checks every mode for real): one verdict serves the
            # modes the checks do not tell apart.
            ac = (
                layout.activation_checkpointing
                if layout.pp > 1 and layout.activation_checkpointing == "selective"
                else "none"
            )
            key = dataclasses.replace(layout, activation_checkpointing=ac)
            if key not in verdicts:
                try:
                    check_run(layout.apply(cfg), world_size, model=stand_in, spec=spec)
                    verdicts[key] = None
                except ConfigError as e:
                    verdicts[key] = reason_of(e)
            reason = verdicts[key]
        if reason is not None:
            refused[reason] += 1
            continue
        valid.append(layout)
    return valid, refused
