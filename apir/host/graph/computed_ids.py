"""Row ids a graph computes: which tensors hold them, their bound, and the check at build.

A rule reads row ids before compute and the kernel is given that checked copy
(`TensorInfo.snapshot`); ids a node of the same graph computes (a MoE's expert ids:
ARGSORT or TOP_K, then GET_ROWS / MUL_MAT_ID) are not there yet. Some ops compute ids in
range whatever their inputs: `ID_WRITERS`, whose result is I32 ids in [0, src0.ne[0]) on
ggml-cpu's kernels (its argsort sorts 0..ne00-1, its top_k partially sorts them); a backend's
profile names those of its own (`BackendProfile.id_writers`: ggml-vulkan's bitonic argsort
writes the first ncols of a permutation, its TOP_K does not). A tensor that is such a
node (flagged to compute), or a view of one, each element on an element of it, in memory the
guest cannot write during compute (a buffer the host allocated, not a guest resource), holds
such ids (`computed_by`). A rule whose bound that is takes them unread
(`shapes.base.check_row_ids`); then `check_computed_reads` holds the graph to it: the writer
runs before the reader, and no other write reaches those bytes from the writer through the
reader (the reader's own included). Anything else is refused. The same code runs on both
paths (apir.accel).
"""

from __future__ import annotations

import functools
from typing import List, Optional, Tuple

import numpy as np

from apir.host.errors import Refused
from apir.host.graph.shapes import TensorInfo

__all__ = [
    "ID_WRITERS",
    "writer_ops",
    "candidate",
    "ids_writer_nodes",
    "computed_by",
    "check_computed_reads",
    "WINDOW_WORK",
]

ID_WRITERS = frozenset(("ARGSORT", "TOP_K"))

# Writes compared, over all reads of computed ids, before a graph is refused as too costly
# to check (each read is compared with the writes between its writer and itself; a decoding
# MoE graph has a few reads per layer, each a few nodes from its writer).
WINDOW_WORK = 1 << 22

_I32 = 4


@functools.lru_cache(maxsize=8)
def writer_ops(g, writers: frozenset = ID_WRITERS) -> np.ndarray:
    """bool per op of build `g`: the `writers` (read-only)."""
    flags = np.array([g.op_names.get(o, "") in writers for o in range(g.op_count)], np.bool_)
    flags.flags.writeable = False
    return flags


def candidate(writers: np.ndarray, ops, view_src, i: int) -> bool:
    """Whether tensor `i` (of a graph whose tensors have ops `ops` and view sources
    `view_src`, -1 none) is, or views, a tensor of an op `writers` flags (`writer_ops`): the
    only tensors `computed_by` may answer for, told in two look-ups so that the others cost
    nothing (a graph's rules see few of its tensors: no pass over all of them)."""
    v = int(view_src[i])
    return bool(writers[ops[i if v < 0 else v]])


def ids_writer_nodes(g, node_index: np.ndarray, ops: np.ndarray) -> np.ndarray:
    """The tensor indices of `node_index` whose op (`ops`, per tensor) is one of `ID_WRITERS`."""
    nodes = node_index.astype(np.int64)
    return nodes[writer_ops(g)[ops[nodes]]]


def computed_by(g, parsed, recs, i: int, writers: frozenset = ID_WRITERS) -> Optional[Tuple[int, int]]:
    """(writer, bound) of tensor `i` of `parsed` (records checked: `recs`, as
    apir.host.graph.build's `_Records`) where every element it has is one a `writers` node
    writes, an id in [0, bound); None otherwise. Whether that node runs, and before its
    readers with nothing written between, is `check_computed_reads`'."""
    t = parsed.tensors
    v = int(parsed.view_src_index[i])
    w = i if v < 0 else v  # (a view's source: ggml makes every view's view_src the root)
    if g.op_names.get(int(t["op"][w])) not in writers:
        return None
    compute = g.tensor_flags.get("COMPUTE", 0)
    if compute and not int(t["flags"][w]) & compute:
        return None  # (ggml skips a node without GGML_TENSOR_FLAG_COMPUTE: it would write nothing)
    if recs.found[int(recs.inverse[i])].res_id is not None:
        return None  # (guest memory: the guest may write it while the graph computes)
    i32 = g.types.get("I32")
    if int(t["type"][i]) != i32 or int(t["type"][w]) != i32:
        return None
    ne_w, nb_w = t["ne"][w].tolist(), t["nb"][w].tolist()
    packed = _I32
    for k in range(len(ne_w)):  # the writer contiguous: its kernel writes every byte of its extent
        if ne_w[k] != 1 and nb_w[k] != packed:
            return None
        packed *= ne_w[k]
    # each element of `i` on an element of the writer (a view lies within its source: checked)
    if (int(recs.offsets[i]) - int(recs.offsets[w])) % _I32 or any(nb % _I32 for nb in t["nb"][i].tolist()):
        return None
    src = int(parsed.src_index[w][0])
    if src < 0:
        return None
    return w, int(t["ne"][src][0])


def check_computed_reads(reads: List[TensorInfo], at: np.ndarray, nodes, writes, buf, recs, op_names) -> None:
    """Refuses a graph where computed ids (`reads`: infos with `read_computed_by`) are not
    what their writer computed when a reader runs: the writer is not a node before the reader,
    or a write over their bytes (same memory, `buf`) lies between the two, the reader's own
    included. `at`: position in the node list per tensor (-1: none); `writes`: (memory, lo,
    hi, position) arrays of every write of the nodes, in graph order."""
    w_buf, w_lo, w_hi, w_pos = writes
    pairs = []
    for info in reads:
        writer = info.computed_by[0] if info.computed_by is not None else -1
        for r in info.read_computed_by or ():
            p_r = int(at[r])
            if p_r < 0:
                continue  # (a reader that is no node reads nothing at compute)
            p_w = int(at[writer])
            if not 0 <= p_w < p_r:
                why = f"row ids computed by node {writer} ({op_names(writer)}), which does not run before this reader"
                raise Refused(f"node {r}: {why}", node=r, op=op_names(r), reason=why, rule=_RULE)
            pairs.append((info.index, p_w, p_r))
    if not pairs:
        return
    starts = np.searchsorted(w_pos, [p for _, p, _ in pairs], side="right")
    ends = np.searchsorted(w_pos, [p for _, _, p in pairs], side="right")
    if int((ends - starts).sum()) > WINDOW_WORK:
        why = f"row ids computed in the graph are read too far from their writers to check ({len(pairs)} reads)"
        raise Refused(f"graph: {why}", reason=why, rule=_RULE)
    for (i, _, _), s, e in zip(pairs, starts.tolist(), ends.tolist()):
        lo, hi = int(recs.offsets[i]), int(recs.offsets[i]) + int(recs.extents[i])
        hit = np.flatnonzero((w_buf[s:e] == buf[i]) & (w_lo[s:e] < hi) & (lo < w_hi[s:e]))
        if len(hit):
            j = int(nodes[int(w_pos[s + int(hit[0])])])
            why = f"row ids computed in the graph, but node {j} ({op_names(j)}) writes over them before they are read"
            raise Refused(f"graph tensor {i}: {why}", node=j, op=op_names(j), reason=why, rule=_RULE)


_RULE = f"{__name__}.check_computed_reads"
