"""The batch arithmetic, in one place: ``global_batch_size = micro_batch_size * accum_steps * dp``.

The samples each step reads are data/sampler.py's; this module only says how the global batch
divides into ranks and micro-batches, and it holds the ONE ``divisors`` (the micro-batch search,
the planner's layouts and ``replan_batch`` all walk divisors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from paratrain.config import ConfigError


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, ascending (pairs d, n/d up to sqrt(n): fast for any batch)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


@dataclass(frozen=True)
class BatchPlan:
    global_batch_size: int
    micro_batch_size: int
    accum_steps: int
    dp: int

    @property
    def per_rank_batch_size(self) -> int:
        return self.micro_batch_size * self.accum_steps

    def describe(self) -> str:
        return (
            f"global_batch_size {self.global_batch_size} = micro_batch_size {self.micro_batch_size}"
            f" x accum_steps {self.accum_steps} x dp {self.dp}"
        )


def plan_batch(*, global_batch_size: int, micro_batch_size: int, dp: int) -> BatchPlan:
    """Derive accumulation steps; micro_batch_size 0 means the whole per-rank batch."""
    if global_batch_size % dp:
        raise ConfigError(
            f"batch.global_batch_size = {global_batch_size} is not divisible by dp = {dp} data-parallel ranks;"
            f" set it to a multiple of {dp}"
        )
    per_rank = global_batch_size // dp
    mbs = micro_batch_size or per_rank
    if per_rank % mbs:
        raise ConfigError(
            f"batch.global_batch_size = {global_batch_size} is not divisible by micro_batch_size {mbs} x dp {dp}"
            f" = {mbs * dp}; set batch.micro_batch_size to a divisor of {per_rank} (the per-rank batch)"
        )
    return BatchPlan(global_batch_size, mbs, per_rank // mbs, dp)


def replan_batch(*, global_batch_size: int, micro_batch_size: int, dp: int) -> BatchPlan:
    """The plan of a global batch the run reached (batch.adaptive grows it) on a new world size.

    After an elastic or by-hand resize, the grown batch that ``micro x dp`` of the old world
    divided may not be a multiple of the new ``micro x dp``: then the micro-batch shrinks to the
    largest divisor of the per-rank batch (the micro-batch is layout, not math), instead of
    stopping the restarted job. Only a batch the new data-parallel degree cannot split at all
    is refused.
    """
    if global_batch_size % dp:
        raise ConfigError(
            f"the adaptive batch reached global batch {global_batch_size}, which dp = {dp} data-parallel"
            f" ranks cannot split evenly; resume on a layout whose dp divides {global_batch_size}, or cap"
            " the growth (batch.max_global_batch_size) at a multiple of micro_batch_size x every dp you resize to"
        )
    per_rank = global_batch_size // dp
    mbs = max(d for d in divisors(per_rank) if d <= (micro_batch_size or per_rank))
    return plan_batch(global_batch_size=global_batch_size, micro_batch_size=mbs, dp=dp)
