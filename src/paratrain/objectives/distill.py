"""Knowledge distillation (docs/preference.md#distillation): a student matches a frozen teacher's
next-token distribution on every target token, ``sum over the global batch's target tokens of a
divergence / their global count`` (loss.name = 'distill', [distill]).

The unit is the target token (a token not equal to ``loss.ignore_index``: an SFT corpus's
assistant tokens, every token of a text corpus), counted over the whole global batch before the
first backward like the cross-entropy's: micro-batching and world size never change the loss. (A
mean per micro-batch, rescaled by the accumulation, does: verl#7200.)

With ``p`` the teacher's and ``q`` the student's distributions at temperature ``t``
(``softmax(logits / t)``):

- ``forward_kl``: ``KL(p || q) = sum p (log p - log q)`` (Hinton et al. 2015; the teacher's mass
  the student misses costs most);
- ``reverse_kl``: ``KL(q || p)`` (mode-seeking; Gu et al. 2024, MiniLLM);
- ``jsd``: the generalised Jensen-Shannon divergence of Agarwal et al. 2024 (GKD), ``b KL(p || m)
  + (1 - b) KL(q || m)`` with ``m = b p + (1 - b) q`` (``beta``; TRL's GKD weighs it so too).

``top_k > 0``: the teacher's distribution is its ``k`` most likely tokens, renormalised, and the
divergence is taken over them (the student's log-probabilities still from its whole softmax): what
a teacher's stored top-k logits allow. The divergence is not multiplied by ``t^2``.

The teacher runs in the step, micro-batch by micro-batch, without a graph, laid out like the
student (build/frozen.py frozen_like_policy: FSDP2 shards it, tensor parallel splits it), so a teacher
larger than one device fits. Each divergence is computed over chunks of positions in float32,
recomputed in the backward (torch.utils.checkpoint), so no ``[tokens, vocab]`` float32 tensor
is held for either model beyond the logits the models return.

Under pipeline parallel the loss is the schedule's, on the last stage, per pipeline piece of rows
(:meth:`DistillLoss.pipeline_loss`): each row's index rides the target (``pipeline_target``), the
piece's input rows are looked up in the rank's inputs kept for the step and run through the
teacher there (held by the last stage's ranks, laid out as one more stage of theirs: whole,
tensor or context parallel, or sharded by FSDP2 over them, build/frozen.py distill_teacher), so one
piece's logits of each model are held at a time (docs/preference.md, Layouts).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# DTensor is imported in the functions that use it: its import costs seconds, which the launcher,
# whose preflight reads this module through the models, must not pay (tests/e2e/test_startup.py).
from torch.utils.checkpoint import checkpoint

from paratrain.objectives.base import Objective
from paratrain.objectives.items import check_count

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
CHUNK = 1024  # positions per float32 chunk


def divergence(
    student: torch.Tensor,
    teacher: torch.Tensor,
    *,
    kind: str,
    temperature: float = 1.0,
    beta: float = 0.5,
    top_k: int = 0,
) -> torch.Tensor:
    """Per-position divergence ``(N,)`` of logits ``(N, V)`` (float32 inside)."""
    s = (student.float() / temperature).log_softmax(-1)
    t = (teacher.float() / temperature).log_softmax(-1)
    if top_k:
        t, picked = t.topk(top_k, dim=-1)
        t = t.log_softmax(-1)  # renormalised over the teacher's top k
        s = s.gather(-1, picked)
    if kind == "forward_kl":
        return (t.exp() * (t - s)).sum(-1)
    if kind == "reverse_kl":
        return (s.exp() * (s - t)).sum(-1)
    m = torch.logsumexp(torch.stack([t + math.log(beta), s + math.log(1 - beta)]), 0)
    return beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)


class DistillLoss(Objective):
    """``sum over target tokens of divergence(teacher, student) / global target-token count``;
    logs the student's own cross-entropy on the targets too (``student_ce``)."""

    name = "loss"
    unit = "target token"
    counts_target_tokens = True
    watched = ("student_ce",)  # the loss is the divergence itself
    pipeline_rows = True  # under pp: pipeline_target, pipeline_loss, pipeline_done
    first_pass_in_eval = True  # the eval step gets the teacher's forward too

    def __init__(self, *, kind: str, temperature: float, beta: float, top_k: int, ignore_index: int = -100):
        self.kind, self.temperature, self.beta, self.top_k = kind, temperature, beta, top_k
        self.ignore_index = ignore_index
        self.teacher = None  # teacher(forward, k): micro-batch k's teacher logits; taken in attach
        # Pipeline parallel (attach): teacher(inputs) instead, the logits of these input
        # rows, run on the last stage per piece (pipeline_loss).
        self.pipelined = False
        self.scale = 1.0

    frozen = ("teacher",)

    def attach(self, world) -> None:
        self.pipelined = world.pipeline is not None  # under pp its loss is the schedule's, on the last stage
        self.teacher = world.teacher()

    def count(self, inputs, target) -> torch.Tensor:
        return (target != self.ignore_index).sum()

    def start(self, *, scale: float, device: torch.device) -> None:
        self.scale, self.device = scale, device
        self.totals = torch.zeros(3, device=device, dtype=torch.float64)
        self._forward, self._k, self._last = None, 0, None

    def before_micro_batches(self, model, batches, *, forward=None) -> None:
        if self.teacher is None:
            raise RuntimeError("the distillation loss's teacher was never set (attach, build/frozen.py)")
        self._forward = forward  # the teacher runs per micro-batch, in loss(): one logits tensor at a time
        if self.pipelined:  # the rank's input rows, for the pieces' teacher runs (pipeline_loss)
            self._inputs = torch.cat([x for x, _ in batches]).to(self.device)
            self._pieces: dict[int, tuple] = {}

    def loss(self, output, target) -> torch.Tensor:
        teacher = self.teacher(self._forward, self._k)
        self._k += 1
        total, n, ce = self._terms(output, teacher, target)
        self._last = (total.detach(), n, ce)
        return total * self.scale

    # --- pipeline parallel: the loss on the last stage, per piece of rows

    def pipeline_target(self, target: torch.Tensor) -> torch.Tensor:
        """The rank's whole target ``(R, T)`` with each row's index as a second plane, ``(R, 2,
        T)``: the schedule cuts both alike, so a piece knows which input rows it holds."""
        rows = torch.arange(len(target), device=target.device, dtype=target.dtype)
        return torch.stack([target, rows[:, None].expand_as(target)], 1)

    def pipeline_loss(self, output, target: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The schedule's loss for one piece of rows: the teacher on the piece's input rows, the
        sum of the divergence over its target tokens (with its graph; the schedule scales it by
        ``scale``) and its token count. The piece's sums are kept by its first row (torch's first
        run calls this once more on piece 0 to infer shapes, which the real piece 0 overwrites)."""
        rows, target = target[:, 1, 0], target[:, 0]
        teacher = self.teacher(self._inputs[rows])
        total, n, ce = self._terms(output, teacher, target)
        self._pieces[int(rows[0])] = (total.detach(), n, ce)
        return total, n

    def pipeline_done(self, *, last: bool) -> None:
        """After the schedule's run: the pieces' sums (on the last stage; the step's reduce runs
        over the pipeline ranks too, so each token is counted once)."""
        if last:
            for total, n, ce in self._pieces.values():
                self._last = (total, n, ce)
                self.end_micro_batch()
        self._pieces, self._inputs = {}, None

    def _terms(self, output, teacher, target) -> tuple[torch.Tensor, int, torch.Tensor]:
        """The divergence summed over ``target``'s target tokens (with the student's graph), their
        count and the student's cross-entropy summed over them (no graph)."""
        from torch.distributed.tensor import DTensor

        student = output.full_tensor() if isinstance(output, DTensor) else output
        teacher = teacher.full_tensor() if isinstance(teacher, DTensor) else teacher
        keep = (target != self.ignore_index).reshape(-1)
        rows = keep.nonzero()[:, 0]
        s = student.reshape(-1, student.shape[-1])[rows]
        t = teacher.reshape(-1, teacher.shape[-1])[rows].detach()
        parts = [
            checkpoint(self._chunk, s[i : i + CHUNK], t[i : i + CHUNK], use_reentrant=False)
            for i in range(0, len(rows), CHUNK)
        ]
        total = torch.stack([p.sum() for p in parts]).sum() if parts else s.sum() * 0
        with torch.no_grad():
            ce = F.cross_entropy(s.float(), target.reshape(-1)[rows], reduction="sum") if len(rows) else total * 0
        return total, len(rows), ce

    def _chunk(self, s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return divergence(s, t, kind=self.kind, temperature=self.temperature, beta=self.beta, top_k=self.top_k)

    def end_micro_batch(self) -> None:
        total, n, ce = self._last
        self._last = None
        self.totals += torch.stack([total.double(), torch.tensor(float(n), device=self.device).double(), ce.double()])

    def sums(self) -> torch.Tensor:
        return self.totals

    def read(self, reduced: list[float], *, units: int) -> dict:
        check_count(reduced[1], units)
        return {"loss": reduced[0] / units, "student_ce": reduced[2] / units}

    def metrics(self, values: dict) -> dict:
        return {"student_ce": values["student_ce"]} if "student_ce" in values else {}
