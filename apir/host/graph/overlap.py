"""The first write over each range of row ids, in plain Python: a sort and a sweep.

`first_overlap`: per query range of bytes, the least position of a write whose bytes
overlap it in the same memory, -1 where none does. Comparing every query with every write is
quadratic, and a guest chooses both counts (a graph of many GET_ROWS nodes, each with its own
ids tensor), so per memory the writes enter in order of their start while it is below the
query's end (queries in order of their end), and a query takes the least position over the
writes entered whose end is above its start (a prefix of the ends sorted from the highest:
`_PrefixLeast`). O((W + Q) log W). apir.host.graph.kernels' `first_overlap_kernel` is the same
sweep, held equal to this by tests on the same inputs.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Dict, List, Sequence

import numpy as np

__all__ = ["first_overlap"]

_NONE = 1 << 62  # no write (positions are below it)


class _PrefixLeast:
    """The least value over slots [0, n) of `size` slots that only ever go down (a Fenwick
    tree of minima): `lower` and `least` each take log2(size) steps."""

    def __init__(self, size: int):
        self.tree = [_NONE] * (size + 1)

    def lower(self, slot: int, value: int) -> None:
        """Slot `slot` to at most `value`."""
        tree, k = self.tree, slot + 1
        while k < len(tree):
            if value < tree[k]:
                tree[k] = value
            k += k & -k

    def least(self, n: int) -> int:
        """The least value of slots [0, n) (_NONE where none was lowered)."""
        tree, least = self.tree, _NONE
        while n > 0:
            if tree[n] < least:
                least = tree[n]
            n -= n & -n
        return least


def first_overlap(w_buf, w_lo, w_hi, w_pos, q_buf, q_lo, q_hi) -> np.ndarray:
    """int64 per query q: the least `w_pos[w]` over the writes w with `w_buf[w] == q_buf[q]`,
    `w_lo[w] < q_hi[q]` and `q_lo[q] < w_hi[w]` (an empty range overlaps one that strictly
    contains its offset), -1 where none does. Every argument a sequence of ints (the w_ of
    one length, the q_ of another), positions >= 0."""
    wb, wl, wh, wp = (_ints(a) for a in (w_buf, w_lo, w_hi, w_pos))
    qb, ql, qh = (_ints(a) for a in (q_buf, q_lo, q_hi))
    out = [-1] * len(ql)
    writes: Dict[int, List[int]] = {}
    for w, b in enumerate(wb):
        writes.setdefault(b, []).append(w)
    queries: Dict[int, List[int]] = {}
    for q, b in enumerate(qb):
        queries.setdefault(b, []).append(q)
    for b, qs in queries.items():
        ws = writes.get(b, [])
        # the writes' ends, highest first, as negatives (ascending): "end > x" is a prefix
        ends = sorted({-wh[w] for w in ws})
        slot = {-e: k for k, e in enumerate(ends)}
        tree = _PrefixLeast(len(ends))
        entering = sorted(ws, key=wl.__getitem__)
        e = 0
        for q in sorted(qs, key=qh.__getitem__):
            while e < len(entering) and wl[entering[e]] < qh[q]:
                w = entering[e]
                tree.lower(slot[wh[w]], wp[w])
                e += 1
            least = tree.least(bisect_left(ends, -ql[q]))
            out[q] = least if least < _NONE else -1
    return np.array(out, np.int64)


def _ints(a: Sequence[int]) -> List[int]:
    """`a` as a list of Python ints."""
    return a.tolist() if isinstance(a, np.ndarray) else [int(x) for x in a]
