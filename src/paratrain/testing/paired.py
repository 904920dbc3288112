"""Paired timing statistics for the benchmarks: each run of A is paired with the run of B beside it.

Runs on a shared machine drift (other jobs, thermal state), so two independent medians can
differ by more than the effect measured. Pairing each A run with the B run next to it (their
order alternating) cancels the drift common to both; the ratio A/B of each pair is the
observation. The summary is the median ratio and a 95% confidence interval of the geometric
mean ratio: Student's t on the log ratios (ratios are multiplicative; with few runs the t
quantile, not 1.96, is the honest width).
"""

from __future__ import annotations

import math
import statistics

# Two-sided 95% Student's t quantiles by degrees of freedom (beyond the table: the next lower
# entry, which is wider, so the interval errs on the safe side).
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}
_T975 |= {11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093}
_T975 |= {20: 2.086, 25: 2.060, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}


def t975(df: int) -> float:
    return _T975[max(k for k in _T975 if k <= df)]


def paired_ratios(a: list[float], b: list[float]) -> list[float]:
    assert len(a) == len(b) and a, (len(a), len(b))
    return [x / y for x, y in zip(a, b)]


def ratio_ci(ratios: list[float]) -> tuple[float, float, float]:
    """(geometric mean, lower, upper) of the 95% t-interval on log ratios; needs >= 2 ratios."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), float("nan"), float("nan")
    half = t975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def summary_line(name: str, ratios: list[float]) -> str:
    """``name: median M (geometric mean G, 95% CI [L, U], n pairs)``."""
    g, lo, hi = ratio_ci(ratios)
    return (
        f"{name}: median {statistics.median(ratios):.3f} (geometric mean {g:.3f},"
        f" 95% CI [{lo:.3f}, {hi:.3f}], {len(ratios)} pairs)"
    )


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman rank correlation of a and b (ties ranked by position): does a order cases as b does?"""

    def ranks(x):
        order = sorted(range(len(x)), key=x.__getitem__)
        r = [0.0] * len(x)
        for i, j in enumerate(order):
            r[j] = i
        return r

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
