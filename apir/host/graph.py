"""The host-side graph builder: a checked `ggml_cgraph` from a parsed wire graph.

Theory of operation: `apir.codec.graph.parse_graph` has already checked the wire's counts, ids,
types, ops, names and acyclicity. Here a node listed twice is refused, every tensor record is
checked against this context (`TensorChecker.check_rpc`: a known buffer, data + extent inside
it, no custom op), each view against its source (same buffer, `data == source data + view_offs`,
its extent inside the source's), every tensor of the graph must have data (a kernel writes
through it), its span (its elements' bytes with each dimension of 0 taken as 1,
`base.check_span`) must fit its buffer (an empty tensor's other dimensions, or elements aliased
through strides of 0, would otherwise size ggml's work buffer and kernel loops far beyond any
memory), and each node's shape goes through `apir.host.shapes.check_node` (once per group of
tensors whose rules see equal inputs, apir.host.rule_memo: a model's layers repeat), then what rules ask
of the whole graph (`_check_graph_needs`: row ids read before compute are written by no node
before they are read; kernels safe only on one thread are in a one-thread graph). Only then are
tensors created in a host `ggml_context` (no data allocated: `data` points into the checked
buffers), in sources-first order (row ids pointed at the copy their rule checked), and the nodes
added to a graph in the guest's node order.

Speed: a MiniLM batch has ~330 tensors, so per-tensor Python work shows in every compute.
The record checks therefore run on the parsed graph's arrays at once (`_check_records`);
when that finds any problem, or values too large for its int64 arithmetic, the per-tensor
checks (`_check_records_one_by_one`, `TensorChecker.check_rpc`: exact Python integers) run
instead and raise the same `Refused` as always, so the vectorized path never decides a
refusal, only an acceptance the per-tensor path would make too. The host tensors' fields
are written in bulk through one numpy view of the context's tensors when ggml placed them
at one fixed stride of at least sizeof(struct ggml_tensor) (whose layout
`apir.ggml.layout.check_layout` checked at load), else tensor by tensor.

Errors: `Refused` (with the tensor or node index) for anything the checks reject.
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import TYPE_CHECKING, List, NamedTuple, Optional

import numpy as np

from apir.ggml.layout import tensor_record
from apir.host.errors import Refused
from apir.host.handles import HostBuffer
from apir.host.rule_memo import check_nodes, rule_groups
from apir.host.shapes import OpEnums, TensorInfo, op_enums
from apir.host.shapes.base import check_span, copy_ids, extent
from apir.host.profiles import CPU, EMPTY_OPS, BackendProfile
from apir.host.work_plan import work_budget
from apir.host.tensors import Scratch

if TYPE_CHECKING:  # annotations only: the dispatcher it leads to imports this module
    from apir.host.backend_library import PythonBackendLibrary

__all__ = [
    "build_graph",
    "build_graph_parts",
    "BuiltGraph",
    "tensor_info",
    "lib_op_enums",
    "point_at_device_copies",
    "fetch_row_ids",
]

# Bound on every intermediate of the vectorized extent arithmetic: below it int64 is exact.
_FAST_LIMIT = float(1 << 60)
_NE_MAX = 1 << 62  # as apir.host.tensors


def tensor_info(lib: PythonBackendLibrary, index: int, rec, address: Optional[int]) -> TensorInfo:
    """The `TensorInfo` the shape rules see of tensor record `rec` (an rpc record or a
    `ggml_tensor`: both have type, op, ne, nb and op_params) of the dispatcher `lib`."""
    g, chk = lib.g, lib.checker
    type_, op = int(rec["type"]), int(rec["op"])
    return TensorInfo(
        index=index,
        type_name=g.type_names[type_],
        ne=[int(x) for x in rec["ne"]],
        nb=[int(x) for x in rec["nb"]],
        op_name=g.op_names[op],
        op_params=rec["op_params"].copy(),
        type_size=chk.type_size[type_],
        blck_size=chk.blck_size[type_],
        address=address,
    )


def lib_op_enums(lib: PythonBackendLibrary) -> OpEnums:
    """`op_enums` of the dispatcher's ggml, computed once per dispatcher."""
    enums = lib._op_enums
    if enums is None:
        enums = lib._op_enums = op_enums(lib.g)
    return enums


_EMPTY_OPS = EMPTY_OPS  # ops whose nodes write nothing (ggml_op_is_empty)


