"""The reference's log-probabilities precomputed once (``preference.precompute``; docs/preference.md).

A preference loss compares the policy with a frozen reference on every pair. Computing the
reference at every step costs a forward per pair per step and, for a reference that is not the
policy itself, a second model in memory. Precomputed, the reference runs before the first step
over the very micro-batches the run's steps and validations will read, its model is then
dropped, and each step looks its numbers up.

**The rows training sees.** A micro-batch's rows end at its longest pair (``data.args.pad_to``),
so a pair's row width depends on its neighbours, and the reference's sums depend on the width by
a rounding: one ulp in 1 of 32 pairs between rows of 512 and 216 columns under context parallel
(its chunk boundaries move with the width), and the kernels may differ with it on another CPU.
The store is therefore filled with the data set's own ``collate`` on the micro-batches of the
run's sample stream (``sampler.global_samples``, cut in micro-batches: the same groups on every
data-parallel degree and accumulation, data/sampler.py ``rank_micro_batches``) and of its
validation set, so each value is computed on the same row, at the same width, by the same
kernels as the per-step reference: the two are equal bit for bit (tests/distributed/
test_preference.py, zero tolerance).

The store is **keyed by the row**: a hash of the pair's token ids and positions and the row's
width (and, for an image-text pair, of its images' pixel values and grids: ``row_keys``), so a
lookup does not depend on the rank, the accumulation or the run: a store filled by one run
serves another of the same pairs, reference and micro-batch size (``preference.store``; a
resume, another world size), and only the rows it lacks are computed (a run stopped while
filling it resumes there; another micro-batch size computes its own widths). The store's
``identity`` (the reference model and what changes its numbers) must match, else it is refused
in one line.

Files: ``identity.json`` and ``values.pt`` (``keys``: the rows' 16-byte keys as hex strings,
``values``: float64 ``[rows, 4]``: the chosen and rejected log-probability sums and token counts).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct

import torch
import torch.distributed as dist

from paratrain.config import ConfigError

log = logging.getLogger("paratrain")


def row_keys(inputs) -> list[str]:
    """Each row's key: a hash of its pair's token ids and positions (the leading columns, position
    >= 0) and of the row's width, which the reference's rounding depends on (module docstring).

    An image-text batch (data/image_rows.py ImageTextBatch): the row's images too, their pixel
    values and grids. Two pairs of the same text about different images have the same tokens (an
    image is one run of image tokens, whatever it shows), so a key of the tokens alone would give
    the second the first one's reference (tests/distributed/test_vision_dpo.py holds such a pair)."""
    images = [b""] * len(inputs)
    if hasattr(inputs, "select_rows"):
        images = [_image_bytes(inputs.select_rows(r, r + 1)) for r in range(len(inputs))]
        inputs = torch.stack([inputs.input_ids, inputs.positions], 1)
    rows = inputs.detach().to("cpu", torch.int64)
    width = struct.pack("<q", rows.shape[-1])
    keys = []
    for row, image in zip(rows, images, strict=True):
        n = int((row[1] >= 0).sum())  # the pair's columns lead the row
        pair = row[:, :n].contiguous().numpy().tobytes()
        keys.append(hashlib.blake2b(pair + width + image, digest_size=16).hexdigest())
    return keys


def _image_bytes(row) -> bytes:
    """One row's images as bytes: its pixel values (float32) and, with variable patches, its
    grids, each behind its shape (so no two different sets of images give the same bytes)."""
    out = b""
    for t in (row.pixel_values.detach().to("cpu", torch.float32), row.image_grid_thw):
        if t is not None:
            t = t.detach().cpu().contiguous()
            out += struct.pack(f"<{t.dim() + 1}q", t.dim(), *t.shape) + t.numpy().tobytes()
    return out


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
    # The model's files last, by name: their [name, size, mtime] lists made a line of 700 characters.
    keys = sorted((k for k in {**a, **b} if a.get(k) != b.get(k)), key=lambda k: (k == "files", k))
    return "; ".join(
        _files_differ(a.get(k), b.get(k)) if k == "files" else f"{k}: {a.get(k)!r} stored, {b.get(k)!r} now"
        for k in keys[:2]
    )


