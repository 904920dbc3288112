"""Peak memory per rank of a layout, from find-batch's fake-tensor estimate of the real step.

The estimator (batch/measure.py: the model from the config, ``parallelize`` with FSDP2/TP/AC, the
optimiser and ``train_step`` on fake tensors under MemTracker, fake process groups standing in
for the other ranks) is called in ONE place, :func:`estimate_layout_peak`. What is built on it:

- **Blocks are identical**: the peak is linear in the number of blocks a rank holds (each adds
  its parameters, gradients, optimiser state and saved activations). For the built-in GPT of
  more than 4 blocks the layout is estimated with the model truncated to 1 and 2 blocks and
  extrapolated, ``peak(L) = peak(1) + (L - 1) x (peak(2) - peak(1))``, so an 8B model plans in
  seconds (checked against the full estimate in tests/distributed/test_plan.py). Other models, and a GPT of
  up to 4 blocks (as cheap whole as the pair), are estimated whole.
- **Micro-batches are estimated as they are**, not extrapolated: the peak is the largest, over
  the step's moments, of what is alive then, each linear in the micro-batch, so it is convex in
  it, and the moment that decides moves (the optimiser step at micro-batch 1, the backward at
  16). A line through micro-batches 1 and 2 was off by -21% to +40% at 8 and 16 on the main GPT
  against the whole model's estimate (world 4, every layout without a pipeline), and 43% under a
  measured FSDP x TP run.
- **Cache**: estimates are keyed by what changes one rank's memory: dp_shard, tp, blocks held,
  micro-batch, accumulation (2 micro-batches or 1), activation checkpointing, resharding,
  dtype, and whether DDP buckets exist (dp_replicate > 1 adds them; its size does not matter).
- **Pipeline stages**: the estimator does not run a pipeline schedule, so a pipeline rank is
  modelled explicitly as the non-pipelined step of its blocks at the pipeline micro-batch
  (``micro_batch / pp_microbatches``) plus the activations of the micro-batches the schedule
  keeps in flight on it, one micro-batch's worth measured as ``peak(2m) - peak(m)``:
  GPipe keeps all n; 1F1B keeps ``pp - rank`` (stage 0 the most, Narayanan et al. 2021);
  interleaved 1F1B and ZB-1P keep torch's warm-up count of chunks,
  ``(v - 1) pp + 2 (pp - 1 - rank) + 1``, of ``1/v`` of the rank's blocks each; looped BFS keeps
  all n; ZB-V keeps ``pp`` and DualPipeV ``pp + 1`` (arXiv:2401.10241, arXiv:2412.19437). The
  stage is estimated with both the embedding and the output layer (an upper bound: every
  stage holds at most one of them), and the rank with the largest total decides.
- **Context parallel** (``cp > 1``): a rank holds ``T / cp`` tokens of each row (the head-tail
  split) and FSDP2 shards the states over ``dp_shard x cp``. The estimator runs no ring (its fake
  process group has no point-to-point), so a cp layout is estimated as the step it matches rank
  for rank: rows of ``T / cp`` tokens (the model keeps its ``T`` positions) with ``dp_shard x cp``
  shards. The ring's attention saves what SDPA's flash kernel saves (q, k, v, out, log-sum-exp;
  the ring's out in float32) and its chunk pairs' scores are transient, so activations scale as
  ``1/cp``; the K/V chunks in flight (two received chunks of ``T / cp`` tokens per layer at a
  time) are not counted.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import warnings
from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh

from paratrain.batch.auto import fake_process_group
from paratrain.batch.measure import StepRunner, estimate_peak, replica_dims
from paratrain.config import Config
from paratrain.data.datasets import build_dataset
from paratrain.distributed.parallel_dims import ParallelDims
from paratrain.distributed.pipeline_parallel import SCHEDULES, pp_microbatches, stage_ranges
from paratrain.models import spec_of
from paratrain.models.spec import ModelSpec
from paratrain.plan.enumerate import Layout
from paratrain.precision import DTYPES

WHOLE_UP_TO = 4  # blocks: a model this small is estimated whole (MemoryModel.extrapolates)

log = logging.getLogger("paratrain")


# ----------------------------------------------------------------------------- the one adapter


@contextlib.contextmanager
def _device_mesh_outside_fake():
    """FSDP2 on a TP mesh concatenates device meshes while the model is built under fake mode,
    and DeviceMesh computes the rank's coordinates with ``nonzero`` on the mesh tensor, which a
    fake tensor cannot answer (DynamicOutputShapeException, torch 2.13). The mesh is metadata:
    build it on real tensors."""
    original = DeviceMesh.__init__

    def init(self, *args, **kwargs):
        with unset_fake_temporarily():
            original(self, *args, **kwargs)

    DeviceMesh.__init__ = init
    try:
        yield
    finally:
        DeviceMesh.__init__ = original


def estimate_layout_peak(cfg: Config, dims: ParallelDims, micro_batch_size: int, *, dataset=None) -> int:
    """Peak bytes of one rank of ``cfg``'s step at ``dims`` (pp must be 1) and this micro-batch."""
    rep = replica_dims(dims)
    with (
        warnings.catch_warnings(),
        _device_mesh_outside_fake(),
        fake_process_group(rep.world_size, 0),
        torch.random.fork_rng(devices=[]),
    ):
        warnings.simplefilter("ignore")  # FSDP's and checkpointing's notes about fake tensors
        runner = StepRunner(cfg, dims, device=torch.device("cpu"), dataset=dataset)
        return estimate_peak(runner, micro_batch_size)


