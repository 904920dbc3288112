"""Losses as (sum of item losses, item count), so normalisation is by the global item count.

The count of a micro-batch must be known before any backward of the step (it is gathered over
micro-batches and ranks first), so every loss also counts items from the target alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

from paratrain.config import ConfigError, LossConfig, resolve_callable


class Loss:
    """``loss(output, target) -> (sum, count)`` and ``loss.count(target) -> count``."""

    def __init__(self, fn: Callable, count: Callable, name: str):
        self.fn, self._count, self.name = fn, count, name

    def __call__(self, output, target) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fn(output, target)

    def count(self, target) -> torch.Tensor:
        return torch.as_tensor(self._count(target), dtype=torch.float64)

    @property
    def owns_head(self) -> bool:
        """The loss runs the model's output layer itself (``loss.chunk_size``)."""
        return isinstance(self.fn, ChunkedCrossEntropy)


def build_loss(cfg: LossConfig, fn: Callable | None = None) -> Loss:
    ignore = cfg.ignore_index

    def count_not_ignored(target: torch.Tensor) -> torch.Tensor:
        return (target != ignore).sum()

    if cfg.chunk_size < 0:
        raise ConfigError(f"loss.chunk_size = {cfg.chunk_size} must be >= 0 (0: no chunking)")
    if cfg.chunk_size and (fn is not None or cfg.name != "cross_entropy"):
        # Checked before the user's loss is taken: a chunk size it would silently ignore is refused.
        raise ConfigError(
            f"loss.chunk_size = {cfg.chunk_size} chunks the built-in cross_entropy only, not"
            f" {'the loss passed to train()' if fn is not None else repr(cfg.name)}; set loss.chunk_size = 0"
        )
    if fn is not None or ":" in cfg.name:
        user = fn if fn is not None else resolve_callable(cfg.name, "loss.name")
        # A user loss may say how it counts with a `count(target)` attribute; by default the
        # items are the target elements not equal to loss.ignore_index.
        count = getattr(user, "count", count_not_ignored)
        return Loss(_checked(user), count, getattr(user, "__name__", "user"))
    if cfg.name == "cross_entropy" and cfg.chunk_size:
        return Loss(ChunkedCrossEntropy(cfg.chunk_size, ignore), count_not_ignored, "cross_entropy")
    if cfg.name == "cross_entropy":

        def cross_entropy(logits: torch.Tensor, target: torch.Tensor):
            s = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), ignore_index=ignore, reduction="sum"
            )
            return s, count_not_ignored(target)

        return Loss(cross_entropy, count_not_ignored, "cross_entropy")
    if cfg.name == "mse":

        def mse(output: torch.Tensor, target: torch.Tensor):
            return F.mse_loss(output.float(), target.float(), reduction="sum"), target.numel()

        return Loss(mse, lambda t: t.numel(), "mse")
    raise ConfigError(f"loss.name = {cfg.name!r} is unknown; use 'cross_entropy', 'mse' or 'package.module:function'")


def _checked(user: Callable) -> Callable:
    def call(output, target):
        result = user(output, target)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise ConfigError(
                f"a user loss must return (sum_of_item_losses, item_count); it returned {type(result).__name__}"
            )
        return result

    return call


def _data_parallel_shards(weight: DTensor) -> tuple[str, ...]:
    """The mesh dimensions other than ``tp`` over which ``weight`` is sharded (FSDP2's)."""
    names = weight.device_mesh.mesh_dim_names or ()
    return tuple(n for n, p in zip(names, weight.placements) if n != "tp" and p.is_shard())


