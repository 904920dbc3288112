"""The GPT's mixture-of-experts layer (``model.args.moe``): router, experts, sequence-wise balance loss.

Router (Shazeer et al. 2017; Switch, Fedus et al. 2021): a linear layer without bias -> softmax
over the experts (in float32) -> the top-k experts of each token; their probabilities, optionally
renormalised to sum to 1 (``norm_topk``, Mixtral/Qwen3-MoE do; DeepSeek-V3 does), weight the
experts' outputs. Every expert has the GPT's own MLP shape. **No token is dropped** (no capacity
factor): what a token gets never depends on which other tokens share its micro-batch.

Exactness. Experts are computed with a plain loop (gather the tokens routed to expert e -> its
MLP -> scatter into a ``(tokens, k, d)`` float32 buffer at the slot that chose e), then each
token's k outputs are summed in slot order in float32. A token's result is therefore the same
function of the token alone whatever the grouping of tokens into micro-batches or ranks (only the
experts' matmul rounding, ~1e-7, changes with the number of rows).

Load-balancing loss (``aux_loss_weight``): the **sequence-wise** balance loss of DeepSeek-V3
(arXiv 2412.19437, section 2.1.2, its eqs. 17-20), per MoE layer and per sequence of T tokens::

    f_i = E / (k T) * #{t : expert i in top-k(t)}      P_i = 1/T * sum_t p_{i,t}
    L_seq = sum_i f_i P_i                                (1 when perfectly balanced)

and the auxiliary loss of a global batch of S sequences is ``aux_loss_weight / S * sum over
sequences and MoE layers of L_seq``. Every term belongs to one sequence and sequences are never
split across ranks or micro-batches, so the sum is a plain sum of per-micro-batch sums and the
step divides it by the global sequence count like the language-model loss (step.py): the same
function of the global batch on every layout, with no collective. (A batch-level loss computed
per forward call, as transformers' ``load_balancing_loss_func`` is, changes with the micro-batch
size and the accumulation: not exact.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from paratrain.config import ConfigError
from paratrain.distributed.expert_parallel import ExpertGroup, dispatch
from paratrain.objectives.moe import RouterStats


@dataclass(frozen=True)
class MoEConfig:
    """``model.args.moe = {n_experts = 8, top_k = 2, ...}``; absent: every block is dense."""

    n_experts: int = 8  # routed experts per MoE layer
    top_k: int = 2  # experts per token
    n_shared_experts: int = 0  # experts every token goes through (DeepSeekMoE), added unweighted
    every: int = 1  # blocks i with i % every == every - 1 are MoE (1: all; 2: every second one)
    aux_loss_weight: float = 0.01  # the sequence-wise balance loss's weight (0: logged, not trained)
    norm_topk: bool = True  # renormalise a token's k routing weights to sum to 1

    @classmethod
    def from_args(cls, args: dict) -> MoEConfig:
        known = {f.name for f in fields(cls)}
        if not isinstance(args, dict):
            raise ConfigError(f"model.args.moe must be a table (e.g. {{n_experts = 8, top_k = 2}}), not {args!r}")
        unknown = sorted(set(args) - known)
        if unknown:
            raise ConfigError(f"model.args.moe.{unknown[0]} is unknown; the keys are {sorted(known)}")
        cfg = cls(**args)
        cfg.check()
        return cfg

    def check(self) -> None:
        for key in ("n_experts", "top_k", "every"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"model.args.moe.{key} = {value!r} must be an integer >= 1")
        if not isinstance(self.n_shared_experts, int) or self.n_shared_experts < 0:
            raise ConfigError(f"model.args.moe.n_shared_experts = {self.n_shared_experts!r} must be an integer >= 0")
        if self.top_k > self.n_experts:
            raise ConfigError(
                f"model.args.moe.top_k = {self.top_k} is more than n_experts = {self.n_experts};"
                f" use a top_k <= {self.n_experts}"
            )
        if not isinstance(self.aux_loss_weight, (int, float)) or self.aux_loss_weight < 0:
            raise ConfigError(f"model.args.moe.aux_loss_weight = {self.aux_loss_weight!r} must be a number >= 0")
        if not isinstance(self.norm_topk, bool):
            raise ConfigError(f"model.args.moe.norm_topk = {self.norm_topk!r} must be true or false")

    def is_moe_block(self, i: int) -> bool:
        return i % self.every == self.every - 1


def route(logits: torch.Tensor, *, top_k: int, norm_topk: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits (N, E) -> (probabilities (N, E) float32, top-k weights (N, k), top-k experts (N, k))."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)  # sorted: slot 0 is the most probable
    if norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return probs, weights, experts


def sequence_balance_loss(
    probs: torch.Tensor, experts: torch.Tensor, n_experts: int, *, cp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss of each sequence: probs (B, T, E), experts (B, T, k)
    -> (B,) ``sum_i f_i P_i`` (f has no gradient: it counts).

    Context parallel (``cp_group``): the rank holds ``T / cp`` tokens of each sequence. ``f`` needs
    the whole sequence's counts, so they are summed over the cp ranks first (integers, no
    gradient); ``P_i`` is a mean over the sequence's tokens, linear in them, so each rank returns
    its own tokens' share ``sum_i f_i (1/T) sum_{t local} p_{i,t}``, and the cp ranks' shares sum
    to the sequence's loss. Each share is differentiated on its own rank through its own
    probabilities only, and the step sums the parameters' gradients over the cp ranks (FSDP2 over
    dp_shard x cp): the exact gradient, with no autograd through a collective (the values are
    summed over cp by the step's reduce like the language-model loss)."""
    _, t, k = experts.shape
    chosen = F.one_hot(experts, n_experts).sum(dim=2).float()  # (B, T, E): 1 where routed
    counts = chosen.sum(dim=1)  # (B, E)
    if cp_group is None:
        return (counts * (n_experts / (k * t)) * probs.mean(dim=1)).sum(dim=-1)
    dist.all_reduce(counts, group=cp_group)
    t *= dist.get_world_size(cp_group)  # the whole sequence's length
    return (counts * (n_experts / (k * t)) * (probs.sum(dim=1) / t)).sum(dim=-1)


