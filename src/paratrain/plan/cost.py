"""Step time of a layout: a cost model with named terms, each printed.

All terms are seconds per optimiser step on the slowest rank's critical path:

- ``compute``: the model FLOPs of the rank's matmuls (its pipeline stage's blocks, 1/tp of each)
  over the achievable FLOP/s of the dtype (profile.py), times the GEMM shape factor on a GPU
  (``gemm_slowdown``: tile and wave quantization, memory-bound thin GEMMs); plus attention: on
  a GPU as causal flash attention computes it (half the T x T square, backward 2.5x the forward)
  at the profile's attention efficiency, elsewhere as MFU counts it (PaLM appendix B: 12 L d T
  per token) at the matmul rate.
- ``recompute``: activation checkpointing. ``full`` runs every block's forward again (a third of
  its forward+backward FLOPs; twice under the zero-bubble schedules, whose backward is two
  autograd calls, each recomputing); ``selective`` saves matmul and attention outputs and recomputes
  only the pointwise ops and norms, priced in ``pointwise`` (Korthikanti et al. 2022 measure a
  few percent for a similar recomputed set).
- ``overhead``: a fixed time per block pass (forward 1, backward 2, recompute 1, selective 0.5) and per
  micro-batch (embedding and head as two more units): launches and dispatch that do not shrink
  with the micro-batch, which is why tiny micro-batches are slow; the profile's DTensor figure
  under TP, and FSDP's per-unit cost for each all-gather and reduce-scatter (profile.py).
- ``pointwise``: the memory-bound ops counted from the block's own modules (``block_shapes``:
  norms, bias adds, GELU or SwiGLU, RoPE, residual adds) and the loss over the vocabulary, over
  memory bandwidth; their FLOPs are not in ``compute``.
- ``tp_comm``: tensor parallel, on the critical path (nothing overlaps it in eager mode): per
  micro-batch and block two all-reduces forward and two backward of the activations
  (Megatron-LM, Shoeybi et al. 2019; sequence parallel's all-gather + reduce-scatter move the
  same bytes), two more per block recomputed, and two for the embedding and head.
- ``fsdp_comm``: FSDP2 all-gathers each unit's parameters (compute dtype) in forward, again in
  backward when ``reshard_after_forward``; reduce-scatters gradients (reduce dtype) every
  micro-batch when resharding, once per step otherwise (paratrain's sync policy); HSDP adds an
  all-reduce of the shard over dp_replicate. The root unit's first all-gather and the last
  reduce-scatter are exposed; each block's collectives hide behind a block's compute up to the
  profile's ``overlap`` of it, the rest is exposed (the max per layer).
- ``dp_grad_reduce``: DDP's all-reduce of the gradients, once per step (``no_sync`` before the
  last micro-batch), hidden behind that micro-batch's backward except the last bucket.
- ``pp_bubble``: the pipeline's idle time over the stage's busy time: ``(p-1)/n`` for GPipe and
  1F1B (n pipeline micro-batches per step; the bubble fraction of the whole step is then
  (p-1)/(n+p-1)), ``/v`` for interleaved 1F1B and looped BFS (Narayanan et al. 2021), a further
  third for ZB-1P (interleaved_zb, Qi et al. 2024 report about a third of 1F1B's), and a sixth
  of 1F1B's for the V schedules (zbv, dualpipev: near zero once n >= 2p).
- A LoRA run (docs/lora.md): frozen weights are gathered like the others but have no gradient to
  reduce nor optimiser state to update, so the reduce-scatter, DDP's all-reduce and the optimiser
  step scale with the trained share of parameters (``ModelStats.trained``). The backward's FLOPs
  are counted as for full training (a frozen linear layer skips its weight gradient: an upper bound).
- ``cp_comm``: context parallel (docs/context-parallel.md), per micro-batch and attention layer.
  The ring (``parallel.cp_attention = "ring"``) sends the rank's K and V chunks on ``cp - 1``
  times forward, each hop overlapping the attention of the chunk it holds (up to ``overlap``);
  its backward sends K, V and their gradient so far ``cp - 1`` times and the gradient home once,
  in float32, each hop waited before the next pair (exposed): :func:`ring_bytes`, checked against
  the bytes the ring sends in tests/distributed/test_plan.py and benchmarks/parallel/cp_memory.py. All-to-all
  (Ulysses) runs four all-to-alls forward (q, k, v, out) and four backward, on the critical path.
  A forward recomputed by full checkpointing communicates again. The rank computes ``T / cp``
  tokens of each row, each attending over the whole row: every other term sees ``1/cp`` of the
  tokens, attention ``1/cp`` of its ``T x T`` work; the gradients are reduced over
  ``dp_shard x cp`` (FSDP2 shards over both).
- ``ep_comm``: expert parallel (docs/moe.md): the token all_to_alls of every MoE layer (counts,
  dispatch, combine forward; their gradients backward), exposed, and the local experts' gradient
  all-reduce over the ranks holding them (:func:`ep_comm_term`, :func:`moe_all_to_all_bytes`).
  At ep > 1 the experts leave DDP's, FSDP2's and the optimiser's shard (``_Rank.dp_params``).
- ``pp_p2p``: sends of activations and their gradients between stages, 2 per chunk and micro-batch.
- ``optimizer``: AdamW is memory-bound: read parameter, gradient and two moments, write three
  (28 bytes per fp32 parameter) plus the gradient-norm read (4), over memory bandwidth (SGD: 24
  with momentum, 16 without, ``optimizer_bytes_per_param``); plus the
  profile's fixed time per parameter tensor (plain, or DTensor under FSDP and TP), which the CPU
  pays (its AdamW loops over tensors one by one).

Collectives cross nodes when their group does: the mesh is ``pp, dp_replicate, dp_shard, cp, tp``
outermost to innermost (parallel_dims.py), so a dimension's ranks are ``stride`` apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch import nn

from paratrain.config import Config
from paratrain.distributed.blocks import BLOCKS_ATTR
from paratrain.distributed.pipeline_parallel import SCHEDULES, pp_microbatches, stage_ranges
from paratrain.models import spec_of
from paratrain.models.spec import ModelSpec
from paratrain.plan.enumerate import Layout
from paratrain.plan.profile import Profile
from paratrain.precision import DTYPES

# Elements read or written per token and block by the memory-bound ops, in units of the width d
# (this GPT block, forward: 2 LayerNorms 4, 2 residual adds 6, GELU on 4d 8, 5 bias adds 22 =
# 40; backward about twice the forward), at the compute dtype's size.
POINTWISE_ELEMENTS = 120
LOSS_BYTES_PER_LOGIT = 20  # fp32 logits: write, softmax read/write, gradient write/read
ADAM_BYTES_PER_PARAM = 32


def optimizer_bytes_per_param(cfg: Config) -> int:
    """fp32 bytes the optimiser step reads and writes per parameter, plus the gradient-norm read (4):
    AdamW reads parameter, gradient and two moments and writes three (28); SGD with momentum
    reads parameter, gradient and buffer and writes two (20); plain SGD reads two, writes one (12)."""
    if cfg.optim.name == "adamw":
        return ADAM_BYTES_PER_PARAM
    return (20 if cfg.optim.beta1 > 0 else 12) + 4


SPLIT_BACKWARD = ("interleaved_zb", "zbv", "dualpipev")  # schedules whose backward is two passes
TERMS = (
    "compute",
    "recompute",
    "overhead",
    "pointwise",
    "tp_comm",
    "cp_comm",
    "ep_comm",
    "fsdp_comm",
    "dp_grad_reduce",
    "pp_bubble",
    "pp_p2p",
    "optimizer",
)


@dataclass
class ModelStats:
    """What the cost model needs of the model, read from it on the meta device."""

    seq_len: int
    hidden: int  # width of the activations between blocks (0: unknown, no TP/PP traffic modelled)
    block_params: list[int]
    block_flops: list[float]  # training FLOPs per token of each block (matmuls and attention, as MFU counts)
    head_flops: float  # the output layer's (on the last stage)
    total_params: int
    flops_per_token: float  # the whole model's, as MFU counts it
    vocab: int = 0
    model: nn.Module | None = None
    # One block's matmuls as (in_features, out_features) of its nn.Linear modules, its attention
    # width (query features; 0: no attention found), and the element accesses per token of its
    # memory-bound ops in a forward: (at the compute dtype, in fp32). See ``block_shapes``.
    gemms: list[tuple[int, int]] = field(default_factory=list)
    attention_width: int = 0
    pointwise: tuple[float, float] = (0.0, 0.0)
    # Parameter tensors of the whole model and of one block: the step's end pays a fixed time for
    # each (the optimiser's per-tensor overhead, profile.py).
    tensors: int = 0
    block_tensors: int = 0
    blocks_attr: str = BLOCKS_ATTR
    # The share of parameters (and of parameter tensors) that train: below 1 with LoRA's frozen
    # base (docs/lora.md), whose weights are gathered by FSDP but have no gradient to reduce and no
    # optimiser state to update. Spread evenly over the blocks (LoRA adapts every block alike).
    trained: float = 1.0
    trained_tensors: float = 1.0
    # Mixture of experts (models/spec.py ExpertLayer): the routed experts' parameters of the whole model
    # (all MoE layers; a rank holds 1/ep of them at ep > 1), the MoE layers and each token's
    # routed experts (top_k). The FLOPs above count the active experts only (top_k of n_experts).
    expert_params: int = 0
    moe_layers: int = 0
    top_k: int = 0
    n_experts: int = 0
    _ranks: dict = field(default_factory=dict)

    @classmethod
    def of(cls, model: nn.Module | None, cfg: Config, *, spec: ModelSpec | None = None) -> ModelStats:
        seq = cfg.data.args.get("block_size") or cfg.model.args.get("block_size") or 1
        if model is None:
            return cls(seq, 0, [0], [0.0], 0.0, 0, 0.0)
        total = sum(p.numel() for p in model.parameters())
        spec = spec or spec_of(cfg.model, model)
        fpt = spec.flops_per_token(model)(seq)
        blocks = [b for _, b in spec.blocks(model)]
        mcfg = getattr(model, "cfg", None) or getattr(model, "config", None)
        d = getattr(mcfg, "d_model", 0) or getattr(mcfg, "hidden_size", 0)
        if not blocks:
            return cls(seq, d, [total], [fpt], 0.0, total, fpt, tensors=sum(1 for _ in model.parameters()))
        bp = [sum(p.numel() for p in b.parameters()) for b in blocks]
        gemms, width, pointwise = block_shapes(blocks[0], rope=getattr(model, "has_rope", False))
        attention = 12.0 * (width or d) * seq  # per block (observability/mfu.py, PaLM)
        # Mixtures of experts, as the spec describes them (models/spec.py ExpertLayer: the GPT's
        # and transformers' alike): a token runs top_k of the n_experts routed experts.
        moes = spec.expert_layers(model)
        inactive = {id(b): sum(e.inactive_params for e in spec.expert_layers(b)) for b in blocks}
        bf = [6.0 * (n - inactive[id(b)]) + attention for n, b in zip(bp, blocks)]
        head = getattr(model, "lm_head", None)
        head_flops = 6.0 * sum(p.numel() for p in head.parameters()) if head is not None else 0.0
        if not spec.flops_count_attention:
            # PaLM's count (the built-in GPT's own, models/spec.py): matmul parameters and attention;
            # a generic model's 6 x parameters would count the embedding and miss attention.
            fpt = sum(bf) + head_flops
        vocab = getattr(mcfg, "vocab_size", 0)
        tensors = sum(1 for _ in model.parameters())
        block_tensors = sum(1 for _ in blocks[0].parameters())
        return cls(
            seq,
            d,
            bp,
            bf,
            head_flops,
            total,
            fpt,
            vocab,
            model,
            gemms,
            width,
            pointwise,
            tensors,
            block_tensors,
            blocks_attr=spec.blocks_attr,
            trained=sum(p.numel() for p in model.parameters() if p.requires_grad) / max(1, total),
            trained_tensors=sum(p.requires_grad for p in model.parameters()) / max(1, tensors),
            expert_params=sum(e.params for e in moes),
            moe_layers=len(moes),
            top_k=moes[0].top_k if moes else 0,
            n_experts=moes[0].n_experts if moes else 0,
        )

    def busiest_rank(self, pp: int, v: int, style: str, cfg: Config) -> tuple[float, int, float]:
        """(FLOPs per token, blocks, parameters) of the pipeline rank with the most work (cached)."""
        key = (pp, v, style)
        if key not in self._ranks:
            ranges = stage_ranges(self.model, pp * v, cfg.parallel.pp_split_points, blocks_attr=self.blocks_attr)
            ranks = []
            for r in range(pp):
                stages = [r, 2 * pp - 1 - r] if style == "v" else list(range(r, pp * v, pp))
                blocks = [i for s in stages for i in ranges[s]]
                last = (pp * v - 1) in stages
                flops = sum(self.block_flops[i] for i in blocks) + (self.head_flops if last else 0.0)
                ranks.append((flops, len(blocks), sum(self.block_params[i] for i in blocks)))
            flops, blocks, _ = max(ranks)
            # Parameters: the largest stage's blocks plus half of the embedding and head (one each
            # on the first and last stage), for the optimiser and gradient traffic.
            params = max(r[2] for r in ranks) + (self.total_params - sum(self.block_params)) / 2
            self._ranks[key] = (flops, blocks, params)
        return self._ranks[key]


def block_shapes(block: nn.Module, *, rope: bool) -> tuple[list[tuple[int, int]], int, tuple[float, float]]:
    """One block's matmul shapes, attention width and memory-bound element accesses per token.

    The memory-bound ops of an eager forward, counted by what each reads and writes per token
    (in units of elements; the backward reads saved inputs and the incoming gradient and writes
    one gradient per op: about twice the forward):

    - LayerNorm: one fused kernel, read x, write y: 2 x width.
    - RMSNorm (Llama's, eager as transformers writes it: upcast, square, mean, scale, downcast,
      weight): 4 x width at the compute dtype and 7 x width in fp32.
    - a bias add: read, write and the addend: 3 x out_features.
    - the MLP activation: GELU reads and writes the hidden width (2 h); SwiGLU's silu(gate) * up
      reads gate and up, writes silu and the product (5 h).
    - RoPE on queries and keys (transformers' ``apply_rotary_pos_emb``: two products, a
      rotate-half (negate, concatenate) and a sum): about 10 accesses per query and key element.
    - two residual adds: 6 x the block's width.
    """
    linears = [m for m in block.modules() if isinstance(m, nn.Linear)]
    gemms = [(m.in_features, m.out_features) for m in linears]
    width = next((m.out_features for n, m in block.named_modules() if n.endswith("q_proj")), 0)
    d = linears[0].in_features if linears else 0
    act, fp32 = 6.0 * d, 0.0  # residual adds
    for name, m in block.named_modules():
        kind = type(m).__name__
        if isinstance(m, nn.LayerNorm):
            act += 2.0 * m.normalized_shape[-1]
        elif "RMSNorm" in kind:
            n = m.weight.shape[-1] if getattr(m, "weight", None) is not None else d
            act, fp32 = act + 4.0 * n, fp32 + 7.0 * n
        elif isinstance(m, nn.Linear) and m.bias is not None:
            act += 3.0 * m.out_features
    gated = next((m for m in block.modules() if hasattr(m, "gate_proj") and hasattr(m, "up_proj")), None)
    if gated is not None:  # SwiGLU
        act += 5.0 * gated.gate_proj.out_features
    elif linears:  # one activation function (GELU) on the widest matmul output
        act += 2.0 * max(m.out_features for m in linears)
    if rope:
        qk = sum(m.out_features for n, m in block.named_modules() if n.endswith(("q_proj", "k_proj")))
        act += 10.0 * qk
    return gemms, width, (act, fp32)


def gemm_slowdown(stats: ModelStats, m: int, tp: int, *, hw: Profile, rate: float, elem_bytes: int) -> float:
    """Time of a block's and the head's GEMMs for a micro-batch of ``m`` tokens (forward, and the
    backward's input and weight gradients) over that of their FLOPs at ``rate``: 1 off a GPU.
    Under TP each matmul is split along its wider side (Megatron's column and row splits)."""
    if not hw.sms or not stats.gemms:
        return 1.0
    shapes = [*stats.gemms, (stats.hidden, stats.vocab)] if stats.vocab and stats.hidden else stats.gemms
    seconds = flops = 0.0
    for k, n in shapes:
        k, n = (k, n // tp) if n >= k else (k // tp, n)
        for a, b, c in ((m, n, k), (m, k, n), (k, n, m)):  # y = x W, dx = dy W^T, dW = x^T dy
            seconds += gemm_seconds(a, b, c, hw=hw, rate=rate, elem_bytes=elem_bytes)
        flops += 6.0 * m * n * k
    return seconds / (flops / rate)


def gemm_seconds(m: float, n: int, k: int, *, hw: Profile, rate: float, elem_bytes: int) -> float:
    """One (m x k) @ (k x n) GEMM. On a GPU (``hw.sms``) it runs in waves of 256 x 128 output
    tiles over the SMs, so a partial last wave or a small output wastes part of the device (tile
    and wave quantization), and a GEMM too thin to reuse its operands is bound by memory
    (NVIDIA, "Matrix Multiplication Background User's Guide": arithmetic intensity, tile and
    wave quantization); elsewhere FLOPs over the rate."""
    flops = 2.0 * m * n * k
    if not hw.sms:
        return flops / rate
    tiles = math.ceil(m / 256) * math.ceil(n / 128)
    waves = math.ceil(tiles / hw.sms)
    busy = tiles / (waves * hw.sms)
    memory = (m * k + k * n + m * n) * elem_bytes / (hw.hbm_gbps * 1e9)
    return max(flops / (rate * busy), memory)


@dataclass
class Cost:
    terms: dict[str, float]
    step_time_s: float
    tokens_per_s: float
    mfu: float
    n_micro: int  # micro-batches (pipeline micro-batches under pp) per step on a rank

    @property
    def dominant(self) -> str:
        return max(self.terms, key=self.terms.get)


def crosses_nodes(stride: int, size: int, ranks_per_node: int) -> bool:
    return size > 1 and (size - 1) * stride >= ranks_per_node


@dataclass(frozen=True)
class _Rank:
    """What every term reads: the layout's work on its busiest rank, worked out once."""

    layout: Layout
    cfg: Config
    stats: ModelStats
    hw: Profile
    ranks_per_node: int
    dtype: str
    act_bytes: int
    reduce_bytes: int
    seq: int  # the whole row: what each token attends over
    local_seq: int  # the tokens of a row this rank computes (seq / cp)
    d: int
    per_rank: int
    n_micro: int  # micro-batches (pipeline micro-batches under pp) per step
    mb: int  # samples in one of them
    stage_flops: float  # training FLOPs per token of the rank's blocks (and head)
    rank_blocks: int
    rank_params: float
    share: float  # the rank's share of a compute resource (CPU cores)
    rate: float  # achievable matmul FLOP/s of that share
    recomputes: int  # forward recomputations per checkpointed block (2 under split backwards)

    @property
    def tokens(self) -> int:
        return self.per_rank * self.local_seq

    @property
    def shard_params(self) -> float:
        return self.rank_params / self.layout.tp

    @property
    def ep(self) -> int:
        return self.layout.ep or 1

    @property
    def expert_local(self) -> float:
        """Expert parameters this rank holds outside DDP / FSDP2: ``1/ep`` of the routed experts at
        ep > 1 (distributed/expert_parallel.py); 0 at ep = 1, where they are wrapped with the rest."""
        return self.stats.expert_params / self.ep if self.ep > 1 else 0.0

    @property
    def dp_params(self) -> float:
        """The parameters DDP or FSDP2 reduce (and FSDP2 gathers): all but the experts at ep > 1."""
        return self.shard_params - (self.stats.expert_params / self.layout.tp if self.ep > 1 else 0.0)

    @classmethod
    def of(cls, layout: Layout, *, cfg: Config, stats: ModelStats, hw: Profile, ranks_per_node: int) -> _Rank:
        dtype = cfg.precision.dtype
        per_rank = cfg.batch.global_batch_size // layout.dp
        accum = per_rank // layout.micro_batch_size
        p, v = layout.pp, (layout.pp_virtual_stages if layout.pp > 1 else 1)
        # Work of the busiest pipeline rank: its blocks (and the head on the last stage).
        if p > 1 and stats.model is not None:
            stage_flops, rank_blocks, rank_params = stats.busiest_rank(p, v, SCHEDULES[layout.pp_schedule][2], cfg)
            ppm = pp_microbatches(
                layout.apply(cfg).parallel, pp=p, micro_batch_size=layout.micro_batch_size, accum_steps=accum
            )
            n_micro, mb = accum * ppm, layout.micro_batch_size // ppm
        else:
            stage_flops, rank_blocks, rank_params = stats.flops_per_token, len(stats.block_params), stats.total_params
            n_micro, mb = accum, layout.micro_batch_size
        share = 1.0 if not hw.cores else min(1.0, hw.cores / max(1, min(ranks_per_node, layout.world_size)))
        return cls(
            layout=layout,
            cfg=cfg,
            stats=stats,
            hw=hw,
            ranks_per_node=ranks_per_node,
            dtype=dtype,
            act_bytes=DTYPES[dtype].itemsize,
            reduce_bytes=2 if cfg.comm.compression in ("bf16", "fp16") or cfg.precision.reduce_dtype != "fp32" else 4,
            seq=stats.seq_len,
            local_seq=stats.seq_len // layout.cp,
            d=stats.hidden,
            per_rank=per_rank,
            n_micro=n_micro,
            mb=mb,
            stage_flops=stage_flops,
            rank_blocks=rank_blocks,
            rank_params=rank_params,
            share=share,
            rate=hw.achievable_flops(dtype) * share,
            # The zero-bubble schedules split each backward into an input-gradient and a
            # weight-gradient pass, two autograd.grad calls, and non-reentrant checkpointing
            # recomputes per call (its recomputed tensors are keyed by the graph task id,
            # torch/utils/checkpoint.py): the forward is run again twice. Measured at world 2 on
            # the main GPT: full checkpointing adds 0.08 s to a 1F1B step and 0.25 s to a DualPipeV one.
            recomputes=2 if p > 1 and layout.pp_schedule in SPLIT_BACKWARD else 1,
        )


def compute_terms(r: _Rank) -> tuple[float, float]:
    """(compute, recompute) seconds: the rank's matmuls and attention, and what checkpointing runs again.

    Matmuls and attention apart: attention as MFU counts it is 12 x width x T per token and block.
    Full checkpointing runs each block's forward again (a third of its matmul FLOPs); selective
    only its pointwise ops (:func:`pointwise_term`): its matmuls and attention are saved.
    """
    stats, hw, layout = r.stats, r.hw, r.layout
    block_flops_rank = r.stage_flops - (stats.head_flops if layout.pp == 1 else 0.0)
    width = stats.attention_width or r.d
    attention_token = r.rank_blocks * 12.0 * width * r.seq if stats.gemms else 0.0
    linear_flops = r.stage_flops - attention_token
    slowdown = gemm_slowdown(stats, r.mb * r.local_seq, layout.tp, hw=hw, rate=r.rate, elem_bytes=r.act_bytes)
    linear_s = r.tokens * linear_flops / layout.tp / r.rate * slowdown
    block_linear_s = linear_s * (block_flops_rank - attention_token) / max(1.0, linear_flops)
    attention_s, attention_forward_s = attention_seconds(r)
    recompute = 0.0
    if layout.activation_checkpointing == "full":
        recompute = r.recomputes * (block_linear_s / 3 + attention_forward_s)
    return linear_s + attention_s, recompute


def attention_seconds(r: _Rank) -> tuple[float, float]:
    """(forward + backward, forward) seconds of the rank's attention. Each of its ``T / cp`` tokens
    of a row attends over the whole row (the head-tail split evens the causal work over cp ranks)."""
    stats, hw, layout = r.stats, r.hw, r.layout
    width = stats.attention_width or r.d
    if hw.attention_efficiency:
        # Causal flash attention computes the lower half of the T x T square: forward 2 x width x T
        # per token (QK^T and PV), backward 2.5x that (it recomputes QK^T: Dao 2023, sec. 3.1).
        att_rate = hw.peak(r.dtype) * hw.attention_efficiency * r.share
        attention_s = r.tokens * r.rank_blocks * 7.0 * width * r.seq / layout.tp / att_rate
        return attention_s, attention_s * 2 / 7
    attention_token = r.rank_blocks * 12.0 * width * r.seq if stats.gemms else 0.0
    attention_s = r.tokens * attention_token / layout.tp / r.rate
    return attention_s, attention_s / 3


def ring_bytes(*, mb: int, local_seq: int, width: int, cp: int, act_bytes: int) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends per attention layer and micro-batch in the ring.

    The rank's K (and V) chunks hold ``mb x local_seq x width`` elements (width: heads x head dim
    on the rank; grouped-query K/V heads are repeated before the ring). Forward
    (distributed/context_parallel.py ``_RingAttention.forward``): ``cp - 1`` hops of K and V at the
    compute dtype. Backward: ``cp - 1`` hops of K, V and their gradient so far, then one hop of the
    gradient home, all float32: ``(4 (cp - 1) + 2)`` chunks. 0 at cp = 1."""
    if cp <= 1:
        return 0, 0
    local = mb * local_seq * width
    return 2 * (cp - 1) * local * act_bytes, (4 * (cp - 1) + 2) * local * 4


def cp_comm_term(r: _Rank) -> float:
    """Context parallel's exposed communication (module docstring, ``cp_comm``)."""
    layout, hw = r.layout, r.hw
    cp = layout.cp
    if cp <= 1:
        return 0.0
    width = (r.stats.attention_width or r.d) // layout.tp
    inter = crosses_nodes(layout.tp, cp, r.ranks_per_node)
    forwards = 1 + (r.recomputes if layout.activation_checkpointing == "full" else 0)
    layers = r.n_micro * r.rank_blocks
    if r.cfg.parallel.cp_attention == "alltoall":
        # Ulysses: q, k, v and out forward, their gradients backward; each all-to-all moves the
        # rank's mb x local_seq x width elements (DeepSpeed-Ulysses, Jacobs et al. 2023, sec. 3.1).
        a2a = hw.collective_s("all_to_all", r.mb * r.local_seq * width * r.act_bytes, cp, inter=inter)
        return layers * (4 * forwards + 4) * a2a
    chunk = r.mb * r.local_seq * width  # elements of the rank's K (or V)
    hop_fwd = hw.collective_s("send_recv", 2 * chunk * r.act_bytes, 2, inter=inter)  # K, V
    hop_bwd = hw.collective_s("send_recv", 4 * chunk * 4, 2, inter=inter)  # K, V, dK, dV in fp32
    hop_home = hw.collective_s("send_recv", 2 * chunk * 4, 2, inter=inter)  # dK, dV
    # The forward passes a chunk on while attending to it: a hop hides behind one step's attention
    # (1/cp of the layer's forward attention); the backward waits for each hop before the next pair.
    _, attention_forward_s = attention_seconds(r)
    step_attention = attention_forward_s / max(1, layers) / cp
    forward = (cp - 1) * max(0.0, hop_fwd - hw.overlap * step_attention)
    backward = (cp - 1) * hop_bwd + hop_home
    return layers * (forwards * forward + backward)


def moe_all_to_all_bytes(*, tokens: int, top_k: int, d_model: int, ep: int, elem_bytes: int = 4) -> tuple[float, float]:
    """(forward, backward) bytes one rank sends to the *other* ep ranks per MoE layer, under
    balanced routing (distributed/expert_parallel.py ``dispatch``): each of its ``tokens x top_k``
    (token, slot) pairs goes to its expert's rank and its output comes back (dispatch and combine:
    2), ``(ep - 1) / ep`` of them to another rank; the backward sends their gradients the other
    way (as much again). Tokens travel in the residual stream's dtype (float32: layer norms run in
    float32 under autocast, and FSDP2's bf16 parameters are refused with ep) and outputs in
    float32, hence ``elem_bytes`` 4 for both. benchmarks/parallel/moe_ep.py measures a whole step's
    (forward and backward, both layers) within the routing's imbalance: 3.998 MiB against 4.000 at
    ep 2 of world 2, 3.110 against 3.000 at ep 4 of world 4 (docs/moe.md)."""
    if ep <= 1:
        return 0.0, 0.0
    forward = 2 * tokens * top_k * d_model * elem_bytes * (ep - 1) / ep
    return forward, forward


def ep_comm_term(r: _Rank) -> float:
    """Expert parallel (docs/moe.md): the token all_to_alls and the experts' gradient all-reduce.

    Per micro-batch and MoE layer, forward: the counts' exchange, the dispatch and the combine;
    backward: the dispatch's and the combine's gradients; a forward recomputed by full
    checkpointing exchanges again. None of them overlaps compute (the dispatch waits for the
    router, the experts for the dispatch): all exposed. Then, once per step after the backward,
    the local experts' gradients are all-reduced over the ``dp / ep`` ranks holding the same
    experts (``reduce_expert_grads``, fp32), also exposed. Each all_to_all is priced with
    nccl-tests' convention (the rank's whole buffer, bus factor ``(ep - 1) / ep``), which sends
    :func:`moe_all_to_all_bytes` to the other ranks."""
    layout, hw, stats = r.layout, r.hw, r.stats
    ep = r.ep
    if ep <= 1 or not stats.moe_layers:
        return 0.0
    stride = layout.tp * layout.cp  # the ep ranks are neighbouring dp ranks (parallel_dims.ep_mesh)
    inter = crosses_nodes(stride, ep, r.ranks_per_node)
    pairs = r.mb * r.local_seq * stats.top_k * stats.hidden  # elements of the rank's dispatched tokens
    dispatch = hw.collective_s("all_to_all", pairs * 4, ep, inter=inter)
    combine = hw.collective_s("all_to_all", pairs * 4, ep, inter=inter)
    counts = hw.collective_s("all_to_all", stats.n_experts * 8, ep, inter=inter)
    forwards = 1 + (r.recomputes if layout.activation_checkpointing == "full" else 0)
    layers = stats.moe_layers * r.rank_blocks / max(1, len(stats.block_params))
    a2a = r.n_micro * layers * (forwards * (counts + dispatch + combine) + dispatch + combine)
    replicas = layout.dp // ep
    inter_r = crosses_nodes(stride * ep, replicas, r.ranks_per_node)
    reduce = hw.collective_s("all_reduce", r.expert_local * stats.trained * 4, replicas, inter=inter_r)
    return a2a + reduce


def pointwise_term(r: _Rank) -> float:
    """Seconds of the memory-bound ops (norms, activations, the loss over the vocabulary) at the
    memory bandwidth: forward once, backward about twice (each op's gradient reads its inputs and
    writes one), and the forward's third again when checkpointing recomputes."""
    stats, layout = r.stats, r.layout
    if stats.pointwise != (0.0, 0.0):
        per_token_block = stats.pointwise[0] * r.act_bytes + stats.pointwise[1] * 4
    else:  # a model without recognisable blocks: the GPT block's figure per unit of width
        per_token_block = POINTWISE_ELEMENTS / 3 * r.d * r.act_bytes
    pointwise_bytes = r.tokens * r.rank_blocks * 3 * per_token_block / layout.tp
    pointwise_bytes *= 1 + (r.recomputes / 3 if layout.activation_checkpointing != "none" else 0)
    # The loss over the vocabulary (on the last stage; counted for the busiest rank as an upper bound).
    pointwise_bytes += r.tokens * stats.vocab * LOSS_BYTES_PER_LOGIT / layout.tp
    return pointwise_bytes / (r.hw.hbm_gbps * 1e9 * r.share)


def overhead_term(r: _Rank) -> float:
    """The fixed time of each block pass (dispatch, launches; more on DTensors) and of each FSDP
    unit and collective (FSDP2's hooks, copy-in and copy-out): profile.py's overhead figures."""
    layout, hw = r.layout, r.hw
    recompute_passes = {"none": 0.0, "selective": 0.5, "full": 1.0}[layout.activation_checkpointing] * r.recomputes
    per_pass = (hw.tp_block_overhead_s or hw.block_overhead_s) if layout.tp > 1 else hw.block_overhead_s
    t = r.n_micro * (r.rank_blocks * (3 + recompute_passes) + 2) * per_pass / r.share
    if layout.shard > 1:
        units = r.rank_blocks + 1
        collectives = r.n_micro * (2 if layout.reshard_after_forward else 1) + (
            r.n_micro if layout.reshard_after_forward else 1
        )
        t += units * collectives * hw.fsdp_unit_overhead_s / r.share
    return t


def tp_comm_term(r: _Rank) -> float:
    """Tensor parallel: all-reduces of one micro-batch's activations, on the critical path (four a
    block, two more for a recomputed forward, and two outside the blocks)."""
    layout = r.layout
    if layout.tp <= 1 or not r.d:
        return 0.0
    act = r.mb * r.local_seq * r.d * r.act_bytes
    per_micro = r.rank_blocks * (4 + (2 * r.recomputes if layout.activation_checkpointing == "full" else 0)) + 2
    inter = crosses_nodes(1, layout.tp, r.ranks_per_node)
    return r.n_micro * per_micro * r.hw.collective_s("all_reduce", act, layout.tp, inter=inter)


def fsdp_comm_term(r: _Rank, busy_compute: float) -> float:
    """FSDP's exposed all-gathers and reduce-scatters (and HSDP's all-reduce), given the compute
    they hide behind.

    One FSDP unit per block and one root unit (embedding, head, final norm); one collective per
    unit and pass, so the per-collective latency is paid per unit. Per micro-batch: the forward
    gathers each unit while the previous block computes (FSDP2's prefetch), the backward gathers
    again when resharding and reduce-scatters each unit's gradients while the next block's
    backward runs (every micro-batch when resharding, else on the last one: paratrain's sync
    policy). Nothing hides the root's first gather nor the last reduce-scatter; a block's
    collective hides behind a block's compute up to ``overlap`` of it and the rest is exposed.
    """
    layout, hw, stats = r.layout, r.hw, r.stats
    shard = layout.shard  # FSDP2 shards over dp_shard x cp flattened (ranks tp apart)
    if shard <= 1:
        return 0.0
    inter = crosses_nodes(layout.tp, shard, r.ranks_per_node)
    experts_out = stats.expert_params if r.ep > 1 else 0  # expert parallel: not FSDP2's
    block_params = (sum(stats.block_params) - experts_out) / max(1, len(stats.block_params)) / layout.tp
    root_params = max(0.0, r.dp_params - block_params * r.rank_blocks)
    gather_bytes = r.act_bytes if r.dtype != "fp32" else 4

    def unit_comm(params: float, scatter: bool) -> tuple[float, float]:
        """(all-gather, reduce-scatter [+ HSDP's all-reduce]) seconds of one unit."""
        ag = hw.collective_s("all_gather", params * gather_bytes, shard, inter=inter)
        rs = 0.0
        if scatter:
            grads = params * stats.trained  # frozen parameters are gathered, never reduced
            rs = hw.collective_s("reduce_scatter", grads * r.reduce_bytes, shard, inter=inter)
            if layout.dp_replicate > 1:
                inter_r = crosses_nodes(layout.tp * shard, layout.dp_replicate, r.ranks_per_node)
                rs += hw.collective_s("all_reduce", grads * r.reduce_bytes / shard, layout.dp_replicate, inter=inter_r)
        return ag, rs

    per_block = busy_compute / max(1, r.n_micro) / max(1, r.rank_blocks)
    fwd_block, bwd_block = per_block / 3, per_block * 2 / 3

    def micro_batch(scatter: bool) -> float:
        ag_root, rs_root = unit_comm(root_params, scatter)
        ag, rs = unit_comm(block_params, scatter)
        bwd_ag = ag if layout.reshard_after_forward else 0.0
        forward = ag_root + r.rank_blocks * max(0.0, ag - hw.overlap * fwd_block)
        return forward + r.rank_blocks * max(0.0, bwd_ag + rs - hw.overlap * bwd_block) + rs_root

    scattering = r.n_micro if layout.reshard_after_forward else 1
    return scattering * micro_batch(True) + (r.n_micro - scattering) * micro_batch(False)


def dp_comm_term(r: _Rank, compute: float, recompute: float) -> float:
    """DDP's gradient all-reduce (no sharding): what the last micro-batch's backward cannot hide,
    and at least the last bucket's share."""
    layout = r.layout
    if layout.shard > 1 or layout.dp_replicate <= 1:
        return 0.0
    inter = crosses_nodes(layout.tp * layout.dp_shard, layout.dp_replicate, r.ranks_per_node)
    grad_bytes = r.dp_params * r.stats.trained * r.reduce_bytes  # DDP reduces trained parameters only
    ar = r.hw.collective_s("all_reduce", grad_bytes, layout.dp_replicate, inter=inter)
    last_backward = (compute * 2 / 3 + recompute) / max(1, r.n_micro)
    last_bucket = min(1.0, r.cfg.comm.bucket_mb * 2**20 / max(1.0, grad_bytes))
    return max(ar - r.hw.overlap * last_backward, ar * last_bucket)


def pipeline_terms(r: _Rank, busy: float) -> tuple[float, float]:
    """(bubble, point-to-point) seconds of a pipeline: the schedule's idle fraction of the busy
    time, and the activation sends between stages."""
    layout = r.layout
    p = layout.pp
    if p <= 1:
        return 0.0, 0.0
    v = layout.pp_virtual_stages
    bubble = (p - 1) / r.n_micro
    if layout.pp_schedule in ("interleaved1f1b", "looped_bfs"):
        bubble /= v
    elif layout.pp_schedule == "interleaved_zb":
        bubble /= 3 * v
    elif layout.pp_schedule in ("zbv", "dualpipev"):
        bubble /= 6
    p2p = 0.0
    if r.d:
        stride_pp = layout.tp * layout.cp * layout.dp_shard * layout.dp_replicate
        inter = crosses_nodes(stride_pp, p, r.ranks_per_node)
        send = r.hw.collective_s("send_recv", r.mb * r.local_seq * r.d * r.act_bytes, 2, inter=inter)
        p2p = 2 * v * r.n_micro * send
    return busy * bubble, p2p


def optimizer_term(r: _Rank) -> float:
    """The step's end: the optimiser's memory traffic over the rank's parameter shard, and a fixed
    time per parameter tensor (norm, clipping, AdamW; more on DTensors under FSDP or TP). A
    pipeline rank holds its blocks' tensors and, as for the parameters, half the others."""
    layout, stats, hw = r.layout, r.stats, r.hw
    # The optimiser holds the trained parameters only (a LoRA run's adapters).
    trained = (r.dp_params / layout.shard + r.expert_local) * stats.trained
    t = trained * optimizer_bytes_per_param(r.cfg) / (hw.hbm_gbps * 1e9 * r.share)
    others = stats.tensors - stats.block_tensors * len(stats.block_params)
    rank_tensors = stats.tensors if layout.pp == 1 else stats.block_tensors * r.rank_blocks + others / 2
    rank_tensors *= stats.trained_tensors
    sharded = layout.shard > 1 or layout.tp > 1
    per_tensor = hw.dtensor_optimizer_tensor_overhead_s if sharded else hw.optimizer_tensor_overhead_s
    return t + rank_tensors * per_tensor / r.share


def step_cost(layout: Layout, *, cfg: Config, stats: ModelStats, hw: Profile, ranks_per_node: int) -> Cost:
    """The step time of ``layout``, term by term (:data:`TERMS`), on its busiest rank."""
    r = _Rank.of(layout, cfg=cfg, stats=stats, hw=hw, ranks_per_node=ranks_per_node)
    t = dict.fromkeys(TERMS, 0.0)
    t["compute"], t["recompute"] = compute_terms(r)
    t["pointwise"] = pointwise_term(r)
    t["overhead"] = overhead_term(r)
    t["tp_comm"] = tp_comm_term(r)
    t["cp_comm"] = cp_comm_term(r)
    t["ep_comm"] = ep_comm_term(r)
    busy_compute = t["compute"] + t["recompute"] + t["overhead"] + t["pointwise"]
    t["fsdp_comm"] = fsdp_comm_term(r, busy_compute)
    t["dp_grad_reduce"] = dp_comm_term(r, t["compute"], t["recompute"])
    t["pp_bubble"], t["pp_p2p"] = pipeline_terms(
        r, busy_compute + t["tp_comm"] + t["cp_comm"] + t["ep_comm"] + t["fsdp_comm"]
    )
    t["optimizer"] = optimizer_term(r)
    step = sum(t.values())
    tokens_step = cfg.batch.global_batch_size * r.seq
    mfu = stats.flops_per_token * tokens_step / (step * layout.world_size * hw.peak(r.dtype)) if step > 0 else math.nan
    return Cost(t, step, tokens_step / step, mfu, r.n_micro)
