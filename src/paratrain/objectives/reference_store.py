"""The reference's log-probabilities precomputed once (``preference.precompute``; docs/preference.md).

A preference loss compares the policy with a frozen reference on every pair. Computing the
reference at every step costs a forward per pair per step and, for a reference that is not the
policy itself, a second model in memory. Precomputed, the reference runs once over the run's
pairs (training and validation) before the first step, its model is then dropped, and each step
looks its numbers up.

The store is **keyed by the pair**: a row's key is a hash of its token ids and positions (the
pair as the step sees it, ``[chosen | rejected]`` cut to the row), so a lookup does not depend on
the layout, the sampler's order, the split or the run: a store filled by one run serves another of
the same pairs and reference (``preference.store``), and only pairs it lacks are computed (a run
stopped while filling it resumes there). The store's ``identity`` (the reference model and what
changes its numbers) must match, else it is refused in one line.

Files: ``identity.json`` and ``values.pt`` (``keys``: the rows' 16-byte keys as hex strings,
``values``: float64 ``[pairs, 4]``: the chosen and rejected log-probability sums and token counts).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import torch
import torch.distributed as dist

from paratrain.config import ConfigError

log = logging.getLogger("paratrain")


def row_keys(inputs: torch.Tensor) -> list[str]:
    """Each row's key: a hash of its token ids and positions, without the padding after the pair
    (position -1): a micro-batch cuts its rows to its longest pair (``data.args.pad_to``), so the
    padding a row carries depends on its neighbours, its key must not."""
    rows = inputs.detach().to("cpu", torch.int64)
    keys = []
    for row in rows:
        n = int((row[1] >= 0).sum())  # the pair's columns lead the row
        keys.append(hashlib.blake2b(row[:, :n].contiguous().numpy().tobytes(), digest_size=16).hexdigest())
    return keys


class ReferenceStore:
    """``{row key: [log p chosen, log p rejected, tokens chosen, tokens rejected]}`` on disk."""

    def __init__(self, path: str, identity: dict):
        self.path, self.identity = path, identity
        self.values: dict[str, list[float]] = {}
        found = os.path.join(path, "identity.json")
        if os.path.isfile(found):
            with open(found) as f:
                stored = json.load(f)
            if stored != identity:
                raise ConfigError(
                    f"preference.store = {path!r} holds another reference's numbers ({_differ(stored, identity)});"
                    " point preference.store at a new folder or delete this one"
                )
            data = torch.load(os.path.join(path, "values.pt"), weights_only=True)
            self.values = dict(zip(data["keys"], data["values"].tolist(), strict=True))

    def missing(self, keys: list[str]) -> list[int]:
        return [i for i, k in enumerate(keys) if k not in self.values]

    def lookup(self, inputs: torch.Tensor, device) -> torch.Tensor:
        """``(B, 4)`` float64 of the rows of ``inputs``."""
        keys = row_keys(inputs)
        lost = self.missing(keys)
        if lost:
            raise RuntimeError(f"{len(lost)} pair(s) of a batch are not in the reference store {self.path}")
        return torch.tensor([self.values[k] for k in keys], dtype=torch.float64, device=device)

    def save(self) -> None:
        """Atomically: the values, then the identity that vouches for them."""
        os.makedirs(self.path, exist_ok=True)
        keys = sorted(self.values)
        tmp = os.path.join(self.path, "values.pt.tmp")
        torch.save({"keys": keys, "values": torch.tensor([self.values[k] for k in keys], dtype=torch.float64)}, tmp)
        os.replace(tmp, os.path.join(self.path, "values.pt"))
        with open(os.path.join(self.path, "identity.json.tmp"), "w") as f:
            json.dump(self.identity, f, indent=1, sort_keys=True)
        os.replace(os.path.join(self.path, "identity.json.tmp"), os.path.join(self.path, "identity.json"))


def _differ(a: dict, b: dict) -> str:
    keys = sorted(k for k in {**a, **b} if a.get(k) != b.get(k))
    return ", ".join(f"{k}: {a.get(k)!r} stored, {b.get(k)!r} now" for k in keys[:2])


@torch.no_grad()
def fill(
    store: ReferenceStore,
    datasets: list,
    *,
    reference,
    forward_of,
    batches_of,
    global_batch_size: int,
    dp_rank: int,
    dp: int,
    dp_group,
    device,
    is_main: bool,
    pipeline=None,
    holds: bool = True,
    share_group=None,
    cut=None,
    cp=None,
) -> tuple[int, int]:
    """Compute the pairs of ``datasets`` the store lacks, over the data-parallel ranks in global
    batches (every rank runs the same number of forwards: FSDP2 and tensor parallel gather in
    them), gather them and save (rank 0). ``reference(forward, k)``: micro-batch ``k``'s reference
    logits; ``forward_of(batches)``: step.no_grad_forward's ``forward``; ``batches_of(samples)``:
    this rank's samples collated into micro-batches. Returns ``(computed, pairs)``: the pairs
    computed now and the distinct pairs of ``datasets``.

    Pipeline parallel: ``pipeline(batches, target, fn)`` runs the reference's pipeline instead
    (objectives/preference.py's ``pipeline_reference``), the values land on the last stage
    (``holds``), and they are shared over ``share_group`` (every rank: each needs the store) in
    place of the data-parallel group.

    Context parallel: ``cut(batches)`` gives this rank's chunks of the rows (step.cp_local_batch),
    which the forwards run on; each pair's sums over its chunks are summed over ``cp``
    (objectives/preference.py's CPGroup) and keyed by the whole row, as without it."""
    # the one definition of a side's log-probability, and the pipeline's row-indexed target
    from paratrain.objectives.preference import row_indexed, side_logps

    todo, seen = [], set()
    for d, dataset in enumerate(datasets):
        n = getattr(dataset, "real", len(dataset))  # a filled-up validation set: its real pairs
        for i in range(n):
            key = row_keys(dataset[i][0][None])[0]
            if key not in seen:  # a pair repeated in the data is computed once
                seen.add(key)
                if key not in store.values:
                    todo.append((d, i))
    computed: list[tuple[str, list[float]]] = []
    g = global_batch_size
    for start in range(0, len(todo), g):
        chunk = todo[start : start + g]
        chunk += chunk[:1] * (g - len(chunk))  # the last global batch filled up (duplicates: the same key)
        # Every rank the same number of micro-batches (their rows cut to each one's longest pair).
        whole = batches_of([datasets[d][i] for d, i in chunk[dp_rank * (g // dp) : (dp_rank + 1) * (g // dp)]])
        batches = whole if cut is None else cut(whole)
        if pipeline is not None:
            target = row_indexed(torch.cat([t for _, t in batches])).to(device)
            rows = torch.zeros(len(target), 4, dtype=torch.float64, device=device)

            def piece(output, t, rows=rows):
                logps, counts = side_logps(output, t[:, :-1])
                rows[t[:, -1, 0]] = torch.cat([logps.double(), counts.double()], -1)

            pipeline(batches, target, piece)
            if holds:
                rows = rows if cp is None else cp.sum(rows, grad=False)  # the last stage's cp ranks
                keys = [key for inputs, _ in whole for key in row_keys(inputs)]
                computed += list(zip(keys, rows.cpu().tolist(), strict=True))
            continue
        forward = forward_of(batches)
        for k, ((inputs, _), (_, target)) in enumerate(zip(whole, batches, strict=True)):
            logps, counts = side_logps(reference(forward, k), target.to(device))
            values = torch.cat([logps.double(), counts.double()], -1)
            values = values if cp is None else cp.sum(values, grad=False)
            computed += list(zip(row_keys(inputs), values.cpu().tolist(), strict=True))
    group = share_group if pipeline is not None else dp_group
    ranks = dist.get_world_size(group) if pipeline is not None else dp
    if ranks > 1:
        gathered: list = [None] * ranks
        dist.all_gather_object(gathered, computed, group=group)
        computed = [kv for part in gathered for kv in part]
    store.values.update(dict(computed))
    if is_main and computed:
        store.save()
    if ranks > 1:
        dist.barrier(group=group)  # every rank reads a complete store from here on
    return len({k for k, _ in computed}), len(seen)
