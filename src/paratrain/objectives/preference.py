"""Preference objectives over pairs (docs/preference.md): DPO and its variants, SimPO.

The unit is a **pair**: a row of the batch holds one, ``[chosen | rejected]`` packed
(data/preference.py), so both replies are always in the same micro-batch and the pair's loss is
a function of that row alone. The loss is ``sum over the global batch's pairs / their global
count``, formed before the first backward like every objective's (objectives/__init__.py):
accumulation, micro-batch size and world size never change it. (In peers the mean is taken per
micro-batch and the accumulation rescales it, which changes the loss when micro-batches hold
different counts of pairs, or lets a fix of the scaling drift: unsloth#3482, trl#2615.)

A side's log-probability ``log pi(reply | prompt)`` sums the reply's target tokens' log-softmax
(the prompt's tokens are never targets); the length-normalised variants take the mean over the
reply's tokens instead. With ``h = (log pi_c - log ref_c) - (log pi_r - log ref_r)``:

=============== ================================================ =======================================
``loss_type``    per-pair loss                                    paper
=============== ================================================ =======================================
sigmoid          ``-(1-e) logsig(b h) - e logsig(-b h)``          Rafailov et al. 2023 (DPO); e: cDPO
robust           ``((1-e)(-logsig(b h)) + e logsig(-b h))/(1-2e)`` Chowdhury et al. 2024
hinge            ``relu(1 - b h)``                                Zhao et al. 2023 (SLiC)
ipo              ``(h - 1/(2 b))^2``, mean log-probabilities      Azar et al. 2023
sigmoid_norm     sigmoid on mean log-probabilities                length-normalised DPO
simpo            ``-logsig(b (m_c - m_r) - g)``, no reference     Meng et al. 2024
orpo             ``-m_c - b logsig(o_c - o_r)``, no reference     Hong et al. 2024
bradley_terry    ``-logsig(r_c - r_r)``, a reward model's scores  Bradley & Terry 1952; Ouyang et al. 2022
=============== ================================================ =======================================

(``m``: a reply's mean token log-probability, ``o = m - log(1 - exp m)`` its log-odds; ``e``: ``label_smoothing``, ``b``: ``beta``, ``g``:
``gamma``; ``r``: a reward model's score of the whole prompt + reply at its last token,
``loss.name = 'reward'``, the model's output layer a one-label score head.) The *reference* log-probabilities come from ``reference(forward, k)``, given by the
build (build/frozen.py): the same model with its LoRA adapters off, or a frozen model (the initial
policy, another directory). They are computed in the phase before the micro-batch loop, without a
graph, for this rank's micro-batches. Under pipeline parallel the loss is the schedule's, run on
the last stage per piece of rows (:meth:`PreferenceLoss.pipeline_loss`), and the reference's
values are computed through a pipeline into that stage, per row (docs/preference.md, Layouts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F

# DTensor is imported in the functions that use it: its import costs seconds, which the launcher,
# whose preflight reads this module through the models, must not pay (tests/e2e/test_startup.py).
from paratrain.config import PREFERENCE_LOSS_TYPES as LOSS_TYPES
from paratrain.config import ConfigError
from paratrain.loss import pair_count, rows
from paratrain.objectives.base import Objective

MEAN_LOGPS = ("ipo", "sigmoid_norm", "simpo", "orpo")  # these compare mean token log-probabilities
NO_REFERENCE = ("simpo", "orpo", "bradley_terry")
SUMS = ("loss", "pairs", "chosen", "rejected", "correct")


def side_scores(scores, target: torch.Tensor, cp: CPGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A reward model's ``(chosen, rejected)`` scores ``(B, 2)``: each side's score at its last
    token, as transformers' sequence classifiers read a sequence's last non-padding token, from
    the per-token scores ``(B, T, 1)``; and the sides' lengths (0: no such side).

    ``cp``: the rows are this context-parallel rank's part (its two chunks): the last token's
    global index is agreed over the cp ranks (a MAX), the one rank that holds it gives its score
    and the others 0, summed with the gradient (``torch.distributed.nn``'s all-reduce)."""
    from torch.distributed.tensor import DTensor

    if isinstance(scores, DTensor):
        scores = scores.full_tensor()
    scores = scores[..., 0].float()
    side = target[:, 1]
    t = side.shape[-1]
    where = torch.arange(t, device=side.device) if cp is None else cp.indices(t).to(side.device)
    out, lengths = [], []
    for s in (0, 1):
        on = side == s
        last = torch.where(on, where, -1).amax(-1)
        if cp is None:
            out.append(scores.gather(-1, last.clamp(min=0)[:, None])[:, 0])
        else:
            dist.all_reduce(last, op=dist.ReduceOp.MAX, group=cp.group)
            out.append((scores * (on & (where == last[:, None]))).sum(-1))  # 0 where this rank lacks it
        lengths.append(on.sum(-1))
    out, lengths = torch.stack(out, -1), torch.stack(lengths, -1).to(torch.float32)
    return (out, lengths) if cp is None else (cp.sum(out), cp.sum(lengths, grad=False))


