"""Compute graphs on the wire: serialization (guest) and the validating parse (host).

Theory of operation. The guest sends a `ggml_cgraph` as

    u32 n_nodes | u64 node ids[n_nodes] | u32 n_tensors | apir_rpc_tensor[n_tensors]

(the C `apir_serialize_graph`, apir_cs_ggml-rpc-front.cpp). Ids are the guest's tensor
addresses. The tensors are every tensor reachable from the nodes through src[] and
view_src, in depth-first post-order: for each node, src[0..GGML_MAX_SRC) first, then
view_src, then the tensor itself, each tensor once. Each record holds ne/nb narrowed to u32,
the buffer as the host's handle, and data as an offset from the buffer's base.

`serialize_graph` walks ggml's structs in place (a Numba kernel over raw addresses, see
`_kernels`); it needs the guest's `BufferTable` (buffer pointer -> host handle, base). Unlike
the C it zeroes every hole and the name's tail, and it raises instead of truncating ne/nb.

`parse_graph` is the host's: the bytes come from guest-writable shared memory, so it copies
them first and then validates the copy (counts against the size, ids non-zero and unique,
every referenced id present, type and op valid, names terminated, no cycles). It returns index
arrays the host can build tensors from in `order` without following any guest address.
Buffer handles, data offsets and shapes are the host's to check against its own buffers.
"""

from __future__ import annotations

import functools
import struct
import threading
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from apir.codec import _kernels as K
from apir.codec.records import GGML_0_20_LIMITS, GgmlLimits, field_offset, rpc_tensor_dtype
from apir.errors import ApirError

__all__ = [
    "BufferTable",
    "GraphError",
    "ParsedGraph",
    "serialize_graph",
    "parse_graph",
    "rpc_tensor_from_ggml",
    "graph_size",
]

_U32 = struct.Struct("<I")


class GraphError(ApirError, ValueError):
    """A serialized graph is malformed or hostile; the message says what is wrong."""


