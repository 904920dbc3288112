"""Losses as (sum of item losses, item count), so normalisation is by the global item count.

The count of a micro-batch must be known before any backward of the step (it is gathered over
micro-batches and ranks first), so every loss also counts items from the target alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# DTensor is imported in the functions that use it: its import costs seconds, which the launcher,
# whose preflight reads this module through the models, must not pay (tests/e2e/test_startup.py).
from torch.utils.checkpoint import checkpoint

from paratrain.config import ConfigError, LossConfig


class Loss:
    """``loss(output, target) -> (sum, count)`` and ``loss.count(target) -> count``.
    ``builtin``: one of ours (``loss.name``), not a user's function, which may share its name."""

    def __init__(self, fn: Callable, count: Callable, name: str, *, builtin: bool = True, over_batch: bool = False):
        self.fn, self._count, self.name, self.builtin = fn, count, name, builtin
        self.plugin = None  # the objectives/registry.py Plugin it was built from (build_loss sets it)
        # A loss over the whole global batch: fn(outputs, targets) -> its mean (objectives/batch_loss.py).
        self.over_batch = over_batch

    def __call__(self, output, target) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fn(output, target)

    def count(self, target) -> torch.Tensor:
        return torch.as_tensor(self._count(target), dtype=torch.float64)

    @property
    def owns_head(self) -> bool:
        """The loss runs the model's output layer itself (``loss.chunk_size``)."""
        return isinstance(self.fn, ChunkedCrossEntropy)


# The losses by kind; objectives/registry.py picks one by ``loss.name`` (the one place that does).


def count_not_ignored(cfg: LossConfig) -> Callable:
    """The items of a target: its elements not equal to ``loss.ignore_index``."""
    ignore = cfg.ignore_index

    def count(target: torch.Tensor) -> torch.Tensor:
        return (target != ignore).sum()

    return count


def cross_entropy_loss(cfg: LossConfig) -> Loss:
    """The token (or class) cross-entropy, summed; chunked over positions with ``loss.chunk_size``."""
    count, ignore = count_not_ignored(cfg), cfg.ignore_index
    if cfg.chunk_size:
        return Loss(ChunkedCrossEntropy(cfg.chunk_size, ignore), count, "cross_entropy")

    def cross_entropy(logits: torch.Tensor, target: torch.Tensor):
        s = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), ignore_index=ignore, reduction="sum"
        )
        return s, count(target)

    return Loss(cross_entropy, count, "cross_entropy")


def mse_loss(cfg: LossConfig) -> Loss:
    def mse(output: torch.Tensor, target: torch.Tensor):
        return F.mse_loss(output.float(), target.float(), reduction="sum"), target.numel()

    return Loss(mse, lambda t: t.numel(), "mse")


def info_nce_loss(cfg: LossConfig) -> Loss:
    return Loss(info_nce(cfg.temperature), rows, "info_nce", over_batch=True)


def user_loss(cfg: LossConfig, user: Callable) -> Loss:
    """A user's function: ``(sum_of_item_losses, item_count)`` of a micro-batch, or with
    ``loss.over = 'global_batch'`` the mean over the whole global batch's outputs."""
    name = getattr(user, "__name__", "user")
    if cfg.over == "global_batch":
        return Loss(user, rows, name, builtin=False, over_batch=True)
    # A user loss may say how it counts with a `count(target)` attribute; by default the
    # items are the target elements not equal to loss.ignore_index.
    return Loss(_checked(user), getattr(user, "count", count_not_ignored(cfg)), name, builtin=False)


def objective_loss(name: str, count: Callable) -> Loss:
    """The Loss of an objective that computes its own terms (objectives/preference.py,
    distill.py, policy_gradient.py): its count; its function is never called."""
    return Loss(_its_objectives, count, name)


def _its_objectives(output, target):
    raise RuntimeError(
        "this loss is its objective's (objectives/preference.py, distill.py, policy_gradient.py), not a (sum, count)"
    )


def pair_count(target: torch.Tensor) -> torch.Tensor:
    """Rows of a pair target ``(B, 2, T)`` (data/preference.py) with a target token on both sides."""
    valid, side = target[:, 0] >= 0, target[:, 1]
    return ((valid & (side == 0)).any(-1) & (valid & (side == 1)).any(-1)).sum()


def rows(batch) -> int:
    """Rows of a micro-batch's inputs or targets (a packed row of documents counts one)."""
    return batch.shape[0] if isinstance(batch, torch.Tensor) else len(batch)


def info_nce(temperature: float) -> Callable:
    """The symmetric InfoNCE (CLIP) loss over the whole global batch: sample ``i``'s query
    against every document of the batch, the right one ``i``, and each document against every
    query, averaged (Radford et al. 2021; van den Oord et al. 2018). The model returns
    ``(queries, documents)``, ``(queries, documents, logit_scale)`` (the learnable scale itself,
    one element, as open_clip's ``self.logit_scale.exp()``) or one ``[rows, 2, dim]`` tensor;
    the embeddings are L2-normalised and their cosines divided by ``loss.temperature``, or
    multiplied by ``logit_scale`` (``loss.temperature`` > 0: config.validate)."""

    def info_nce(output, target):
        q, d, logit_scale = query_document(output)
        scale = logit_scale.float() if logit_scale is not None else 1.0 / temperature
        logits = q @ d.T * scale
        labels = torch.arange(len(q), device=q.device)
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2

    info_nce.retrieval = lambda output: query_document(output)[:2]  # the eval's recall@1 and MRR
    return info_nce


