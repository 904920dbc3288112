"""The load-balancing loss of a mixture of experts, and its router statistics, as an objective.

The model's router layers (models/gpt/moe.py, models/hf/moe.py) leave a :class:`RouterStats`
after each forward: their balance loss *summed* over the forward's sequences (with its graph)
and their tokens per expert. :class:`BalanceLoss` adds each micro-batch's sum to its backward
times ``dp x cp / global sequences`` (the unit is a sequence, counted before the first backward
like the loss's items), so the gradient is that of the mean over the global batch's sequences
on every layout, and rides the step's one reduce with the tokens per expert. Nothing of it is in
the step or the trainer (torchtitan keeps its balancing in the model and an optimizer hook,
``ModelSpec.post_optimizer_build_fn``; here it is one objective like the loss itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from paratrain.config import ConfigError
from paratrain.objectives.base import Objective
from paratrain.objectives.items import rows


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


class BalanceLoss(Objective):
    """The routers' auxiliary loss over the global sequence count, and their tokens per expert.

    Sums: ``[aux sum, tokens per expert (layers x experts)]``. Under pipeline parallel a rank
    holds some of the model's router layers: ``shape`` is (all router layers, experts), fixed
    before the split, and each stage fills the rows of its own layers (``slots``, found by name
    in :meth:`bind`), so the reduce over the stages sums rows that each stage fills (zeros
    elsewhere). A stage's sum joins its own backward (distributed/pipeline_parallel.py).
    """

    pipeline_stage_term = True  # under pp each stage takes its routers' sums (take/add)

    name = "moe_balance"
    unit = "sequence"

    def __init__(self, layers, *, names=(), shape: tuple[int, int] | None = None):
        self.modules = tuple(layers)
        self.names = list(names)  # the whole model's router layers, in order (pipeline: bind)
        self.shape = shape
        self.slot = {id(m): s for s, m in enumerate(self.modules)}
        self.scale = 1.0

    @classmethod
    def of(cls, model: nn.Module, *, pipeline: bool = False) -> BalanceLoss | None:
        """The objective of ``model``'s router layers (a user model's too), None without any;
        ``pipeline``: the stages will hold them, their count and width are fixed now."""
        layers = router_layers(model)
        if not layers:
            return None
        names = [n for n, m in model.named_modules() if hasattr(m, "router_stats")]
        shape = None
        if pipeline:
            # Each stage holds some router layers; the step's reduce needs all of them (their
            # names and widths, known only before the split).
            widths = {router_width(m) for m in layers}
            if len(widths) != 1 or None in widths:
                raise ConfigError(
                    "a model with router layers (mixture of experts) of unknown or unequal expert counts"
                    " with parallel.pp > 1 is not supported; give every router layer the same n_experts or set parallel.pp = 1"
                )
            shape = (len(layers), widths.pop())
        return cls(layers, names=names, shape=shape)

    def bind(self, model: nn.Module) -> None:
        """Under pipeline parallel: this rank's router layers and their positions among the whole
        model's, by name (the stages keep the whole model's names; wrappers add prefixes)."""
        if self.shape is None:
            return  # the whole model's layers, found before the wrappers (which keep the modules)
        position = {n: i for i, n in enumerate(self.names)}
        found = []
        for part in model.parts:
            for name, m in part.named_modules():
                if hasattr(m, "router_stats"):
                    plain = name.removeprefix("module.").replace("_checkpoint_wrapped_module.", "")
                    found.append((position[plain.replace("_orig_mod.", "")], m))
        found.sort(key=lambda x: x[0])
        self.modules = tuple(m for _, m in found)
        self.slot = {id(m): i for i, m in found}

    @property
    def enabled(self) -> bool:
        return bool(self.modules) or bool(self.shape and self.shape[0])

    def count(self, inputs, target) -> float:
        return float(rows(inputs))

    def static_count(self, inputs) -> int:
        return rows(inputs)

    def start(self, *, scale: float, device: torch.device) -> None:
        # Under context parallel each cp rank's auxiliary loss is its tokens' share of its
        # sequences' (models/gpt/moe.py sequence_balance_loss): scale = dp x cp / sequences
        # averages it over dp x cp like the language-model loss.
        self.scale, self.device = scale, device
        self.aux = torch.zeros((), device=device, dtype=torch.float64)
        self.counts: torch.Tensor | None = None

    def loss(self, output, target) -> torch.Tensor | None:
        if not self.modules:
            return None
        aux, counts = self.take(self.modules)
        self.add(self.modules, aux, counts)
        return aux * self.scale

    def take(self, modules) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The forward's auxiliary-loss sum of ``modules`` (with its graph) and their counts."""
        return sum_router_stats(modules)

    def add(self, modules, aux: torch.Tensor, counts: list[torch.Tensor]) -> None:
        """Keep one forward's stats of ``modules`` (some of self.modules)."""
        self.aux += aux.detach().double()
        if self.counts is None:
            self.counts = torch.zeros(
                self.shape or (len(self.slot), counts[0].numel()), device=self.device, dtype=torch.float64
            )
        for m, c in zip(modules, counts):
            self.counts[self.slot[id(m)]] += c.detach().double()

    def end_micro_batch(self) -> None:
        """Drop what activation checkpointing's recompute left in the layers during backward
        (its graph would hold a micro-batch's activations until the next forward)."""
        for m in self.modules:
            m.router_stats = None

    def sums(self) -> torch.Tensor | None:
        if not self.enabled:
            return None
        counts = self.counts if self.counts is not None else torch.zeros(self.shape, dtype=torch.float64)
        return torch.cat([self.aux.reshape(1), counts.to(self.aux.device).reshape(-1)])

    def read(self, reduced: list[float], *, units: int) -> dict:
        """``aux_loss``: the mean over the global batch's sequences (weight included);
        ``tokens_per_expert``: the global batch's top-k assignments, (layers, experts)."""
        if not self.enabled:
            return {}
        n = self.shape[0] if self.shape else len(self.modules)
        counts = torch.tensor(reduced[1:]).view(n, -1)
        return {"aux_loss": reduced[0] / units, "tokens_per_expert": counts.long().tolist()}

    def metrics(self, values: dict) -> dict:
        if "aux_loss" not in values:
            return {}
        return router_metrics(values["aux_loss"], values["tokens_per_expert"])


def router_metrics(aux_loss: float, tokens_per_expert: list[list[int]]) -> dict:
    """The auxiliary loss (not in ``loss``) and the global batch's tokens per expert (top-k
    assignments), their min and max over layers and experts, and the imbalance, the largest
    max/mean of any MoE layer (1: perfectly balanced)."""
    counts = torch.tensor(tokens_per_expert, dtype=torch.float64)
    imbalance = (counts.max(dim=1).values / counts.mean(dim=1).clamp(min=1e-12)).max()
    return {
        "aux_loss": aux_loss,
        "expert_tokens_min": int(counts.min()),
        "expert_tokens_max": int(counts.max()),
        "expert_imbalance": float(imbalance),
    }
