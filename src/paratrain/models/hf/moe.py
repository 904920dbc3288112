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
  ``sequence_balance_loss``, objectives.moe.RouterStats, the step's division by the global sequence count),
  scaled so that on one sequence and one MoE layer it *is* transformers' value: DeepSeek-V3's
  ``sum_i f_i P_i`` is 1 when balanced, Switch's is ``top_k``, so each term is multiplied by
  ``top_k``, and the layers are averaged (``/ n_moe_layers``) where transformers pools them.
  Its weight is ``router_aux_loss_coef`` when ``output_router_logits`` is true, else 0 (the loss
  is still logged), which is when transformers adds it.
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.device_mesh import DeviceMesh

# DTensor is imported in the functions that use it: its import costs seconds, which the launcher,
# whose preflight reads this module through the models, must not pay (tests/e2e/test_startup.py).
from paratrain.config import ConfigError
from paratrain.distributed.expert_parallel import ExpertGroup, dispatch
from paratrain.distributed.layout_checks import ZERO_BUBBLE
from paratrain.models.gpt.moe import sequence_balance_loss
from paratrain.models.spec import ExpertLayer
from paratrain.objectives.moe import RouterStats

# The config fields that give a transformers model's routed-expert count (Qwen-MoE and OLMoE,
# Mixtral, DeepSeek).
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
# The architectures whose sparse block, router and fused experts are checked here (tests/distributed/test_moe_hf.py).
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


