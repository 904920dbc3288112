"""Context parallelism: the sequence split over the ``cp`` ranks, attention by a ring or all-to-all.

Each rank of a cp group holds a slice of every row's sequence; everything but attention (the
embeddings, the MLPs, the norms, the loss) runs on that slice alone. Attention needs every key,
so the key/value chunks travel around the ring of cp ranks, point to point (Liu et al. 2023,
"Ring Attention with Blockwise Transformers"): at each of the ``cp`` steps a rank attends its
queries to the chunk it holds while it passes that chunk on. The partial outputs are merged with
their log-sum-exp in float32 (the online softmax of Milakov & Gimelshein 2018, as in
FlashAttention), which is the exact softmax, not an approximation.

**The split (head-tail).** Under a causal mask a query attends to the keys before it, so the last
tokens cost the most. Cut in ``cp`` contiguous pieces, the last rank would work ``2cp - 1`` times
as hard as the first. Cut in ``2cp`` chunks instead, rank r keeps chunks ``r`` and ``2cp - 1 - r``
(one near the head, one near the tail): every rank then does the same causal work, as Megatron-LM
and torchtitan do (``_HeadTailLoadBalancer``).

**Masks.** A query at global index ``j`` sees the key at global index ``i`` when
``start[j] <= i <= j``: ``start`` is 0 for plain causal rows, and for packed documents the
index where the query's document begins, ``j - position[j]`` (positions restart at 0 at every
document, data/packing.py; padding has position -1 and sees itself only), the same rule as
``data.packing.document_mask``. Only the queries' starts are needed: a key's global index follows
from which rank's chunk it came, so nothing but K and V travels. Each (query chunk, key chunk)
pair gets its own mask, and a pair that the mask empties (a key chunk after every query, or
before every query's document) is skipped: no compute.

**Backward** recomputes the scores per chunk pair from the saved output and log-sum-exp (the
FlashAttention backward, Dao et al. 2022, algorithm 4): ``dS = P * (dP - rowsum(dO * O))``. The
key/value chunks go around the ring again with their gradient accumulators, which arrive back at
the chunk's owner after the last step.

torch 2.13's own ``torch.distributed.tensor.experimental.context_parallel`` is not used: it
replaces only the CUDA SDPA kernels (flash, memory-efficient, cuDNN). Checked here at world 2 on
gloo, plain causal SDPA under it raises ``NotImplementedError: Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
registered``. It also refuses an attention mask (``attn_bias is not supported yet``), and its
document masks go through FlexAttention, which has no backward on CPU. This module is written on
``torch.distributed`` point-to-point instead, which runs on gloo and NCCL alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from paratrain.config import ConfigError
from paratrain.randomness import active_draws, head_slice

# --- the split ------------------------------------------------------------------------------


def chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of ``2 cp``) that cp rank ``rank`` holds: one from the head, one from the tail."""
    return rank, 2 * cp - 1 - rank


def shard_sequence(x: torch.Tensor, *, dim: int, cp: int, rank: int) -> torch.Tensor:
    """This rank's part of ``x`` along ``dim``: its two chunks, head chunk first."""
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[c] for c in chunk_ids(rank, cp)], dim=dim)


def global_indices(local_len: int, *, cp: int, rank: int, device=None) -> torch.Tensor:
    """The global sequence index of each of a rank's ``local_len`` tokens (its two chunks)."""
    c = local_len // 2
    return torch.cat([torch.arange(k * c, (k + 1) * c, device=device) for k in chunk_ids(rank, cp)])


def unshard_sequence(parts: list[torch.Tensor], *, dim: int) -> torch.Tensor:
    """The whole sequence from every rank's part (in rank order): the inverse of shard_sequence."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for r, part in enumerate(parts):
        head, tail = part.chunk(2, dim=dim)
        chunks[r], chunks[2 * cp - 1 - r] = head, tail
    return torch.cat(chunks, dim=dim)


def gather_sequence(x: torch.Tensor, *, group) -> torch.Tensor:
    """The whole rows from every cp rank's part of them (``x``: this rank's, sequence last): an
    all-gather over the cp group, then :func:`unshard_sequence`."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return unshard_sequence(parts, dim=-1)


# --- one chunk pair -------------------------------------------------------------------------


