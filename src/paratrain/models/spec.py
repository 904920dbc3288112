"""ModelSpec: what paratrain needs to know about a model family, kept next to the model.

torchtitan's ``ModelSpec`` idea in our words: the parallel code (``distributed/``) knows no model;
it receives the spec's pieces as arguments. A spec says

- how to build the model (``build(**model.args) -> nn.Module``, on CPU, after seeding);
- where its repeated blocks are: ``blocks_attr`` names a ModuleDict/ModuleList/Sequential
  attribute of the model, and that ONE rule is what the pipeline split, FSDP wrapping,
  activation checkpointing and per-block compile all use. The pipeline's first stage also keeps
  the modules registered before the blocks (embeddings), its last stage those after (final
  norm, output layer);
- its tensor-parallel plan: ``tp_plan(model, *, sequence_parallel, loss_parallel) ->
  {module name: ParallelStyle}`` (None: the user gives ``[parallel.tp_plan]``);
- its training FLOPs per token: ``flops_per_token(model) -> f(seq_len)`` (default 6 x params);
  ``flops_count_attention``: that count includes the attention products (the GPT's, PaLM's
  count), so the planner takes it whole instead of counting the blocks' matmuls itself;
- its own layout checks: ``check_layout(args, *, tp, sequence_parallel)`` raising ConfigError
  before any process starts (e.g. attention heads divisible by tp), and ``check_degrees(args, *,
  dims, parallel)`` for what its args ask of the cp and ep degrees (e.g. heads split over
  cp x tp by all-to-all attention, routed experts divisible by ep);
- whether the built-in cross-entropy may run on vocabulary-sharded logits (``loss_parallel``);
- its context length from its args (``context_length``), checked against the data's block size
  and the row length when the data does not set one;
- ``materialize(model, *, device)``: when set, the model is built on the meta device and this
  fills it after the parallelisms (each rank its own shards; e.g. pretrained HF weights);
- ``head_attr``: its output layer (an ``nn.Linear``), which a chunked cross-entropy
  (``loss.chunk_size``) runs itself; the model then returns its last hidden states when its
  ``return_hidden`` attribute is True (None: the model has no such switch);
- ``cp_attention(model, attention_fn)``: installs a context-parallel attention
  (distributed/context_parallel.py ``apply_cp``) that the model's attention then calls as
  ``attention_fn(q, k, v, positions=...)`` (None: the model cannot run ``parallel.cp > 1``);
- ``expert_layers(module) -> [ExpertLayer]``: the mixture-of-experts layers inside a module (the
  model or one block), in module order: what the planner and the memory estimate price (the
  active experts' FLOPs, ``ep``, the experts' memory per rank; none for a dense model).

A user model gets a spec from its factory (``model.factory`` may return a ModelSpec instead of a
module) or from the documented conventions: blocks in ``model.layers``, the plan from
``[parallel.tp_plan]`` or ``parallel.tp_plan_factory``, FLOPs from 6 x parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from paratrain.config import ConfigError
from paratrain.distributed.blocks import BLOCKS_ATTR, blocks_of


@dataclass(frozen=True)
class ExpertLayer:
    """One sparse layer as plan/ and batch/ price it: the module holding its routed experts (all
    of them, as built), their count, the experts each token runs (``top_k``) and the width of
    the tokens dispatched to them. Shared experts are not routed: they count as dense weights."""

    experts: nn.Module
    n_experts: int
    top_k: int
    d_model: int

    @property
    def params(self) -> int:
        """Parameters of all the routed experts."""
        return sum(p.numel() for p in self.experts.parameters())

    @property
    def inactive_params(self) -> int:
        """Parameters of the ``n_experts - top_k`` routed experts a token does not run."""
        return self.params // self.n_experts * (self.n_experts - self.top_k)


def no_expert_layers(module: nn.Module) -> list[ExpertLayer]:
    return []


def params_flops_per_token(model: nn.Module) -> Callable[[int], float]:
    """6 x parameters per token (sample, for non-token inputs): a lower bound that ignores
    attention-like products (forward 2, backward 4 FLOPs per parameter)."""
    n = sum(p.numel() for p in model.parameters())
    return lambda seq_len: 6.0 * n


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[..., nn.Module]
    blocks_attr: str = BLOCKS_ATTR
    tp_plan: Callable[..., dict] | None = None
    flops_per_token: Callable[[nn.Module], Callable[[int], float]] = params_flops_per_token
    check_layout: Callable[..., None] | None = None
    check_degrees: Callable[..., None] | None = None
    loss_parallel: bool = False
    context_length: Callable[[dict], int | None] | None = None
    materialize: Callable[..., object] | None = None
    head_attr: str | None = None
    cp_attention: Callable[[nn.Module, Callable], None] | None = None
    expert_layers: Callable[[nn.Module], list[ExpertLayer]] = no_expert_layers
    flops_count_attention: bool = False

    def hand_head_to(self, model: nn.Module, loss_fn, *, loss_parallel: bool) -> None:
        """Give the output layer to a loss that runs it (loss.py ``ChunkedCrossEntropy``), before
        the parallelisms: they change the layer's parameters in place, and a pipeline's last
        stage is the model itself cut down (distributed/pipeline_parallel.py ``apply_pp``)."""
        if not getattr(loss_fn, "owns_head", False):
            return
        head = getattr(model, self.head_attr, None) if self.head_attr else None
        if not isinstance(head, nn.Linear):
            raise ConfigError(
                f"loss.chunk_size needs the model's plain output layer ({self.name} has"
                f" {type(head).__name__ if head is not None else 'none'}: the built-in GPT and model.hf have one,"
                " unless model.lora.modules_to_save wraps it); set loss.chunk_size = 0"
            )
        model.return_hidden = True
        loss_fn.fn.bind(head, loss_parallel=loss_parallel)

    def blocks(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """The model's repeated blocks ``[(name, module), ...]`` (empty when it has none)."""
        return blocks_of(model, self.blocks_attr)


def default_spec(name: str, build: Callable[..., nn.Module]) -> ModelSpec:
    """The spec of a plain module from a user factory: the documented conventions."""
    return ModelSpec(name=name, build=build)
