"""benchmarks/paired_stats.py: the median's distribution-free interval that bench_minilm prints
next to each paired ratio (the benchmark itself runs in benchmarks/, never in tests)."""

import random

import pytest

from tests.benchkit import load_benchmark


def _stats():
    return load_benchmark("paired_stats")


# n -> the ranks (1-based) of the 95% interval for the median in the sign test's published
# tables of order statistics (6 values: the whole sample, 96.9%; 5 values: the same, 93.8%,
# the most there is)
@pytest.mark.parametrize(
    "n, ranks", [(5, (1, 5)), (6, (1, 6)), (10, (2, 9)), (12, (3, 10)), (20, (6, 15)), (30, (10, 21))]
)
def test_the_interval_has_the_tables_ranks(n, ranks):
    values = [10.0 * r for r in range(1, n + 1)]
    random.Random(n).shuffle(values)  # (the order given must not matter)
    median, lo, hi = _stats().median_interval(values)
    assert (lo, hi) == (10.0 * ranks[0], 10.0 * ranks[1])
    assert median == 5.0 * (n + 1)


def test_the_interval_holds_the_true_median_about_95_times_in_100():
    # exponential samples (a skewed distribution, true median ln 2) of the default 20 rounds:
    # the interval's own coverage at n = 20 is 95.86%
    rng = random.Random(15)
    median_interval = _stats().median_interval
    trials = 4000
    held = 0
    for _ in range(trials):
        _, lo, hi = median_interval([rng.expovariate(1.0) for _ in range(20)])
        held += lo <= 0.6931471805599453 <= hi
    assert 0.945 <= held / trials <= 0.972


def test_no_values_is_an_error():
    with pytest.raises(ValueError):
        _stats().median_interval([])