def _files_differ(stored, now) -> str:
    """Which of the reference directory's files (``[name, size, mtime_ns]`` each) differ."""
    old, new = ({f[0]: f for f in files or []} for files in (stored, now))
    names = [n for n in sorted(old.keys() | new.keys()) if old.get(n) != new.get(n)]
    return "files: " + ", ".join(
        f"{n} {'added' if n not in old else 'gone' if n not in new else 'changed'}" for n in names
    )


@torch.no_grad()
def fill(
    store: ReferenceStore,
    walks: list,
    *,
    reference,
    forward_of,
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
    """Compute the rows the store lacks, over the data-parallel ranks, gather them and save (rank 0).

    ``walks``: ``(load, micro_batches, per_rank)`` each: the micro-batches (sample index lists) in
    the order the run reads them, ``load(indices)`` collates one as the loader does, and each
    rank runs ``per_rank`` of them per round (every rank the same number of forwards: FSDP2 and
    tensor parallel gather in them; the last round filled up with a repeat). A micro-batch whose
    rows are all stored is skipped. ``reference(forward, k)``: micro-batch ``k``'s reference
    logits; ``forward_of(batches)``: step.no_grad_forward's ``forward``. Returns ``(computed,
    rows)``: the rows computed now and the distinct rows of the walks.

    Pipeline parallel: ``pipeline(batches, target, fn)`` runs the reference's pipeline instead
    (objectives/preference.py's ``pipeline_reference``), the values land on the last stage
    (``holds``), and they are shared over ``share_group`` (every rank: each needs the store) in
    place of the data-parallel group.

    Context parallel: ``cut(batches)`` gives this rank's chunks of the rows (step.cp_local_batch),
    which the forwards run on; each pair's sums over its chunks are summed over ``cp``
    (objectives/preference.py's CPGroup) and keyed by the whole row, as without it."""
    # the one definition of a side's log-probability, and the pipeline's row-indexed target
    from paratrain.objectives.preference import row_indexed, side_logps

    # Every rank reads every micro-batch's keys (not only its own) so that all agree on what is
    # lacking without a collective; a lacking one is collated again when computed, rather than
    # held: the first fill of a long run would hold all of its rows.
    rows, seen, todo = set(), set(), []
    for load, micro, per in walks:
        lacking = []
        for mb in micro:
            keys = tuple(row_keys(load(mb)[0]))
            rows.update(keys)
            if keys not in seen and any(k not in store.values for k in keys):
                lacking.append(mb)
            seen.add(keys)
        todo.append((load, lacking, per))
    computed: list[tuple[str, list[float]]] = []
    for load, lacking, per in todo:
        span = dp * per
        for start in range(0, len(lacking), span):
            chunk = lacking[start : start + span]
            chunk += chunk[:1] * (span - len(chunk))  # the last round filled up (a repeat: the same keys)
            whole = [load(mb) for mb in chunk[dp_rank * per : (dp_rank + 1) * per]]
            batches = whole if cut is None else cut(whole)
            if pipeline is not None:
                target = row_indexed(torch.cat([t for _, t in batches])).to(device)
                values = torch.zeros(len(target), 4, dtype=torch.float64, device=device)

                def piece(output, t, values=values):
                    logps, counts = side_logps(output, t[:, :-1])
                    values[t[:, -1, 0]] = torch.cat([logps.double(), counts.double()], -1)

                pipeline(batches, target, piece)
                if holds:
                    values = values if cp is None else cp.sum(values, grad=False)  # the last stage's cp ranks
                    keys = [key for inputs, _ in whole for key in row_keys(inputs)]
                    computed += list(zip(keys, values.cpu().tolist(), strict=True))
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
    return len({k for k, _ in computed}), len(rows)