class MoE(nn.Module):
    """Router + ``n_experts`` routed experts (+ shared experts), each an MLP made by ``make_expert``.

    After each forward, ``router_stats`` holds this call's balance-loss sum and tokens per expert
    (paratrain.objectives.moe.RouterStats); the step's BalanceLoss objective takes it.
    """

    def __init__(self, cfg: MoEConfig, d_model: int, make_expert: Callable[[], nn.Module]):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(d_model, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(make_expert() for _ in range(cfg.n_experts))
        self.shared_experts = nn.ModuleList(make_expert() for _ in range(cfg.n_shared_experts))
        self.router_stats: RouterStats | None = None
        self.ep: ExpertGroup | None = None  # expert parallel (enable_expert_parallel)
        # Context parallel: the cp ranks holding the other parts of this rank's sequences
        # (models/gpt/parallel.py gpt_cp_attention sets it), over which the balance loss's
        # expert counts are summed (sequence_balance_loss).
        self.cp_group: dist.ProcessGroup | None = None

    def enable_expert_parallel(self, ep: ExpertGroup) -> list[nn.Parameter]:
        """Keep this rank's ``n_experts / ep`` experts only (distributed/expert_parallel.py), under
        their global indices (``experts.2``, ``experts.3``): the names, hence checkpoints and
        exports, are those of ep = 1. Returns their parameters. The full model was built (and
        seeded) first, so each expert has the weights it has at ep = 1."""
        self.ep = ep
        self.experts = nn.ModuleDict({str(e): self.experts[e] for e in ep.local_experts(self.cfg.n_experts)})
        return list(self.experts.parameters())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        # The router in float32 also under autocast: a top-k decided in bf16 flips on ties that
        # float32 separates.
        meta = x.device.type == "meta"  # (autocast does not know the meta device)
        with contextlib.nullcontext() if meta else torch.autocast(device_type=x.device.type, enabled=False):
            logits = F.linear(flat.float(), self.router.weight.float())
        probs, weights, experts = route(logits, top_k=self.cfg.top_k, norm_topk=self.cfg.norm_topk)
        out = self.combine(flat, weights, experts)
        for shared in self.shared_experts:
            out = out + shared(flat).float()
        counts = (
            experts.new_zeros(self.cfg.n_experts)  # bincount's size depends on the values
            if _estimating(experts)
            else torch.bincount(experts.reshape(-1), minlength=self.cfg.n_experts)
        )
        self.router_stats = RouterStats(
            aux_sum=self.cfg.aux_loss_weight
            * sequence_balance_loss(
                probs.view(b, t, -1), experts.view(b, t, -1), self.cfg.n_experts, cp_group=self.cp_group
            ).sum(),
            tokens_per_expert=counts.detach(),
        )
        return out.to(x.dtype).view(b, t, d)

    def combine(self, flat: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Each token's k expert outputs, weighted, summed in slot order in float32: (N, d)."""
        n, k = experts.shape
        estimating = _estimating(experts)
        if self.ep is not None and not estimating:
            # Expert parallel: each (token, slot) pair's expert output comes back from the rank
            # that holds it, in float32, at its own place; weighted and summed exactly as below.
            y = dispatch(flat, experts, list(self.experts.values()), self.cfg.n_experts, self.ep)
            slots = y.view(n, k, -1) * weights.unsqueeze(-1)
            return _sum_slots(slots)
        slots = flat.new_zeros((n, k, flat.shape[-1]), dtype=torch.float32)
        # Expert parallel under a memory estimate: this rank's experts, each on the balanced share
        # of all ep ranks' tokens (no values to route by, no all_to_all).
        local = (
            [(e, self.experts[str(e)]) for e in self.ep.local_experts(self.cfg.n_experts)]
            if self.ep is not None
            else list(enumerate(self.experts))
        )
        repeat = 1 if self.ep is None else self.ep.size
        for e, expert in local:
            # Every expert runs, on no rows at all if need be: its parameters stay in the graph,
            # so DDP and FSDP see a gradient (zeros) for each of them at every step.
            token, slot = (
                _balanced(e, n, k, self.cfg.n_experts, experts.device)
                if estimating
                else ((experts == e).nonzero(as_tuple=True))
            )
            if repeat > 1:
                y = expert(flat[token].repeat(repeat, 1))[: len(token)].float()
            else:
                y = expert(flat[token]).float()
            y = y * weights[token, slot].unsqueeze(-1)
            slots = slots.index_put((token, slot), y)  # each (token, slot) chose one expert
        return _sum_slots(slots)


def _sum_slots(slots: torch.Tensor) -> torch.Tensor:
    """(N, k, d) float32 -> (N, d): each token's k outputs summed in the fixed slot order."""
    out = slots[:, 0]
    for j in range(1, slots.shape[1]):  # fixed order: slot 0 (the most probable) first
        out = out + slots[:, j]
    return out


def _estimating(t: torch.Tensor) -> bool:
    """Fake or meta tensors (``paratrain plan``'s and find-batch's memory estimate): no values to route by."""
    return t.device.type == "meta" or is_fake(t)


def _balanced(e: int, n: int, k: int, n_experts: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert e's share of the n x k (token, slot) pairs under perfectly balanced routing: the
    shapes a memory estimate runs with (routing needs values that fake tensors do not have)."""
    per = -(-n * k // n_experts)
    pairs = torch.arange(e * per, min((e + 1) * per, n * k), device=device)
    return pairs // k, pairs % k
