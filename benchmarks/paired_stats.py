"""The statistics of paired benchmark rounds (benchmarks/bench_minilm.py): the median of
per-round ratios and a confidence interval for it that assumes no distribution.

A round runs each compared backend once, back to back, so the ratio of two backends' times in
one round is free of the drift between rounds on a shared machine; the median of those ratios
over the rounds, with its interval, says whether one backend is measurably slower than the
other, where a ratio of medians only gives a number.
"""

from __future__ import annotations

import math
import statistics

__all__ = ["median_interval"]


def median_interval(values: list, level: float = 0.95) -> tuple:
    """(median, low, high) of `values`: low and high the order statistics x(k) and x(n+1-k)
    with the largest k for which the median lies between them with probability >= `level`
    whatever the distribution (the sign test's interval: P(Binomial(n, 1/2) < k) <= (1 -
    level) / 2). With too few values for that, low and high are the smallest and largest."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        raise ValueError("no values")
    k, below = 0, 0.0  # below: P(Binomial(n, 1/2) <= k - 1), adding one term per k
    while k < n // 2 and below + math.comb(n, k) / 2**n <= (1 - level) / 2:
        below += math.comb(n, k) / 2**n
        k += 1
    lo, hi = (xs[k - 1], xs[n - k]) if k else (xs[0], xs[-1])
    return statistics.median(xs), lo, hi