def _check_graph_needs(parsed, infos, bufs, offsets, extents, profile: BackendProfile = CPU) -> None:
    """What rules asked of the whole graph: row ids they read before compute are not written
    by a node that runs before (or is) their last reader (a node's own result, or the sources
    an OPT_STEP_* updates in place): ggml CPU would then read other ids than those checked.
    A write after the last reader is fine (ggml's allocator reuses a consumed input's memory),
    and the kernels read the checked copy anyway (TensorInfo.snapshot). And a kernel that is
    only safe on one thread is in a graph that the CPU runs on one thread (the profile's
    `one_task_ops`)."""
    nodes = [int(j) for j in parsed.node_index]
    if any(info.one_thread for info in infos):
        many = [j for j in nodes if infos[j].op_name not in profile.one_task_ops]
        if many:
            who = next(info for info in infos if info.one_thread)
            why = (
                f"only safe on one thread, and node {many[0]} ({infos[many[0]].op_name}) "
                f"makes the CPU run this graph on several"
            )
            raise Refused(f"node {who.index}: {why}", node=who.index, op=who.op_name, reason=why, rule=_GRAPH_NEEDS)
    read = [i for i, info in enumerate(infos) if info.snapshot is not None]
    if not read:
        return
    position = {j: pos for pos, j in enumerate(nodes)}
    src_rows = parsed.src_index.tolist()
    writes = []  # (position, node, tensor it writes)
    for pos, j in enumerate(nodes):
        if infos[j].op_name in _EMPTY_OPS:
            continue
        writes.append((pos, j, j))
        if infos[j].op_name.startswith("OPT_STEP"):
            writes += [(pos, j, k) for k in src_rows[j] if k >= 0]
    for i in read:
        # (a reader that is not a node, e.g. a leaf, reads nothing at compute)
        until = max((position.get(j, -1) for j in infos[i].read_by or ()), default=-1)
        lo, hi = offsets[i], offsets[i] + extents[i]
        for pos, j, k in writes:
            if pos <= until and bufs[k] is bufs[i] and offsets[k] < hi and lo < offsets[k] + extents[k]:
                why = (
                    f"row ids read before compute, but node {j} ({infos[j].op_name}) "
                    f"writes over them before they are read"
                )
                raise Refused(f"graph tensor {i}: {why}", node=j, op=infos[j].op_name, reason=why, rule=_GRAPH_NEEDS)


# (the `rule` of _check_graph_needs' refusals: apir.host.errors.Refused)
_GRAPH_NEEDS = f"{__name__}._check_graph_needs"


class _Records(NamedTuple):
    """What the record checks found: per tensor its buffer, data offset and extent."""

    bufs: list  # HostBuffer per tensor
    offsets: np.ndarray  # int64
    extents: np.ndarray  # int64


def _check_spans(lib: PythonBackendLibrary, parsed, infos: list[TensorInfo], recs: _Records) -> None:
    """Every tensor's span (`base.span_nbytes`: its elements' bytes with each 0 dimension
    taken as 1) within its buffer's size, an empty tensor's within the larger of that and the
    context's work budget (`base.check_span`, issue 13 classes 1 and 2: an empty tensor is
    never read, but ggml plans work buffers from its other dimensions). Estimated in float for
    the whole graph; the few tensors near or over their buffer are then checked exactly."""
    t = parsed.tensors
    if not len(t):
        return
    chk = lib.checker
    type_ = t["type"].astype(np.int64)
    ne = np.maximum(t["ne"].astype(np.float64), 1.0)
    span = np.ceil(ne[:, 0] / chk.blck_size_arr[type_]) * ne[:, 1:].prod(axis=1) * chk.type_size_arr[type_]
    sizes = np.array([b.size for b in recs.bufs], dtype=np.float64)
    suspects = np.flatnonzero(span > sizes * (1 - 1e-9)).tolist()
    budget = work_budget(lib) if suspects else 0
    for i in suspects:
        size = recs.bufs[i].size
        check_span(infos[i], size if 0 not in infos[i].ne else max(size, budget), f"graph tensor {i}")