class ChunkedCrossEntropy:
    """The cross-entropy of the output layer's logits, ``chunk`` positions at a time.

    The model returns its last hidden states (its ``return_hidden`` is set, models/spec.py
    ``ModelSpec.hand_head_to``) and this loss owns the output layer (``bind``): each chunk's
    logits are made, turned into a float32 loss sum and dropped, and recomputed in the backward
    (non-reentrant ``torch.utils.checkpoint``), so at most one chunk's ``[chunk, vocab]`` logits
    and their gradient exist at once: 2.4 GB less per 4k-token sequence at a 150k vocabulary.
    The idea of Liger Kernel's fused linear cross-entropy and of Cut Cross-Entropy (Wijmans
    et al. 2024, arXiv:2411.09009), on torch's own checkpoint instead of a kernel. The
    autograd engine sums the chunks' gradients of the weight before it reaches the weight's
    accumulator, so DDP's hooks fire once per parameter and FSDP2's root keeps the weight
    unsharded from its forward to its backward (torch does not reshard the root after forward).

    Under tensor parallelism the weight is a DTensor sharded by vocabulary rows: the hidden
    states are made replicated first (an all-gather under sequence parallelism, as the layer's
    own ColwiseParallel would do), and each chunk's logits stay vocabulary-sharded for torch's
    ``loss_parallel`` or are gathered per chunk without it.
    """

    def __init__(self, chunk: int, ignore_index: int):
        self.chunk, self.ignore_index = chunk, ignore_index
        self.head: nn.Module | None = None
        self.loss_parallel = False

    def bind(self, head: nn.Module, *, loss_parallel: bool) -> None:
        """Own ``head`` (an ``nn.Linear``: its weight and bias are read at each call, so the
        parallelisms may replace them in place)."""
        self.head, self.loss_parallel = head, loss_parallel

    def __call__(self, hidden: torch.Tensor, target: torch.Tensor):
        if self.head is None:
            raise RuntimeError(
                "loss.chunk_size > 0 but no output layer was handed to the loss (ModelSpec.hand_head_to)"
            )
        weight, bias = self.head.weight, self.head.bias
        if isinstance(weight, DTensor) and (dims := _data_parallel_shards(weight)):
            # A weight sharded over data-parallel ranks is an FSDP2 shard: its root was resharded
            # after the forward (parallelize's loss_owns_head not applied). Read as if it were a
            # tensor-parallel weight it gives plausible, wrong logits, and gradients that skip
            # FSDP2's reduce-scatter: refuse it instead.
            raise RuntimeError(
                f"loss.chunk_size > 0: the output layer's weight is still sharded by FSDP2 over {dims}"
                " when the loss reads it; its FSDP2 root must keep it gathered after the forward"
                " (parallelize(..., loss_owns_head=True))"
            )
        if isinstance(weight, DTensor):
            whole = [Replicate()] * weight.device_mesh.ndim
            if isinstance(hidden, DTensor):
                hidden = hidden.redistribute(weight.device_mesh, whole)
            else:  # replicated over the tensor-parallel ranks already
                hidden = DTensor.from_local(hidden, weight.device_mesh, whole, run_check=False)
        elif isinstance(hidden, DTensor):
            hidden = hidden.full_tensor()
        hidden = hidden.reshape(-1, hidden.shape[-1])
        target = target.reshape(-1)
        total = None
        for h, t in zip(hidden.split(self.chunk), target.split(self.chunk)):
            s = checkpoint(self._chunk, h, t, weight, bias, use_reentrant=False, preserve_rng_state=False)
            total = s if total is None else total + s
        return total, (target != self.ignore_index).sum()

    def _chunk(self, h, t, weight, bias):
        logits = F.linear(h, weight, bias)
        if isinstance(logits, DTensor) and not self.loss_parallel:
            logits = logits.full_tensor()
        return F.cross_entropy(logits.float(), t, ignore_index=self.ignore_index, reduction="sum")


@dataclass
class RouterStats:
    """What a mixture-of-experts layer's router leaves after a forward (models/gpt/moe.py).

    ``aux_sum``: the weighted auxiliary loss *summed* over this forward's sequences (with its
    graph), so the step divides the global sum by the global sequence count as it divides the
    language-model loss by the global item count; ``tokens_per_expert``: (n_experts,) counts of
    this forward's top-k assignments.
    """

    aux_sum: torch.Tensor
    tokens_per_expert: torch.Tensor


def router_layers(model: nn.Module) -> list[nn.Module]:
    """The modules that leave RouterStats (``router_stats`` attribute), in module order; also
    through a DDP wrapper."""
    return [m for m in model.modules() if hasattr(m, "router_stats")]


