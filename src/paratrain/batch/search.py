"""The pure search for the largest micro-batch that fits, and its result format (no torch state).

See find_batch/__init__.py for the whole picture.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from paratrain.batch.plan import divisors
from paratrain.config import ConfigError
from paratrain.distributed.parallel_dims import ParallelDims

log = logging.getLogger("paratrain")

MAX_TRIALS = 12
GIB = 1 << 30


# ----------------------------------------------------------------------------- results


@dataclass
class Trial:
    micro_batch_size: int
    fits: bool
    peak_bytes: int | None  # None when the trial ran out of memory
    note: str = ""


@dataclass
class SearchResult:
    micro_batch_size: int | None  # None: not even 1 fits
    peak_bytes: int | None
    budget_bytes: int
    usable_bytes: int
    method: str
    budget_source: str
    per_rank_batch_size: int
    trials: list[Trial] = field(default_factory=list)

    @property
    def accum_steps(self) -> int | None:
        return None if self.micro_batch_size is None else self.per_rank_batch_size // self.micro_batch_size

    def table(self) -> str:
        lines = [
            f"find-batch: {self.method}; budget {self.budget_bytes / GIB:.3f} GiB per rank ({self.budget_source}),"
            f" usable {self.usable_bytes / GIB:.3f} GiB after the margin;"
            f" candidates: divisors of the per-rank batch {self.per_rank_batch_size}",
            f"  {'micro_batch':>11}  {'peak_MiB':>10}  fits",
        ]
        for t in self.trials:
            peak = "OOM" if t.peak_bytes is None else f"{t.peak_bytes / 2**20:.1f}"
            lines.append(
                f"  {t.micro_batch_size:>11}  {peak:>10}  {'yes' if t.fits else 'no'}{'  ' + t.note if t.note else ''}"
            )
        if self.micro_batch_size is None:
            lines.append("  -> not even micro_batch_size 1 fits")
        else:
            lines.append(
                f"  -> micro_batch_size {self.micro_batch_size} x accum_steps {self.accum_steps}"
                f" (peak {self.peak_bytes / 2**20:.1f} MiB)"
            )
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "micro_batch_size": self.micro_batch_size,
            "peak_bytes": self.peak_bytes,
            "accum_steps": self.accum_steps,
            "budget_bytes": self.budget_bytes,
            "usable_bytes": self.usable_bytes,
            "method": self.method,
            "per_rank_batch_size": self.per_rank_batch_size,
            "trials": [dataclasses.asdict(t) for t in self.trials],
        }

    @classmethod
    def from_json(cls, data: dict) -> SearchResult:
        """The inverse of :meth:`to_json` (with ``budget_source`` added)."""
        return cls(
            data["micro_batch_size"],
            data["peak_bytes"],
            data["budget_bytes"],
            data["usable_bytes"],
            data["method"],
            data["budget_source"],
            data["per_rank_batch_size"],
            [Trial(**t) for t in data["trials"]],
        )


def nothing_fits_error(result: SearchResult, dims: ParallelDims) -> ConfigError:
    one = next((t for t in result.trials if t.micro_batch_size == 1), None)
    peak = "out of memory" if one is None or one.peak_bytes is None else f"peak {one.peak_bytes / GIB:.2f} GiB"
    return ConfigError(
        f"batch.micro_batch_size = 'auto': not even a micro-batch of 1 fits ({peak} > usable"
        f" {result.usable_bytes / GIB:.2f} GiB per rank); try a layout that holds less per rank: more"
        f" parallel.dp_shard (FSDP, now {dims.dp_shard}), parallel.tp (now {dims.tp}), activation"
        f" checkpointing, or a larger batch.memory_gib / more memory"
    )


# ----------------------------------------------------------------------------- the search


def trials_needed(n_candidates: int) -> int:
    """Trials :func:`search_micro_batch` needs at most for ``n_candidates`` divisors: the largest
    first, then a bisection of the rest (ceil(log2(n_candidates)) more)."""
    return 1 + max(0, n_candidates - 1).bit_length()


def search_micro_batch(
    try_size: Callable[[int], Trial],
    *,
    per_rank_batch_size: int,
    max_trials: int = MAX_TRIALS,
    allowed: Callable[[int], bool] | None = None,
) -> tuple[int | None, list[Trial]]:
    """Largest divisor of ``per_rank_batch_size`` for which ``try_size`` fits (None if not 1).

    The whole per-rank batch first (the common answer: no accumulation needed), then bisection
    over the sorted divisors. Fitting is monotone in the size, so every divisor is reachable as
    the answer in :func:`trials_needed` trials: 12 cover any per-rank batch with up to 2048
    divisors (the first with more is above 10^11). Doubling from 1 instead needed log2(batch)
    trials to reach the top and ran out at a per-rank batch of 4096 (12 trials reach 2048).
    ``try_size`` must give the same answer on every rank (see :func:`agreed`). ``allowed``: the
    divisors a run may use (a BatchNorm model's micro-batch holds whole groups of
    ``batch.norm_group``, models/batch_norm.py ``check_groups``); None: all.
    """
    cands = [d for d in divisors(per_rank_batch_size) if allowed is None or allowed(d)]
    if not cands:
        return None, []
    trials: list[Trial] = []

    def attempt(i: int) -> bool:
        t = try_size(cands[i])
        trials.append(t)
        return t.fits

    if attempt(len(cands) - 1):
        return cands[-1], trials
    lo, hi = -1, len(cands) - 1  # indices: largest known fit, smallest known failure
    while hi - lo > 1 and len(trials) < max_trials:
        mid = (lo + hi) // 2
        if attempt(mid):
            lo = mid
        else:
            hi = mid
    if hi - lo > 1:
        log.warning("find-batch: the trial budget (%d) ran out before the search converged", max_trials)
    return (cands[lo] if lo >= 0 else None), trials