def _check_records_one_by_one(lib: PythonBackendLibrary, parsed) -> _Records:
    """The per-tensor checks, in tensor order; raises the first Refused."""
    chk, recs = lib.checker, parsed.tensors
    n = len(recs)
    bufs: list = [None] * n
    offsets = [0] * n
    extents = [0] * n
    for i in range(n):
        rec = recs[i]
        buf, extent = chk.check_rpc(rec, lib.buffers, f"graph tensor {i}")
        if buf is None or not buf.base:
            raise Refused(f"graph tensor {i}: no buffer with data")
        bufs[i], offsets[i], extents[i] = buf, int(rec["data"]), extent
    for i in range(n):
        v = int(parsed.view_src_index[i])
        if v < 0:
            continue
        if bufs[v] is not bufs[i]:
            raise Refused(f"graph tensor {i}: view in another buffer than its source {v}")
        offs = int(recs[i]["view_offs"])
        if offsets[i] != offsets[v] + offs or offs + extents[i] > extents[v]:
            raise Refused(
                f"graph tensor {i}: view [{offs}, {offs + extents[i]}) outside its source's {extents[v]} bytes"
            )
    return _Records(bufs, np.array(offsets, dtype=np.int64), np.array(extents, dtype=np.int64))


def _check_records(lib: PythonBackendLibrary, parsed) -> Optional[_Records]:
    """`_check_records_one_by_one` on whole arrays: the same checks (check_common, extent,
    check_rpc, a buffer with data, views inside their source), or None when any fails or a
    value leaves the range where int64 arithmetic is exact (the caller then runs the
    per-tensor checks, which refuse or accept exactly)."""
    chk, t = lib.checker, parsed.tensors
    n = len(t)
    if n == 0:
        return _Records([], np.zeros(0, np.int64), np.zeros(0, np.int64))
    type_ = t["type"].astype(np.int64)
    op = t["op"].astype(np.int64)
    # check_common: a valid type, an op below GGML_OP_COUNT and not custom
    if type_.min() < 0 or type_.max() >= len(chk.valid_types) or not chk.valid_types[type_].all():
        return None
    if op.min() < 0 or op.max() >= chk.g.op_count or chk.custom_op_mask[op].any():
        return None
    ne_w, nb_w = t["ne"], t["nb"]
    if ne_w.max() >= _NE_MAX or nb_w.max() >= _NE_MAX:  # not reachable with u32 fields
        return None
    ne = ne_w.astype(np.int64)
    nb = nb_w.astype(np.int64)
    if ne.min() < 0 or nb.min() < 0:
        return None
    ts = chk.type_size_arr[type_]
    blck = chk.blck_size_arr[type_]
    if (ne[:, 0] % blck).any():
        return None
    # name NUL-terminated
    if not (t["name"].view(np.uint8) == 0).any(axis=1).all():
        return None
    # extent (TensorChecker.extent): first bound every intermediate in float, then exact int64
    nef, nbf = ne.astype(np.float64), nb.astype(np.float64)
    bound = nef[:, 0] * (nbf[:, 0] + ts) + (nef[:, 1:] * nbf[:, 1:]).sum(axis=1) + nbf.sum(axis=1)
    if bound.max() >= _FAST_LIMIT:
        return None
    blocks0 = ne[:, 0] // blck
    row = np.maximum(blocks0 * ts, (blocks0 - 1) * nb[:, 0] + ts)
    row = np.where(blck > 1, np.maximum(row, blocks0 * nb[:, 0]), row)
    extents = row + ((ne[:, 1:] - 1) * nb[:, 1:]).sum(axis=1)
    extents = np.where((ne > 0).all(axis=1), extents, 0)
    # check_rpc: a known buffer (never handle 0 here: every graph tensor needs data) with a
    # base, data + extent inside it
    data_w, offs_w = t["data"], t["view_offs"]
    if data_w.max() >= _NE_MAX or offs_w.max() >= _NE_MAX:
        return None
    offsets = data_w.astype(np.int64)
    handles, inverse = np.unique(t["buffer"], return_inverse=True)
    inverse = inverse.reshape(-1)
    found: List[HostBuffer] = []
    for h in handles.tolist():
        b = lib.buffers.get(int(h))
        if b is None or not b.base or not 0 <= b.size < _NE_MAX:
            return None
        found.append(b)
    sizes = np.array([b.size for b in found], dtype=np.int64)
    if (offsets + extents > sizes[inverse]).any():
        return None
    # views: the same buffer object as the source, data == source data + view_offs, extent inside
    v = parsed.view_src_index
    is_view = v >= 0
    if is_view.any():
        ident: dict[int, int] = {}  # id(buffer) -> index of its first handle
        same = np.array([ident.setdefault(id(b), k) for k, b in enumerate(found)], dtype=np.int64)[inverse]
        vi = v[is_view]
        view_offs = offs_w[is_view].astype(np.int64)
        if (
            (same[is_view] != same[vi]).any()
            or (offsets[is_view] != offsets[vi] + view_offs).any()
            or (view_offs + extents[is_view] > extents[vi]).any()
        ):
            return None
    return _Records([found[k] for k in inverse.tolist()], offsets, extents)


