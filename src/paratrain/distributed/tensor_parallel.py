"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism (Korthikanti et
al. 2022) with DTensor: ``apply_tp(model, mesh, *, plan, sequence_parallel, loss_parallel)``.

A model's own plan comes from its ModelSpec (the built-in GPT's: models/gpt/parallel.py): in each block the first linear layers are split by
output features ("colwise": q/k/v, i.e. whole heads, and the MLP's fc_in) and the second ones by
input features ("rowwise": o_proj, fc_out), so a block costs one all-reduce in forward and one in
backward per sub-layer and nothing in between. The token embedding is split by vocabulary rows,
the output layer by vocabulary columns; with ``loss_parallel`` the cross-entropy runs on those
vocabulary shards (torch's ``loss_parallel``) and the (batch, seq, vocab) logits are never
gathered. Sequence parallelism shards the norms and the residual stream along the sequence
between the tensor-parallel regions: the all-reduce becomes a reduce-scatter + all-gather pair
(same traffic) and activations outside the matmuls take 1/tp of the memory.

Users' models: ``[parallel.tp_plan]`` maps module-name patterns (fnmatch) to style names, or
``parallel.tp_plan_factory = "pkg.module:fn"`` returns ``{fqn: ParallelStyle}`` for
``parallelize_module``. Every rank of one TP group sees the same data (the data loader indexes by
the dp rank only, see ParallelDims), so the loss is the same on each of them.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel import (
    loss_parallel as torch_loss_parallel,
)

from paratrain.config import ConfigError, resolve_callable
from paratrain.distributed.layout_checks import STYLE_NAMES


class ReplicateWithGradAllReduce(ParallelStyle):
    """Replicated parameters of a module that sees a head-sharded input (dim -2, local heads): the
    ``replicated_with_grad_allreduce`` entry of a transformers plan (models/hf/parallel.py)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        for name, p in list(module.named_parameters(recurse=False)):
            dt = DTensor.from_local(p.data, device_mesh, [Replicate()], run_check=False)
            module.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))

        def to_dtensor(mod, args):
            x = args[0]
            return (DTensor.from_local(x, device_mesh, [Shard(x.dim() - 2)], run_check=False), *args[1:])

        module.register_forward_pre_hook(to_dtensor)
        module.register_forward_hook(lambda mod, args, out: out.to_local() if isinstance(out, DTensor) else out)
        return module


def style_from_name(name: str, module: nn.Module, key: str) -> ParallelStyle:
    # An embedding's "rowwise" split is over vocabulary rows; its input (token ids) is replicated.
    emb_in = Replicate() if isinstance(module, nn.Embedding) else Shard(-1)
    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        return RowwiseParallel(input_layouts=emb_in)
    if name == "colwise_gather":
        return ColwiseParallel(output_layouts=Replicate())
    if name == "sequence":
        return SequenceParallel()
    if name == "rowwise_to_sequence":
        return RowwiseParallel(input_layouts=emb_in, output_layouts=Shard(1))
    if name == "sequence_to_colwise":
        return ColwiseParallel(input_layouts=Shard(1))
    raise ConfigError(f"{key} = {name!r} is not a tensor-parallel style; use one of {', '.join(STYLE_NAMES)}")


def plan_from_table(
    model: nn.Module,
    table: dict,
    *,
    style_of: Callable[[str, nn.Module, str], ParallelStyle] = style_from_name,
    key_of: Callable[[str], str] = lambda pattern: f"parallel.tp_plan.{pattern}",
    require_match: bool = True,
) -> dict[str, ParallelStyle]:
    """Expand ``{pattern: style name}`` (fnmatch on module names) into ``{fqn: ParallelStyle}``.

    The ONE expansion: ``[parallel.tp_plan]`` uses paratrain's style names; an HF model's own
    ``base_model_tp_plan`` passes transformers' names (``style_of``, models/hf/parallel.py) and
    ``require_match=False``, since a pipeline stage holds only some of the modules named.
    """
    modules = {fqn: m for fqn, m in model.named_modules() if fqn}
    plan: dict[str, ParallelStyle] = {}
    for pattern, name in table.items():
        key = key_of(pattern)
        if not isinstance(name, str):
            raise ConfigError(f"{key} = {name!r} must be a style name; use one of {', '.join(STYLE_NAMES)}")
        hits = [fqn for fqn in modules if fnmatch.fnmatchcase(fqn, pattern)]
        if not hits and require_match:
            sample = ", ".join(list(modules)[:8])
            raise ConfigError(f"{key}: the pattern matches no module of the model; module names look like: {sample}")
        for fqn in hits:
            plan[fqn] = style_of(name, modules[fqn], key)
    return plan


def styles_around_adapters(model: nn.Module, styles: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """The plan of a model whose planned linear layers PEFT wrapped in LoRA adapters (docs/lora.md).

    A LoRA layer computes ``base_layer(x) + lora_B(lora_A(x)) * scale``; the plan names the
    wrapper, whose own parameters live in ``base_layer``, ``lora_A.default``, ``lora_B.default``.
    The base layer keeps its style and the adapter is split so that its output is laid out like
    the base's, with no collective of its own beyond the base's kind:

    - colwise base (output features split): ``lora_B`` colwise with the base's input and output
      layouts, ``lora_A`` replicated (r x in is small; its gradient is all-reduced by ``lora_B``'s
      input, as a colwise layer's input gradient is);
    - rowwise base (input features split): ``lora_A`` rowwise with the base's layouts (its r-wide
      output all-reduced, or reduce-scattered over the sequence), ``lora_B`` replicated.

    ``modules_to_save`` copies (PEFT's ModulesToSaveWrapper: ``original_module`` and
    ``modules_to_save.default``) both take the wrapper's style. Other entries stay as they are.
    """
    modules = dict(model.named_modules())
    out: dict[str, ParallelStyle] = {}
    for fqn, style in styles.items():
        module = modules.get(fqn)
        if module is not None and hasattr(module, "base_layer") and hasattr(module, "lora_A"):
            out[f"{fqn}.base_layer"] = style
            for adapter in module.lora_A:
                out.update(_adapter_styles(f"{fqn}", adapter, style, fqn))
        elif module is not None and hasattr(module, "original_module") and hasattr(module, "modules_to_save"):
            out[f"{fqn}.original_module"] = style
            for adapter in module.modules_to_save:
                out[f"{fqn}.modules_to_save.{adapter}"] = style
        else:
            out[fqn] = style
    return out


def _adapter_styles(fqn: str, adapter: str, style: ParallelStyle, key: str) -> dict[str, ParallelStyle]:
    # A colwise layer's output dimension is lora_B's, a rowwise layer's input dimension lora_A's.
    part = {ColwiseParallel: "lora_B", RowwiseParallel: "lora_A"}.get(type(style))
    if part is not None:
        return {
            f"{fqn}.{part}.{adapter}": type(style)(
                input_layouts=style.input_layouts[0],
                output_layouts=style.output_layouts[0],
                use_local_output=style.use_local_output,
            )
        }
    raise ConfigError(
        f"model.lora: {key} has tensor-parallel style {type(style).__name__}, which LoRA adapters cannot follow"
        " yet (colwise or rowwise only); leave it out of model.lora.target_modules or set parallel.tp = 1"
    )


def _check_sequence_divisible(tp: int):
    def hook(module, args):
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] % tp:
            raise ConfigError(
                f"parallel.sequence_parallel shards the sequence over parallel.tp = {tp} ranks but a"
                f" batch has sequence length {x.shape[1]}; use a sequence length divisible by {tp}"
                " or set parallel.sequence_parallel = false"
            )

    return hook


def _keep_gradients_sharded(model: nn.Module) -> None:
    """Give every DTensor parameter's gradient the parameter's own layout.

    DTensor's sharding rules can return a gradient more replicated than its parameter: the
    backward of a vocabulary-sharded embedding (RowwiseParallel) yields a Replicate gradient of
    the full table on every rank. The optimiser still computes the right update (it
    redistributes), but each rank would hold the full gradient. Redistributing Replicate ->
    Shard is a local slice (no communication); Partial -> Shard is a reduce-scatter. (FSDP2,
    when applied on top, replaces these parameters and does the same for its own gradients.)
    """
    for p in model.parameters():
        if isinstance(p, DTensor) and p.requires_grad:
            placements = p.placements
            p.register_hook(
                lambda g, pl=placements: (
                    g.redistribute(placements=pl) if isinstance(g, DTensor) and g.placements != pl else g
                )
            )


def loss_parallel_enabled(
    *, tp: int, requested: bool, builtin_cross_entropy: bool, user_plan: bool, supported: bool
) -> bool:
    """Whether the loss runs on vocabulary-sharded logits: only for a model whose own plan shards
    its output layer (``ModelSpec.loss_parallel``), under that plan, with the built-in
    cross-entropy (torch's loss_parallel covers cross_entropy, not any loss)."""
    return tp > 1 and requested and builtin_cross_entropy and not user_plan and supported


def apply_tp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    plan: dict,
    plan_factory: str,
    sequence_parallel: bool,
    loss_parallel: bool,
    model_plan: Callable[..., dict] | None = None,
) -> None:
    """Shard ``model`` in place over the 1-D ``mesh``.

    ``plan``/``plan_factory`` are the user's plan; without them the model's own ``model_plan``
    (``ModelSpec.tp_plan(model, *, sequence_parallel, loss_parallel)``) is used.
    ``loss_parallel`` (decided by :func:`loss_parallel_enabled`) leaves the GPT's logits as
    vocabulary-sharded DTensors; the step then runs the loss under :func:`maybe_loss_parallel`.
    """
    if plan_factory:
        styles = resolve_callable(plan_factory, "parallel.tp_plan_factory")(model, mesh)
        if not isinstance(styles, dict):
            raise ConfigError("parallel.tp_plan_factory must return a dict {module name: ParallelStyle}")
    elif plan:
        styles = plan_from_table(model, plan)
    elif model_plan is not None:
        styles = model_plan(model, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    else:
        raise ConfigError(
            f"parallel.tp = {mesh.size()} needs a plan for {type(model).__name__}; set a"
            " [parallel.tp_plan] table or parallel.tp_plan_factory (see the README)"
        )
    parallelize_module(model, mesh, styles_around_adapters(model, styles))
    _keep_gradients_sharded(model)
    if sequence_parallel:
        model.register_forward_pre_hook(_check_sequence_divisible(mesh.size()))


def maybe_loss_parallel(enabled: bool) -> contextlib.AbstractContextManager:
    """torch's loss_parallel context (cross-entropy on vocabulary-sharded logits) when enabled.

    It must cover the loss's forward and backward: both run the sharded kernels.
    """
    return torch_loss_parallel() if enabled else contextlib.nullcontext()
