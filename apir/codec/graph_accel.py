"""The Numba twins of `apir.codec.graph`'s serialize and parse (imported only when
`apir.accel.enabled()`): the same results and errors, from kernels over raw memory
(`apir.codec._kernels`) that address fields through layout arrays of byte offsets.

`apir.codec.graph` holds the plain code a porter reads; tests/codec holds the twins equal.
"""

from __future__ import annotations

import functools
from typing import Optional

import numpy as np

from apir.codec import _kernels as K
from apir.codec import graph_types as T
from apir.codec.records import GgmlLimits, field_offset, rpc_tensor_dtype

__all__ = ["serialize_graph", "rpc_tensor_from_ggml", "parse_graph"]


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


def _serialize_error(g, code: int, info: np.ndarray) -> ValueError:
    t = int(info[0])
    if code == K.SER_NARROW:
        return T.narrow_error(g, t, "ne" if info[1] == 0 else "nb", int(info[2]), int(info[3]))
    if code == K.SER_UNKNOWN_BUFFER:
        return T.unknown_buffer_error(g, t, int(info[1]))
    if code == K.SER_DATA_NO_BUFFER:
        return T.data_no_buffer_error(g, t, int(info[1]))
    return ValueError(f"graph serialization failed with code {code}")  # pragma: no cover


def _pow2_at_least(n: int) -> int:
    return 1 << max(4, (n - 1).bit_length())


def serialize_graph(g, cgraph_addr: int, buffers: T.BufferTable, out: Optional[np.ndarray], kernel=None) -> np.ndarray:
    """`apir.codec.graph.serialize_graph` (`out` already checked) by `serialize_graph_kernel`:
    the kernel returns SER_OUT_FULL / SER_SET_FULL when its arrays are too small, and is run
    again with double."""
    kernel = kernel or K.serialize_graph_kernel
    tl, rl, lim, rpc = _layout(g.tensor_dtype, g.limits)
    n_nodes = int(g.ggml_graph_n_nodes(cgraph_addr))
    nodes_addr = int(g.ggml_graph_nodes(cgraph_addr) or 0)
    ptrs, handles, bases = buffers.arrays()
    info = np.zeros(4, dtype=np.int64)
    guess = 2 * n_nodes + 16  # tensors per graph: nodes plus their leafs and views
    set_cap = _pow2_at_least(guess)
    out_size = 8 + 8 * n_nodes + rpc.itemsize * guess
    if out is not None:
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


def rpc_tensor_from_ggml(g, tensor_addr: int, buffers: T.BufferTable, kernel=None) -> np.void:
    """`apir.codec.graph.rpc_tensor_from_ggml` by `serialize_tensor_kernel`."""
    kernel = kernel or K.serialize_tensor_kernel
    tl, rl, lim, rpc = _layout(g.tensor_dtype, g.limits)
    ptrs, handles, bases = buffers.arrays()
    info = np.zeros(4, dtype=np.int64)
    out = np.empty(1, dtype=rpc)
    err = kernel(int(tensor_addr), out.ctypes.data, tl, rl, lim, ptrs, handles, bases, info)
    if err != 0:
        raise _serialize_error(g, err, info)
    return out[0]


def _parse_error(code: int, info: np.ndarray) -> T.GraphError:
    i = int(info[0])
    if code == K.PARSE_ZERO_ID:
        return T.zero_id_error(i)
    if code == K.PARSE_DUP_ID:
        return T.dup_id_error(i, int(info[1]))
    if code == K.PARSE_BAD_TYPE:
        return T.bad_type_error(i, int(info[1]))
    if code == K.PARSE_BAD_OP:
        return T.bad_op_error(i, int(info[1]))
    if code == K.PARSE_NAME:
        return T.name_error(i)
    if code == K.PARSE_UNKNOWN_SRC:
        return T.unknown_src_error(i, int(info[1]), int(info[2]))
    if code == K.PARSE_UNKNOWN_VIEW_SRC:
        return T.unknown_view_src_error(i, int(info[1]))
    if code == K.PARSE_UNKNOWN_NODE:
        return T.unknown_node_error(i, int(info[1]))
    if code == K.PARSE_CYCLE:
        return T.cycle_error(i)
    return T.GraphError(f"graph parse failed with code {code}")  # pragma: no cover


def parse_graph(window: T.GraphWindow, limits: GgmlLimits, op_count: int, type_valid, kernel=None) -> T.ParsedGraph:
    """`apir.codec.graph.parse_graph` (counts already checked, `window`) by
    `parse_graph_kernel`, which copies each record just before it checks it: the guest's
    bytes are read once, and checked in cache."""
    n_nodes, n_tensors, need = window.n_nodes, window.n_tensors, window.size
    data = np.empty(need, dtype=np.uint8)  # (the kernel copies the graph into it)
    rl, lim, rpc = _rpc_layout(limits)
    kernel = kernel or K.parse_graph_kernel
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
        window.guest.ctypes.data,
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
    del window  # a kept traceback must not pin the guest's buffer
    if err != 0:
        raise _parse_error(err, info)
    T.write_counts(data, n_nodes, n_tensors)
    node_ids = np.frombuffer(data, dtype="<u8", count=n_nodes, offset=4).copy()
    return T.ParsedGraph(node_ids, tensors, order, node_index, src_index, view_src_index, need)