def query_document(output):
    """A dual encoder's L2-normalised float32 queries and documents, and its logit scale or None."""
    if isinstance(output, torch.Tensor) and output.dim() == 3:
        queries, documents, logit_scale = output[:, 0], output[:, 1], None
    elif isinstance(output, (tuple, list)) and len(output) in (2, 3):
        queries, documents, logit_scale = (*output, None)[:3]
    else:
        raise ConfigError(
            "loss.name = 'info_nce' needs the model to return (queries, documents[, logit_scale]) or a"
            " [rows, 2, dim] tensor; return that, or give your own loss.name with loss.over = 'global_batch'"
        )
    return F.normalize(queries.float(), dim=-1), F.normalize(documents.float(), dim=-1), logit_scale


def retrieval_metrics(queries: torch.Tensor, documents: torch.Tensor) -> dict:
    """Each query's right document (the same row) among all ``documents`` by cosine: the share
    ranked first (recall@1) and the mean reciprocal rank (a tie ranks the right one last)."""
    scores = queries @ documents.T
    rank = (scores >= scores.diagonal().unsqueeze(1)).sum(1)  # the right one counts itself
    return {"recall_at_1": float((rank == 1).double().mean()), "mrr": float((1.0 / rank.double()).mean())}


def _checked(user: Callable) -> Callable:
    def call(output, target):
        result = user(output, target)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise ConfigError(
                f"a user loss must return (sum_of_item_losses, item_count); it returned {type(result).__name__}"
            )
        return result

    return call


def _data_parallel_shards(weight: torch.Tensor) -> tuple[str, ...]:
    """The mesh dimensions other than ``tp`` over which ``weight`` (a DTensor) is sharded (FSDP2's)."""
    names = weight.device_mesh.mesh_dim_names or ()
    return tuple(n for n, p in zip(names, weight.placements) if n != "tp" and p.is_shard())


class ChunkedCrossEntropy:
    """The cross-entropy of the output layer's logits, ``chunk`` positions at a time.

    The model returns its last hidden states (its ``return_hidden`` is set, models/spec.py
    ``ModelSpec.hand_head_to``) and this loss owns the output layer (``bind``): each chunk's
    logits are made, turned into a float32 loss sum and dropped, and recomputed in the backward
    (non-reentrant ``torch.utils.checkpoint``), so at most one chunk's ``[chunk, vocab]`` logits
    and their gradient exist at once: 2.4 GB less per 4k-token sequence at a 150k vocabulary.
    The idea of Liger Kernel's fused linear cross-entropy and of Cut Cross-Entropy (Wijmans
    et al. 2024, arXiv:2411.09009), on torch's own checkpoint instead of a kernel. The
    autograd engine sums the chunks' gradients of the weight before it reaches the weight's
    accumulator, so DDP's hooks fire once per parameter and FSDP2's root keeps the weight
    unsharded from its forward to its backward (torch does not reshard the root after forward).

    Under tensor parallelism the weight is a DTensor sharded by vocabulary rows: the hidden
    states are made replicated first (an all-gather under sequence parallelism, as the layer's
    own ColwiseParallel would do), and each chunk's logits stay vocabulary-sharded for torch's
    ``loss_parallel`` or are gathered per chunk without it.
    """

    def __init__(self, chunk: int, ignore_index: int):
        self.chunk, self.ignore_index = chunk, ignore_index
        self.head: nn.Module | None = None
        self.loss_parallel = False

    def bind(self, head: nn.Module, *, loss_parallel: bool) -> None:
        """Own ``head`` (an ``nn.Linear``: its weight and bias are read at each call, so the
        parallelisms may replace them in place)."""
        self.head, self.loss_parallel = head, loss_parallel

    def __call__(self, hidden: torch.Tensor, target: torch.Tensor):
        from torch.distributed.tensor import DTensor, Replicate

        if self.head is None:
            raise RuntimeError(
                "loss.chunk_size > 0 but no output layer was handed to the loss (ModelSpec.hand_head_to)"
            )
        weight, bias = self.head.weight, self.head.bias
        if isinstance(weight, DTensor) and (dims := _data_parallel_shards(weight)):
            # A weight sharded over data-parallel ranks is an FSDP2 shard: its root was resharded
            # after the forward (parallelize's loss_owns_head not applied). Read as if it were a
            # tensor-parallel weight it gives plausible, wrong logits, and gradients that skip
            # FSDP2's reduce-scatter: refuse it instead.
            raise RuntimeError(
                f"loss.chunk_size > 0: the output layer's weight is still sharded by FSDP2 over {dims}"
                " when the loss reads it; its FSDP2 root must keep it gathered after the forward"
                " (parallelize(..., loss_owns_head=True))"
            )
        if isinstance(weight, DTensor):
            whole = [Replicate()] * weight.device_mesh.ndim
            if isinstance(hidden, DTensor):
                hidden = hidden.redistribute(weight.device_mesh, whole)
            else:  # replicated over the tensor-parallel ranks already
                hidden = DTensor.from_local(hidden, weight.device_mesh, whole, run_check=False)
        elif isinstance(hidden, DTensor):
            hidden = hidden.full_tensor()
        hidden = hidden.reshape(-1, hidden.shape[-1])
        target = target.reshape(-1)
        total = None
        for h, t in zip(hidden.split(self.chunk), target.split(self.chunk)):
            s = checkpoint(self._chunk, h, t, weight, bias, use_reentrant=False, preserve_rng_state=False)
            total = s if total is None else total + s
        return total, (target != self.ignore_index).sum()

    def _chunk(self, h, t, weight, bias):
        from torch.distributed.tensor import DTensor

        logits = F.linear(h, weight, bias)
        if isinstance(logits, DTensor) and not self.loss_parallel:
            logits = logits.full_tensor()
        return F.cross_entropy(logits.float(), t, ignore_index=self.ignore_index, reduction="sum")