# ----------------------------------------------------------------------------- the model of a layout


def truncatable(cfg: Config) -> bool:
    """The built-in GPT: its block count is one argument, so the model can be cut for the estimate."""
    return not cfg.model.factory and not cfg.model.hf and cfg.model.name == "gpt"


@dataclasses.dataclass
class RankMemory:
    peak_bytes: int
    stage_rank: int = 0  # the pipeline rank that decides
    in_flight: float = 1.0  # micro-batches of activations it holds (pipeline)


class MemoryModel:
    """Peak memory per rank of layouts of one config, with the cache described above."""

    def __init__(
        self,
        cfg: Config,
        *,
        model=None,
        n_blocks: int | None = None,
        estimate: Callable | None = None,
        spec: ModelSpec | None = None,
    ):
        self.cfg = cfg
        self.model = model  # the meta model: pipeline stage boundaries
        self.spec = spec or spec_of(cfg.model, model)  # its blocks, as the trainer reads them
        self.n_blocks = n_blocks
        self.estimate = estimate or estimate_layout_peak
        self.cache: dict[tuple, int] = {}
        self.estimates = 0  # calls of the estimator (cache misses)
        self._datasets: dict[int, object] = {}
        self._stage_ranges: dict[int, list[range]] = {}
        self._sizes: list[int] | None = None
        self._expert_sizes: list[int] | None = None
        self._rest: dict[tuple, dict[int, float]] = {}  # sibling key -> micro-batch -> held beyond states

    @property
    def dataset(self):
        return self.dataset_for(1)

    def dataset_for(self, cp: int):
        """The dataset with rows of ``T / cp`` tokens (a cp rank's part of a row), built once per cp."""
        if cp not in self._datasets:
            data = copy.deepcopy(self.cfg.data)
            if cp > 1:
                data.args = {**data.args, "block_size": self._seq_len() // cp}
            self._datasets[cp] = build_dataset(data)
        return self._datasets[cp]

    @staticmethod
    def _key(layout: Layout, *, blocks: int | None, m: int, accumulate: bool, dp_replicate: int) -> tuple:
        return (
            dp_replicate > 1,
            layout.dp_shard,
            layout.tp,
            blocks,
            m,
            accumulate,
            layout.activation_checkpointing,
            layout.reshard_after_forward if layout.shard > 1 else True,
            layout.cp,
            layout.ep or 1,
        )

    def _one(self, layout: Layout, *, blocks: int | None, m: int, accumulate: bool, dp_replicate: int) -> int:
        """Estimator call (cached): pp = 1, ``blocks`` blocks (None: the model as configured)."""
        key = self._key(layout, blocks=blocks, m=m, accumulate=accumulate, dp_replicate=dp_replicate)
        if key not in self.cache:
            cfg = copy.deepcopy(layout.apply(self.cfg))
            cfg.parallel.pp = 1
            cfg.parallel.dp_replicate = dp_replicate
            # Context parallel as the step it matches rank for rank (module docstring): rows of
            # T / cp tokens, FSDP2 over dp_shard x cp.
            cfg.parallel.cp, shard = 1, layout.shard
            cfg.parallel.dp_shard = shard
            dp = dp_replicate * shard
            cfg.batch.global_batch_size = dp * m * (2 if accumulate else 1)
            cfg.batch.micro_batch_size = m
            if blocks is not None:
                cfg.model.args = {**cfg.model.args, "n_layer": blocks}
            # Expert parallel: the estimate runs the experts as at ep = 1 and corrects what a rank
            # holds (batch/measure.py expert_parallel_bytes), so ep rides in the dims only.
            dims = ParallelDims(dp_replicate, shard, layout.tp, 1, dp * layout.tp, ep=layout.ep or 1)
            self.cache[key] = int(self.estimate(cfg, dims, m, dataset=self.dataset_for(layout.cp)))
            self.estimates += 1
        return self.cache[key]

    def blocks_peak(self, layout: Layout, *, blocks: int, m: int, accumulate: bool, dp_replicate: int) -> float:
        """Peak with ``blocks`` blocks and micro-batch ``m``: extrapolated linearly from 1 and 2
        blocks where the model allows (two runs price every block count), at ``m`` itself."""
        kw = dict(m=m, accumulate=accumulate, dp_replicate=dp_replicate)
        if not self.extrapolates or blocks <= 2:
            return self._one(layout, blocks=blocks if truncatable(self.cfg) else None, **kw)
        one, two = self._one(layout, blocks=1, **kw), self._one(layout, blocks=2, **kw)
        return one + (blocks - 1) * (two - one)

    @property
    def extrapolates(self) -> bool:
        """Whether block counts are extrapolated from 1 and 2 blocks: for a built-in GPT of more
        than :data:`WHOLE_UP_TO` blocks. A run's cost grows with the blocks (the 8B GPT, one
        timing each: 0.65 s with 1 block, 0.69 s with 2, 1.16 s with 3, 1.4 s with 4), so up to 4
        blocks the model as it is costs about what the pair does, and is exact: with FSDP's
        resharding, the slope from 1 to 2 blocks of the 4-block main GPT held up to 14% too much
        (the line is exact on the 8B GPT)."""
        return truncatable(self.cfg) and (self.n_blocks or 0) > WHOLE_UP_TO

    def _ranges(self, stages: int) -> list[range]:
        if stages not in self._stage_ranges:
            self._stage_ranges[stages] = stage_ranges(
                self.model, stages, self.cfg.parallel.pp_split_points, blocks_attr=self.spec.blocks_attr
            )
        return self._stage_ranges[stages]

    @staticmethod
    def _rank_stages(layout: Layout, rank: int) -> list[int]:
        if SCHEDULES[layout.pp_schedule][2] == "v":
            return [rank, 2 * layout.pp - 1 - rank]
        return list(range(rank, layout.pp * layout.pp_virtual_stages, layout.pp))

    def _rank_blocks(self, layout: Layout, rank: int) -> list[int]:
        ranges = self._ranges(layout.pp * layout.pp_virtual_stages)
        return [i for s in self._rank_stages(layout, rank) for i in ranges[s]]

    def _sibling_key(self, layout: Layout) -> tuple:
        # Resharding belongs to the key: without it FSDP keeps every unit's unsharded parameters
        # from forward to backward (38 GiB more per rank on the 8B GPT at 8 x 8).
        resharded = layout.reshard_after_forward if layout.shard > 1 else True
        return (layout.tp, layout.cp, layout.activation_checkpointing, resharded)

    def _states(self, layout: Layout, blocks: int) -> float:
        """fp32 parameters, gradients and optimiser state of the model cut to ``blocks`` blocks, split
        tp x dp_shard x cp ways (the bound of :meth:`lower_bound`)."""
        sizes, experts = self._block_sizes(), self._block_expert_sizes()
        held = self._state_bytes(self.model.parameters()) - sum(sizes[blocks:])
        return self._split(layout, held, sum(experts[:blocks]))

    @staticmethod
    def _split(layout: Layout, held: float, experts: float) -> float:
        """State bytes per rank: split tp x dp_shard x cp ways, but at ep > 1 the ``experts`` part
        ``ep`` ways (a rank holds ``n_experts / ep`` experts: whole under DDP), and with FSDP2
        ``dp`` ways (its experts sharded over their ``dp / ep`` ep_replicate ranks: docs/moe.md)."""
        if (layout.ep or 1) > 1:
            experts_split = layout.dp if layout.shard > 1 else layout.ep
            return (held - experts) / (layout.tp * layout.shard) + experts / experts_split
        return held / (layout.tp * layout.shard)

    def _remember(self, layout: Layout, *, m: int, accumulate: bool) -> None:
        """Keep what an estimated layout holds beyond its states (1 and 2 blocks) at micro-batch ``m``."""
        kw = dict(m=m, accumulate=accumulate, dp_replicate=layout.dp_replicate)
        keys = [self._key(layout, blocks=b, **kw) for b in (1, 2)]
        if all(k in self.cache for k in keys):
            one, two = (self.cache[k] - self._states(layout, b) for k, b in zip(keys, (1, 2)))
            rest = self._rest.setdefault(self._sibling_key(layout), {})
            # The least of the siblings: what one holds beyond its states still varies (resharding
            # keeps unsharded parameters or not, DDP's buckets), and the shortcut must not overshoot.
            rest[m] = min(rest.get(m, math.inf), one + (self.n_blocks - 1) * (two - one))

    def sibling_guess(self, layout: Layout) -> int:
        """A lower estimate of this layout's peak from estimated siblings (the same tp, checkpointing
        and resharding, other data-parallel degrees or accumulation): its own states plus the least
        a sibling held beyond its states (activations and buffers, which do not depend on how
        parameters and gradients are split) at the largest micro-batch up to this one (what is held
        does not shrink with the micro-batch). An estimate, not a bound: the siblings' figures
        are extrapolated in blocks, hence the planner's margin. The states alone when no sibling
        is known."""
        bound = self.lower_bound(layout)
        rest = self._rest.get(self._sibling_key(layout), {})
        m = layout.micro_batch_size
        known = sorted(k for k in rest if k <= m)
        if layout.pp > 1 or not known:
            return bound
        return int(bound + max(0.0, rest[known[-1]]))

    def _state_bytes(self, params) -> int:
        """fp32 bytes of ``params`` and, for those that train, their gradients and optimiser state
        (AdamW's two moments, SGD's momentum buffer). A frozen parameter (LoRA's base, docs/lora.md)
        has neither: 4 bytes against 8 + 8 under AdamW."""
        o = self.cfg.optim
        per_trained = 8 + (8 if o.name == "adamw" else (4 if o.beta1 > 0 else 0))
        return sum(p.numel() * (per_trained if p.requires_grad else 4) for p in params)

    def lower_bound(self, layout: Layout) -> int:
        """Bytes every step certainly holds on the busiest rank: fp32 parameters, gradients and
        optimiser state of its blocks, as if all of them were split over tp x dp_shard x cp. A layout
        over budget by this bound needs no fake-tensor run (most of the fastest layouts of a
        large model: replicas that cannot hold the model)."""
        if self.model is None:
            return 0
        if layout.pp == 1:
            held = self._state_bytes(self.model.parameters())
            return int(self._split(layout, held, sum(self._block_expert_sizes())))
        sizes = self._block_sizes()
        held = max(sum(sizes[i] for i in self._rank_blocks(layout, r)) for r in range(layout.pp))
        return int(held / (layout.tp * layout.shard))

    def _block_sizes(self) -> list[int]:
        """Each block's state bytes (:meth:`_state_bytes`)."""
        if self._sizes is None:
            self._sizes = [self._state_bytes(b.parameters()) for _, b in self.spec.blocks(self.model)]
        return self._sizes

    def _block_expert_sizes(self) -> list[int]:
        """Each block's routed experts' state bytes (the spec's ``expert_layers``; 0 for a dense block)."""
        if self._expert_sizes is None:
            self._expert_sizes = [
                self._state_bytes(p for e in self.spec.expert_layers(b) for p in e.experts.parameters())
                for _, b in self.spec.blocks(self.model)
            ]
        return self._expert_sizes

    def peak(self, layout: Layout) -> RankMemory:
        per_rank = self.cfg.batch.global_batch_size // layout.dp
        accumulate = per_rank // layout.micro_batch_size >= 2
        if layout.pp == 1:
            blocks = self.n_blocks if self.n_blocks is not None else 0
            peak = self.blocks_peak(
                layout,
                blocks=blocks,
                m=layout.micro_batch_size,
                accumulate=accumulate,
                dp_replicate=layout.dp_replicate,
            )
            if self.extrapolates:
                self._remember(layout, m=layout.micro_batch_size, accumulate=accumulate)
            return RankMemory(int(peak))
        return self._pipeline_peak(layout, per_rank)

    def _pipeline_peak(self, layout: Layout, per_rank: int) -> RankMemory:
        ranks = self.pipeline_ranks(layout, per_rank)
        rank = max(range(len(ranks)), key=lambda r: ranks[r].peak_bytes)
        return ranks[rank]

    def pipeline_ranks(self, layout: Layout, per_rank: int) -> list[RankMemory]:
        """Each pipeline rank's modelled peak (``stage_rank`` and ``in_flight`` filled in)."""
        cfg = layout.apply(self.cfg)
        accum = per_rank // layout.micro_batch_size
        ppm = pp_microbatches(cfg.parallel, pp=layout.pp, micro_batch_size=layout.micro_batch_size, accum_steps=accum)
        m = layout.micro_batch_size // ppm
        n = accum * ppm  # pipeline micro-batches per step
        v = layout.pp_virtual_stages
        # torch.distributed.pipelining allocates, per stage and pipeline micro-batch, a buffer
        # for the activations it receives (every stage but the first) and one for the gradients
        # it receives (every stage but the last), kept for the schedule's life (stage.py,
        # _prepare_forward_infra / _prepare_backward_infra): measured on CPU, docs/plan.md.
        boundary = m * self._seq_len() // layout.cp * self._width() * DTYPES[cfg.precision.dtype].itemsize
        n_stages = layout.pp * v
        out = []
        for rank in range(layout.pp):
            blocks = len(self._rank_blocks(layout, rank))
            # With n >= 2 the gradients of earlier micro-batches are alive during later ones.
            kw = dict(blocks=blocks, accumulate=n >= 2, dp_replicate=layout.dp_replicate)
            base = self.blocks_peak(layout, m=m, **kw)
            act = self.blocks_peak(layout, m=2 * m, **kw) - base
            stages = self._rank_stages(layout, rank)
            if n_stages - 1 not in stages and blocks:
                # Not the last stage: its in-flight micro-batches hold no logits. The estimate's
                # part that is not in the blocks (head, logits, loss) is what 0 blocks would
                # hold, by the same linearity in blocks: act(1) - (act(2) - act(1)).
                one, two = (self._act(layout, m, b, n, kw["dp_replicate"]) for b in (1, 2))
                act = max(act - max(0.0, 2 * one - two), act * blocks / (blocks + 1))
            flight = in_flight(layout.pp_schedule, rank=rank, pp=layout.pp, v=v, n=n)
            buffers = n * boundary * sum((s > 0) + (s < n_stages - 1) for s in stages)
            out.append(RankMemory(int(base + (flight - 1) * act + buffers), rank, flight))
        return out

    def _act(self, layout: Layout, m: int, blocks: int, n: int, dp_replicate: int) -> float:
        """One pipeline micro-batch's activations with ``blocks`` blocks: peak(2m) - peak(m)."""
        kw = dict(blocks=blocks, accumulate=n >= 2, dp_replicate=dp_replicate)
        return self.blocks_peak(layout, m=2 * m, **kw) - self.blocks_peak(layout, m=m, **kw)

    def _seq_len(self) -> int:
        return self.cfg.data.args.get("block_size") or self.cfg.model.args.get("block_size") or 1

    def _width(self) -> int:
        mcfg = getattr(self.model, "cfg", None) or getattr(self.model, "config", None)
        return getattr(mcfg, "d_model", 0) or getattr(mcfg, "hidden_size", 0)


def in_flight(schedule: str, *, rank: int, pp: int, v: int, n: int) -> float:
    """Micro-batches whose activations pipeline rank ``rank`` holds at once (in units of all its blocks)."""
    if schedule in ("gpipe", "looped_bfs"):
        return float(n)
    if schedule == "1f1b":
        return float(min(n, pp - rank))
    if schedule in ("interleaved1f1b", "interleaved_zb"):
        # torch's _get_warmup_ops (microbatches_per_round = pp): chunks of 1/v of the rank's blocks.
        chunks = min((v - 1) * pp + 2 * (pp - 1 - rank) + 1, n * v)
        return chunks / v
    if schedule == "zbv":
        return float(min(n, pp))
    if schedule == "dualpipev":
        return float(min(n, pp + 1))
    raise ValueError(schedule)
