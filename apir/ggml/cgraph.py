"""Use counts in a `ggml_cgraph` built node by node, as ggml's own graph building fills them.

Theory of operation: ggml_build_forward_expand visits every tensor a graph reaches, puts it
in the graph's `visited_hash_set` (open addressing on `tensor >> 4`, linear probing) and
counts in `use_counts[slot]` how many source slots name it. Backends fuse a node into its
consumer only where that count says one use (`ggml_node_get_use_count`, ggml-impl.h; ggml-cpu
fuses RMS_NORM + MUL, ggml-vulkan many more), so a graph made with ggml_graph_add_node alone
never fuses. `fill_use_counts` writes the hash set and counts of a graph's nodes (raised to
the guest's own counts where the guest sends them, docs/protocol.md 12.5). The struct
is private to ggml (ggml-impl.h: the same fields in ggml 0.20 and 0.25), so `CgraphLayout.of`
checks the layout against a graph the loaded build made itself, and answers None where it
does not match (then nothing is written and the graph runs unfused, as before).
"""

from __future__ import annotations

import ctypes
from typing import Dict, Optional

import numpy as np

from apir.codec.constants import APIR_WIRE_USE_COUNT_MAX

__all__ = ["CgraphLayout", "fill_use_counts", "share_use_counts", "source_uses", "tensor_use_counts", "write_hash_set"]


class _HashSet(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t), ("used", ctypes.c_void_p), ("keys", ctypes.c_void_p)]


class _Cgraph(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_int),
        ("n_nodes", ctypes.c_int),
        ("n_leafs", ctypes.c_int),
        ("nodes", ctypes.c_void_p),
        ("grads", ctypes.c_void_p),
        ("grad_accs", ctypes.c_void_p),
        ("leafs", ctypes.c_void_p),
        ("use_counts", ctypes.c_void_p),
        ("visited_hash_set", _HashSet),
    ]


class CgraphLayout:
    """The ggml_cgraph fields `fill_use_counts` writes, checked once per ggml build."""

    _checked: Dict[int, Optional["CgraphLayout"]] = {}

    @classmethod
    def of(cls, g) -> Optional["CgraphLayout"]:
        key = id(g)
        if key not in cls._checked:
            cls._checked[key] = cls() if _probe(g) else None
        return cls._checked[key]


def _view(graph: int) -> _Cgraph:
    return _Cgraph.from_address(graph)


