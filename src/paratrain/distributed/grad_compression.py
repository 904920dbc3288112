"""Gradient compression for the data-parallel reduce, and the count of the bytes it sends.

DDP takes a *communication hook* that replaces its bucket all-reduce (torch's
``ddp_comm_hooks``): ``"none"`` keeps DDP's own all-reduce (below), ``"bf16"``/``"fp16"`` cast
each bucket to half width before the all-reduce and back after it (half the bytes), and
``"powersgd"`` is torch's PowerSGD hook (Vogels et al., NeurIPS 2019, arXiv:1905.13727): each
gradient matrix M (n x m) is sent as two rank-r factors P (n x r) and Q (m x r), and the part
the approximation misses is kept on each rank and added to the next step's gradient (error
feedback), so nothing is lost over time. All of them divide by the data-parallel size before
summing, like DDP's own reduce: the loss scaling in ``step.py`` (by ``dp / items``) stays exact.

With ``"none"`` no hook is registered: DDP's built-in bucket all-reduce (C++, no Python on the
hot path) already averages over the data-parallel ranks, and its bytes are known without
watching it: every gradient once per optimiser step (gradient sync runs on the last micro-batch
only, step.py), ``sum(numel x element size)`` over the parameters that take gradients.

Counting bytes "in the hook" (the compressed settings): the hooks talk to a :class:`CountingGroup`, a thin stand-in for
the process group that forwards each collective to the real group and adds up the bytes of the
tensors it carried. That counts what the hook actually sent (for PowerSGD: the uncompressed
vectors, then P, then Q), not what we think it should send. The figure is the payload handed
to the collectives; a ring all-reduce moves about 2(n-1)/n times that over each rank's link.

Under FSDP2 the reduce is a reduce-scatter inside ``fully_shard``, with no hook: the only knob
torch gives is ``MixedPrecisionPolicy(reduce_dtype=...)`` (see :mod:`paratrain.precision`), so
"bf16"/"fp16" map to that and PowerSGD is refused.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.parallel import DistributedDataParallel as DDP

from paratrain.config import CommConfig, ConfigError
from paratrain.distributed.layout_checks import check_compression as check_compression  # its old home
from paratrain.precision import DTYPES

log = logging.getLogger("paratrain")

HALF_DTYPES = {name: DTYPES[name] for name in ("bf16", "fp16")}


class CountingGroup:
    """A process group stand-in for DDP comm hooks: forwards collectives and counts their bytes.

    ``dist.all_reduce(t, group=g)`` calls ``g.allreduce([t], opts)``; the hooks also ask
    ``g.size()``. Everything else is forwarded to the real group.
    """

    def __init__(self, group: dist.ProcessGroup):
        self._group = group
        self._lock = threading.Lock()  # gloo may run future callbacks on another thread
        self.bytes = 0

    def allreduce(self, tensors, opts=None):
        with self._lock:
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return self._group.allreduce(tensors, opts) if opts is not None else self._group.allreduce(tensors)

    def take(self) -> int:
        """Bytes counted since the last call."""
        with self._lock:
            n, self.bytes = self.bytes, 0
        return n

    def __getattr__(self, name):
        return getattr(self._group, name)


def _bf16_compress_hook_gloo(process_group, bucket):
    """torch's bf16 compress hook, for CPU tensors on gloo.

    DDP refuses ``bf16_compress_hook`` by its name unless CUDA with NCCL >= 2.10 is present
    (old NCCL had no bf16 sum); gloo sums bf16 on CPU, so the same body (torch's
    ``_compress_hook``, which ``bf16_compress_hook`` calls) runs here under another name.
    """

    return default_hooks._compress_hook(torch.bfloat16, process_group, bucket)


@dataclass
class GradCompression:
    """What the trainer keeps: the counter to read each step and the hook's state."""

    name: str
    counter: CountingGroup | None = None
    state: object = None
    extra: dict = field(default_factory=dict)
    bytes_per_step: int | None = None  # "none" under DDP: counted arithmetically, once per step
    checkpoint: Stateful | None = None  # what a checkpoint saves of it (PowerSGD's state), None if nothing

    def take_bytes(self) -> int | None:
        """Gradient bytes handed to collectives since the last call (None when not counted)."""
        if self.bytes_per_step is not None:
            return self.bytes_per_step
        return None if self.counter is None else self.counter.take()