def ordered_sum(rows: torch.Tensor, group) -> torch.Tensor:
    """The sum over every rank's ``rows`` (dim 0) gathered in rank order, the global batch's order
    (data/sampler.py gives rank r its r-th contiguous slice): the same tensor, so the same bits, on
    every layout (run.bitwise)."""
    if group is not None and dist.get_world_size(group) > 1:
        parts = [torch.empty_like(rows) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, rows.contiguous(), group=group)
        rows = torch.cat(parts)
    return rows.sum(0)


@dataclass(frozen=True)
class CPGroup:
    """Context parallel (distributed/context_parallel.py): a pair's row is cut over ``size`` ranks,
    so a side's log-probability is a sum over them. ``sum`` all-reduces per-pair partial sums,
    with the gradient (each rank's part gets the whole pair's gradient) or without."""

    group: dist.ProcessGroup
    size: int
    rank: int
    # The global sequence index of each of this rank's local positions (context_parallel.py's
    # global_indices, handed in by build/__init__.py: objectives sit below distributed/).
    indices: Callable[[int], torch.Tensor]
    # The whole rows from every cp rank's part of them (context_parallel.py's gather_sequence):
    # the reference store is keyed by a pair's whole row.
    whole: Callable[[torch.Tensor], torch.Tensor]

    def sum(self, x: torch.Tensor, *, grad: bool = True) -> torch.Tensor:
        if grad and x.requires_grad:
            return dist_nn.all_reduce(x, group=self.group)
        x = x.detach().clone()
        dist.all_reduce(x, group=self.group)
        return x


def row_indexed(target: torch.Tensor) -> torch.Tensor:
    """Pipeline parallel: the rank's whole target ``(R, C, T)`` with each row's index ``(R, 1, T)``
    after it. The schedule cuts both alike, so a piece knows which rows (and reference values) it
    holds: ``target[:, -1, 0]``."""
    rows = torch.arange(len(target), device=target.device, dtype=target.dtype)
    return torch.cat([target, rows[:, None, None].expand(-1, 1, target.shape[-1])], 1)


