"""The host-side graph builder: a checked `ggml_cgraph` from a parsed wire graph.

Theory of operation: `apir.codec.graph.parse_graph` has already checked the wire's counts,
ids, types, ops, names and acyclicity. Here a node listed twice is refused, every tensor record is checked against this context
(`TensorChecker.check_rpc`: a known buffer, data + extent inside it, no custom op), each
view against its source (same buffer, `data == source data + view_offs`, its extent inside
the source's), every tensor of the graph must have data (a kernel writes through it), and
each node's shape goes through `apir.host.shapes.check_node`, then what rules ask of the whole
graph (`_check_graph_needs`: row ids read before compute are written by no node; kernels
safe only on one thread are in a one-thread graph). Only then are tensors created
in a host `ggml_context` (no data allocated: `data` points into the checked buffers), in
sources-first order (row ids pointed at the copy their rule checked), and the nodes added to
a graph in the guest's node order.

Errors: `Refused` (with the tensor or node index) for anything the checks reject.
"""

from __future__ import annotations

import ctypes
from typing import List, Optional

from apir.ggml.layout import tensor_record
from apir.host.errors import Refused
from apir.host.shapes import OpEnums, TensorInfo, check_node, op_enums
from apir.host.tensors import Scratch

__all__ = ["build_graph", "tensor_info", "lib_op_enums"]


def tensor_info(lib, index: int, rec, address: Optional[int]) -> TensorInfo:
    """The `TensorInfo` the shape rules see of tensor record `rec` (an rpc record or a
    `ggml_tensor`: both have type, op, ne, nb and op_params) of the dispatcher `lib`."""
    g, chk = lib.g, lib.checker
    type_, op = int(rec["type"]), int(rec["op"])
    return TensorInfo(
        index=index, type_name=g.type_names[type_], ne=[int(x) for x in rec["ne"]],
        nb=[int(x) for x in rec["nb"]], op_name=g.op_names[op], op_params=rec["op_params"].copy(),
        type_size=chk.type_size[type_], blck_size=chk.blck_size[type_],
        is_leaf=op == g.ops["NONE"], address=address)


def lib_op_enums(lib) -> OpEnums:
    """`op_enums` of the dispatcher's ggml, computed once per dispatcher."""
    enums = getattr(lib, "_op_enums", None)
    if enums is None:
        enums = lib._op_enums = op_enums(lib.g)
    return enums


# Ops the CPU does not compute (ggml_op_is_empty): their nodes write nothing.
_EMPTY_OPS = frozenset(("NONE", "RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE"))
# Ops ggml-cpu's ggml_get_n_tasks gives 1 task (ggml 0.10 and 0.20): a graph of only these
# runs on one thread (cplan.n_threads = the most tasks of any node).
_ONE_TASK_OPS = _EMPTY_OPS | {"GET_ROWS", "SET_ROWS", "GET_ROWS_BACK"}


def _check_graph_needs(g, parsed, infos, bufs, offsets, extents) -> None:
    """What rules asked of the whole graph: row ids they read before compute are not written
    by any node (a node's own result, or the sources an OPT_STEP_* updates in place), and a
    kernel that is only safe on one thread is in a graph that the CPU runs on one thread."""
    nodes = [int(j) for j in parsed.node_index]
    if any(info.one_thread for info in infos):
        many = [j for j in nodes if infos[j].op_name not in _ONE_TASK_OPS]
        if many:
            who = next(info.index for info in infos if info.one_thread)
            raise Refused(f"node {who}: only safe on one thread, and node {many[0]} "
                          f"({infos[many[0]].op_name}) makes the CPU run this graph on several")
    read = [i for i, info in enumerate(infos) if info.snapshot is not None]
    if not read:
        return
    writes = []
    for j in nodes:
        if infos[j].op_name in _EMPTY_OPS:
            continue
        writes.append((j, j))
        if infos[j].op_name.startswith("OPT_STEP"):
            writes += [(j, int(k)) for k in parsed.src_index[j] if k >= 0]
    for i in read:
        lo, hi = offsets[i], offsets[i] + extents[i]
        for j, k in writes:
            if bufs[k] is bufs[i] and offsets[k] < hi and lo < offsets[k] + extents[k]:
                raise Refused(f"graph tensor {i}: row ids read before compute, but node {j} "
                              f"({infos[j].op_name}) writes over them")


def build_graph(lib, parsed, scratch: Scratch, enums: OpEnums) -> int:
    """A host cgraph (in `scratch`) for `parsed`; raises Refused."""
    g, chk = lib.g, lib.checker
    recs = parsed.tensors
    n = len(recs)
    if len(set(parsed.node_index.tolist())) != len(parsed.node_index):
        raise Refused("graph: a node is listed twice")
    infos: List[Optional[TensorInfo]] = [None] * n
    bufs = [None] * n
    offsets = [0] * n
    extents = [0] * n
    for i in range(n):
        rec = recs[i]
        buf, extent = chk.check_rpc(rec, lib.buffers, f"graph tensor {i}")
        if buf is None or not buf.base:
            raise Refused(f"graph tensor {i}: no buffer with data")
        bufs[i], offsets[i], extents[i] = buf, int(rec["data"]), extent
        infos[i] = tensor_info(lib, i, rec, buf.base + offsets[i])
    for i in range(n):
        v = int(parsed.view_src_index[i])
        if v < 0:
            continue
        if bufs[v] is not bufs[i]:
            raise Refused(f"graph tensor {i}: view in another buffer than its source {v}")
        offs = int(recs[i]["view_offs"])
        if offsets[i] != offsets[v] + offs or offs + extents[i] > extents[v]:
            raise Refused(f"graph tensor {i}: view [{offs}, {offs + extents[i]}) outside its "
                          f"source's {extents[v]} bytes")
    for i in range(n):
        srcs = [infos[j] if j >= 0 else None for j in parsed.src_index[i]]
        while srcs and srcs[-1] is None:
            srcs.pop()
        check_node(infos[i], srcs, enums)
    _check_graph_needs(g, parsed, infos, bufs, offsets, extents)

    host = [0] * n
    for i in (int(x) for x in parsed.order):
        t = chk.host_from_rpc(scratch, recs[i], bufs[i])
        rec = tensor_record(t, chk.tensor_dtype)
        for k, j in enumerate(parsed.src_index[i]):
            if j >= 0:
                rec["src"][k] = host[j]
        v = int(parsed.view_src_index[i])
        if v >= 0:
            rec["view_src"] = host[v]
            rec["view_offs"] = int(recs[i]["view_offs"])
        snapshot = infos[i].snapshot
        if snapshot is not None:  # row ids: the kernel reads the copy the rule checked
            rec["data"] = ctypes.addressof(snapshot)
            scratch.pinned.append(snapshot)
        host[i] = t
    graph = g.ggml_new_graph_custom(scratch.ctx, max(len(parsed.node_index), 1), False)
    for j in parsed.node_index:
        g.ggml_graph_add_node(graph, host[int(j)])
    return graph