def take_router_stats(layers) -> list[RouterStats]:
    """The RouterStats of the forward just run, one per router layer (of :func:`router_layers`),
    cleared so that a layer which did not run this time is caught instead of counted twice."""
    out = []
    for m in layers:
        if m.router_stats is None:
            raise RuntimeError(f"{type(m).__name__} left no router_stats in this forward")
        out.append(m.router_stats)
        m.router_stats = None
    return out


def sum_router_stats(layers) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Take the forward's RouterStats of ``layers``: their auxiliary-loss sum (with its graph, in
    layer order) and each layer's tokens per expert."""
    stats = take_router_stats(layers)
    aux = stats[0].aux_sum
    for s in stats[1:]:  # in layer order
        aux = aux + s.aux_sum
    return aux, [s.tokens_per_expert for s in stats]


def router_width(layer: nn.Module) -> int | None:
    """The number of experts a router layer counts tokens for (None when it does not say)."""
    for owner, attr in ((getattr(layer, "cfg", None), "n_experts"), (layer, "n_experts"), (layer, "num_experts")):
        if isinstance(getattr(owner, attr, None), int):
            return getattr(owner, attr)
    return None


class RouterTotals:
    """The mixture-of-experts side of one training step (step.py; StepContext.router_layers,
    nothing without them).

    Each micro-batch's auxiliary-loss sum joins its backward times ``aux_scale = dp / global
    sequences`` (the same dp round trip as the language-model loss's ``dp / items``), so the
    gradient is that of ``sum over the global batch's sequences / their count`` on every layout;
    its value and the tokens per expert ride the step's one reduce (``totals``).

    Under pipeline parallel a rank holds some of the model's router layers: ``slots`` are their
    positions among all of them and ``shape`` is (all router layers, experts), so the reduce over
    the stages sums rows that each stage fills for its own layers (zeros elsewhere).
    """

    def __init__(
        self,
        layers: tuple,
        *,
        aux_scale: float,
        device: torch.device,
        slots: tuple[int, ...] | None = None,
        shape: tuple[int, int] | None = None,
    ):
        self.layers, self.aux_scale, self.device = layers, aux_scale, device
        self.slot = {id(m): s for m, s in zip(layers, range(len(layers)) if slots is None else slots)}
        self.shape = shape
        self.aux = torch.zeros((), device=device, dtype=torch.float64)
        self.counts: torch.Tensor | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.layers) or bool(self.shape and self.shape[0])

    def take(self) -> torch.Tensor | None:
        """This forward's auxiliary-loss sum (with its graph, times aux_scale), its stats kept."""
        if not self.layers:
            return None
        aux, counts = sum_router_stats(self.layers)
        self.add(self.layers, aux, counts)
        return aux * self.aux_scale

    def add(self, layers, aux: torch.Tensor, counts: list[torch.Tensor]) -> None:
        """Keep one forward's stats of ``layers`` (some of self.layers): see :func:`sum_router_stats`."""
        self.aux += aux.detach().double()
        if self.counts is None:
            self.counts = torch.zeros(
                self.shape or (len(self.slot), counts[0].numel()), device=self.device, dtype=torch.float64
            )
        for m, c in zip(layers, counts):
            self.counts[self.slot[id(m)]] += c.detach().double()

    def clear(self) -> None:
        """Drop what activation checkpointing's recompute left in the layers during backward
        (its graph would hold a micro-batch's activations until the next forward)."""
        for m in self.layers:
            m.router_stats = None

    def totals(self) -> torch.Tensor | None:
        if not self.enabled:
            return None
        counts = self.counts if self.counts is not None else torch.zeros(self.shape, dtype=torch.float64)
        return torch.cat([self.aux.reshape(1), counts.to(self.aux.device).reshape(-1)])

    def read(self, reduced: list[float], *, sequences: int) -> tuple[float | None, list[list[int]] | None]:
        if not self.enabled:
            return None, None
        n = self.shape[0] if self.shape else len(self.layers)
        counts = torch.tensor(reduced[1:]).view(n, -1)
        return reduced[0] / sequences, counts.long().tolist()