def _pair_mask(q_idx, q_start, k_idx) -> torch.Tensor:
    """(B, 1, Tq, Tk) boolean: query j sees key i when start[j] <= i <= j (global indices)."""
    i = k_idx.view(1, 1, -1)
    return ((i >= q_start.unsqueeze(-1)) & (i <= q_idx.view(1, -1, 1))).unsqueeze(1)


def _pair_forward(q, k, v, mask, scale, keep=None):
    """Output and log-sum-exp (float32) of q's attention over k/v under ``mask``. A query row the
    mask empties gets output 0 and log-sum-exp -inf: it adds nothing when merged. ``keep``: the
    attention dropout's mask of the pair, already scaled by 1 / (1 - p); the probabilities it drops
    still count in the normaliser (dropout comes after the softmax), so the merge is unchanged."""
    s = (q @ k.transpose(-2, -1)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    out = ((p if keep is None else p * keep) @ v) / denom.clamp_min(torch.finfo(denom.dtype).tiny)
    return out, (m + denom.log()).squeeze(-1)


def _pair_keep(keep, q_idx, k_idx):
    """The scaled dropout mask of a chunk pair from the whole sequence's (None: no dropout)."""
    return None if keep is None else keep[:, :, q_idx][:, :, :, k_idx]


def _merge(out, lse, out_b, lse_b):
    """Merge two partial softmax results by their log-sum-exp (exact, float32)."""
    new = torch.logaddexp(lse, lse_b)
    empty = torch.isinf(new)  # both partials empty so far
    wa = torch.where(empty, torch.zeros_like(new), torch.exp(lse - new)).unsqueeze(-1)
    wb = torch.where(empty, torch.zeros_like(new), torch.exp(lse_b - new)).unsqueeze(-1)
    return out * wa + out_b * wb, new


# --- the ring -------------------------------------------------------------------------------


def _exchange(send: torch.Tensor, group, *, to: int, frm: int) -> tuple[torch.Tensor, list]:
    """Start sending ``send`` to global rank ``to`` and receiving its like from ``frm``."""
    recv = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, to, group), dist.P2POp(dist.irecv, recv, frm, group)]
    return recv, dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def _pairs(q_idx, q_start, k_idx):
    """The (query half, key half, mask) pairs of one ring step that the mask leaves non-empty."""
    lq, lk = q_idx.shape[0] // 2, k_idx.shape[0] // 2
    for a in range(2):
        qa = slice(a * lq, (a + 1) * lq)
        for b in range(2):
            kb = slice(b * lk, (b + 1) * lk)
            mask = _pair_mask(q_idx[qa], q_start[:, qa], k_idx[kb])
            if mask.any():  # an empty pair is skipped: no compute
                yield qa, kb, mask


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_start, group, scale, keep):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        to = dist.get_global_rank(group, (rank + 1) % cp)
        frm = dist.get_global_rank(group, (rank - 1) % cp)
        q32 = q.float()
        t = q.shape[-2]
        q_idx = global_indices(t, cp=cp, rank=rank, device=q.device)
        out = torch.zeros_like(q32)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        for step in range(cp):
            works = []
            if step < cp - 1:  # pass the chunk on while computing with it
                nxt, works = _exchange(kv.contiguous(), group, to=to, frm=frm)
            src = (rank - step) % cp
            k_idx = global_indices(kv.shape[-2], cp=cp, rank=src, device=q.device)
            k32, v32 = kv[0].float(), kv[1].float()
            for qa, kb, mask in _pairs(q_idx, q_start, k_idx):
                pk = _pair_keep(keep, q_idx[qa], k_idx[kb])
                o, s = _pair_forward(q32[..., qa, :], k32[..., kb, :], v32[..., kb, :], mask, scale, pk)
                out[..., qa, :], lse[..., qa] = _merge(out[..., qa, :], lse[..., qa], o, s)
            if works:
                _wait(works)
                kv = nxt
        ctx.save_for_backward(q, k, v, q_start, out, lse)
        ctx.group, ctx.scale, ctx.keep = group, scale, keep
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, q_start, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        to = dist.get_global_rank(group, (rank + 1) % cp)
        frm = dist.get_global_rank(group, (rank - 1) % cp)
        q32, do = q.float(), d_out.float()
        q_idx = global_indices(q.shape[-2], cp=cp, rank=rank, device=q.device)
        delta = (do * out).sum(dim=-1)  # rowsum(dO * O), FlashAttention's D
        dq = torch.zeros_like(q32)
        kv = torch.stack([k, v]).float()
        dkv = torch.zeros_like(kv)
        for step in range(cp):
            src = (rank - step) % cp
            k_idx = global_indices(kv.shape[-2], cp=cp, rank=src, device=q.device)
            for qa, kb, mask in _pairs(q_idx, q_start, k_idx):
                kc, vc = kv[0][..., kb, :], kv[1][..., kb, :]
                s = (q32[..., qa, :] @ kc.transpose(-2, -1)) * scale
                p = torch.exp(s - lse[..., qa].unsqueeze(-1)).masked_fill(~mask, 0.0)
                pk = _pair_keep(ctx.keep, q_idx[qa], k_idx[kb])
                dkv[1][..., kb, :] += (p if pk is None else p * pk).transpose(-2, -1) @ do[..., qa, :]
                dp = do[..., qa, :] @ vc.transpose(-2, -1)
                if pk is not None:  # the gradient reaches the kept probabilities only, scaled
                    dp = dp * pk
                ds = p * (dp - delta[..., qa].unsqueeze(-1))
                dq[..., qa, :] += (ds @ kc) * scale
                dkv[0][..., kb, :] += (ds.transpose(-2, -1) @ q32[..., qa, :]) * scale
            # K/V go on to the next rank with their gradient so far; after the last step only the
            # gradient travels, the one hop that brings it home to the chunk's owner.
            send = dkv if step == cp - 1 else torch.cat([kv, dkv])
            recv, works = _exchange(send.contiguous(), group, to=to, frm=frm)
            _wait(works)
            if step == cp - 1:
                dkv = recv
            else:
                kv, dkv = recv[:2], recv[2:]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    positions: torch.Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Exact attention over the whole sequence from this rank's part of it.

    ``q, k, v``: (B, H, T_local, D), this rank's two chunks (:func:`shard_sequence`) of the
    sequence split over ``group``. ``positions``: (B, T_local) position ids of those tokens for
    packed documents (restarting at 0 per document, -1 for padding); None: plain causal.
    Returns (B, H, T_local, D), this rank's rows of the whole sequence's attention output.
    ``dropout_p``: attention dropout, its mask keyed by the sample (paratrain/randomness.py: this
    rank's queries and each chunk's keys of the whole sequence's mask); it needs keyed draws.
    """
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    if q.shape[-2] % 2:
        raise ValueError(f"a context-parallel rank holds two equal chunks; got {q.shape[-2]} positions")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    j = global_indices(q.shape[-2], cp=cp, rank=rank, device=q.device)
    if positions is None:
        q_start = torch.zeros(q.shape[0], q.shape[-2], dtype=torch.long, device=q.device)
    else:
        q_start = j - positions.clamp(min=0)  # where each query's document starts (global index)
    keep = None
    if dropout_p:
        draws = active_draws()
        if draws is None:
            raise ConfigError(
                "attention dropout under parallel.cp > 1 needs run.keyed_random = true (its mask is the sample's)"
            )
        whole = draws.attention_keep((q.shape[0], q.shape[1], cp * q.shape[-2], cp * q.shape[-2]), dropout_p, q.device)
        keep = whole.to(torch.float32) * (1.0 / (1.0 - dropout_p))
    return _RingAttention.apply(q, k, v, q_start, group, scale, keep)


class RingAttention:
    """The attention function a model calls under context parallelism: ``fn(q, k, v,
    positions=None) -> out`` (picklable state: the cp group only)."""

    def __init__(self, cp_mesh: DeviceMesh):
        self.mesh = cp_mesh
        self.group = cp_mesh.get_group()

    def __call__(self, q, k, v, *, positions=None, scale=None, dropout_p=0.0):
        return ring_attention(q, k, v, group=self.group, positions=positions, scale=scale, dropout_p=dropout_p)


# --- all-to-all (Ulysses) ---------------------------------------------------------------------


def alltoall_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    positions: torch.Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """The same result as :func:`ring_attention` by all-to-all (DeepSpeed-Ulysses, Jacobs et al.
    2023): each rank trades its sequence part of every head for the whole sequence of ``H / cp``
    heads, runs plain SDPA over the whole sequence with the whole mask, and trades back. Exact
    (one SDPA per head, as without cp); needs the head count divisible by cp. Four all-to-alls per
    layer forward (q, k, v, out) and four in backward, against the ring's ``cp - 1`` K/V hops; but
    packed documents' mask is built whole, ``T x T`` per row (the ring's per chunk pair)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    def all_to_all(x):  # differentiable; dim 0 split evenly over the ranks
        return wait_tensor(all_to_all_single_autograd(x, None, None, group))

    cp = dist.get_world_size(group)
    b, h, t, d = q.shape
    if h % cp:
        raise ConfigError(
            f"parallel.cp_attention = 'alltoall' splits the {h} attention heads over cp = {cp} ranks;"
            " use a cp that divides the heads or parallel.cp_attention = 'ring'"
        )
    # Global index of each token of the rank-ordered whole sequence, and the order that sorts it.
    order = torch.cat([global_indices(t, cp=cp, rank=r, device=q.device) for r in range(cp)])
    natural = torch.argsort(order)

    def to_heads(x):  # (B, H, t, D), my tokens of all heads -> (B, H/cp, T, D), all tokens of my heads
        x = x.reshape(b, cp, h // cp, t, d).transpose(0, 1).contiguous()
        x = all_to_all(x)  # dim 0: the source rank
        return x.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * t, d)[:, :, natural]

    def to_tokens(x):  # the inverse of to_heads
        x = x[:, :, order].reshape(b, h // cp, cp, t, d).permute(2, 0, 1, 3, 4).contiguous()
        x = all_to_all(x)  # dim 0: the head group
        return x.transpose(0, 1).reshape(b, h, t, d)

    qh, kh, vh = to_heads(q), to_heads(k), to_heads(v)
    if positions is not None:
        parts = [torch.empty_like(positions) for _ in range(cp)]
        dist.all_gather(parts, positions.contiguous(), group=group)
        positions = torch.cat(parts, dim=-1)[:, natural]
        j = torch.arange(cp * t, device=q.device)
        if torch.equal(positions, j.expand_as(positions)):
            positions = None  # one document per row: plain causal, SDPA's kernel without a mask
    # Attention dropout: keyed draws (paratrain/randomness.py) give this rank's heads their slice
    # of the mask of every head, over the whole sequence, as without cp.
    rank = dist.get_rank(group)
    with head_slice(rank * (h // cp), h):
        if positions is None:
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, dropout_p=dropout_p)
        else:
            start = j - positions.clamp(min=0)  # the same rule as the ring's and data.packing.document_mask
            mask = (j.view(1, 1, -1) >= start.unsqueeze(-1)) & (j.view(1, 1, -1) <= j.view(1, -1, 1))
            out = F.scaled_dot_product_attention(
                qh, kh, vh, attn_mask=mask.unsqueeze(1), scale=scale, dropout_p=dropout_p
            )
    return to_tokens(out)


class AllToAllAttention(RingAttention):
    """``fn(q, k, v, positions=None)`` by all-to-all (``parallel.cp_attention = "alltoall"``)."""

    def __call__(self, q, k, v, *, positions=None, scale=None, dropout_p=0.0):
        return alltoall_attention(q, k, v, group=self.group, positions=positions, scale=scale, dropout_p=dropout_p)


class AutoAttention(RingAttention):
    """``parallel.cp_attention = "auto"`` (the default): all-to-all where it applies cheaply, the
    ring elsewhere. All-to-all when this rank's heads divide by cp and every row of the micro-batch
    is one causal document (so SDPA runs its causal kernel with no mask); the ring when the heads
    do not divide or documents are packed (the all-to-all would build each row's whole ``T x T``
    mask, the ring never does). Both are exact, so the choice changes no number.

    Why all-to-all first: it sends ``8 (cp - 1) / cp`` chunks per layer against the ring's ``6 (cp
    - 1) + 2`` and runs one fused SDPA instead of the ring's loop over chunk pairs; on CPU it took
    0.41-0.43 of the ring's step time at cp 2 and 4 (docs/context-parallel.md, measured with
    benchmarks/parallel/cp_ring_vs_alltoall.py).

    Who decides: a cp rank sees only its chunks of a row, and a row can look like one document in
    one rank's chunks and not in another's. The step sees the whole rows before it cuts them
    (step.cp_decisions, before step.cp_local_batch), the same rows on every cp rank, so it decides
    there once per micro-batch (:func:`one_document_rows`) and hands the decision in through
    :func:`maybe_auto_decision`: no collective and no host read per layer. Outside such a context
    (``rows_plain`` None: a forward the step did not run, or a pipeline step whose pipeline
    micro-batches decide differently) the cp ranks agree per layer by a one-element all-reduce."""

    # True/False: every row of the micro-batch now running is (not) one causal document, set by
    # the step from the whole rows (maybe_auto_decision); None: undecided, agreed per layer.
    rows_plain: bool | None = None

    def __call__(self, q, k, v, *, positions=None, scale=None, dropout_p=0.0):
        cp = dist.get_world_size(self.group)
        if q.shape[1] % cp == 0 and self._one_document_per_row(positions):
            return alltoall_attention(q, k, v, group=self.group, positions=None, scale=scale, dropout_p=dropout_p)
        return ring_attention(q, k, v, group=self.group, positions=positions, scale=scale, dropout_p=dropout_p)

    def _one_document_per_row(self, positions: torch.Tensor | None) -> bool:
        if positions is None:
            return True
        if self.rows_plain is not None:
            return self.rows_plain
        return _agreed_one_document_per_row(positions, self.group)


def one_document_rows(positions: torch.Tensor) -> torch.Tensor:
    """(B,) bool: which rows of whole position ids (B, T), before the cp split, are one causal
    document (positions 0..T-1): :class:`AutoAttention`'s rule, decided from the whole row."""
    return (positions == torch.arange(positions.shape[-1], device=positions.device)).all(dim=-1)


def _agreed_one_document_per_row(positions: torch.Tensor, group) -> bool:
    """Whether every cp rank's rows are plain causal (positions = global indices), agreed by all:
    a one-element all-reduce and a host read (the undecided path of AutoAttention)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    j = global_indices(positions.shape[-1], cp=cp, rank=rank, device=positions.device)
    plain = torch.tensor([float(torch.equal(positions, j.expand_as(positions)))], device=positions.device)
    dist.all_reduce(plain, op=dist.ReduceOp.MIN, group=group)
    return bool(plain.item())


def auto_attentions(model: nn.Module) -> list[AutoAttention]:
    """The "auto" attentions installed in ``model`` (one per model or pipeline stage; the model's
    ``cp_attention`` hook puts the same one on its attention modules), [] for any other."""
    found = {id(a): a for m in model.modules() if isinstance(a := getattr(m, "cp_attention", None), AutoAttention)}
    return list(found.values())


@contextlib.contextmanager
def maybe_auto_decision(attentions: Sequence[AutoAttention], rows_plain: bool | None):
    """While the micro-batch runs (forward, backward and any recomputation of activation
    checkpointing): ``attentions`` take ``rows_plain`` as the decision (:class:`AutoAttention`).
    Nothing to do without "auto" attentions or without a decision (None)."""
    if not attentions or rows_plain is None:
        yield
        return
    for a in attentions:
        a.rows_plain = rows_plain
    try:
        yield
    finally:
        for a in attentions:
            a.rows_plain = None


ATTENTIONS = {"ring": RingAttention, "alltoall": AllToAllAttention, "auto": AutoAttention}


def apply_cp(
    model: nn.Module,
    cp_mesh: DeviceMesh,
    *,
    install: Callable[[nn.Module, Callable], None] | None,
    attention: str = "auto",
) -> None:
    """Give ``model``'s attention the ring (or all-to-all) attention over ``cp_mesh`` (in place).

    ``install(model, attention_fn)`` is the model's own hook (``ModelSpec.cp_attention``; this
    package knows no model): the model then calls ``attention_fn(q, k, v, positions=...)``
    instead of its attention over the local positions.

    Gradients: the cp ranks of one data-parallel rank hold the same parameters and each computes
    the gradient of its own tokens, so their gradients must be summed. FSDP2 over ``dp_shard x
    cp`` flattened does that and also shards the parameters over the cp ranks, which they would
    otherwise each hold whole (torchtitan's choice; DDP over ``dp_replicate x cp`` would keep a
    full copy per cp rank). With dp_replicate > 1 it is HSDP on (dp_replicate, cp). FSDP2 averages
    over all dp x cp ranks, so the step scales its loss by
    ``dp x cp / items`` (step.py) to turn that mean into the sum of the global mean's gradient.
    """
    if install is None:
        raise ConfigError(
            "parallel.cp > 1 needs a model whose attention can run the ring (the built-in GPT);"
            " set parallel.cp = 1 for this model"
        )
    install(model, ATTENTIONS[attention](cp_mesh))