def expert_layers(module: nn.Module) -> list[ExpertLayer]:
    """The sparse blocks inside ``module`` as the planner prices them (models/spec.py): the fused
    experts module (all routed experts), their count, the router's top_k and its input width."""
    return [
        ExpertLayer(b.experts, b.experts.num_experts, b.gate.top_k, b.gate.weight.shape[-1])
        for b in sparse_blocks(module)
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


@contextlib.contextmanager
def fake_grouped_mm():
    """transformers' ``grouped_mm`` experts on fake tensors (the memory estimate, batch/measure.py).

    torch's meta kernel of ``_grouped_mm`` accepts bf16 only (torch 2.13,
    ``_meta_grouped_mm_common``) where the CPU kernel also takes fp32, so a float32 step raised
    under FakeTensorMode. transformers' own fallback, the custom op
    ``transformers::grouped_mm_fallback`` (integrations/moe.py: a fake kernel, and an autograd
    formula that saves the input and the weight), computes the same product with outputs of the
    same shapes, and transformers takes it itself where ``grouped_mm`` cannot run (fp32 under
    torch.compile); here it runs for fake tensors only. The estimate of a Qwen3-MoE step is then
    as close to the real step's MemTracker peak (+2% at micro-batch 2, +3% at 4) as a dense
    Llama's (tests/unit/test_plan_moe.py)."""
    try:
        from transformers.integrations import moe as hf_moe
    except ImportError:  # no transformers: no model.hf either
        yield
        return
    original = hf_moe._can_use_grouped_mm

    def can_use(input, weight, offs):
        return not is_fake(weight) and original(input, weight, offs)

    hf_moe._can_use_grouped_mm = can_use
    try:
        yield
    finally:
        hf_moe._can_use_grouped_mm = original


def aux_loss_weight(config, n_layers: int) -> float:
    """The weight of each layer's per-sequence DeepSeek-V3 term (the module docstring says why)."""
    if not getattr(config, "output_router_logits", False):
        return 0.0
    return float(config.router_aux_loss_coef) * config.num_experts_per_tok / n_layers


def install_router_stats(model: nn.Module) -> int:
    """Make each sparse block's router leave a ``RouterStats`` (its ``router_stats``, which the
    step's BalanceLoss finds through objectives.moe.router_layers) after every forward. Hooks, no module is replaced:
    the block's pre-hook notes (batch, tokens) (the router sees the flattened tokens) and the
    router's hook computes the stats from what it returned. Returns the number of blocks."""
    blocks = sparse_blocks(model)
    weight = aux_loss_weight(model.config, len(blocks)) if blocks else 0.0
    for block in blocks:
        gate = block.gate
        gate.router_stats = None
        gate.aux_loss_weight = weight
        # Context parallel: the cp ranks holding the other parts of this rank's sequences
        # (models/hf/parallel.py hf_cp_attention sets it), over which the balance loss's expert
        # counts are summed (models/gpt/moe.py sequence_balance_loss, as the GPT's MoE does).
        gate.cp_group = None
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
    per_sequence = sequence_balance_loss(probs, experts.view(b, t, -1), n, cp_group=gate.cp_group)
    estimating = experts.device.type == "meta" or is_fake(experts)  # a memory estimate: no values to count
    counts = experts.new_zeros(n) if estimating else torch.bincount(experts.reshape(-1), minlength=n)
    gate.router_stats = RouterStats(
        aux_sum=gate.aux_loss_weight * per_sequence.sum(), tokens_per_expert=counts.detach()
    )


def check_hf_moe_combinations(config, cfg, *, tp: int, pp: int, cp: int, ep: int, dp_shard: int = 1) -> None:
    """What a ``model.hf`` mixture of experts (``config``, its transformers config) runs with (DDP,
    FSDP2, HSDP, accumulation, activation checkpointing, expert parallel, tensor parallel with the
    sparse blocks replicated (models/hf/parallel.py), pipeline parallel with each stage's balance
    loss riding its output (distributed/pipeline_parallel.py ``_AuxLoss``), context parallel,
    compile), refusing the rest in one line before any process starts (preflight, through
    models/hf's ``check_hf_layout_of``)."""
    if not is_moe(config):
        if ep > 1:
            raise ConfigError(
                f"parallel.ep = {ep} needs a mixture of experts, and model.hf = {cfg.model.hf!r} is dense"
                f" ({config.model_type}); set parallel.ep = 1"
            )
        return
    if n_experts(config) % ep:
        raise ConfigError(
            f"parallel.ep = {ep} does not divide the {n_experts(config)} experts of model.hf = {cfg.model.hf!r};"
            " use an ep that divides both the experts and dp"
        )
    if ep > 1 and dp_shard > 1 and cfg.precision.dtype != "fp32":
        # FSDP2's mixed precision casts the weights it shards, not the expert weights it ignores.
        raise ConfigError(
            f"parallel.ep > 1 with parallel.dp_shard > 1 and precision.dtype = {cfg.precision.dtype!r} is not"
            " supported yet; use DDP (parallel.dp_shard = 1) or precision.dtype = 'fp32'"
        )
    if pp > 1 and cfg.parallel.pp_schedule in ZERO_BUBBLE:
        # As for the GPT's MoE: their split weight pass would have to find the auxiliary loss's path too.
        raise ConfigError(
            f"model.hf = {cfg.model.hf!r} is a mixture of experts, which runs with parallel.pp_schedule ="
            f" '{cfg.parallel.pp_schedule}' not yet; use 'gpipe', '1f1b', 'interleaved1f1b' or 'looped_bfs'"
        )
    for key, on in (
        # Each is tested with DDP, FSDP2 and ep (tests/distributed/test_moe_hf_layouts.py, test_moe_compile_cp.py),
        # not yet with one another.
        (f"parallel.cp = {cp} with parallel.tp or parallel.pp > 1", cp > 1 and (tp > 1 or pp > 1)),
        ("train.compile = true with parallel.tp or parallel.pp > 1", cfg.train.compile and (tp > 1 or pp > 1)),
        ("batch.adaptive = true", cfg.batch.adaptive),
        ("optim.lr_scaling = 'adascale'", cfg.optim.lr_scaling == "adascale"),
    ):
        if on:
            raise ConfigError(
                f"model.hf = {cfg.model.hf!r} is a mixture of experts ({config.model_type}), which runs with"
                f" {key} not yet; turn it off (docs/moe.md)"
            )


# --- expert parallel (parallel.ep) -----------------------------------------------------------
#
# transformers runs a fused experts module through the function its config names in
# ``ExpertsInterface`` (integrations/moe.py; "eager", "grouped_mm", ...), as it runs attention
# through ``AttentionInterface``. paratrain registers one more, which sends each (token, slot)
# pair to the rank holding its expert (distributed/expert_parallel.dispatch) and combines the
# float32 outputs in slot order, as the GPT's MoE does.
#
# The fused tensors (``gate_up_proj`` (E, 2I, H), ``down_proj`` (E, H, I)) hold every expert under
# one name, so each rank's experts are its rows: they become DTensors ``Shard(0)`` over the ep
# group (rows = experts). Everything that reads parameters by name then sees the global tensor
# with this rank's region: the loader reads only those rows (weights.py ``_local_slice``), DCP
# saves each rank's rows and reshards them across ep degrees (ep_replicate ranks save the same
# chunk, which DCP's save planner deduplicates), and the full-weights export gathers them
# (``full_tensor``). The forward, the gradient reduce and the norm use the local rows.

EP_EXPERTS = "paratrain_ep"


def _local_expert(experts: nn.Module, gate_up: torch.Tensor, down: torch.Tensor, j: int, x: torch.Tensor):
    """This rank's expert ``j`` (row j of the local fused tensors) on rows ``x``, with the
    module's own gating (``_apply_gate``: act(gate) * up, as transformers' functions)."""
    return F.linear(experts._apply_gate(F.linear(x, gate_up[j])), down[j])


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t  # to_local is differentiable: grads land on the DTensor


def ep_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """An ``ExpertsInterface`` function: (N, H) tokens, (N, k) experts and weights -> (N, H)."""
    n, k = top_k_index.shape
    gate_up, down = _local(self.gate_up_proj), _local(self.down_proj)
    local = [functools.partial(_local_expert, self, gate_up, down, j) for j in range(gate_up.shape[0])]
    y = dispatch(hidden_states, top_k_index, local, self.num_experts, self.ep)  # (N k, H) float32
    slots = y.view(n, k, -1) * top_k_weights.float().unsqueeze(-1)
    out = slots[:, 0]
    for j in range(1, k):  # the fixed slot order, in float32
        out = out + slots[:, j]
    return out.to(hidden_states.dtype)


@functools.cache
def _ep_device_mesh(ep: ExpertGroup) -> DeviceMesh:
    """The ep group as a 1-D device mesh (the same ranks, the same process group)."""
    backend = dist.get_backend(ep.group)
    device_type = "cuda" if backend != "gloo" and torch.cuda.is_available() else "cpu"
    return DeviceMesh.from_group(ep.group, device_type, mesh_dim_names=("ep",))


def enable_expert_parallel(experts: nn.Module, ep: ExpertGroup) -> list[nn.Parameter]:
    """Keep rows ``[r L, (r + 1) L)`` of the fused expert tensors (``L = experts / ep``), as
    DTensors ``Shard(0)`` over the ep group, and run the module through
    :func:`ep_experts_forward`. Returns the (DTensor) parameters. A meta model stays on meta
    (the loader fills each rank's rows)."""
    from torch.distributed.tensor import DTensor, Shard
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    rows = ep.local_experts(experts.num_experts)
    mesh = _ep_device_mesh(ep)
    for name in ("gate_up_proj", "down_proj"):
        full = getattr(experts, name)
        local = full.detach()[rows.start : rows.stop].clone()
        sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())
        setattr(experts, name, nn.Parameter(sharded, requires_grad=full.requires_grad))
    experts.ep = ep
    ALL_EXPERTS_FUNCTIONS.register(EP_EXPERTS, ep_experts_forward)
    experts.config._experts_implementation = EP_EXPERTS
    return [experts.gate_up_proj, experts.down_proj]


