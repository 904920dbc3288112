"""The tensor-parallel plan of an HF decoder from its own ``base_model_tp_plan``, and its layout checks.

transformers ships, per architecture, a table of module-name patterns (relative to the decoder:
``layers.*.self_attn.q_proj``) to style names, and the causal-LM class one for ``lm_head``.
We map those names to torch's DTensor styles here (the same meaning as transformers'
``integrations/tensor_parallel.py`` and torchtitan's Llama plan), with the module names of
``HFCausalLM`` (models/hf/model.py), which keeps the decoder's names (``layers.0.self_attn...``):

- ``colwise``: ColwiseParallel (split output features: whole heads of q/k/v, the MLP's up/gate);
  the attention reshapes with ``view(..., -1, head_dim)``, so it runs on ``heads / tp`` local
  heads, and grouped-query attention keeps ``heads / kv_heads`` because both divide by tp;
- ``rowwise``: RowwiseParallel (split input features, all-reduce the output: o_proj, down_proj);
- ``colwise_rep`` / ``colwise_gather_output``: ColwiseParallel with the output gathered;
- ``rowwise_rep``: RowwiseParallel with a replicated output (what rowwise gives already);
- ``replicated_with_grad_allreduce``: parameters replicated, but the module sees only this
  rank's heads (Qwen3's per-head q/k norms), so its gradient must be summed over the tp ranks:
  the input is wrapped as a DTensor sharded on the heads dim and DTensor's backward reduces the
  weight's gradient (a Partial -> Replicate all-reduce);
- ``sequence_parallel``: SequenceParallel.

Embeddings stay replicated (the plans of transformers 5 do not split them), and ``lm_head`` is
split only when its weight is not tied to the embedding (splitting one would split both).

A mixture of experts' sparse block (models/hf/moe.py) stays **replicated** over tp, as the GPT's
MoE does (docs/moe.md): the plan's entries for its router and experts (transformers 5's
``layers.*.mlp.experts`` "moe_tp_experts", "packed_colwise", ...) are left out, so every tp rank
runs the whole block on the whole (replicated) residual stream. The attention keeps its plan,
and so do the dense MLPs of a model that mixes both (Qwen3-MoE's ``mlp_only_layers``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from paratrain.config import ConfigError
from paratrain.models.hf.moe import sparse_blocks

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

# torch's tensor-parallel styles (DTensor) and distributed/tensor_parallel.py are imported in the
# functions that build a plan: importing DTensor costs seconds, which the launcher, whose
# preflight reads this module through the models, must not pay (tests/e2e/test_startup.py).


def style_of(name: str, key: str) -> ParallelStyle:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    from paratrain.distributed.tensor_parallel import ReplicateWithGradAllReduce  # DTensor: see the imports

    styles = {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(output_layouts=Replicate()),
        "replicated_with_grad_allreduce": ReplicateWithGradAllReduce,
        "sequence_parallel": lambda: SequenceParallel(),
    }
    if name not in styles:
        raise ConfigError(
            f"{key} = {name!r}: paratrain has no DTensor style for this transformers plan entry; give the model's plan"
            " yourself in [parallel.tp_plan] (styles: colwise, rowwise, colwise_gather, sequence, ...)"
        )
    return styles[name]()


def hf_plan_table(model: nn.Module) -> dict[str, str]:
    """The model's own pattern -> style-name table (decoder plan + the output layer's when untied)."""
    table = dict(getattr(model.config, "base_model_tp_plan", None) or {})
    if not model.tied and not model.scores:  # a one-label score head stays replicated
        table["lm_head"] = "colwise_gather_output"
    return table


def hf_tp_plan(model: nn.Module, *, sequence_parallel: bool, loss_parallel: bool) -> dict[str, ParallelStyle]:
    """``{module name: ParallelStyle}`` for this (possibly pipeline-split) HFCausalLM."""
    del loss_parallel  # the logits are gathered (ModelSpec.loss_parallel is False for HF models)
    if sequence_parallel:
        raise ConfigError(
            "parallel.sequence_parallel = true is not supported for model.hf (its plan keeps the residual stream"
            " replicated); set it to false"
        )
    from paratrain.distributed.tensor_parallel import plan_from_table  # DTensor: see the imports

    # Mixture of experts: the modules of the sparse blocks (router, fused experts) stay replicated.
    moe = {id(m) for block in sparse_blocks(model) for m in block.modules()}
    plan = plan_from_table(
        model,
        hf_plan_table(model),
        style_of=lambda name, module, key: None if id(module) in moe else style_of(name, key),
        key_of=lambda pattern: f"base_model_tp_plan[{pattern!r}]",
        require_match=False,
    )
    return {fqn: style for fqn, style in plan.items() if style is not None}


def check_hf_layout(config, *, tp: int) -> None:
    """Refuse a tp degree that does not split the heads (query and key/value) and the MLP whole."""
    heads = config.num_attention_heads
    checks = [
        ("num_attention_heads", heads, "attention heads are split whole across the tp ranks"),
        (
            "num_key_value_heads",
            getattr(config, "num_key_value_heads", None) or heads,
            "grouped-query attention splits the key/value heads whole across the tp ranks",
        ),
        ("intermediate_size", getattr(config, "intermediate_size", None), "the MLP is split across the tp ranks"),
    ]
    for key, value, why in checks:
        if isinstance(value, int) and value % tp:
            raise ConfigError(
                f"parallel.tp = {tp} does not divide {key} = {value} of model.hf ({why}); use a tp that divides {value}"
            )


# --- context parallel (distributed/context_parallel.py, docs/context-parallel.md) ---------------

CP_ATTENTION = "paratrain_ring"


def _ring_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """An attention function in transformers' ``AttentionInterface`` signature: the ring attention
    (``module.cp_attention``, set by :func:`hf_cp_attention`) over the whole sequence, its
    document masks from the ``position_ids`` the decoder layers pass every attention (global,
    restarting at 0 per packed document). Returns ``(B, T, heads, head_dim)`` and no weights."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads (repeat_kv)
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    out = module.cp_attention(query, key, value, positions=kwargs.get("position_ids"), scale=scaling, dropout_p=dropout)
    return out.transpose(1, 2).contiguous(), None


def hf_cp_attention(model: nn.Module, attention_fn) -> None:
    """Context parallel for an ``HFCausalLM``: its layers' attention runs through a function
    registered with transformers' ``AttentionInterface`` (no module is patched). The function is
    stateless; each attention module carries the ring (its cp group) as ``cp_attention``."""
    from transformers import AttentionInterface

    if "sliding_attention" in (getattr(model.config, "layer_types", None) or ()):
        raise ConfigError("parallel.cp with sliding-window attention layers is not supported yet; set parallel.cp = 1")
    AttentionInterface.register(CP_ATTENTION, _ring_attention_forward)
    model.config._attn_implementation = CP_ATTENTION
    model.cp_attention = attention_fn
    for layer in model.layers.values():
        layer.self_attn.cp_attention = attention_fn
    for block in sparse_blocks(model):
        # A rank holds part of each sequence: the balance loss sums its expert counts over cp.
        block.gate.cp_group = attention_fn.group
