"""Collective arithmetic shared by ``paratrain bench comm`` and the planner: nccl-tests' bus
bandwidth and Hockney's latency-bandwidth line through measured times."""

from __future__ import annotations

import functools
import statistics


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor for ``op`` on ``n`` ranks (its PERFORMANCE.md): busbw =
    algbw x factor is the per-link traffic, comparable across ops and group sizes."""
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "send_recv"):
        return 1.0
    raise ValueError(f"unknown op {op!r}")


def bandwidths(op: str, nbytes: int, seconds: float, n: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes per second)."""
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * bus_factor(op, n)


@functools.cache
def _fit(table: tuple[tuple[int, float], ...]) -> tuple[float, float]:
    pairs = [(t1 - t0) / (b1 - b0) for i, (b0, t0) in enumerate(table) for b1, t1 in table[i + 1 :] if b1 != b0]
    per_byte = max(0.0, statistics.median(pairs)) if pairs else 0.0
    latency = max(0.0, statistics.median(t - per_byte * b for b, t in table))
    return latency, per_byte


def fit_line(table: list[tuple[int, float]]) -> tuple[float, float]:
    """(latency s, s per byte) of ``time = latency + bytes x per_byte`` (Hockney's alpha-beta model)
    through measured (bytes, time) points, by the Theil-Sen estimator (the median of the pairwise
    slopes, then the median intercept): a few timings spoiled by another process on a shared
    machine do not bend it, where interpolating between the raw points made a larger message
    cheaper than a smaller one (e.g. a 16 KiB send at 2.9 ms between two 0.25 ms ones)."""
    return _fit(tuple(table))
