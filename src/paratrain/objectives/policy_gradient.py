"""Group-relative policy-gradient losses over the policy's own completions (docs/grpo.md).

The completions come from the generation phase (paratrain/objectives/rl/rollout.py), which writes
each micro-batch's numbers into its target, a :class:`Rollout` of ``(B, T)`` tensors: the next token
to score at each position (-1: none; the completion's tokens, the stop token included), the
log-probability of that token under the policy that generated it (``old``, for the importance
ratio), the reference's (the KL term), the row's advantage, and the token's weight in its unit. With the ratio
``r = exp(log pi - log pi_old)``, the advantage ``A`` and ``e_lo, e_hi`` = ``rl.epsilon``,
``rl.epsilon_high``, a token's loss is PPO's clipped surrogate plus the k3 estimate of the KL to
the reference (Schulman et al. 2017; Shao et al. 2024, GRPO):

    l = -min(r A, clip(r, 1 - e_lo, 1 + e_hi) A) + beta (exp(ref - log pi) - (ref - log pi) - 1)

and the step's loss is ``sum over the global batch of w l / units``, with

===================== ========================== ===================================================
``rl.loss_type``       units (the normaliser)     w
===================== ========================== ===================================================
grpo                   completions                ``1 / |o|`` (the completion's mean: Shao et al.)
seq_mean_token_mean    completions                ``1 / |o|`` (verl's name for the same)
seq_mean_token_sum     completions                1 (verl)
dapo, bnpo, token_mean completion tokens          1 (Yu et al. 2025, DAPO; verl's token-mean)
dr_grpo                completions x max_new      1 (Liu et al. 2025, Dr. GRPO: a constant)
===================== ========================== ===================================================

Every normaliser is counted over the optimiser step's whole global batch before the first
backward, so accumulation, ``steps_per_generation``, the world size and the parallel degrees never
change an update. Where a variant's authors define it per micro-batch (TRL's ``bnpo``: the tokens
of the local batch) this is the definition that does not depend on the layout, which makes
``bnpo`` equal ``dapo``. In peers these normalisers change with the split: trl#6024 (DAPO scaled
by 0.5x or 4x when accumulation and steps_per_generation differ), ms-swift#10117 (divided by the
accumulation twice), verl#5625 (a token mean per micro-batch).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from torch.distributed.tensor import DTensor

from paratrain.config import RL_LOSS_TYPES, ConfigError
from paratrain.objectives.base import Objective

TOKEN_UNITS = ("dapo", "bnpo", "token_mean")
MEAN_OVER_TOKENS = ("grpo", "seq_mean_token_mean")  # w = 1 / |o|
SUMS = ("loss", "units", "tokens", "clipped", "kl", "importance", "capped")


@dataclass
class Rollout:
    """A micro-batch's completions as the loss reads them, each ``(B, T)`` at the positions of the
    rows' inputs (a completion token is scored at the position before it): ``tokens`` (int64, -1:
    nothing to score), the sampler's or the old policy's log-probabilities ``old``, the
    reference's ``ref`` (0 until written), the row's ``advantage`` and the token's ``weight`` in
    its unit (float64: the generation phase's own precision, cast where the loss uses them), and
    ``behaviour``, the sampler's log-probabilities, kept when ``old`` is overwritten by the
    trainer's recomputation (the importance weight of stale rounds, :func:`importance_weights`)."""

    tokens: torch.Tensor
    old: torch.Tensor
    ref: torch.Tensor
    advantage: torch.Tensor
    weight: torch.Tensor
    behaviour: torch.Tensor

    def to(self, device) -> Rollout:
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def token_weights(loss_type: str, lengths: torch.Tensor) -> torch.Tensor:
    """Each completion's token weight ``(B,)`` from its length: ``1 / |o|`` for the variants
    that take a completion's mean, else 1."""
    if loss_type in MEAN_OVER_TOKENS:
        return 1.0 / lengths.clamp(min=1).double()
    return torch.ones_like(lengths, dtype=torch.float64)


def importance_weights(
    old: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor, *, mode: str, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The importance weight ``(B, T)`` of each scored token of a stale sampler's completions, and
    where it was capped (bool ``(B, T)``), from ``rho = pi_old / pi_sampler`` (``old`` and
    ``behaviour``: log-probabilities ``(B, T)``, ``mask``: the scored tokens; a row is one
    completion, whole in its micro-batch). As TRL's GRPOTrainer (``vllm_importance_sampling_mode``):

    - ``token_truncate``: ``min(rho_t, cap)`` per token, truncated IS (Yao et al. 2025, "Your
      efficient RL framework secretly brings you off-policy RL training"; verl's TIS);
    - ``sequence_mask``: the completion's ``rho = exp(sum_t (old_t - behaviour_t))`` for each of
      its tokens, 0 where ``rho > cap`` (masked IS; TRL's default, cap 3.0);
    - ``none``: 1."""
    if mode == "none":
        return torch.ones_like(old, dtype=torch.float64), torch.zeros_like(mask)
    gap = torch.where(mask, old.double() - behaviour.double(), 0.0)
    if mode == "token_truncate":
        rho = gap.exp()
        return rho.clamp(max=cap), mask & (rho > cap)
    rho = gap.sum(-1, keepdim=True).exp().expand_as(gap)
    capped = mask & (rho > cap)
    return torch.where(capped, 0.0, rho), capped


def token_logps(logits, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log softmax(logits / temperature)`` of ``tokens`` ``(B, T)`` (float32; 0 where the token
    is -1), the policy's log-probability as the sampler draws from it."""
    if isinstance(logits, DTensor):  # tensor parallel: vocabulary-sharded or replicated logits
        logits = logits.full_tensor()
    logits = logits.float() / temperature
    picked = logits.gather(-1, tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(tokens >= 0, picked - logits.logsumexp(-1), 0.0)


class PolicyGradientLoss(Objective):
    """``sum over the global batch of w l / units`` (module docstring); logs the share of tokens
    whose ratio was clipped and the mean KL to the reference per token."""

    name = "loss"
    # The rollouts' rewards (their mean, spread and each function's mean: objectives/rl/rollout.py)
    # and the KL to the reference; the loss itself is near 0 on-policy (docs/grpo.md).
    watched = ("reward", "reward_*", "kl")

    def __init__(
        self,
        loss_type: str = "grpo",
        *,
        epsilon: float = 0.2,
        epsilon_high: float = 0.0,
        beta: float = 0.0,
        temperature: float = 1.0,
        max_new_tokens: int = 16,
        on_policy: bool = True,
        importance: str = "none",
        importance_cap: float = 3.0,
    ):
        if loss_type not in RL_LOSS_TYPES:
            raise ConfigError(f"rl.loss_type = {loss_type!r} is unknown; use one of {', '.join(RL_LOSS_TYPES)}")
        self.loss_type, self.beta, self.temperature = loss_type, beta, temperature
        self.low, self.high = 1 - epsilon, 1 + (epsilon_high or epsilon)
        self.max_new_tokens = max_new_tokens
        # On-policy (one optimiser step per generation, one epoch): the old policy is the one
        # differentiated, r = 1 exactly and its gradient is A grad log pi (TRL, verl do the same).
        self.on_policy = on_policy
        # Stale rounds (rl.async_steps > 0): the surrogate of each token weighted by
        # importance_weights, TRL's place for it (before the KL is added); "none" skips it.
        self.importance, self.importance_cap = importance, importance_cap
        self.unit = "completion token" if loss_type in TOKEN_UNITS else "completion"
        self.counts_target_tokens = loss_type in TOKEN_UNITS
        self.scale, self._last = 1.0, None
        # reference(forward, k): micro-batch k's reference output (build/frozen.py preference_reference),
        # run by the generation phase when beta > 0.
        self.reference = None

    @property
    def uses_reference(self) -> bool:
        return self.beta > 0

    @property
    def frozen(self) -> tuple[str, ...]:
        return ("reference",) if self.uses_reference else ()

    def attach(self, world) -> None:
        if self.uses_reference:  # pipeline parallel is refused with GRPO (preflight/support.py)
            self.reference = world.reference()

    def count(self, inputs, target: Rollout) -> torch.Tensor:
        tokens = target.tokens >= 0
        if self.loss_type in TOKEN_UNITS:
            return tokens.sum()
        completions = tokens.any(-1).sum()
        if self.loss_type == "dr_grpo":
            return completions * self.max_new_tokens
        return completions

    def start(self, *, scale: float, device: torch.device) -> None:
        self.scale, self.device = scale, device
        self.totals = torch.zeros(len(SUMS), device=device, dtype=torch.float64)
        self._last = None

    def loss(self, output, target: Rollout) -> torch.Tensor:
        target = target.to(self.device)
        mask = target.tokens >= 0
        logp = token_logps(output, target.tokens, self.temperature)
        old = logp.detach() if self.on_policy else target.old.float()
        ratio = torch.exp(logp - old)
        advantage = target.advantage.float()
        surrogate = torch.minimum(ratio * advantage, ratio.clamp(self.low, self.high) * advantage)
        per_token = -surrogate
        # pi_old on-policy is the policy differentiated here (one step per round): its own logp,
        # no recomputation needed (rollout.py skips it, as for the ratio)
        weight_is, capped_is = importance_weights(
            old, target.behaviour, mask, mode=self.importance, cap=self.importance_cap
        )
        if self.importance != "none":  # a factor of l alone: the units (the normaliser) stay as counted
            per_token = per_token * weight_is.float()
        kl = torch.zeros_like(logp)
        if self.beta:
            gap = target.ref.float() - logp
            kl = torch.exp(gap) - gap - 1
            per_token = per_token + self.beta * kl
        weight = torch.where(mask, target.weight, 0.0)
        loss_sum = (per_token.double() * weight).sum()
        with torch.no_grad():
            clipped = ((ratio < self.low) & (advantage < 0)) | ((ratio > self.high) & (advantage > 0))
            self._last = torch.stack(
                [
                    loss_sum.detach(),
                    self.count(None, target).double(),
                    mask.sum().double(),
                    (clipped & mask).sum().double(),
                    torch.where(mask, kl, 0.0).double().sum(),
                    torch.where(mask, weight_is, 0.0).sum(),
                    capped_is.sum().double(),
                ]
            )
        return loss_sum.float() * self.scale

    def end_micro_batch(self) -> None:
        self.totals += self._last
        self._last = None

    def sums(self) -> torch.Tensor:
        return self.totals

    def read(self, reduced: list[float], *, units: int) -> dict:
        if round(reduced[1]) != units:
            raise ConfigError(
                f"the policy-gradient loss saw {round(reduced[1])} {self.unit}s but the step counted {units};"
                " the rows must come from the generation phase (paratrain/objectives/rl/rollout.py)"
            )
        tokens = max(reduced[2], 1)
        return {
            "loss": reduced[0] / max(units, 1),
            "clip_ratio": reduced[3] / tokens,
            "kl": reduced[4] / tokens,
            "importance_weight": reduced[5] / tokens,
            "importance_capped": reduced[6] / tokens,
        }

    def metrics(self, values: dict) -> dict:
        keys = ("clip_ratio", "kl") if self.beta else ("clip_ratio",)
        if self.importance != "none":
            keys += ("importance_weight", "importance_capped")
        return {k: values[k] for k in keys if k in values}
