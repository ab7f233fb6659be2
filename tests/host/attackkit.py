"""What the first-build attack tests share: a guest thread rewriting its memory while the
host reads it (`flip`), and rule_group_kernel's answer from its definition
(`groups_by_definition`)."""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(nogil=True)
def flip(mem, offs, a, b, stop):
    """Until `stop[0]` is set, writes `a` then `b` (uint8 each) at the offsets `offs` of
    `mem`, without the GIL: a guest racing the host's reads of its bytes."""
    while stop[0] == 0:
        for k in range(offs.size):
            mem[offs[k]] = a[k]
        for k in range(offs.size):
            mem[offs[k]] = b[k]


def groups_by_definition(words, mask, src):
    """rule_group_kernel's answer from its definition, by brute force: each tensor's first
    tensor with the same masked record, the same source slots (none, itself, a slot's tensor
    again) and sources of the same masked records."""
    n, slots = src.shape

    def record(i):
        return tuple((words[i] & mask).tolist())

    def inputs(i):
        row = src[i].tolist()
        out = [record(i)]
        for k, s in enumerate(row):
            if s < 0:
                out.append(("none",))
            elif s == i:
                out.append(("self",))
            elif row.index(s) < k:
                out.append(("again", row.index(s)))
            else:
                out.append(("src", record(s)))
        return tuple(out)

    seen = {}
    return np.array([seen.setdefault(inputs(i), i) for i in range(n)], np.int32)