def _slot(h: _HashSet, key: int) -> int:
    """ggml_hash_find: the slot of `key`, or of the free slot where it would go; -1 when full."""
    used = (ctypes.c_uint32 * ((h.size + 31) // 32)).from_address(h.used)
    keys = (ctypes.c_void_p * h.size).from_address(h.keys)
    i = start = (key >> 4) % h.size
    while used[i >> 5] >> (i & 31) & 1 and keys[i] != key:
        i = (i + 1) % h.size
        if i == start:
            return -1
    return i


def _use_count(graph: int, tensor: int) -> int:
    c = _view(graph)
    h = c.visited_hash_set
    i = _slot(h, tensor)
    used = (ctypes.c_uint32 * ((h.size + 31) // 32)).from_address(h.used)
    if i < 0 or not used[i >> 5] >> (i & 31) & 1:
        return 0
    return ctypes.c_int32.from_address(c.use_counts + 4 * i).value


def _probe(g) -> bool:
    """Whether the layout reads what ggml_build_forward_expand wrote: b = a + a, c = b * a."""
    from apir.ggml.functions import InitParams

    ctx = g.ggml_init(InitParams(1 << 20, None, True))
    if not ctx:
        return False
    try:
        a = g.ggml_new_tensor_1d(ctx, 0, 4)  # GGML_TYPE_F32
        b = g.ggml_add(ctx, a, a)
        c = g.ggml_mul(ctx, b, a)
        graph = g.ggml_new_graph_custom(ctx, 8, False)
        g.ggml_build_forward_expand(graph, c)
        view = _view(graph)
        if view.size != g.ggml_graph_size(graph) or view.n_nodes != g.ggml_graph_n_nodes(graph):
            return False
        if ctypes.c_void_p.from_address(view.nodes).value != g.ggml_graph_node(graph, 0):
            return False
        return (_use_count(graph, a), _use_count(graph, b), _use_count(graph, c)) == (3, 1, 0)
    finally:
        g.ggml_free(ctx)


def source_uses(src_index: np.ndarray, n_tensors: int) -> np.ndarray:
    """int32[n_tensors]: how many slots of `src_index` (tensor indices, -1 where none) name
    each tensor index."""
    return np.bincount(src_index[src_index >= 0], minlength=n_tensors).astype(np.int32)


def fill_use_counts(
    g,
    graph: int,
    host_at: np.ndarray,
    node_index: np.ndarray,
    uses: np.ndarray,
    pinned=None,
    write=None,
    guest_counts: Optional[np.ndarray] = None,
) -> bool:
    """Puts the nodes of `graph` (host tensors `host_at[node_index]`) in its hash set with
    their use counts: how many source slots of the graph's tensors name each (`uses`, int32
    by tensor index: `source_uses`), plus one for each tensor index in `pinned` (never fused
    into a consumer: a backend then computes it whole). `guest_counts` (int32 by tensor
    index, the guest's whole-graph counts) raises a node's count to its guest count (at most
    APIR_WIRE_USE_COUNT_MAX), never lowers it: a guest can make the host fuse less, never
    more, than this graph's own links allow. False (nothing written) where the layout of this
    ggml is not known.
    `write`: `write_hash_set`'s accelerated twin (apir.host.graph.kernels.use_counts_kernel),
    same arguments."""
    if CgraphLayout.of(g) is None or not len(node_index):
        return CgraphLayout.of(g) is not None
    view = _view(graph)
    h = view.visited_hash_set
    size = int(h.size)
    if len(node_index) > size:
        return False
    used = np.ctypeslib.as_array((ctypes.c_uint32 * ((size + 31) // 32)).from_address(h.used))
    if used.any():  # (a fresh graph's set is empty: never mix with another's entries)
        return False
    table = np.ctypeslib.as_array((ctypes.c_uint64 * size).from_address(h.keys))
    counts = np.ctypeslib.as_array((ctypes.c_int32 * size).from_address(view.use_counts))
    if pinned is not None and len(pinned):
        uses = uses.copy()  # (the caller's counts stay as they were)
        np.add.at(uses, np.asarray(pinned, np.int64), 1)
    (write or write_hash_set)(
        np.ascontiguousarray(host_at, np.int64).view(np.uint64),  # (the addresses' bits: no copy)
        node_index.astype(np.int64),
        uses,
        used,
        table,
        counts,
    )
    if guest_counts is not None:
        _raise_counts(host_at, node_index, uses, guest_counts, used, table, counts)
    return True


def _raise_counts(host_at, node_index, uses, guest_counts, used, table, counts) -> None:
    """Each node's count in the written hash set (`uses`, by tensor index, as written) raised
    to its guest count (at most APIR_WIRE_USE_COUNT_MAX) where that is higher: few nodes
    (those a later split of the guest's graph reads too), each found by ggml_hash_find's walk."""
    nodes = np.asarray(node_index, np.int64)
    wanted = np.minimum(guest_counts[nodes].astype(np.int64), APIR_WIRE_USE_COUNT_MAX)
    size = len(table)
    for j, count in zip(nodes[wanted > uses[nodes]].tolist(), wanted[wanted > uses[nodes]].tolist()):
        key = int(host_at[j])
        i = (key >> 4) % size
        while int(table[i]) != key:  # (written above: the walk finds it)
            i = (i + 1) % size
        counts[i] = count


def write_hash_set(host_at, node_index, uses, used, table, counts) -> None:
    """Into an empty hash set (bit words `used`, `table` of keys, `counts` per slot): each node
    `host_at[j]` (j of `node_index`) with its count `uses[j]`."""
    keys = host_at[node_index]
    slots = _insert(keys, len(table))
    table[slots] = keys
    counts[slots] = uses[node_index]
    # one bit per slot, the slots distinct: a word's bits add up without a carry
    bits = np.left_shift(np.uint64(1), (slots & 31).astype(np.uint64)).astype(np.float64)
    used |= np.bincount(slots >> 5, weights=bits, minlength=len(used)).astype(np.uint32)


def tensor_use_counts(g, graph: int, tensors: np.ndarray) -> np.ndarray:
    """The use count in cgraph `graph` of each tensor address in `tensors`, as ggml-rpc's
    add_tensor reads it: the count of the tensor's slot in the graph's hash set, 0 for a tensor
    not in it; all 0 where the layout of this ggml is not known. Every key walks from its home
    slot at once, one slot a round, as ggml_hash_find does."""
    out = np.zeros(len(tensors), np.int32)
    view = _view(graph) if CgraphLayout.of(g) is not None else None
    if view is None or not len(tensors) or not view.visited_hash_set.size or not view.use_counts:
        return out
    h = view.visited_hash_set
    size = int(h.size)
    used = np.ctypeslib.as_array((ctypes.c_uint32 * ((size + 31) // 32)).from_address(h.used))
    table = np.ctypeslib.as_array((ctypes.c_uint64 * size).from_address(h.keys))
    counts = np.ctypeslib.as_array((ctypes.c_int32 * size).from_address(view.use_counts))
    keys = np.asarray(tensors, np.uint64)
    pos = ((keys >> np.uint64(4)) % np.uint64(size)).astype(np.int64)
    pending = np.arange(len(keys))
    for _ in range(size):  # (a full table: ggml_hash_find gives up after one turn, so does this)
        if not len(pending):
            break
        at = pos[pending]
        taken = (used[at >> 5] >> (at & 31).astype(np.uint32)) & 1 != 0
        hit = taken & (table[at] == keys[pending])
        out[pending[hit]] = counts[at[hit]]
        pending = pending[taken & ~hit]  # (a free slot: not in the set)
        pos[pending] = (pos[pending] + 1) % size
    return out


def share_use_counts(g, part: int, whole: int) -> bool:
    """Points cgraph `part` (a range of `whole`'s nodes, added with ggml_graph_add_node) at the
    hash set and use counts of `whole`, as ggml_graph_view does: a backend then fuses within
    `part` exactly where the whole graph's counts allow (a node read in a later range keeps
    its count, and is not fused away). False (nothing written) where the layout is not known."""
    if CgraphLayout.of(g) is None:
        return False
    view, of_whole = _view(part), _view(whole)
    view.use_counts = of_whole.use_counts
    view.visited_hash_set = of_whole.visited_hash_set  # (a copy of the struct: size, used, keys)
    return True


def _insert(keys: np.ndarray, size: int) -> np.ndarray:
    """Slots for distinct `keys` in an empty table of `size` (> len(keys)) such that
    ggml_hash_find finds each: every slot from a key's home to its own is taken. Rounds of
    linear probing, all keys at once: a key that finds its slot taken moves on by one."""
    slots = np.full(len(keys), -1, dtype=np.int64)
    taken = np.zeros(size, dtype=bool)
    pos = ((keys >> np.uint64(4)) % np.uint64(size)).astype(np.int64)
    pending = np.arange(len(keys))
    while len(pending):
        at = pos[pending]
        free = ~taken[at]
        # among keys wanting the same free slot, the first one gets it
        cand = pending[free]
        uniq, first = np.unique(pos[cand], return_index=True)
        winners = cand[first]
        slots[winners] = uniq
        taken[uniq] = True
        done = np.zeros(len(keys), dtype=bool)
        done[winners] = True
        pending = pending[~done[pending]]
        pos[pending] = (pos[pending] + (taken[pos[pending]])) % size
    return slots