# TensorInfo's leading fields in order: then `_infos` passes them by position (a keyword call
# costs twice as much), else by keyword.
_INFO_FIELDS = ("index", "type_name", "ne", "nb", "op_name", "op_params", "type_size", "blck_size", "address")
_INFO_POSITIONAL = tuple(f.name for f in dataclasses.fields(TensorInfo))[: len(_INFO_FIELDS)] == _INFO_FIELDS


def _infos(lib: PythonBackendLibrary, parsed, addresses: List[int]) -> List[TensorInfo]:
    """`tensor_info` of every record (ne, nb, op_params read in bulk; op_params one host copy)."""
    g, chk, t = lib.g, lib.checker, parsed.tensors
    type_names, op_names, type_size, blck_size = g.type_names, g.op_names, chk.type_size, chk.blck_size
    rows = zip(
        range(len(t)),
        t["type"].tolist(),
        t["op"].tolist(),
        t["ne"].tolist(),
        t["nb"].tolist(),
        list(t["op_params"].copy()),
        addresses,
    )
    if _INFO_POSITIONAL:
        return [
            TensorInfo(i, type_names[ty], ne, nb, op_names[op], params, type_size[ty], blck_size[ty], addr)
            for i, ty, op, ne, nb, params, addr in rows
        ]
    return [
        TensorInfo(
            index=i,
            type_name=type_names[ty],
            ne=ne,
            nb=nb,
            op_name=op_names[op],
            op_params=params,
            type_size=type_size[ty],
            blck_size=blck_size[ty],
            address=addr,
        )
        for i, ty, op, ne, nb, params, addr in rows
    ]


def _tensor_view(addrs: List[int], dtype: np.dtype) -> Optional[np.ndarray]:
    """One numpy view of the tensors at `addrs` when they lie at one stride >= the struct's
    size (ggml places each tensor after its object header, one after another), else None."""
    n = len(addrs)
    if n == 0:
        return None
    stride = addrs[1] - addrs[0] if n > 1 else dtype.itemsize
    if stride < dtype.itemsize or any(addrs[k + 1] - addrs[k] != stride for k in range(n - 1)):
        return None
    raw = (ctypes.c_char * (stride * (n - 1) + dtype.itemsize)).from_address(addrs[0])
    return np.ndarray((n,), dtype=dtype, buffer=memoryview(raw), strides=(stride,))


def _create_tensors(lib: PythonBackendLibrary, parsed, scratch: Scratch, recs: _Records) -> np.ndarray:
    """The host twins of the checked records (as `TensorChecker.host_from_rpc`, with src and
    view_src pointing at the twins), created in sources-first order; their addresses by
    tensor index."""
    g, chk, t = lib.g, lib.checker, parsed.tensors
    n = len(t)
    order = parsed.order.astype(np.int64)
    types = t["type"].tolist()
    blck = chk.blck_size
    new, ctx = g.ggml_new_tensor_1d, scratch.ctx
    created = []
    for i in order.tolist():
        addr = new(ctx, types[i], blck[types[i]])
        if not addr:
            raise MemoryError("scratch ggml_context full")
        created.append(addr)
    host = np.zeros(n, dtype=np.uint64)
    host[order] = np.array(created, dtype=np.uint64)

    # Every field as host_from_rpc writes it, rows in creation order.
    src_index = parsed.src_index.astype(np.int64)
    v = parsed.view_src_index.astype(np.int64)
    names = t["name"].view(np.uint8)[order]
    # ggml_set_name on a fresh (zeroed) name: the bytes up to the first NUL, zeros after (the
    # checks found a NUL in every name, so the result's last byte is one too)
    names[np.cumsum(names == 0, axis=1) > 0] = 0
    ptrs = np.array([b.ptr for b in recs.bufs], dtype=np.uint64)
    bases = np.array([b.base for b in recs.bufs], dtype=np.uint64)
    fields = {
        "ne": t["ne"][order].astype(np.int64),
        "nb": t["nb"][order].astype(np.uint64),
        "op": t["op"][order],
        "op_params": t["op_params"][order],
        "flags": t["flags"][order],
        "buffer": ptrs[order],
        "data": (bases + recs.offsets.astype(np.uint64))[order],
        "src": np.where(src_index >= 0, host[src_index], 0).astype(np.uint64)[order],
        "view_src": np.where(v >= 0, host[v], 0).astype(np.uint64)[order],
        "view_offs": np.where(v >= 0, t["view_offs"], 0).astype(np.uint64)[order],
    }
    view = _tensor_view(created, chk.tensor_dtype)
    if view is not None:
        for name, values in fields.items():
            view[name] = values
        view["name"].view(np.uint8)[...] = names
    else:
        for k, addr in enumerate(created):
            rec = tensor_record(addr, chk.tensor_dtype)
            for name, values in fields.items():
                rec[name] = values[k]
            rec["name"].view(np.uint8)[...] = names[k]
    return host