class PowerSGDCheckpoint(Stateful):
    """PowerSGD's state for checkpoints: the iteration count (which decides when compression
    starts), the warm-start Q factors (the same on every rank: they are all-reduced) and this
    rank's error feedback (its own: ``per_rank``), each keyed by DDP bucket index.

    The P buffers are saved too although every step recomputes P from the gradient and Q: torch's
    hook takes a bucket without a P buffer for a new one and draws fresh random Qs for it (from
    its numpy RNG, also saved), which would throw the warm start away. At another world size the error feedback of the ranks cannot be mapped onto the new ones; it restarts at
    zero (rank 0's Q and count are kept) and the run leaves the uninterrupted trajectory.
    """

    per_rank = True

    def __init__(self, state: powerSGD_hook.PowerSGDState, device: torch.device):
        self.state, self.device = state, device

    def state_dict(self) -> dict:
        s = self.state
        _, key, pos, has_gauss, gauss = s.rng.get_state()
        return {
            "iter": s.iter,
            "error": {str(k): v for k, v in s.error_dict.items()},
            "p": {str(k): v for k, v in s.p_memory_dict.items()},
            "q": {str(k): v for k, v in s.q_memory_dict.items()},
            "rng": {"key": torch.from_numpy(key.astype("int64")), "pos": pos, "has_gauss": has_gauss, "gauss": gauss},
        }

    def load_state_dict(self, state_dict: dict, *, own: bool = True) -> None:
        s = self.state
        s.iter = int(state_dict["iter"])
        s.p_memory_dict = {int(k): v.to(self.device) for k, v in (state_dict.get("p") or {}).items()}
        s.q_memory_dict = {int(k): v.to(self.device) for k, v in (state_dict.get("q") or {}).items()}
        rng = state_dict.get("rng")
        if rng:
            key = rng["key"].numpy().astype("uint32")
            s.rng.set_state(("MT19937", key, int(rng["pos"]), int(rng["has_gauss"]), float(rng["gauss"])))
        s.error_dict = {int(k): v.to(self.device) for k, v in (state_dict.get("error") or {}).items()} if own else {}
        if not own:
            log.warning(
                "PowerSGD: the checkpoint was written at another world size; its error feedback restarts at zero"
            )


def apply_grad_compression(model: nn.Module, *, cfg: CommConfig, seed: int = 0) -> GradCompression:
    """Register the comm hook of ``cfg.compression`` on a DDP model; no-op for other models.

    ``"none"`` keeps DDP's built-in all-reduce (no hook) and counts its bytes arithmetically:
    a Python hook cost a measurable share of a small model's step (docs/overhead.md).
    """

    if not isinstance(model, DDP):
        return GradCompression(cfg.compression)
    if cfg.compression == "none":
        grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        return GradCompression("none", bytes_per_step=grads)
    counter = CountingGroup(model.process_group)
    if cfg.compression in HALF_DTYPES:
        hook = default_hooks.fp16_compress_hook
        if cfg.compression == "bf16":
            on_cuda = next(model.parameters()).is_cuda
            hook = default_hooks.bf16_compress_hook if on_cuda else _bf16_compress_hook_gloo
        model.register_comm_hook(counter, hook)
        return GradCompression(cfg.compression, counter, counter)
    if cfg.compression == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=counter,
            matrix_approximation_rank=cfg.powersgd_rank,
            start_powerSGD_iter=cfg.powersgd_start_step,
            use_error_feedback=True,
            warm_start=True,
            # The random init of Q must be the same on every rank: a fixed seed, from the run's.
            random_seed=seed,
            # torch logs its own compression stats every N iterations; we log bytes per step.
            compression_stats_logging_frequency=10**9,
        )
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        # PowerSGD keys its error feedback and Q factors by DDP bucket. DDP rebuilds its buckets
        # once, after the first backward of a process, in the order the gradients were ready; a
        # resumed process would run its first step on the initial buckets with state saved for
        # the rebuilt ones. Pushing the rebuilt order now (parameter order, what DDP's Join does
        # for late ranks) fixes one bucket layout from the first step, the same in every process.
        model.reducer._push_all_rebuilt_params()
        device = next(model.parameters()).device
        return GradCompression("powersgd", counter, state, checkpoint=PowerSGDCheckpoint(state, device))
    raise ConfigError(f"comm.compression = {cfg.compression!r} is unknown; use 'none', 'bf16', 'fp16' or 'powersgd'")
