"""transformers' mixture-of-experts decoders under ``model.hf`` (docs/moe.md, docs/huggingface.md).

What transformers 5 ships for Qwen3-MoE and Mixtral, and what paratrain adds:

- Each sparse block (``layer.mlp``) holds a router ``gate`` (``*TopKRouter``: a linear layer,
  softmax in float32, top-k, optionally renormalised; it returns ``(logits, weights, experts)``)
  and ``experts``, one module with the experts fused into 3-D parameters (``gate_up_proj``
  ``(E, 2I, H)``, ``down_proj`` ``(E, H, I)``), run by transformers' experts implementation
  (``ExpertsInterface``). paratrain runs those modules as they are; the checkpoints hold the
  experts one by one, which the loader (weights.py) and ``save_pretrained`` convert with
  transformers' own conversion mapping.
- The auxiliary loss. transformers adds ``router_aux_loss_coef x load_balancing_loss_func`` to
  its loss when ``output_router_logits`` is on: the Switch loss (arXiv 2101.03961, eqs. 4-6) over
  all the tokens of one forward call, pooled over layers. That depends on which sequences share a
  micro-batch, so it changes with the micro-batch size, accumulation and dp. paratrain instead
  computes it **per sequence** and per layer, with the GPT's machinery (models/gpt/moe.py
  ``sequence_balance_loss``, loss.RouterStats, the step's division by the global sequence count),
  scaled so that on one sequence and one MoE layer it *is* transformers' value: DeepSeek-V3's
  ``sum_i f_i P_i`` is 1 when balanced, Switch's is ``top_k``, so each term is multiplied by
  ``top_k``, and the layers are averaged (``/ n_moe_layers``) where transformers pools them.
  Its weight is ``router_aux_loss_coef`` when ``output_router_logits`` is true, else 0 (the loss
  is still logged), which is when transformers adds it.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from paratrain.config import ConfigError
from paratrain.distributed.expert_parallel import ExpertGroup, dispatch
from paratrain.loss import RouterStats
from paratrain.models.gpt.moe import sequence_balance_loss

# The config fields that give a transformers model's routed-expert count (Qwen-MoE and OLMoE,
# Mixtral, DeepSeek).
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
# The architectures whose sparse block, router and fused experts are checked here (tests/test_moe_hf.py).
# OLMoE has the same blocks but its config no base_model_pp_plan, which HFCausalLM reads.
SUPPORTED = ("qwen3_moe", "mixtral")


def n_experts(config) -> int | None:
    """The routed-expert count of a transformers config, None for a dense model."""
    return next((getattr(config, k) for k in MOE_KEYS if getattr(config, k, None)), None)


def check_hf_moe(config, key: str = "model.hf") -> None:
    """Refuse, in one line, a mixture of experts that paratrain does not train exactly."""
    experts = n_experts(config)
    if not experts:
        return
    if config.model_type not in SUPPORTED:
        raise ConfigError(
            f"{key}: {config.model_type} is a mixture of experts ({experts} experts) that model.hf does not support"
            f" yet; the supported ones are {', '.join(SUPPORTED)}"
        )
    if getattr(config, "router_jitter_noise", 0.0):
        # Mixtral multiplies the router's input by uniform noise in training: random per call,
        # not per sample, so no two layouts would train the same function.
        raise ConfigError(
            f"model.args.router_jitter_noise = {config.router_jitter_noise} draws noise per forward call, which no"
            " layout reproduces; set it to 0"
        )


def is_moe(config) -> bool:
    return bool(n_experts(config))


def sparse_blocks(model: nn.Module) -> list[nn.Module]:
    """The sparse MoE blocks (a router ``gate`` and fused ``experts``), in module order."""
    return [
        m
        for m in model.modules()
        if isinstance(getattr(m, "gate", None), nn.Module) and hasattr(getattr(m, "experts", None), "gate_up_proj")
    ]


def active_params(model: nn.Module) -> int:
    """Parameters a token goes through: all of them but the ``num_experts - top_k`` routed experts
    of each sparse block it does not choose (the FLOPs per token and MFU count these)."""
    n = sum(p.numel() for p in model.parameters())
    for block in sparse_blocks(model):
        experts = block.experts
        per_expert = (experts.gate_up_proj.numel() + experts.down_proj.numel()) // experts.gate_up_proj.shape[0]
        n -= (experts.num_experts - block.gate.top_k) * per_expert
    return n


def aux_loss_weight(config, n_layers: int) -> float:
    """The weight of each layer's per-sequence DeepSeek-V3 term (the module docstring says why)."""
    if not getattr(config, "output_router_logits", False):
        return 0.0
    return float(config.router_aux_loss_coef) * config.num_experts_per_tok / n_layers


def install_router_stats(model: nn.Module) -> int:
    """Make each sparse block's router leave a ``RouterStats`` (its ``router_stats``, which the
    step finds through loss.router_layers) after every forward. Hooks, no module is replaced:
    the block's pre-hook notes (batch, tokens) (the router sees the flattened tokens) and the
    router's hook computes the stats from what it returned. Returns the number of blocks."""
    blocks = sparse_blocks(model)
    weight = aux_loss_weight(model.config, len(blocks)) if blocks else 0.0
    for block in blocks:
        gate = block.gate
        gate.router_stats = None
        gate.aux_loss_weight = weight
        block.register_forward_pre_hook(_note_shape)
        gate.register_forward_hook(_router_stats)
    return len(blocks)