class BuiltGraph(NamedTuple):
    """A built host graph and what its checks saw (for `apir.host.graph_cache`)."""

    graph: int  # the ggml_cgraph, in the scratch context
    host: List[int]  # host tensor address by tensor index
    infos: List[TensorInfo]  # as the rules saw them (snapshots and readers of row ids included)
    src_rows: List[List[int]]  # src indices per tensor (-1: none)
    bufs: list  # HostBuffer per tensor


def build_graph(lib: PythonBackendLibrary, parsed, scratch: Scratch, enums: OpEnums) -> int:
    """A host cgraph (in `scratch`) for `parsed`; raises Refused."""
    return build_graph_parts(lib, parsed, scratch, enums).graph


def build_graph_parts(lib: PythonBackendLibrary, parsed, scratch: Scratch, enums: OpEnums) -> BuiltGraph:
    """`build_graph`, returning the graph with what its checks saw; raises Refused."""
    g = lib.g
    if len(np.unique(parsed.node_index)) != len(parsed.node_index):
        raise Refused("graph: a node is listed twice")
    recs = _check_records(lib, parsed)
    if recs is None:
        recs = _check_records_one_by_one(lib, parsed)
    # per tensor: its HostBuffer and data offset (Python ints); recs.extents: its extent
    bufs, offsets = recs.bufs, recs.offsets.tolist()
    infos = _infos(lib, parsed, [b.base + o for b, o in zip(bufs, offsets)])
    profile = getattr(lib, "profile", None) or CPU
    for info, b, o in zip(infos, bufs, offsets):
        info.room = b.size - o  # bytes to the end of its buffer (TensorInfo.room)
    if not profile.host_addressable:
        for info, b, o in zip(infos, bufs, offsets):
            info.fetch = _Fetcher(lib, b, o)
    _check_spans(lib, parsed, infos, recs)
    src_rows = parsed.src_index.tolist()
    check_nodes(infos, src_rows, enums, profile.rules, rule_groups(parsed))
    _check_graph_needs(parsed, infos, bufs, offsets, recs.extents.tolist(), profile)

    host = _create_tensors(lib, parsed, scratch, recs).tolist()
    # row ids: the kernel reads the copy the rule checked (the guest may write the original,
    # e.g. in a buffer of its memory, between the check and the kernel)
    if profile.host_addressable:
        for info, addr in zip(infos, host):
            if info.snapshot is not None:
                tensor_record(addr, lib.checker.tensor_dtype)["data"] = ctypes.addressof(info.snapshot)
                scratch.pinned.append(info.snapshot)
    else:
        point_at_device_copies(lib, scratch, [(info, addr) for info, addr in zip(infos, host) if info.snapshot])
    if profile.device_checks_nodes:
        _check_device_supports(lib, parsed, infos, host)
    graph = g.ggml_new_graph_custom(scratch.ctx, max(len(parsed.node_index), 1), False)
    add = g.ggml_graph_add_node
    for j in parsed.node_index.tolist():
        add(graph, host[j])
    return BuiltGraph(graph, host, infos, src_rows, bufs)


def _check_device_supports(lib, parsed, infos, host) -> None:
    """Every node that computes something passes the device's own `supports_op` (a GPU
    backend aborts on a node it has no kernel for; apir.host.profiles)."""
    supports = lib.g.ggml_backend_dev_supports_op
    for j in parsed.node_index.tolist():
        if infos[j].op_name not in _EMPTY_OPS and not supports(lib.dev, host[j]):
            raise Refused(f"node {j}: the device does not support {infos[j].op_name} of this shape and types")


