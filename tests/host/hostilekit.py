"""What the host's hostile graph tests share: a guest thread rewriting its memory while the
host reads it (`flip`, `racing_guest`), rule_group_kernel's answer from its definition
(`groups_by_definition`), and what a build made, comparable across builds (`host_tensors`)."""

from __future__ import annotations

import contextlib
import threading
import time

import numba
import numpy as np

from apir.ggml.layout import tensor_record


@numba.njit(nogil=True)
def flip(mem, offs, a, b, stop):
    """Until `stop[0]` is set, writes `a` then `b` (uint8 each) at the offsets `offs` of
    `mem`, without the GIL: a guest racing the host's reads of its bytes."""
    while stop[0] == 0:
        for k in range(offs.size):
            mem[offs[k]] = a[k]
        for k in range(offs.size):
            mem[offs[k]] = b[k]


@contextlib.contextmanager
def racing_guest(wire: bytes, spec):
    """`wire` copied into a buffer (uint8, yielded) whose bytes another thread keeps
    rewriting (`flip`) while the block runs: for each (offset, a, b) of `spec`, between a
    and b."""
    mem = np.frombuffer(bytearray(wire), np.uint8)
    offs = np.array([o for o, _, _ in spec], np.int64)
    a = np.array([v for _, v, _ in spec], np.uint8)
    b = np.array([v for _, _, v in spec], np.uint8)
    flip(mem, offs, a, b, np.ones(1, np.int64))  # compiled here, not in the thread's first seconds
    stop = np.zeros(1, np.int64)
    th = threading.Thread(target=flip, args=(mem, offs, a, b, stop))
    was = mem[offs].copy()
    th.start()
    try:
        # the block starts once the guest has rewritten each byte it rewrites (the last one
        # in its order): before that, a read could still see the bytes as they were
        moving = np.flatnonzero((a != was) | (b != was))
        deadline = time.monotonic() + 30
        while moving.size and mem[offs[moving[-1]]] == was[moving[-1]] and time.monotonic() < deadline:
            time.sleep(0)
        yield mem
    finally:
        stop[0] = 1
        th.join()


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


def host_tensors(dtype: np.dtype, host: np.ndarray, copied=()) -> list:
    """Each host tensor a build made (`host`: their addresses by tensor index; `dtype`: the
    ggml_tensor layout) as the fields a kernel reads, its src and view_src as tensor indices
    (-1: none) instead of addresses, which differ from one build to the next; the data of
    the tensors in `copied` (row ids whose copy the kernel reads: a new one each build) as
    None."""
    index = {a: i for i, a in enumerate(host.tolist())}
    out = []
    for i, a in enumerate(host.tolist()):
        r = tensor_record(a, dtype)
        fields = tuple(r[f].tobytes() for f in ("type", "ne", "nb", "op", "op_params", "flags", "name"))
        links = tuple(index.get(int(p), -1) if p else -1 for p in r["src"].tolist() + [int(r["view_src"])])
        data = None if i in copied else int(r["data"])
        out.append((fields, int(r["buffer"]), data, int(r["view_offs"]), links))
    return out