def _note_shape(block: nn.Module, args) -> None:
    block.gate.sequence_shape = tuple(args[0].shape[:2])


def _router_stats(gate: nn.Module, args, out) -> None:
    logits, _, experts = out
    b, t = gate.sequence_shape
    n = logits.shape[-1]
    probs = torch.softmax(logits.float(), dim=-1).view(b, t, n)  # as the router itself computes them
    per_sequence = sequence_balance_loss(probs, experts.view(b, t, -1), n)
    estimating = experts.device.type == "meta" or is_fake(experts)  # a memory estimate: no values to count
    counts = experts.new_zeros(n) if estimating else torch.bincount(experts.reshape(-1), minlength=n)
    gate.router_stats = RouterStats(
        aux_sum=gate.aux_loss_weight * per_sequence.sum(), tokens_per_expert=counts.detach()
    )


def check_hf_moe_combinations(config, cfg, *, tp: int, pp: int, cp: int, ep: int) -> None:
    """What a ``model.hf`` mixture of experts (``config``, its transformers config) runs with (DDP,
    FSDP2, HSDP, accumulation, activation checkpointing), refusing the rest in one line before any
    process starts (preflight, through models/hf's ``check_hf_layout_of``)."""
    if not is_moe(config):
        return
    for key, on in (
        (f"parallel.ep = {ep}", ep > 1),  # the fused experts do not go through expert_parallel.dispatch yet
        (f"parallel.tp = {tp}", tp > 1),
        (f"parallel.pp = {pp}", pp > 1),
        (f"parallel.cp = {cp}", cp > 1),  # a rank would hold part of each sequence of the balance loss
        ("train.compile = true", cfg.train.compile),
        ("batch.adaptive = true", cfg.batch.adaptive),
        ("optim.lr_scaling = 'adascale'", cfg.optim.lr_scaling == "adascale"),
    ):
        if on:
            raise ConfigError(
                f"model.hf = {cfg.model.hf!r} is a mixture of experts ({config.model_type}), which runs with"
                f" {key} not yet; turn it off (docs/moe.md)"
            )


# --- expert parallel: the building block (parallel.ep with model.hf stays refused above) ---------
#
# transformers runs a fused experts module through the function its config names in
# ``ExpertsInterface`` (integrations/moe.py; "eager", "grouped_mm", ...), as it runs attention
# through ``AttentionInterface``. paratrain registers one more, which sends each (token, slot)
# pair to the rank holding its expert (distributed/expert_parallel.dispatch) and combines the
# float32 outputs in slot order, as the GPT's MoE does. What is missing before ``parallel.ep``
# can be lifted for model.hf (docs/moe.md): loading each rank's experts from the checkpoint
# (their rows of the fused tensor), and checkpoints, optimiser state and exports of a fused
# tensor whose rows live on different ranks under one name (DCP would keep one rank's rows).

EP_EXPERTS = "paratrain_ep"


def _local_expert(experts: nn.Module, j: int, x: torch.Tensor) -> torch.Tensor:
    """This rank's expert ``j`` (row j of the local fused tensors) on rows ``x``, with the
    module's own gating (``_apply_gate``: act(gate) * up, as transformers' functions)."""
    return F.linear(experts._apply_gate(F.linear(x, experts.gate_up_proj[j])), experts.down_proj[j])


def ep_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """An ``ExpertsInterface`` function: (N, H) tokens, (N, k) experts and weights -> (N, H)."""
    n, k = top_k_index.shape
    local = [functools.partial(_local_expert, self, j) for j in range(self.gate_up_proj.shape[0])]
    y = dispatch(hidden_states, top_k_index, local, self.num_experts, self.ep)  # (N k, H) float32
    slots = y.view(n, k, -1) * top_k_weights.float().unsqueeze(-1)
    out = slots[:, 0]
    for j in range(1, k):  # the fixed slot order, in float32
        out = out + slots[:, j]
    return out.to(hidden_states.dtype)


def enable_expert_parallel(experts: nn.Module, ep: ExpertGroup) -> list[nn.Parameter]:
    """Keep rows ``[r L, (r + 1) L)`` of the fused expert tensors (``L = experts / ep``) and run the
    module through :func:`ep_experts_forward`. Returns the local parameters."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    rows = ep.local_experts(experts.num_experts)
    for name in ("gate_up_proj", "down_proj"):
        full = getattr(experts, name)
        local = nn.Parameter(full.detach()[rows.start : rows.stop].clone(), requires_grad=full.requires_grad)
        setattr(experts, name, local)
    experts.ep = ep
    ALL_EXPERTS_FUNCTIONS.register(EP_EXPERTS, ep_experts_forward)
    experts.config._experts_implementation = EP_EXPERTS
    return [experts.gate_up_proj, experts.down_proj]
