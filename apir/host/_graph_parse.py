"""A plain-Python validating parse of the serialized cgraph (host side).

Theory of operation: stand-in for `apir.codec.graph.parse_graph` (same signature and
result) until the codec's lands on main; then this module goes. The wire
(`apir_serialize_graph`):

    u32 n_nodes | u64 node ids[n_nodes] | u32 n_tensors | apir_rpc_tensor[n_tensors]

Checks, each raising GraphError: the counts match the byte length exactly; tensor ids are
non-zero and unique; every node id, src id and view_src id names a tensor of the graph;
node ids are unique; type is valid (`type_valid[type]`) and op below `op_count`; names are
NUL-terminated; the src/view_src relation has no cycle. `order` lists tensor indices with
every tensor after its sources and view source.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from apir.codec.records import GgmlLimits, rpc_tensor_dtype

__all__ = ["GraphError", "ParsedGraph", "parse_graph"]


class GraphError(ValueError):
    """The serialized graph is malformed or hostile; the message says how."""


@dataclass
class ParsedGraph:
    node_ids: np.ndarray  # u64[n_nodes]
    tensors: np.ndarray  # rpc tensor records (a copy), [n_tensors]
    order: np.ndarray  # int32 tensor indices, sources first
    node_index: np.ndarray  # int32[n_nodes]: tensor index of each node
    src_index: np.ndarray  # int32[n_tensors, max_src], -1 for none
    view_src_index: np.ndarray  # int32[n_tensors], -1 for none


def parse_graph(buf, start: int, end: int, *, limits: GgmlLimits, op_count: int,
                type_valid: Sequence[bool]) -> ParsedGraph:
    """Parses and checks the graph in ``buf[start:end]``. Raises GraphError."""
    view = memoryview(buf).cast("B")[start:end]
    size = len(view)
    dtype = rpc_tensor_dtype(limits)
    if size < 4:
        raise GraphError("graph shorter than its node count")
    (n_nodes,) = struct.unpack_from("<I", view, 0)
    off = 4 + 8 * n_nodes
    if off + 4 > size:
        raise GraphError(f"{n_nodes} nodes do not fit {size} bytes")
    node_ids = np.frombuffer(view, dtype="<u8", count=n_nodes, offset=4).copy()
    (n_tensors,) = struct.unpack_from("<I", view, off)
    off += 4
    if off + n_tensors * dtype.itemsize != size:
        raise GraphError(f"{n_nodes} nodes and {n_tensors} tensors need "
                         f"{off + n_tensors * dtype.itemsize} bytes, the graph has {size}")
    tensors = np.frombuffer(view, dtype=dtype, count=n_tensors, offset=off).copy()

    ids = tensors["id"]
    if n_tensors and (ids == 0).any():
        raise GraphError("tensor id 0")
    index = {int(t): i for i, t in enumerate(ids)}
    if len(index) != n_tensors:
        raise GraphError("duplicate tensor ids")
    types, ops = tensors["type"], tensors["op"]
    valid = np.asarray(type_valid, dtype=bool)
    for i in range(n_tensors):
        t = int(types[i])
        if t >= len(valid) or not valid[t]:
            raise GraphError(f"tensor {i}: type {t} invalid")
        if int(ops[i]) >= op_count:
            raise GraphError(f"tensor {i}: op {int(ops[i])} >= GGML_OP_COUNT {op_count}")
        if b"\0" not in bytes(tensors["name"][i]):
            raise GraphError(f"tensor {i}: name not NUL-terminated")

    def lookup(tid: int, what: str) -> int:
        j = index.get(tid)
        if j is None:
            raise GraphError(f"{what}: id 0x{tid:x} is not a tensor of the graph")
        return j

    src_index = np.full((n_tensors, limits.max_src), -1, dtype=np.int32)
    view_src_index = np.full(n_tensors, -1, dtype=np.int32)
    for i in range(n_tensors):
        for k in range(limits.max_src):
            sid = int(tensors["src"][i][k])
            if sid:
                src_index[i, k] = lookup(sid, f"tensor {i} src[{k}]")
        vid = int(tensors["view_src"][i])
        if vid:
            view_src_index[i] = lookup(vid, f"tensor {i} view_src")
    node_index = np.array([lookup(int(n), f"node {k}") for k, n in enumerate(node_ids)], dtype=np.int32)
    if len(set(node_index.tolist())) != n_nodes:
        raise GraphError("a node is listed twice")

    # Depth-first topological order with an explicit stack (no recursion limit); a tensor met
    # again while still on the stack closes a cycle.
    state = np.zeros(n_tensors, dtype=np.int8)  # 0 new, 1 on stack, 2 done
    order = []
    for root in range(n_tensors):
        if state[root]:
            continue
        stack = [(root, 0)]
        state[root] = 1
        while stack:
            i, k = stack.pop()
            deps = [d for d in src_index[i] if d >= 0] + ([view_src_index[i]] if view_src_index[i] >= 0 else [])
            if k < len(deps):
                stack.append((i, k + 1))
                d = int(deps[k])
                if state[d] == 1:
                    raise GraphError(f"cycle through tensor {d}")
                if state[d] == 0:
                    state[d] = 1
                    stack.append((d, 0))
            else:
                state[i] = 2
                order.append(i)
    return ParsedGraph(node_ids, tensors, np.array(order, dtype=np.int32), node_index, src_index, view_src_index)