def _bytes_tensor(lib, scratch: Scratch, buffer: int, data: int, n: int) -> int:
    """A 1-d I8 tensor over the `n` bytes at `data` of ggml buffer `buffer`, for copies
    through the backend (ggml_backend_tensor_get / _set)."""
    g = lib.g
    return lib.checker.host_tensor(
        scratch, g.types["I8"], [n, 1, 1, 1], [1, n, n, n], 0, 0, 0, b"row ids\0", buffer, data
    )


class _Fetcher:
    """`TensorInfo.fetch` of a tensor at `offset` in HostBuffer `buf`: `fetch(n)`, its first
    `n` bytes copied out through the backend (`ggml_backend_tensor_get` on a byte tensor over
    them). `fetch_row_ids` batches several."""

    __slots__ = ("lib", "buf", "offset")

    def __init__(self, lib, buf: HostBuffer, offset: int):
        self.lib, self.buf, self.offset = lib, buf, offset

    def __call__(self, n: int) -> ctypes.Array:
        out = ctypes.create_string_buffer(max(n, 1))
        if n:
            with Scratch(self.lib.g, 1) as s:
                t = _bytes_tensor(self.lib, s, self.buf.ptr, self.buf.base + self.offset, n)
                self.lib.g.ggml_backend_tensor_get(t, ctypes.addressof(out), 0, n)
        return out


def fetch_row_ids(lib, infos: List[TensorInfo]) -> List[ctypes.Array]:
    """`shapes.base.copy_ids` of each of `infos` (the copies, in order), with the reads through
    the backend of tensors in buffers that allow it (apir.host.transfers: a device buffer of
    the backend's default type) made asynchronously, one synchronize for all; every other
    tensor read as copy_ids reads it (synchronously)."""
    transfers = getattr(lib, "transfers", None)
    out: List[ctypes.Array] = []
    batch = []
    for k, info in enumerate(infos):
        f = info.fetch
        if transfers is not None and isinstance(f, _Fetcher) and transfers.eligible(f.buf):
            batch.append(k)
            out.append(ctypes.create_string_buffer(1))  # replaced below
        else:
            out.append(copy_ids(info))
    if transfers is not None and batch:
        with Scratch(lib.g, len(batch)) as s:
            reads = []
            for k in batch:
                f, n = infos[k].fetch, extent(infos[k])
                assert isinstance(f, _Fetcher)
                reads.append((_bytes_tensor(lib, s, f.buf.ptr, f.buf.base + f.offset, n), n))
            for k, copy in zip(batch, transfers.read(reads)):
                out[k] = copy
    return out


def point_at_device_copies(lib, scratch: Scratch, snaps) -> None:
    """Where kernels read device memory: the checked row ids (`snaps`: (TensorInfo with a
    snapshot, host tensor)) copied, in one transfer, into a buffer of the device's own type
    (the context's `ids_buffer`, kept between graphs; else one made for this graph and freed
    with `scratch`), and each host tensor pointed at its copy (its view_src cleared:
    ggml-vulkan addresses a view through its source). The copies are at most the ids'
    extents, already inside the context's charged buffers."""
    if not snaps:
        return
    g = lib.g
    buft = g.ggml_backend_dev_buffer_type(lib.dev)
    align = max(1, g.ggml_backend_buft_get_alignment(buft))
    offsets, total = [], 0
    for info, _ in snaps:
        offsets.append(total)
        total += -(-len(info.snapshot) // align) * align
    keep = getattr(lib, "ids_buffer", None)
    buf = keep(total) if keep is not None else g.ggml_backend_buft_alloc_buffer(buft, total)
    if not buf:
        raise Refused(f"graph: no device buffer of {total} bytes for the checked row ids")
    if keep is None:
        scratch.buffers.append(buf)
    base = g.ggml_backend_buffer_get_base(buf)
    staging = (ctypes.c_char * total)()
    for (info, _), off in zip(snaps, offsets):
        # (ctypes' slice assignment sets byte by byte: 7 ms for 352 KiB of ids, a memmove 0.1 ms)
        ctypes.memmove(ctypes.addressof(staging) + off, info.snapshot, len(info.snapshot))
    with Scratch(g, 1) as copies:
        g.ggml_backend_tensor_set(_bytes_tensor(lib, copies, buf, base, total), ctypes.addressof(staging), 0, total)
    dtype = lib.checker.tensor_dtype
    for (_, addr), off in zip(snaps, offsets):
        rec = tensor_record(addr, dtype)
        rec["buffer"], rec["data"], rec["view_src"], rec["view_offs"] = buf, base + off, 0, 0