class BufferTable:
    """The guest's map of its remote buffers: `ggml_backend_buffer_t` pointer (int) ->
    (host handle u64, base address int). The C guest keeps both in the buffer's context
    (`ggml_backend_remoting_buffer_context`); apir keeps them here for the serializer.

    Thread-safe: `arrays()` returns a consistent snapshot (sorted pointers, handles, bases,
    all int64) that stays valid while other threads register or unregister."""

    def __init__(self):
        self._lock = threading.Lock()
        self._entries: dict[int, Tuple[int, int]] = {}
        self._arrays = self._build()

    def _build(self):
        ptrs = sorted(self._entries)
        handles = np.array([self._entries[p][0] for p in ptrs], dtype=np.uint64).view(np.int64)
        bases = np.array([self._entries[p][1] for p in ptrs], dtype=np.uint64).view(np.int64)
        return np.array(ptrs, dtype=np.uint64).view(np.int64), handles, bases

    def register(self, buffer_ptr: int, handle: int, base: int) -> None:
        """Adds or replaces the entry of `buffer_ptr` (non-zero)."""
        if not buffer_ptr:
            raise ValueError("buffer pointer must be non-zero")
        with self._lock:
            self._entries[int(buffer_ptr)] = (int(handle), int(base))
            self._arrays = self._build()

    def unregister(self, buffer_ptr: int) -> bool:
        """Removes `buffer_ptr`; returns whether it was registered."""
        with self._lock:
            if self._entries.pop(int(buffer_ptr), None) is None:
                return False
            self._arrays = self._build()
            return True

    def lookup(self, buffer_ptr: int) -> Optional[Tuple[int, int]]:
        """(handle, base) of `buffer_ptr`, or None."""
        return self._entries.get(int(buffer_ptr))

    def arrays(self) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(pointers sorted, handles, bases) as int64 arrays, for the kernels."""
        return self._arrays

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, buffer_ptr) -> bool:
        return int(buffer_ptr) in self._entries


@functools.lru_cache(maxsize=8)
def _rpc_layout(limits: GgmlLimits):
    """(rl, lim, rpc dtype): the kernels' apir_rpc_tensor offsets and ggml sizes."""
    rpc = rpc_tensor_dtype(limits)
    rl = np.array([field_offset(rpc, f) for f in K.RL_FIELDS] + [rpc.itemsize], dtype=np.int64)
    lim = np.array([limits.max_dims, limits.max_src, limits.max_op_params // 4, limits.max_name], dtype=np.int64)
    return rl, lim, rpc


@functools.lru_cache(maxsize=8)
def _layout(tensor_dtype: np.dtype, limits: GgmlLimits):
    """(tl, rl, lim, rpc dtype): adds the ggml_tensor offsets of one ggml build."""
    tl = np.array([field_offset(tensor_dtype, f) for f in K.TL_FIELDS], dtype=np.int64)
    return (tl,) + _rpc_layout(limits)


def _tensor_desc(g, addr: int) -> str:
    try:
        name = g.ggml_get_name(addr)
        name = name.decode(errors="replace") if name else ""
    except Exception:  # pragma: no cover - a build without ggml_get_name
        name = "?"
    return f"tensor {addr:#x} ({name!r})"


def _serialize_error(g, code: int, info: np.ndarray) -> ValueError:
    t = int(info[0])
    if code == K.SER_NARROW:
        field = "ne" if info[1] == 0 else "nb"
        return ValueError(
            f"{_tensor_desc(g, t)}: {field}[{int(info[2])}] = {int(info[3]) & (2**64 - 1)} does not fit the wire's u32"
        )
    if code == K.SER_UNKNOWN_BUFFER:
        return ValueError(
            f"{_tensor_desc(g, t)}: buffer {int(info[1]) & (2**64 - 1):#x} is not a registered remote buffer"
        )
    if code == K.SER_DATA_NO_BUFFER:
        return ValueError(f"{_tensor_desc(g, t)}: has data {int(info[1]) & (2**64 - 1):#x} but no buffer")
    return ValueError(f"graph serialization failed with code {code}")  # pragma: no cover


def _pow2_at_least(n: int) -> int:
    return 1 << max(4, (n - 1).bit_length())


def serialize_graph(
    g, cgraph_addr: int, buffers: BufferTable, *, out: Optional[np.ndarray] = None, _kernel=None
) -> np.ndarray:
    """The wire bytes of the ggml_cgraph at `cgraph_addr` (the C `apir_serialize_graph`).

    `g` is the loaded ggml (`apir.ggml.load()`), whose `tensor_dtype` and `limits` give the
    layouts; `buffers` maps each tensor's buffer to its host handle and base. Returns a
    uint8 array of exactly the graph's size; every byte defined (holes zeroed).

    `out` (a 1-D C-contiguous writable uint8 array) is written instead of a fresh array when
    it is at least as large as the fresh one would be and the graph fits; the result is then
    `out[:size]`. `result.base` is the array written either way: a caller serializing graph
    after graph passes the last one back, since malloc may map a fresh array of this size
    afresh on every call, whose pages then fault in again (seen for a 1,000-node graph: 130
    page faults per call, 4x the time of the call without them).

    Raises ValueError when a tensor's ne/nb do not fit u32, when a tensor's buffer is not in
    `buffers`, or when a tensor has data but no buffer. The cgraph and its tensors must be
    live in this process (the guest's own ggml context): they are read at raw addresses."""
    kernel = _kernel or K.serialize_graph_kernel
    tl, rl, lim, rpc = _layout(g.tensor_dtype, g.limits)
    n_nodes = int(g.ggml_graph_n_nodes(cgraph_addr))
    nodes_addr = int(g.ggml_graph_nodes(cgraph_addr) or 0)
    ptrs, handles, bases = buffers.arrays()
    info = np.zeros(4, dtype=np.int64)
    guess = 2 * n_nodes + 16  # tensors per graph: nodes plus their leafs and views
    set_cap = _pow2_at_least(guess)
    out_size = 8 + 8 * n_nodes + rpc.itemsize * guess
    if out is not None:
        if out.dtype != np.uint8 or out.ndim != 1 or not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError("out must be a 1-D C-contiguous writable uint8 array")
        out_size = max(out_size, len(out))
    while True:
        if out is None or len(out) < out_size:
            out = np.empty(out_size, dtype=np.uint8)
        keys = np.zeros(set_cap, dtype=np.int64)
        stack_t = np.empty(set_cap, dtype=np.int64)
        stack_k = np.empty(set_cap, dtype=np.int64)
        n = kernel(
            nodes_addr,
            n_nodes,
            tl,
            rl,
            lim,
            ptrs,
            handles,
            bases,
            out.ctypes.data,
            out_size,
            keys,
            stack_t,
            stack_k,
            info,
        )
        if n >= 0:
            return out[:n]
        if n == K.SER_OUT_FULL:
            out_size = 8 + 8 * n_nodes + 2 * (out_size - 8 - 8 * n_nodes)
        elif n == K.SER_SET_FULL:
            set_cap *= 2
        else:
            raise _serialize_error(g, n, info)


def rpc_tensor_from_ggml(g, tensor_addr: int, buffers: BufferTable, *, _kernel=None) -> np.void:
    """The apir_rpc_tensor record of the ggml_tensor at `tensor_addr` (the C
    `apir_serialize_tensor`), holes zeroed. Raises ValueError as `serialize_graph`."""
    kernel = _kernel or K.serialize_tensor_kernel
    tl, rl, lim, rpc = _layout(g.tensor_dtype, g.limits)
    ptrs, handles, bases = buffers.arrays()
    info = np.zeros(4, dtype=np.int64)
    out = np.empty(1, dtype=rpc)
    err = kernel(int(tensor_addr), out.ctypes.data, tl, rl, lim, ptrs, handles, bases, info)
    if err != 0:
        raise _serialize_error(g, err, info)
    return out[0]


def graph_size(n_nodes: int, n_tensors: int, limits: GgmlLimits = GGML_0_20_LIMITS) -> int:
    """Bytes of a serialized graph with these counts."""
    return 8 + 8 * n_nodes + rpc_tensor_dtype(limits).itemsize * n_tensors


@dataclass(frozen=True)
class ParsedGraph:
    """A validated graph (host side). Every array is the host's own copy.

    node_ids        u64[n_nodes]     the graph's nodes, in order (guest ids)
    tensors         rpc[n_tensors]   the apir_rpc_tensor records (`rpc_tensor_dtype(limits)`)
    order           int32[n_tensors] indices into `tensors`, each after its srcs and view_src
    node_index      int32[n_nodes]   index into `tensors` of each node
    src_index       int32[n_tensors, max_src]  index of each src, -1 where none
    view_src_index  int32[n_tensors] index of the view source, -1 where none
    size            bytes the graph occupies (trailing bytes after it are ignored, as the C)
    """

    node_ids: np.ndarray
    tensors: np.ndarray
    order: np.ndarray
    node_index: np.ndarray
    src_index: np.ndarray
    view_src_index: np.ndarray
    size: int

    @property
    def n_nodes(self) -> int:
        return len(self.node_ids)

    @property
    def n_tensors(self) -> int:
        return len(self.tensors)


def _parse_error(code: int, info: np.ndarray, tensors: np.ndarray) -> GraphError:
    i = int(info[0])
    u = lambda v: int(v) & (2**64 - 1)  # noqa: E731 - ids travel as u64, the kernel holds int64
    if code == K.PARSE_ZERO_ID:
        return GraphError(f"tensor {i}: id is 0")
    if code == K.PARSE_DUP_ID:
        return GraphError(f"tensor {i}: id {u(info[1]):#x} appears twice")
    if code == K.PARSE_BAD_TYPE:
        return GraphError(f"tensor {i}: type {int(info[1])} is not a ggml type of this build")
    if code == K.PARSE_BAD_OP:
        return GraphError(f"tensor {i}: op {int(info[1])} is out of range")
    if code == K.PARSE_NAME:
        return GraphError(f"tensor {i}: name is not NUL-terminated")
    if code == K.PARSE_UNKNOWN_SRC:
        return GraphError(f"tensor {i}: src[{int(info[1])}] = {u(info[2]):#x} is not among the tensors")
    if code == K.PARSE_UNKNOWN_VIEW_SRC:
        return GraphError(f"tensor {i}: view_src {u(info[1]):#x} is not among the tensors")
    if code == K.PARSE_UNKNOWN_NODE:
        return GraphError(f"node {i}: id {u(info[1]):#x} is not among the tensors")
    if code == K.PARSE_CYCLE:
        return GraphError(f"tensor {i}: its sources form a cycle")
    return GraphError(f"graph parse failed with code {code}")  # pragma: no cover


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

    The bytes are checked in a private copy (the kernel copies each record just before it
    checks it), so a guest writing to the buffer meanwhile cannot change what was checked;
    only the bytes the graph's counts claim are copied (the counts used are written back into
    the copy), so a small graph in a large window costs what the graph does.
    `op_count` is GGML_OP_COUNT; `type_valid` a bool array indexed by type, False for removed
    types (`apir.ggml.lib.Ggml.valid_types`). Raises GraphError naming the first problem found."""
    view = memoryview(buf)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    total = len(view)
    if end is None:
        end = total
    if not 0 <= start <= end <= total:
        raise GraphError(f"graph window [{start}, {end}) outside a {total}-byte buffer")
    size = end - start
    rpc = rpc_tensor_dtype(limits)
    if size < 4:
        raise GraphError(f"graph of {size} bytes: no room for n_nodes")
    n_nodes = _U32.unpack(view[start : start + 4])[0]
    need = 4 + 8 * n_nodes + 4
    if need > size:
        raise GraphError(f"n_nodes = {n_nodes} needs {need} bytes, the graph has {size}")
    n_tensors = _U32.unpack(view[start + need - 4 : start + need])[0]
    need += rpc.itemsize * n_tensors
    if need > size:
        raise GraphError(f"n_tensors = {n_tensors} needs {need} bytes, the graph has {size}")
    guest = np.frombuffer(view, dtype=np.uint8, count=need, offset=start)
    data = np.empty(need, dtype=np.uint8)  # (the kernel copies the graph into it)
    rl, lim, _ = _rpc_layout(limits)
    kernel = _kernel or K.parse_graph_kernel
    cap = _pow2_at_least(2 * n_tensors)
    node_index = np.empty(n_nodes, dtype=np.int32)
    src_index = np.empty((n_tensors, limits.max_src), dtype=np.int32)
    view_src_index = np.empty(n_tensors, dtype=np.int32)
    order = np.empty(n_tensors, dtype=np.int32)
    map_keys = np.zeros(cap, dtype=np.int64)
    map_vals = np.empty(cap, dtype=np.int32)
    state = np.zeros(n_tensors, dtype=np.int8)
    stack_t = np.empty(n_tensors, dtype=np.int32)
    stack_k = np.empty(n_tensors, dtype=np.int32)
    info = np.zeros(4, dtype=np.int64)
    type_valid = np.ascontiguousarray(type_valid, dtype=np.bool_)
    tensors = np.frombuffer(data, dtype=rpc, count=n_tensors, offset=8 + 8 * n_nodes)
    err = kernel(
        guest.ctypes.data,
        data.ctypes.data,
        n_nodes,
        n_tensors,
        rl,
        lim,
        int(op_count),
        type_valid,
        node_index,
        src_index,
        view_src_index,
        order,
        map_keys,
        map_vals,
        state,
        stack_t,
        stack_k,
        info,
        K.TABLE_KEY,
    )
    del guest, view
    if err != 0:
        raise _parse_error(err, info, tensors)
    # The guest may have rewritten a count since it was read: the copy holds the ones used.
    _U32.pack_into(data.data, 0, n_nodes)
    _U32.pack_into(data.data, 4 + 8 * n_nodes, n_tensors)
    node_ids = np.frombuffer(data, dtype="<u8", count=n_nodes, offset=4).copy()
    return ParsedGraph(node_ids, tensors, order, node_index, src_index, view_src_index, need)
