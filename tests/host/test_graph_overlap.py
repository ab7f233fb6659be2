"""The first write over each range of row ids (apir.host.graph.overlap.first_overlap, the plain
path's sweep) against its definition (every pair compared) and against
apir.host.graph.kernels' first_overlap_kernel on the same inputs: random ones (few buffers,
short spans, empty ranges, several writes at one position) and hostile ones (every range in
one buffer, nested, touching, empty at a range's ends, offsets near 2**62)."""

import numpy as np
import pytest

from apir import accel
from apir.host.graph.overlap import first_overlap


def _by_pairs(w_buf, w_lo, w_hi, w_pos, q_buf, q_lo, q_hi):
    over = (w_buf[None, :] == q_buf[:, None]) & (w_lo[None, :] < q_hi[:, None]) & (q_lo[:, None] < w_hi[None, :])
    least = np.where(over, w_pos[None, :], 1 << 62).min(axis=1, initial=1 << 62)
    return np.where(over.any(axis=1), least, -1)


def _random(rng):
    nw, nq = int(rng.integers(0, 40)), int(rng.integers(0, 15))
    span = int(rng.choice([4, 16, 64]))
    w_buf, q_buf = rng.integers(0, 3, nw), rng.integers(0, 3, nq)
    w_lo, q_lo = rng.integers(0, span, nw), rng.integers(0, span, nq)
    w_hi = w_lo + rng.integers(0, 8, nw) * (rng.random(nw) < 0.85)  # some empty
    q_hi = q_lo + rng.integers(0, 8, nq) * (rng.random(nq) < 0.85)
    w_pos = rng.integers(0, 20, nw)  # (several writes at one position: an OPT_STEP's)
    return [a.astype(np.int64) for a in (w_buf, w_lo, w_hi, w_pos, q_buf, q_lo, q_hi)]


def _hostile():
    """Inputs shaped against a sweep: one buffer, nested and touching ranges, empty ranges at
    every end, the same position many times, offsets near 2**62, positions in reverse."""
    top = (1 << 62) - 64
    cases = []
    n = 200
    lo = np.arange(n, dtype=np.int64)
    # nested: write k covers [k, 2n - k), queries empty at each offset and one byte wide
    at = np.arange(2 * n)
    cases.append((np.zeros(n), lo, 2 * n - lo, lo[::-1], np.zeros(2 * n), at, at + at % 2))
    # touching: writes [8k, 8k + 8), queries [8k + 8, 8k + 16) and empty at 8k, 8k + 8
    w = 8 * lo
    q = np.concatenate([w + 8, w, w + 8, w + 4])
    qh = np.concatenate([w + 16, w, w + 8, w + 4])
    cases.append((np.zeros(n), w, w + 8, lo, np.zeros(4 * n), q, qh))
    # near the top of int64's useful range, in two buffers, every write at position 0
    cases.append((lo % 2, top - lo, top + lo % 3, np.zeros(n), lo % 2, top - lo[::-1], top - lo[::-1] + 1))
    # no writes; no queries
    cases.append((np.zeros(0), np.zeros(0), np.zeros(0), np.zeros(0), np.zeros(3), np.arange(3), np.arange(3) + 1))
    cases.append((np.zeros(3), np.arange(3), np.arange(3) + 1, np.arange(3), np.zeros(0), np.zeros(0), np.zeros(0)))
    return [[np.asarray(a, np.int64) for a in c] for c in cases]


def test_first_overlap_matches_its_definition():
    rng = np.random.default_rng(29)
    for trial in range(3000):
        arrays = _random(rng)
        assert np.array_equal(first_overlap(*arrays), _by_pairs(*arrays)), trial
    for k, arrays in enumerate(_hostile()):
        assert np.array_equal(first_overlap(*arrays), _by_pairs(*arrays)), k


@pytest.mark.skipif(not accel.enabled(), reason="the host's kernels are off (APIR_ACCEL=0 or no Numba)")
@pytest.mark.parametrize("direct_max", [0, 1 << 30], ids=["sweep", "pairs"])
def test_first_overlap_matches_the_kernel(direct_max):
    from apir.host.graph.kernels import first_overlap_kernel

    rng = np.random.default_rng(31)
    inputs = [_random(rng) for _ in range(2000)] + _hostile()
    for k, arrays in enumerate(inputs):
        got = np.full(len(arrays[5]), -7, np.int64)
        first_overlap_kernel(*arrays, got, direct_max)
        assert np.array_equal(first_overlap(*arrays), got), k
