"""The GPT's parallel side: its Megatron tensor-parallel plan, its layout checks, its ModelSpec.

The plan (Megatron-LM, Shoeybi et al. 2019; sequence parallel, Korthikanti et al. 2022): in each
block the first linear layers are split by output features ("colwise": q/k/v, i.e. whole heads,
and the MLP's fc_in) and the second ones by input features ("rowwise": o_proj, fc_out), so a block
costs one all-reduce in forward and one in backward per sub-layer. The token embedding is split by
vocabulary rows, the output layer by vocabulary columns; with ``loss_parallel`` the logits stay
vocabulary-sharded for the cross-entropy.

Mixture-of-experts blocks (models/gpt/moe.py) keep their router, routed and shared experts
**replicated over tp**: every tp rank runs the same tokens through the same whole experts. That
is exact by construction (nothing of the MoE is split, so routing, the slot-order float32
combine and the balance loss are those of tp = 1), composes with ep unchanged (the tp ranks of
one ep coordinate exchange the same tokens within their own ep group), and costs no collective
inside the layer. The price is that the expert compute and weights are not divided by tp: with
MoE, ep is the dimension that divides the experts (torchtitan also keeps experts out of tp
unless it asks for "expert tensor parallel"). Gradients are not double-counted: the gradient
reaching the MoE's output is the full one on every tp rank (the next colwise layer all-reduces
its input gradient, or, under sequence parallel, the all-gather below is transposed), so each
tp rank holds the same full gradient of the replicated weights, which the tensor-parallel
plan never reduces and the gradient norm counts once (plain tensors are not summed over tp).
Under sequence parallel the MoE takes the whole sequence (all-gather in) and hands back its
own tp rank's positions (a local slice, no communication).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from paratrain.config import ConfigError
from paratrain.models.gpt.model import GPTConfig, build_gpt, gpt_flops
from paratrain.models.gpt.moe import MoE, MoEConfig
from paratrain.models.spec import ExpertLayer, ModelSpec

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

# torch's tensor-parallel styles (DTensor) are imported in gpt_tp_plan: importing DTensor costs
# seconds, which the launcher, whose preflight reads this module through the models, must not pay
# (tests/e2e/test_startup.py).


def gpt_tp_plan(model: nn.Module, *, sequence_parallel: bool, loss_parallel: bool) -> dict[str, ParallelStyle]:
    """The Megatron plan for paratrain's GPT (modules that a pipeline stage dropped are skipped)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    seq = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream
    plan: dict[str, ParallelStyle] = {}
    if getattr(model, "tok_emb", None) is not None:
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
        # Positions (T, d_model): their sequence dim is 0, they are added to the (B, T, d) tokens.
        plan["pos_emb"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(0) if sequence_parallel else Replicate()
        )
    for name, block in model.layers.items():
        p = f"layers.{name}."
        moe = hasattr(block.mlp, "router_stats")  # models/gpt/moe.py's MoE
        if sequence_parallel:
            plan[p + "attn_norm"] = SequenceParallel()
            plan[p + "mlp_norm"] = SequenceParallel()
            # The attention and the MLP need the whole sequence: all-gather it on entry.
            # Its second input is the packed documents' mask (or None): a plain tensor, left alone.
            plan[p + "attn"] = PrepareModuleInput(
                input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
            )
            plan[p + "mlp"] = (
                PrepareModuleInputOutput(
                    input_layouts=(Shard(1),),
                    desired_input_layouts=(Replicate(),),
                    use_local_input=True,  # the replicated MoE runs plain tensors
                    output_layouts=(Replicate(),),
                    desired_output_layouts=(Shard(1),),
                )
                if moe
                else PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            )
        # Whole heads per rank: q/k/v split by output features = by heads (n_head % tp == 0).
        for proj in ("q_proj", "k_proj", "v_proj"):
            plan[p + "attn." + proj] = ColwiseParallel()
        plan[p + "attn.o_proj"] = RowwiseParallel(output_layouts=seq)
        if not moe:  # a mixture of experts stays replicated over tp (module docstring)
            plan[p + "mlp.fc_in"] = ColwiseParallel()
            plan[p + "mlp.fc_out"] = RowwiseParallel(output_layouts=seq)
    if getattr(model, "norm", None) is not None and sequence_parallel:
        plan["norm"] = SequenceParallel()
    if getattr(model, "lm_head", None) is not None:
        plan["lm_head"] = ColwiseParallel(
            input_layouts=seq,
            # loss_parallel keeps the logits a DTensor sharded on the vocabulary for the loss.
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    return plan


def check_gpt_layout(args: dict, *, tp: int, sequence_parallel: bool) -> None:
    """Refuse a tensor-parallel degree that does not split the GPT whole (runs before launch)."""
    defaults = GPTConfig()
    get = lambda k: args.get(k, getattr(defaults, k))  # noqa: E731
    checks = [
        ("n_head", "attention heads are split whole across the tp ranks"),
        ("d_model", "the hidden size is split across the tp ranks"),
    ]
    if sequence_parallel:
        checks.append(("block_size", "sequence parallelism splits the positions across the tp ranks"))
    for key, why in checks:
        value = get(key)
        if isinstance(value, int) and value % tp:
            raise ConfigError(
                f"parallel.tp = {tp} does not divide model.args.{key} = {value} ({why}); use a tp"
                f" that divides {value} or a {key} that is a multiple of {tp}"
            )


def check_gpt_degrees(args: dict, *, dims, parallel) -> None:
    """What the GPT's args ask of the cp and ep degrees (runs before launch): all-to-all context
    parallel splits the heads over cp x tp; expert parallel splits the routed experts over ep."""
    heads = args.get("n_head", GPTConfig.n_head)
    if dims.cp > 1 and parallel.cp_attention == "alltoall" and isinstance(heads, int) and heads % (dims.cp * dims.tp):
        raise ConfigError(
            f"parallel.cp_attention = 'alltoall' splits model.args.n_head = {heads} over cp x tp = {dims.cp * dims.tp}"
            " ranks; use a cp that divides the heads per tp rank or parallel.cp_attention = 'ring'"
        )
    if args.get("moe") is not None:
        moe = MoEConfig.from_args(args["moe"])  # its own values, before any process starts
        if moe.n_experts % dims.ep:
            raise ConfigError(
                f"parallel.ep = {dims.ep} does not divide model.args.moe.n_experts = {moe.n_experts};"
                " use an ep that divides both n_experts and dp"
            )


def gpt_cp_attention(model: nn.Module, attention_fn) -> None:
    """Context parallel (distributed/context_parallel.py ``apply_cp``): every block's attention
    calls ``attention_fn``, and the model passes it the position ids instead of a mask."""
    if getattr(getattr(model, "cfg", None), "attention", "sdpa") == "flex":
        raise ConfigError("parallel.cp with model.args.attention = 'flex' is not supported yet; use 'sdpa'")
    model.cp_attention = attention_fn
    for block in model.layers.values():
        block.attn.cp_attention = attention_fn
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        # A rank holds part of each sequence: the balance loss sums its expert counts over cp.
        moe.cp_group = attention_fn.group


def gpt_context_length(args: dict) -> int:
    return args.get("block_size", GPTConfig.block_size)


def gpt_expert_layers(module: nn.Module) -> list[ExpertLayer]:
    """The MoE layers (models/gpt/moe.py) inside ``module``, for the planner."""
    return [
        ExpertLayer(m.experts, m.cfg.n_experts, m.cfg.top_k, m.router.in_features)
        for m in module.modules()
        if isinstance(m, MoE)
    ]


GPT_SPEC = ModelSpec(
    name="gpt",
    build=build_gpt,
    blocks_attr="layers",
    tp_plan=gpt_tp_plan,
    flops_per_token=gpt_flops,
    check_layout=check_gpt_layout,
    check_degrees=check_gpt_degrees,
    loss_parallel=True,
    context_length=gpt_context_length,
    head_attr="lm_head",
    cp_attention=gpt_cp_attention,
    expert_layers=gpt_expert_layers,
    flops_count_attention=True,
)