def side_logps(logits, target: torch.Tensor, sides: tuple[int, ...] = (0, 1)) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``(chosen, rejected)`` log-probability sums ``(B, 2)`` (float32) and their
    target-token counts ``(B, 2)``, from the logits ``(B, T, V)`` and the pair target ``(B, 2, T)``.
    ``sides``: the sides whose sums are wanted; another's is 0, its tokens skip the logsumexp
    (KTO's loss reads side 0 only, its KL pass side 1 only)."""
    from torch.distributed.tensor import DTensor

    if isinstance(logits, DTensor):  # tensor parallel without loss_parallel: replicated logits
        logits = logits.full_tensor()
    tokens, side = target[:, 0], target[:, 1]
    valid = tokens >= 0
    logits = logits.float()
    picked = logits.gather(-1, tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    # The vocabulary-wide normaliser only where a target is: the prompts' and the padding's
    # positions (about half a pair's row in benchmarks/peers/vs_trl_dpo.py) skip the logsumexp
    # and its backward. Each position's value is the same bits as over the whole (B, T, V): a
    # row's reduction over the vocabulary does not depend on the other rows (tests/unit/
    # test_preference_logps.py). The boolean index costs a host sync on a GPU.
    wanted = valid if len(sides) == 2 else valid & (side == sides[0])
    normaliser = torch.zeros_like(picked).index_put((wanted,), logits[wanted].logsumexp(-1))
    token_logp = torch.where(wanted, picked - normaliser, 0.0)
    sums, counts = [], []
    for s in (0, 1):
        on = valid & (side == s)
        sums.append((token_logp * on).sum(-1) if s in sides else torch.zeros_like(token_logp[:, 0]))
        counts.append(on.sum(-1))
    return torch.stack(sums, -1), torch.stack(counts, -1).to(torch.float32)


class PreferenceLoss(Objective):
    """``sum over pairs of the pair loss / global pair count``; logs the rewards' means, their
    margin and how often the chosen reply's reward is the higher (``reward_accuracy``)."""

    name = "loss"
    unit = "pair"
    watched = ("reward_accuracy", "reward_margin", "kto_kl")

    def __init__(
        self,
        loss_type: str = "sigmoid",
        *,
        beta: float = 0.1,
        label_smoothing: float = 0.0,
        gamma: float = 0.5,
        reference=None,
        weights: tuple[float, float] = (1.0, 1.0),
        dp_group=None,
        cp: CPGroup | None = None,
        ordered: bool = False,
    ):
        if loss_type not in (*LOSS_TYPES, "bradley_terry"):  # bradley_terry: loss.name = 'reward'
            raise ConfigError(f"preference.loss_type = {loss_type!r} is unknown; use one of {', '.join(LOSS_TYPES)}")
        self.loss_type, self.beta, self.eps, self.gamma = loss_type, beta, label_smoothing, gamma
        # KTO: the desirable and undesirable examples' weights; its KL term's sums are reduced
        # over the data-parallel ranks (dp_group) before the micro-batch loop.
        self.weights, self.dp_group, self.kl = weights, dp_group, torch.zeros(())
        # run.bitwise (docs/bitwise.md): KTO's KL sums are taken over the global batch's rows
        # gathered in its order, one sum the same bits on every layout, not per rank then reduced.
        self.ordered = ordered
        # Context parallel: every cp rank of a row computes the whole pair's loss from the summed
        # sides, so each adds 1/cp of it (their gradients add up to one) and cp rank 0 alone
        # counts it in the step's sums (they are reduced over dp x cp).
        self.cp = cp
        # reference(forward, k): micro-batch k's reference output, taken in attach once the
        # policy is parallelised (None for a reference-free loss: uses_reference).
        self.reference = reference
        # The reference's numbers precomputed (objectives/reference_store.py), looked up by pair.
        self.store = None
        # Pipeline parallel (attach): the loss runs as the schedule's loss on the last
        # stage, per piece of rows (pipeline_loss), and ``pipeline_reference(batches, target, fn)``
        # runs the reference forward through a pipeline, calling ``fn(output, target piece)`` per
        # piece on the last stage (distributed/pipeline_parallel.py's pipeline_forward_each).
        self.pipelined = False
        self.pipeline_reference: Callable | None = None
        # KTO's KL pass: the policy's forward through its pipeline the same way, and the pipeline
        # group over which the last stage's KL sums reach every stage (the logged kto_kl).
        self.pipeline_policy: Callable | None = None
        self.pp_group = None
        self.scale = 1.0
        self.refs: list[torch.Tensor] = []
        self._eval = [0.0] * 4  # pairs, chosen and rejected rewards, correct: summed over eval steps

    # The eval step runs before_micro_batches too: the reference is part of the loss's value.
    pipeline_rows = True  # under pp: pipeline_target, pipeline_loss, pipeline_done
    first_pass_in_eval = True

    @property
    def uses_reference(self) -> bool:
        return self.loss_type not in NO_REFERENCE

    @property
    def frozen(self) -> tuple[str, ...]:
        return ("reference",) if self.uses_reference else ()

    def attach(self, world) -> None:
        if world.pipeline is not None:
            # Under pp its loss is the schedule's, on the last stage; KTO's KL pass runs the policy forward.
            self.pipelined, self.pp_group = True, world.pipeline.pp_group
            self.pipeline_policy = world.policy_forward()
        if self.uses_reference:
            reference = world.reference()
            if self.pipelined:
                self.pipeline_reference = reference
            else:
                self.reference = reference

    def count(self, inputs, target) -> torch.Tensor:
        return pair_count(target)

    def static_count(self, inputs) -> int:
        return rows(inputs)  # a training row is one pair with a target on both sides (PreferencePairs)

    def start(self, *, scale: float, device: torch.device) -> None:
        self.scale, self.device = scale, device
        self.totals = torch.zeros(len(SUMS), device=device, dtype=torch.float64)
        self.refs, self._k, self._last = [], 0, None

    @torch.no_grad()
    def before_micro_batches(self, model, batches, *, forward=None) -> None:
        """The reference's log-probabilities of this rank's pairs, micro-batch by micro-batch;
        KTO's KL term over the whole global batch."""
        unpaired = batches[0][1].shape[1] == 3  # data/preference.py: the target's third row is KTO's label
        if unpaired != (self.loss_type == "kto"):
            raise ConfigError(
                "an unpaired corpus (prepare --format unpaired) trains with preference.loss_type = 'kto', and 'kto'"
                " takes no other: set preference.loss_type or data.args.path to match"
            )
        if self.pipelined:
            rows = sum(len(t) for _, t in batches)
            # Per row of the rank's batch: the loss, 1 for a pair, the two rewards, ranked right.
            self.row_sums = torch.zeros(rows, len(SUMS), dtype=torch.float64, device=self.device)
            self.ref_rows = torch.zeros(rows, 2, device=self.device)
        if not self.uses_reference:
            return
        if self.store is not None:
            for inputs, _ in batches:
                values = self.store.lookup(inputs if self.cp is None else self.cp.whole(inputs), self.device)
                self.refs.append(self._normalised(values[:, :2].float(), values[:, 2:].float()))
            if self.pipelined:
                self.ref_rows = torch.cat(self.refs)
        elif self.pipelined and self.pipeline_reference is not None:
            target = self.pipeline_target(torch.cat([t for _, t in batches]))
            self.pipeline_reference(batches, target, self._reference_piece)
        elif self.reference is None:
            raise RuntimeError("the preference loss's reference was never set (build/frozen.py preference_reference)")
        else:
            for k, (_, target) in enumerate(batches):
                logps, counts = self._sides(self.reference(forward, k), target.to(self.device), grad=False)
                self.refs.append(self._normalised(logps, counts))
        if self.loss_type == "kto":
            # Micro-batch 0's KL terms are read off its training forward in loss() (the same
            # input and weights, so the same logits): one policy forward fewer per step. Not under
            # pp or cp (their own forwards), nor with dropout (the training forward's masks, or
            # the torch generator's stream, would differ from the KL pass's).
            self._kl_parts = {}
            if self.pipelined or self.cp is not None or (model.training and self._has_dropout(model)):
                self.kl = self._kl(batches, forward)
            else:
                self.kl = None  # set by loss() of micro-batch 0, before its term
                self._kl_parts = self._kl_terms(batches, forward, skip=0)

    def _has_dropout(self, model) -> bool:
        if getattr(self, "_dropout", (None,))[0] is not model:  # once per model: it reads every module
            # Here, not at the top: randomness.py imports DTensor, and the launcher's preflight imports
            # this module; tests/e2e/test_startup.py keeps parallelism out of the launcher.
            from paratrain.randomness import has_dropout

            self._dropout = (model, has_dropout(model))
        return self._dropout[1]

    def _kl_terms(self, batches, forward, *, skip: int | None = None) -> dict:
        """Each micro-batch's per-row ``(log pi - log ref of the KL side, 1 if it has one)``
        ``(B, 2)`` float64, from the policy's forward without a graph (but micro-batch ``skip``)."""
        return {
            k: self._kl_rows(forward(k), target.to(self.device), k)
            for k, (_, target) in enumerate(batches)
            if k != skip
        }

    def _kl_rows(self, output, target: torch.Tensor, k: int) -> torch.Tensor:
        with torch.no_grad():
            policy, counts = self._sides(output, target, grad=False, sides=(1,))
        real = counts[:, 1] > 0
        gap = torch.where(real, policy[:, 1] - self.refs[k][:, 1], 0.0).double()
        return torch.stack([gap, real.double()], -1)

    def _kl(self, batches, forward, parts: dict | None = None) -> torch.Tensor:
        """KTO's reference point ``z0 = max(0, mean KL estimate)``: each example's prompt with
        another row's completion (side 1 of its row), ``log pi - log ref`` without a graph,
        averaged over the whole global batch (Ethayarajh et al. 2024). TRL averages it per
        micro-batch (then over devices), so it changes with the micro-batch size. ``parts``: the
        micro-batches' terms already computed (:meth:`_kl_terms`), summed in micro-batch order."""
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        if self.pipelined:  # per row on the last stage, zeros elsewhere, then summed over the stages
            per_row = torch.zeros(len(self.ref_rows), 2, dtype=torch.float64, device=self.device)

            def piece(output, target):
                rows = target[:, -1, 0]
                policy, counts = self._sides(output, target[:, :-1], grad=False)
                real = counts[:, 1] > 0
                gap = torch.where(real, policy[:, 1] - self.ref_rows[rows, 1], 0.0).double()
                per_row[rows] = torch.stack([gap, real.double()], -1)

            self.pipeline_policy(batches, self.pipeline_target(torch.cat([t for _, t in batches])), piece)
            total += per_row.sum(0)
            dist.all_reduce(total, group=self.pp_group)
        rows = []
        if parts is None and not self.pipelined:
            parts = self._kl_terms(batches, forward)
        for k in range(len(parts or ())):
            if self.ordered:
                rows.append(parts[k])
                continue
            total += torch.stack([parts[k][:, 0].contiguous().sum(), parts[k][:, 1].contiguous().sum()])
        if self.ordered:
            total = ordered_sum(torch.cat(rows), self.dp_group)
        elif self.dp_group is not None:
            dist.all_reduce(total, group=self.dp_group)
        return (total[0] / total[1].clamp(min=1)).clamp(min=0).float()  # stays on the device: no sync

    # --- pipeline parallel: the loss on the last stage, per piece of rows

    def pipeline_target(self, target: torch.Tensor) -> torch.Tensor:
        return row_indexed(target)

    @torch.no_grad()
    def _reference_piece(self, output, target: torch.Tensor) -> None:
        rows = target[:, -1, 0]
        logps, counts = self._sides(output, target[:, :-1], grad=False)
        self.ref_rows[rows] = self._normalised(logps, counts)

    def pipeline_loss(self, output, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The schedule's loss for one piece of rows (pairs: a piece never splits one): the sum
        of its pair losses with its graph, which the schedule scales by ``scale``, and its pair
        count; each row's numbers are kept by its index (torch's first run calls this once more
        on piece 0 to infer shapes, whose rows the real piece 0 then overwrites)."""
        rows, target = target[:, -1, 0], target[:, :-1]
        ref = self.ref_rows[rows] if self.uses_reference else None
        losses, real, rewards, counted = self._pair_terms(output, target, ref)
        r = torch.where(real[:, None], rewards.detach().double(), 0.0)
        self.row_sums[rows] = torch.stack(
            [losses.detach().double(), real.double(), r[:, 0], r[:, 1], (counted & real).double()], -1
        )
        s = losses.sum()
        return (s if self.cp is None else s / self.cp.size), real.sum()

    def pipeline_done(self, *, last: bool) -> None:
        """After the schedule's run: the rows' sums (on the last stage; the step's reduce runs
        over the pipeline ranks too, so each pair is counted once)."""
        if last and (self.cp is None or self.cp.rank == 0):
            self.totals += self.row_sums.sum(0)

    def _sides(
        self, output, target: torch.Tensor, *, grad: bool = True, sides: tuple[int, ...] = (0, 1)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' ``(chosen, rejected)`` log-probabilities (a reward model: scores) and token
        counts, whole: summed over the context-parallel ranks that each hold part of a row."""
        if self.loss_type == "bradley_terry":
            return side_scores(output, target, self.cp)
        logps, counts = side_logps(output, target, sides)
        if self.cp is None:
            return logps, counts
        return self.cp.sum(logps, grad=grad), self.cp.sum(counts, grad=False)

    def _normalised(self, logps: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return logps / counts.clamp(min=1) if self.loss_type in MEAN_LOGPS else logps

    def loss(self, output, target) -> torch.Tensor:
        if self.loss_type == "kto" and self.kl is None:  # micro-batch 0: the KL pass's terms from this forward
            self._kl_parts[0] = self._kl_rows(output, target, 0)
            self.kl, self._kl_parts = self._kl(None, None, self._kl_parts), {}
        ref = self.refs[self._k] if self.uses_reference else None
        self._k += 1
        losses, real, rewards, counted = self._pair_terms(output, target, ref)
        self._last = (losses.sum().detach(), real, rewards.detach(), counted.detach())
        return losses.sum() * (self.scale if self.cp is None else self.scale / self.cp.size)

    def _pair_terms(self, output, target: torch.Tensor, ref: torch.Tensor | None):
        """The rows' losses (0 for a row without a pair), whether each holds a pair, the rewards
        ``(B, 2)`` and the fifth sum's flags, from the policy's output and the reference values."""
        # KTO's loss reads the example (side 0) only; its KL side's sum is the KL pass's.
        logps, counts = self._sides(output, target, sides=(0,) if self.loss_type == "kto" else (0, 1))
        policy = self._normalised(logps, counts)
        if ref is None:
            ref = torch.zeros_like(policy)
        if self.loss_type == "kto":
            desirable = target[:, 2, 0] == 1
            losses, rewards = self.kto_losses(policy[:, 0] - ref[:, 0], desirable)
            counted = desirable  # the fifth sum: KTO's desirable examples
        else:
            losses, rewards = self.pair_losses(policy, ref)
            counted = rewards[:, 0] > rewards[:, 1]  # the fifth sum: the pairs ranked right
        real = (counts > 0).all(-1)  # a filled-up validation row has no pair
        return torch.where(real, losses, 0.0), real, rewards, counted

    def kto_losses(self, ratio: torch.Tensor, desirable: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """KTO's per-example losses ``(B,)`` from ``log pi - log ref`` of each example and its
        label; the rewards as ``(B, 2)``: ``b x ratio`` in column 0 for a desirable example, in
        column 1 for an undesirable one (the other 0), so their sums are per kind."""
        b, (w_d, w_u) = self.beta, self.weights
        losses = torch.where(
            desirable,
            w_d * (1 - torch.sigmoid(b * (ratio - self.kl))),
            w_u * (1 - torch.sigmoid(b * (self.kl - ratio))),
        )
        reward = b * ratio
        return losses, torch.stack([torch.where(desirable, reward, 0.0), torch.where(desirable, 0.0, reward)], -1)

    def pair_losses(self, policy: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-pair losses ``(B,)`` and rewards ``(B, 2)`` from the sides' log-probabilities."""
        b, e = self.beta, self.eps
        if self.loss_type == "bradley_terry":
            z = policy[:, 0] - policy[:, 1]
            return -(1 - e) * F.logsigmoid(z) - e * F.logsigmoid(-z), policy
        if self.loss_type == "orpo":
            # ORPO's NLL term per pair, the chosen reply's mean token NLL: TRL takes the mean over
            # a micro-batch's chosen tokens instead, which weighs pairs by the micro-batch they share.
            odds = policy - torch.log1p(-torch.exp(policy))
            return -policy[:, 0] - b * F.logsigmoid(odds[:, 0] - odds[:, 1]), b * policy
        if self.loss_type == "simpo":
            rewards = b * policy
            z = rewards[:, 0] - rewards[:, 1] - self.gamma
            return -(1 - e) * F.logsigmoid(z) - e * F.logsigmoid(-z), rewards
        rewards = b * (policy - ref)
        h = (policy[:, 0] - ref[:, 0]) - (policy[:, 1] - ref[:, 1])
        if self.loss_type in ("sigmoid", "sigmoid_norm"):
            losses = -(1 - e) * F.logsigmoid(b * h) - e * F.logsigmoid(-b * h)
        elif self.loss_type == "robust":
            losses = ((1 - e) * -F.logsigmoid(b * h) + e * F.logsigmoid(-b * h)) / (1 - 2 * e)
        elif self.loss_type == "hinge":
            losses = torch.relu(1 - b * h)
        else:  # ipo
            losses = (h - 1 / (2 * b)) ** 2
        return losses, rewards

    def end_micro_batch(self) -> None:
        loss_sum, real, rewards, counted = self._last
        self._last = None
        if self.cp is not None and self.cp.rank:
            return  # the same pairs as cp rank 0, which counts them
        # Masked sums, not boolean indexing: no host sync per micro-batch.
        r = torch.where(real[:, None], rewards.double(), 0.0)
        self.totals += torch.stack(
            [loss_sum.double(), real.sum().double(), r[:, 0].sum(), r[:, 1].sum(), (counted & real).sum().double()]
        )

    def sums(self) -> torch.Tensor:
        return self.totals

    def read(self, reduced: list[float], *, units: int) -> dict:
        if int(reduced[1]) != units:
            raise ConfigError(
                f"the preference loss saw {int(reduced[1])} pairs but the step counted {units}; every row of a"
                " preference batch must hold one pair with a target on both sides (data/preference.py)"
            )
        n = max(units, 1)
        if self.loss_type == "kto":  # the rewards' means over their own kind of example
            good = reduced[4]
            chosen, rejected = reduced[2] / max(good, 1), reduced[3] / max(n - good, 1)
            return {
                "loss": reduced[0] / n,
                "rewards_chosen": chosen,
                "rewards_rejected": rejected,
                "reward_margin": chosen - rejected,
                "kto_kl": float(self.kl),
            }
        chosen, rejected = reduced[2] / n, reduced[3] / n
        return {
            "loss": reduced[0] / n,
            "rewards_chosen": chosen,
            "rewards_rejected": rejected,
            "reward_margin": chosen - rejected,
            "reward_accuracy": reduced[4] / n,
        }

    def eval_add(self, reduced: list[float]) -> None:
        self._eval = [a + b for a, b in zip(self._eval, reduced[1:], strict=True)]

    def eval_metrics(self) -> dict:
        """Over the whole evaluation: the mean rewards and how often the chosen one is higher
        (a reward model's pairwise accuracy)."""
        (n, chosen, rejected, correct), self._eval = self._eval, [0.0] * 4
        if not n:
            return {}
        if self.loss_type == "kto":
            return {"reward_margin": chosen / max(correct, 1) - rejected / max(n - correct, 1)}
        return {"reward_accuracy": correct / n, "reward_margin": (chosen - rejected) / n}

    def metrics(self, values: dict) -> dict:
        keys = ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy", "kto_kl")
        return {k: values[k] for k in keys if k in values}
