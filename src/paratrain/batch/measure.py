"""Whether a micro-batch fits: the real step on fake tensors (MemTracker) or on the device (trials).

See find_batch/__init__.py for the whole picture.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from paratrain.batch.plan import plan_batch
from paratrain.batch.search import GIB, Trial
from paratrain.build import build_parallel
from paratrain.config import Config, ConfigError
from paratrain.data.datasets import build_dataset
from paratrain.data.sampler import load_batches
from paratrain.distributed.parallel_dims import ParallelDims
from paratrain.loss import Loss
from paratrain.models import build, spec_of
from paratrain.models.batch_norm import check_groups, has_batch_norm, norm_group
from paratrain.models.hf.moe import fake_grouped_mm
from paratrain.models.spec import ModelSpec
from paratrain.objectives.registry import build_loss
from paratrain.optim import build_optimizer
from paratrain.precision import build_precision
from paratrain.step import StepContext, train_step

log = logging.getLogger("paratrain")


@dataclass(frozen=True)
class MoEShape:
    """A mixture of experts' shape, as expert parallelism's memory needs it (models/spec.py ExpertLayer)."""

    expert_params: int  # the routed experts of all MoE layers
    top_k: int
    d_model: int


def moe_shape(model: nn.Module, spec: ModelSpec) -> MoEShape | None:
    moes = spec.expert_layers(model)
    if not moes:
        return None
    return MoEShape(sum(e.params for e in moes), moes[0].top_k, moes[0].d_model)


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
        self.cfg, self.full_dims, self.device = cfg, dims, device
        self.dims = replica_dims(dims)
        self.user_model = model
        self._dataset = dataset
        self.loss_fn = loss if isinstance(loss, Loss) else build_loss(cfg.loss, loss)
        self.step_ctx: StepContext | None = None  # made in build(), with the model's parallelisms
        self.iterations = iterations
        self._norm_group: int | None = None  # allows()'s, read from the model once
        self.moe: MoEShape | None = None  # a mixture of experts' shape, read in build()
        self.per_rank = plan_batch(
            global_batch_size=cfg.batch.global_batch_size, micro_batch_size=0, dp=dims.dp
        ).per_rank_batch_size

    def allows(self, m: int) -> bool:
        """Whether the run may use micro-batch ``m``: a BatchNorm model's holds whole groups of
        ``batch.norm_group`` (or a part that ranks complete), models/batch_norm.py."""
        return self.norm_problem(m) is None

    def norm_problem(self, m: int | None = None) -> str | None:
        """:func:`check_groups`'s line for micro-batch ``m`` (None: the group itself, a micro-batch
        that always holds whole groups: what is left is a global batch they do not divide)."""
        size = self.cfg.batch.global_batch_size
        if self._norm_group is None:  # read from the model once
            self._norm_group = norm_group(self.cfg.batch.norm_group, size) if has_batch_norm(self._bare_model()) else 0
        if not self._norm_group:
            return None
        group = self._norm_group
        return check_groups(group=group, global_batch_size=size, micro_batch_size=m or group, dp=self.full_dims.dp)

    def _bare_model(self) -> nn.Module:
        """The user's model, or the config's built on the meta device (no memory, no init), or
        on the CPU for a builder that cannot build there; the run's RNG untouched."""
        if self.user_model is not None:
            return self.user_model
        with torch.random.fork_rng(devices=[]):
            try:
                with torch.device("meta"):
                    return build(self.cfg.model)[0]
            except Exception:  # a user factory that computes on its weights while building
                return build(self.cfg.model)[0]

    @property
    def dataset(self):
        if self._dataset is None:  # built on first use: an injected measure never needs it
            self._dataset = build_dataset(self.cfg.data)
        return self._dataset

    def batches(self, m: int) -> list:
        n = m * min(2, self.per_rank // m)
        probe = getattr(self.dataset, "probe_indices", None)  # image rows: the widest, most patches
        indices = probe(n, m) if probe is not None else [i % len(self.dataset) for i in range(n)]
        return load_batches(self.dataset, indices, m)

    def build(self, fake_mode=None) -> tuple[nn.Module, torch.optim.Optimizer]:
        with torch.random.fork_rng(devices=[]):  # trials must not move the run's RNG
            if self.user_model is not None:
                spec = spec_of(self.cfg.model, self.user_model)
                if fake_mode is not None:
                    with fake_mode, FakeCopyMode(fake_mode):
                        model = copy.deepcopy(self.user_model)
                else:
                    model = copy.deepcopy(self.user_model)
            elif fake_mode is not None:
                # Fake parameters are created on the device: Module.to cannot move them (torch 2.13).
                with fake_mode, torch.device(self.device):
                    model, spec = build(self.cfg.model, meta_enabled=False)
            else:
                model, spec = build(self.cfg.model, meta_enabled=False)
            self.moe = moe_shape(model, spec)  # before the wrappers: whole (not sharded) expert weights
            # The real step's build (build/__init__.py, as training runs it): vocabulary-sharded logits
            # change the activation memory, ZeRO-3's per-micro-batch sync the gradient memory, a
            # mixture of experts' auxiliary loss (its router probabilities) the activations.
            # The step's own mixed precision: autocast changes the activations' dtype.
            precision = build_precision(self.cfg.precision, device=self.device, fsdp_enabled=self.dims.fsdp_enabled)
            with fake_mode or contextlib.nullcontext():
                model, step_ctx, _ = build_parallel(
                    self.cfg,
                    self.dims,
                    model,
                    spec=spec,
                    device=self.device,
                    loss_fn=self.loss_fn,
                    precision=precision,
                    compile_enabled=False,
                    # torch's BatchNorm holds what the groups' does (one rank has no groups that span
                    # ranks), bar a transposed copy of the input when a micro-batch holds several
                    batch_norm_groups=False,
                )
                # Counts read like the loss's own (step.py StepContext.static_counts): on fake
                # tensors a count from the rows' shapes never matched (info_nce: "item count 1").
                self.step_ctx = dataclasses.replace(step_ctx, static_counts=False)
                optimizer = build_optimizer(model, self.cfg.optim)
        return model, optimizer

    def run(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, batches: list, iterations: int | None = None
    ) -> None:
        model.train()
        for _ in range(self.iterations if iterations is None else iterations):
            train_step(model, optimizer, batches, self.step_ctx)

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
        if self.full_dims.ep > 1 and self.moe is not None:  # the experts are left out of DDP's buckets
            buckets -= self.moe.expert_params * 4
        return buckets if self.per_rank // m >= 2 else max(0, buckets - grads_at_peak)

    def expert_parallel_bytes(self, m: int, seq_len: int) -> int:
        """What expert parallelism changes in one rank's peak against the estimate, which runs the
        step as at ep = 1 (the fake process group has no ranks to send tokens to; models/gpt/moe.py
        gives each expert the balanced share of the tokens, the activations of ep > 1 too).

        - States: at ep = 1 every expert is held with the rest, sharded over dp_shard by FSDP2
          (whole under DDP); at ep > 1 a rank holds ``n_experts / ep`` experts
          (distributed/expert_parallel.py): whole under DDP, or with FSDP2 sharded over their
          ``ep_replicate`` group of ``dp / ep`` ranks (``apply_expert_fsdp``), so ``1/dp`` of
          the experts' fp32 weights, gradients and optimiser state instead of ``1/dp_shard``
          (the same under plain FSDP2; less under HSDP, whose replicas share them out).
        - The dispatch's receive buffers, alive together while the last MoE layer combines: the
          rank's ``tokens x top_k`` (token, slot) rows arriving from the other ranks (float32,
          models/gpt/moe.py) and their expert outputs coming back (float32).
        """
        ep = self.full_dims.ep
        if ep <= 1 or self.moe is None:
            return 0
        o = self.cfg.optim
        per_param = 8 + (8 if o.name == "adamw" else (4 if o.beta1 > 0 else 0))
        held = 1 / self.full_dims.dp if self.full_dims.fsdp_enabled else 1 / ep
        states = self.moe.expert_params * per_param * (held - 1 / self.dims.dp_shard)
        tokens = m * seq_len  # the rank's tokens of one micro-batch
        buffers = 2 * tokens * self.moe.top_k * self.moe.d_model * 4
        return int(states + buffers)


try:
    from torch._subclasses.fake_tensor import FakeCopyMode, FakeTensorMode, is_fake, unset_fake_temporarily
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
except ImportError:  # pragma: no cover - torch too old for the estimator
    MemTracker = None


if MemTracker is not None:

    class _NoHook:
        def remove(self) -> None:
            pass

    _NO_HOOK = _NoHook()

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

        def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
            # Frozen parameters (LoRA's base, docs/lora.md) get no gradient, and torch refuses a
            # gradient hook on them: mark them hooked already, with handles that remove nothing.
            for p in module.parameters():
                if not p.requires_grad and self._param_to_grad_hook_handles.get(p) is None:
                    self._param_to_grad_hook_handles[p] = (_NO_HOOK, _NO_HOOK)
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def peak(self) -> tuple[int, int]:
            """(peak total bytes, gradient bytes at that moment), the largest device."""
            snap = self.get_tracker_snapshot("peak")
            if not snap:
                return 0, 0
            dev = max(snap, key=lambda d: snap[d]["Total"])
            return snap[dev]["Total"], snap[dev].get(_MemRefType.GRAD, 0)

    class _RealInputs(TorchDispatchMode):
        """An op none of whose tensors is fake runs on real tensors, outside the fake mode.

        The estimate runs the step on fake parameters, but the micro-batch stays real. Qwen2-VL's
        vision tower and ``get_rope_index`` compute shapes from the values of an image batch's
        ids and grids (``repeat_interleave`` by the grids, ``.tolist()`` of patch counts, boolean
        indexing), which fake tensors cannot answer (DynamicOutputShapeException): kept real, they
        give the real step's shapes; whatever touches a weight is still fake. Active for the whole
        step, so a checkpointed block's recomputation in the backward takes the forward's path.
        MemTracker does not count these tensors (the batch's own metadata) but for the pixel
        values, added by :func:`pixel_bytes`."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if not tensors or any(is_fake(t) for t in tensors):
                return func(*args, **kwargs)
            with unset_fake_temporarily():
                return func(*args, **kwargs)

    class _FakeScalars(TorchDispatchMode):
        """``.item()`` on a fake tensor has no value; the step only needs *a* number to go on.

        The counts it reads are made non-zero (1), which is all train_step checks; memory does
        not depend on these values.
        """

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                if not is_fake(args[0]):  # a real tensor (an image batch's grids): its value
                    with unset_fake_temporarily():
                        return func(*args)
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
    # The first iteration runs untracked. DTensor works out an op's output shapes by running it
    # under the fake mode it detects, ours here (torch/distributed/tensor/_sharding_prop.py,
    # _propagate_tensor_meta_non_cached; a real run makes a fresh one, which allocates nothing),
    # and caches that by shapes: the first step of a process at new shapes counted tensors a
    # real step never holds (+47% at tp 4 with full checkpointing on the main GPT), so the
    # estimate depended on what ran before it. The second iteration, the one tracked, holds the
    # optimiser state as every later step does: its peak is the step's.
    real_inputs = contextlib.nullcontext
    if any(hasattr(x, "pixel_values") for x, _ in batches):  # data-dependent shapes: _RealInputs
        # The targets fake, as the loss's item count is (_FakeScalars), so the two counts agree.
        batches = [(x, fake.from_tensor(t)) for x, t in batches]
        real_inputs = _RealInputs
    with fake, _FakeScalars(), fake_grouped_mm(), real_inputs():
        runner.run(model, optimizer, batches, iterations=1)
    tracker = _StepMemTracker()
    tracker.track_external(model, optimizer)
    with fake, tracker, _FakeScalars(), fake_grouped_mm(), real_inputs():
        runner.run(model, optimizer, batches, iterations=max(1, runner.iterations - 1))
    peak, grads_at_peak = tracker.peak()
    return (
        peak
        + runner.ddp_extra_bytes(model, m, grads_at_peak)
        + runner.expert_parallel_bytes(m, row_width(batches[0][0]))
        + pixel_bytes(batches)
    )


def pixel_bytes(batches: list) -> int:
    """The pixel values of the step's image-text micro-batches (data/image_rows.py), on the device
    for the whole step. The fake run never allocates its real inputs; a real step holds them, and
    for Qwen2-VL, whose patch embedding views them, MemTracker counts them (without them the tiny
    test model's estimate was 13% under the measured peak at micro-batch 2)."""
    return sum(x.pixel_values.nbytes for x, _ in batches if hasattr(x, "pixel_values"))


def row_width(inputs) -> int:
    """The tokens of a micro-batch's rows: a tensor's last dimension, an image-text batch's ids'."""
    return getattr(inputs, "input_ids", inputs).shape[-1]


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