def keep_experts_eager(model: nn.Module) -> None:
    """``train.compile``: each sparse block's experts module runs eagerly inside its compiled
    block (``torch.compiler.disable``; a no-op without compile). Its work is data-dependent:
    transformers' eager experts loop over the experts a batch hit (``nonzero``) and gather each
    one's rows (``torch.where``), and under ``parallel.ep`` the all_to_all's split sizes are read
    on the host; traced, each is a graph break with data-dependent sizes, and the many small
    graphs take minutes to compile (Qwen3-MoE's first step was still compiling after 240 s on the
    shared 2-core CPU machine). The router, its balance-loss hook, the attention and the norms
    stay compiled; torchtitan likewise keeps the token dispatch out of the compiled region."""
    for block in sparse_blocks(model):
        # A method bound to the module, not a closure over its bound forward: a deepcopy (the
        # pipeline split copies the model) rebinds it to the copy.
        block.experts.forward = types.MethodType(_eager_experts_forward, block.experts)


@torch._disable_dynamo  # torch.compiler.disable, importing dynamo at the first call, not here
def _eager_experts_forward(experts: nn.Module, *args, **kwargs):
    return type(experts).forward(experts, *args, **kwargs)  # the class's: transformers' dispatch


def offer_expert_parallel(model: nn.Module) -> None:
    """Give each sparse block's experts module the ``enable_expert_parallel(ep)`` method that
    distributed/expert_parallel.apply_ep looks for (the GPT's MoE defines it as a method)."""
    for block in sparse_blocks(model):
        block.experts.enable_expert_parallel = functools.partial(enable_expert_parallel, block.experts)
