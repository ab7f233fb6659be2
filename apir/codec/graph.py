"""Compute graphs on the wire: serialization (guest) and the validating parse (host).

Theory of operation. The guest sends a `ggml_cgraph` as

    u32 n_nodes | u64 node ids[n_nodes] | u32 n_tensors | apir_rpc_tensor[n_tensors]

(the C `apir_serialize_graph`, apir_cs_ggml-rpc-front.cpp; docs/protocol.md section 7). Ids
are the guest's tensor addresses; the tensors are every tensor reachable from the nodes through
src[] and view_src in depth-first post-order (for each node src[0..GGML_MAX_SRC), view_src,
then the tensor itself, each once). Unlike the C, `serialize_graph` zeroes every hole and the
name's tail, and raises instead of truncating. Under the USE_COUNTS extension `write_use_counts`
puts each tensor's use count in its record's `padding` (docs/protocol.md 12.5).

`parse_graph` is the host's: it copies the bytes out of guest-writable shared memory, then
validates the copy (counts against the size, ids non-zero and unique, every referenced id
present, type and op valid, names terminated, no cycles) and returns index arrays the host
builds tensors from in `order` without following any guest address; buffer handles, data
offsets and shapes are the host's to check against its own buffers. This is the plain
reference; with `apir.accel.enabled()` each public function runs its Numba twin
(`apir.codec.graph_accel`): the same bytes, arrays and errors.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Callable, Dict, List, Optional, Set, Tuple

import numpy as np

from apir import accel
from apir.codec import graph_types as T
from apir.codec.graph_types import BufferTable, GraphError, GraphWindow, ParsedGraph, graph_size, graph_window
from apir.codec.records import GGML_0_20_LIMITS, GgmlLimits, field_offset, rpc_tensor_dtype

__all__ = [
    "BufferTable",
    "GraphError",
    "ParsedGraph",
    "serialize_graph",
    "parse_graph",
    "rpc_tensor_from_ggml",
    "graph_size",
    "serialize_graph_plain",
    "rpc_tensor_from_ggml_plain",
    "parse_graph_plain",
    "write_use_counts",
]

_U32_MAX = 0xFFFFFFFF
_U64_MASK = 2**64 - 1


@functools.lru_cache(maxsize=1)
def _accelerated():
    from apir.codec import graph_accel

    return graph_accel


# --- serialization (guest): ggml_cgraph in memory -> wire bytes -------------------------------


def serialize_graph(
    g, cgraph_addr: int, buffers: BufferTable, *, out: Optional[np.ndarray] = None, _kernel=None
) -> np.ndarray:
    """The wire bytes of the ggml_cgraph at `cgraph_addr` (the C `apir_serialize_graph`).

    `g` is the loaded ggml (`apir.ggml.load()`), whose `tensor_dtype` and `limits` give the
    layouts; `buffers` maps each tensor's buffer to its host handle and base. Returns a
    uint8 array of exactly the graph's size; every byte defined (holes zeroed).

    `out` (a 1-D C-contiguous writable uint8 array) is written instead of a fresh array when
    it is large enough; the result is then `out[:size]`. `result.base` is the array written
    either way: a caller serializing graph after graph passes the last one back, since malloc
    may map a fresh array of this size afresh on every call, whose pages then fault in again.

    Raises ValueError when a tensor's ne/nb do not fit u32, when a tensor's buffer is not in
    `buffers`, or when a tensor has data but no buffer. The cgraph and its tensors must be
    live in this process (the guest's own ggml context): they are read at raw addresses."""
    if out is not None:
        if out.dtype != np.uint8 or out.ndim != 1 or not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError("out must be a 1-D C-contiguous writable uint8 array")
    if _kernel is not None or accel.enabled():
        return _accelerated().serialize_graph(g, cgraph_addr, buffers, out, _kernel)
    return serialize_graph_plain(g, cgraph_addr, buffers, out=out)


def write_use_counts(graph: np.ndarray, limits: GgmlLimits, counts_of: Callable[[np.ndarray], np.ndarray]) -> None:
    """The USE_COUNTS extension (docs/protocol.md 12.5): each record's `padding` in serialized
    `graph` (as `serialize_graph` gives it) set to the int32 little-endian use count that
    `counts_of` gives for the records' tensor ids (the guest's tensor addresses), in order."""
    n_nodes = int(graph[:4].view("<u4")[0])
    at = 8 + 8 * n_nodes
    dt = rpc_tensor_dtype(limits)
    n = int(graph[at - 4 : at].view("<u4")[0])
    rows = graph[at : at + n * dt.itemsize].reshape(n, dt.itemsize)
    id_at, pad = field_offset(dt, "id"), field_offset(dt, "padding")
    ids = rows[:, id_at : id_at + 8].copy().view("<u8").reshape(n)
    rows[:, pad : pad + 4] = np.asarray(counts_of(ids), "<i4").reshape(n, 1).view(np.uint8)


def _read_tensor(address: int, tensor_dtype: np.dtype) -> np.void:
    """A copy of the ggml_tensor struct at `address`, as a record of `tensor_dtype`."""
    return np.frombuffer(ctypes.string_at(address, tensor_dtype.itemsize), dtype=tensor_dtype)[0]


def _sources(tensor: np.void) -> List[int]:
    """src[0..GGML_MAX_SRC), then view_src: the order `apir_add_tensor` visits them in."""
    return [int(s) for s in tensor["src"]] + [int(tensor["view_src"])]


def _add_tensor(root: int, tensor_dtype: np.dtype, visited: Set[int], tensors: List[Tuple[int, np.void]]) -> None:
    """The C `apir_add_tensor`: appends to `tensors` every tensor reachable from `root` that is
    not in `visited` yet, each after its sources, as (address, struct). The C's recursion,
    kept on a list: a chain of sources may run deeper than Python's recursion limit."""
    if root == 0 or root in visited:
        return
    visited.add(root)
    struct = _read_tensor(root, tensor_dtype)
    path = [(root, struct, iter(_sources(struct)))]  # the tensors being visited, innermost last
    while path:
        address, struct, pending = path[-1]
        source = next((s for s in pending if s != 0 and s not in visited), 0)
        if source:
            visited.add(source)
            source_struct = _read_tensor(source, tensor_dtype)
            path.append((source, source_struct, iter(_sources(source_struct))))
        else:
            path.pop()
            tensors.append((address, struct))


def _serialize_tensor(g, address: int, tensor: np.void, buffers: BufferTable, record: np.void) -> None:
    """The C `apir_serialize_tensor`: fills `record` (zeroed) from the ggml_tensor `tensor`
    (its struct) at `address`. Raises ValueError as `serialize_graph`."""
    record["id"] = address
    record["type"] = tensor["type"]
    base = 0
    buffer = int(tensor["buffer"])
    if buffer:
        entry = buffers.lookup(buffer)
        if entry is None:
            raise T.unknown_buffer_error(g, address, buffer)
        record["buffer"], base = entry
    for dim, (ne, nb) in enumerate(zip(tensor["ne"].tolist(), tensor["nb"].tolist())):
        if not 0 <= ne <= _U32_MAX:
            raise T.narrow_error(g, address, "ne", dim, ne)
        if nb > _U32_MAX:
            raise T.narrow_error(g, address, "nb", dim, nb)
    record["ne"] = tensor["ne"]
    record["nb"] = tensor["nb"]
    record["op"] = tensor["op"]
    record["op_params"] = tensor["op_params"]
    record["flags"] = tensor["flags"]
    record["src"] = tensor["src"]
    record["view_src"] = tensor["view_src"]
    record["view_offs"] = tensor["view_offs"]
    data = int(tensor["data"])
    if data:
        if not buffer:
            raise T.data_no_buffer_error(g, address, data)
        data = (data - base) & _U64_MASK  # an offset from the buffer's base
    record["data"] = data
    # snprintf(name, GGML_MAX_NAME, "%s", tensor->name): up to the NUL, at most max - 1 bytes
    max_name = len(record["name"])
    name = tensor["name"].tobytes().split(b"\0", 1)[0][: max_name - 1]
    record["name"] = np.frombuffer(name.ljust(max_name, b"\0"), dtype="S1")


def serialize_graph_plain(g, cgraph_addr: int, buffers: BufferTable, *, out: Optional[np.ndarray] = None) -> np.ndarray:
    """`serialize_graph` in plain Python (`out`, when given, already checked)."""
    n_nodes = int(g.ggml_graph_n_nodes(cgraph_addr))
    nodes = np.frombuffer(ctypes.string_at(g.ggml_graph_nodes(cgraph_addr), 8 * n_nodes) if n_nodes else b"", "<u8")
    visited: Set[int] = set()
    tensors: List[Tuple[int, np.void]] = []
    for node in nodes.tolist():
        _add_tensor(node, g.tensor_dtype, visited, tensors)
    records = np.zeros(len(tensors), dtype=rpc_tensor_dtype(g.limits))
    for record, (address, tensor) in zip(records, tensors):
        _serialize_tensor(g, address, tensor, buffers, record)

    size = graph_size(n_nodes, len(tensors), g.limits)
    if out is None or len(out) < size:
        out = np.empty(size, dtype=np.uint8)
    graph = out[:size]
    graph[0:4] = np.array([n_nodes], dtype="<u4").view(np.uint8)
    graph[4 : 4 + 8 * n_nodes] = nodes.view(np.uint8)
    graph[4 + 8 * n_nodes : 8 + 8 * n_nodes] = np.array([len(tensors)], dtype="<u4").view(np.uint8)
    graph[8 + 8 * n_nodes :] = records.view(np.uint8)
    return graph


def rpc_tensor_from_ggml(g, tensor_addr: int, buffers: BufferTable, *, _kernel=None) -> np.void:
    """The apir_rpc_tensor record of the ggml_tensor at `tensor_addr` (the C
    `apir_serialize_tensor`), holes zeroed. Raises ValueError as `serialize_graph`."""
    if _kernel is not None or accel.enabled():
        return _accelerated().rpc_tensor_from_ggml(g, tensor_addr, buffers, _kernel)
    return rpc_tensor_from_ggml_plain(g, tensor_addr, buffers)


def rpc_tensor_from_ggml_plain(g, tensor_addr: int, buffers: BufferTable) -> np.void:
    """`rpc_tensor_from_ggml` in plain Python."""
    record = np.zeros(1, dtype=rpc_tensor_dtype(g.limits))
    address = int(tensor_addr)
    _serialize_tensor(g, address, _read_tensor(address, g.tensor_dtype), buffers, record[0])
    return record[0]


# --- validating parse (host): wire bytes -> indices ------------------------------------------


def parse_graph(
    buf,
    start: int = 0,
    end: Optional[int] = None,
    *,
    limits: GgmlLimits = GGML_0_20_LIMITS,
    op_count: int,
    type_valid: np.ndarray,
    _kernel=None,
) -> ParsedGraph:
    """Validates the graph in ``buf[start:end]`` (any readable buffer; typically the guest's
    shared memory) and returns a `ParsedGraph`. The host's side of `apir_decode_ggml_cgraph`.

    The bytes are checked in a private copy, so a guest writing to the buffer meanwhile
    cannot change what was checked; only the bytes the graph's counts claim are copied (the
    counts used are written back into the copy), so a small graph in a large window costs what
    the graph does. `op_count` is GGML_OP_COUNT; `type_valid` a bool array indexed by type,
    False for removed types (`apir.ggml.lib.Ggml.valid_types`). Raises GraphError naming the
    first problem found."""
    if _kernel is None and not accel.enabled():
        return parse_graph_plain(buf, start, end, limits=limits, op_count=op_count, type_valid=type_valid)
    window = graph_window(buf, start, end, limits)
    try:
        return _accelerated().parse_graph(window, limits, op_count, type_valid, _kernel)
    finally:
        del window  # a kept traceback must not pin the guest's buffer (an mmap could not close)


def parse_graph_plain(
    buf,
    start: int = 0,
    end: Optional[int] = None,
    *,
    limits: GgmlLimits = GGML_0_20_LIMITS,
    op_count: int,
    type_valid: np.ndarray,
) -> ParsedGraph:
    """`parse_graph` in plain Python."""
    window = graph_window(buf, start, end, limits)
    try:
        return _parse_window(window, limits, op_count, type_valid)
    finally:
        del window


def _parse_window(window: GraphWindow, limits: GgmlLimits, op_count: int, type_valid: np.ndarray) -> ParsedGraph:
    n_nodes, n_tensors = window.n_nodes, window.n_tensors
    data = window.guest.copy()  # the host's private copy: everything below reads only it
    del window
    T.write_counts(data, n_nodes, n_tensors)
    node_ids = data[4 : 4 + 8 * n_nodes].view("<u8").copy()
    tensors = np.frombuffer(data, dtype=rpc_tensor_dtype(limits), count=n_tensors, offset=8 + 8 * n_nodes)

    # Each record on its own: id non-zero and unique, type and op valid, name terminated.
    index: Dict[int, int] = {}  # id -> the record's index
    names = tensors["name"]
    for i, (tid, type_, op) in enumerate(zip(tensors["id"].tolist(), tensors["type"].tolist(), tensors["op"].tolist())):
        if tid == 0:
            raise T.zero_id_error(i)
        if tid in index:
            raise T.dup_id_error(i, tid)
        index[tid] = i
        if type_ >= len(type_valid) or not type_valid[type_]:
            raise T.bad_type_error(i, type_)
        if op >= op_count:
            raise T.bad_op_error(i, op)
        if b"\0" not in names[i].tobytes():
            raise T.name_error(i)

    # Every src and view_src id among the records (a source may come after its user).
    src_index = np.full((n_tensors, limits.max_src), -1, dtype=np.int32)
    view_src_index = np.full(n_tensors, -1, dtype=np.int32)
    for i, (srcs, vid) in enumerate(zip(tensors["src"].tolist(), tensors["view_src"].tolist())):
        for slot, sid in enumerate(srcs):
            if sid:
                if sid not in index:
                    raise T.unknown_src_error(i, slot, sid)
                src_index[i, slot] = index[sid]
        if vid:
            if vid not in index:
                raise T.unknown_view_src_error(i, vid)
            view_src_index[i] = index[vid]
    node_index = np.empty(n_nodes, dtype=np.int32)
    for i, nid in enumerate(node_ids.tolist()):
        if nid not in index:  # (0 never is)
            raise T.unknown_node_error(i, nid)
        node_index[i] = index[nid]

    order = np.array(_sources_first(src_index, view_src_index), dtype=np.int32)
    return ParsedGraph(node_ids, tensors, order, node_index, src_index, view_src_index, len(data))


def _sources_first(src_index: np.ndarray, view_src_index: np.ndarray) -> List[int]:
    """The tensors' indices, each after its srcs and view_src; GraphError on a cycle. The
    records' own order when it already is (the C lists sources first), else a depth-first
    post-order from each tensor in turn, sources visited in slot order, then view_src."""
    n = len(view_src_index)
    own = np.arange(n)[:, None]
    if (src_index < own).all() and (view_src_index < own[:, 0]).all():  # (-1: no source)
        return list(range(n))
    sources = [[s for s in srcs + [v] if s >= 0] for srcs, v in zip(src_index.tolist(), view_src_index.tolist())]
    NEW, ON_PATH, DONE = 0, 1, 2
    state = [NEW] * n
    order: List[int] = []
    for root in range(n):
        if state[root] != NEW:
            continue
        state[root] = ON_PATH
        path = [(root, iter(sources[root]))]
        while path:
            t, pending = path[-1]
            for s in pending:
                if state[s] == ON_PATH:
                    raise T.cycle_error(t)
                if state[s] == NEW:
                    state[s] = ON_PATH
                    path.append((s, iter(sources[s])))
                    break
            else:
                state[t] = DONE
                order.append(t)
                path.pop()
    return order
