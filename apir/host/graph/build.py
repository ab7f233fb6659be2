"""The host-side graph builder: a checked `ggml_cgraph` from a parsed wire graph.

Theory of operation: `apir.codec.graph.parse_graph` has checked the wire's counts, ids, types,
ops, names and acyclicity. Here a node listed twice is refused; every tensor record is checked
against this context (`TensorChecker.check_rpc`: a known buffer with data, data + extent inside
it, no custom op), each view against its source (same buffer, data = source data + view_offs,
extent inside the source's), each span within its buffer (`base.check_span`: an empty or
aliased tensor would size ggml's work buffers far beyond any memory); each node's shape goes
through `shapes.check_node`, once per group of equal inputs (apir.host.graph.rule_memo), then
what rules ask of the whole graph (`_check_graph_needs`). Only then are the host tensors made
(`data` pointing into the checked buffers, row ids at the copy their rule checked) and the
nodes added in the guest's order, in the scratch's `ggml_context`.

Two paths, one answer (apir.accel): the plain one checks each record on its own
(`_check_records_one_by_one`), makes each host tensor with ggml_new_tensor_1d and sweeps the
nodes' writes for writes over row ids (`_graph_writes_plain`). The accelerated one runs these steps in
Numba kernels on whole arrays (apir.host.graph.kernels: a large graph has 10,000 tensors) and
leaves every refusal to the per-record checks, which it runs on any doubt. Errors: `Refused`
(with the tensor or node index) for anything the checks reject.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from apir import accel
from apir.codec.copy import copy_bytes
from apir.ggml.cgraph import fill_use_counts, source_uses
from apir.ggml.layout import tensor_record
from apir.host.errors import Refused
from apir.host.handles import HostBuffer
from apir.host.graph.computed_ids import (
    ID_WRITERS,
    candidate,
    check_computed_reads,
    computed_by,
    ids_writer_nodes,
    writer_ops,
)
from apir.host.graph.overlap import first_overlap
from apir.host.graph.rule_memo import check_nodes, rule_groups
from apir.host.graph.shapes import OpEnums, TensorInfo
from apir.host.graph.shapes.base import IdReads, check_span, copy_ids, extent
from apir.host.graph.profiles import CPU, EMPTY_OPS, BackendProfile
from apir.host.graph.seams import GraphLibrary, profile_of
from apir.host.graph.work_plan import work_budget
from apir.host.tensors import Scratch

if accel.enabled():  # (the plain path imports no Numba)
    from apir.host.graph.kernels import (
        TABLE_KEY,
        add_nodes_kernel,
        copy_written_kernel,
        use_counts_kernel,
        first_overlap_kernel,
        graph_writes_kernel,
        record_bounds_kernel,
        record_fields_kernel,
        write_tensors_kernel,
    )

__all__ = [
    "graph_scratch",
    "build_graph_parts",
    "BuiltGraph",
    "tensor_info",
    "point_at_device_copies",
    "fetch_row_ids",
    "guest_use_counts",
]

_NE_MAX = 1 << 62  # as apir.host.tensors


def tensor_info(lib: GraphLibrary, index: int, rec, address: Optional[int]) -> TensorInfo:
    """The `TensorInfo` the shape rules see of tensor record `rec` (an rpc record or a
    `ggml_tensor`: both have type, op, ne, nb and op_params) of the dispatcher `lib`."""
    fields = (rec["type"], rec["op"], rec["ne"], rec["nb"], rec["op_params"])
    return _tensor_info(lib, index, *fields, address)


def _tensor_info(lib: GraphLibrary, index: int, type_, op, ne, nb, op_params, address) -> TensorInfo:
    # (`tensor_info` from the record's fields, each as numpy holds it)
    g, chk = lib.g, lib.checker
    type_, op = int(type_), int(op)
    return TensorInfo(
        index=index,
        type_name=g.type_names[type_],
        ne=ne.tolist(),  # (Python ints)
        nb=nb.tolist(),
        op_name=g.op_names[op],
        op_params=op_params.copy(),
        type_size=chk.type_size[type_],
        blck_size=chk.blck_size[type_],
        address=address,
    )


_EMPTY_OPS = EMPTY_OPS  # ops whose nodes write nothing (ggml_op_is_empty)


def _check_graph_needs(
    lib: GraphLibrary, parsed, made: List[TensorInfo], recs: _Records, profile: BackendProfile = CPU
) -> None:
    """What rules asked of the whole graph: row ids they read before compute are not written
    by a node that runs before (or is) their last reader (a node's own result, or the sources
    an OPT_STEP_* updates in place): ggml CPU would then read other ids than those checked.
    A write after the last reader is fine (ggml's allocator reuses a consumed input's memory),
    and the kernels read the checked copy anyway (TensorInfo.snapshot), as long as no node
    writes through the tensor given that copy (`_check_copies_unwritten`). Row ids the graph
    computes in range (apir.host.graph.computed_ids) were not read: nothing but their writer
    writes them before their readers (`check_computed_reads`). And a kernel that is
    only safe on one thread is in a graph that the CPU runs on one thread (the profile's
    `one_task_ops`)."""
    op_names, ops = lib.g.op_names, recs.ops
    nodes = parsed.node_index.astype(np.int64)
    one_thread = [info for info in made if info.one_thread]
    if one_thread:
        many = [j for j in nodes.tolist() if op_names[int(ops[j])] not in profile.one_task_ops]
        if many:
            who = one_thread[0]
            why = (
                f"only safe on one thread, and node {many[0]} ({op_names[int(ops[many[0]])]}) "
                f"makes the CPU run this graph on several"
            )
            raise Refused(f"node {who.index}: {why}", node=who.index, op=who.op_name, reason=why, rule=_GRAPH_NEEDS)
    read = [info for info in made if info.snapshot is not None]
    computed = [info for info in made if info.read_computed_by]
    if not read and not computed:
        return
    for info in computed:
        if info.snapshot is not None:  # (one host tensor: it cannot both hold the copy and be computed)
            j, r = (info.read_by or [info.index])[0], (info.read_computed_by or [info.index])[0]
            why = f"row ids read before compute by node {j} and computed by the graph for node {r}"
            op = op_names[int(ops[j])]
            raise Refused(f"graph tensor {info.index}: {why}", node=j, op=op, reason=why, rule=_GRAPH_NEEDS)
    # each reader's position (-1: a reader that is not a node, e.g. a leaf, reads nothing at
    # compute), the last per ids tensor
    at = np.full(len(parsed.tensors), -1, np.int64)
    at[nodes] = np.arange(len(nodes))
    until = np.array([max((int(at[j]) for j in info.read_by or ()), default=-1) for info in read], np.int64)
    computed_at = [int(at[j]) for info in computed for j in info.read_computed_by or ()]
    last = max([int(until.max()) if len(until) else -1] + computed_at)
    # only the nodes up to the last reader can write before one (an embedding's GET_ROWS is
    # node 0: one node's writes, not the whole graph's)
    before = nodes[: last + 1]
    buf = _same_memory(recs.found)[recs.inverse]  # per tensor: its memory, as one number
    graph_writes = _graph_writes if accel.enabled() else _graph_writes_plain
    writes = graph_writes(lib.g, before, ops, parsed.src_index, buf, recs)
    check_computed_reads(computed, at, nodes, writes, buf, recs, lambda j: op_names[int(ops[j])])
    if not read:
        return
    q_t = np.array([info.index for info in read], np.int64)
    first_overlap_of = _first_overlap if accel.enabled() else _first_overlap_plain
    first = first_overlap_of(writes, buf, recs, q_t)
    hit = np.flatnonzero((first >= 0) & (first <= until))
    if len(hit):
        k = int(hit[0])  # (`read` is in tensor order: the first ids tensor so overwritten)
        i, j = read[k].index, int(nodes[first[k]])
        op = op_names[int(ops[j])]
        why = f"row ids read before compute, but node {j} ({op}) writes over them before they are read"
        raise Refused(f"graph tensor {i}: {why}", node=j, op=op, reason=why, rule=_GRAPH_NEEDS)
    _check_copies_unwritten(lib, parsed, nodes, ops, read, profile)


def _check_copies_unwritten(
    lib: GraphLibrary, parsed, nodes: np.ndarray, ops: np.ndarray, read: List[TensorInfo], profile
) -> None:
    """Refuses a node writing through a host tensor that the build points at the checked copy
    of its row ids (`read`): itself or, where a backend addresses views through their source
    (a profile without `host_addressable`: ggml-vulkan), a view of it. Its result would land
    in the copy and the guest's tensor keep what it held, where ggml writes the tensor (a write
    before the last reader is refused anyway; this is one after it). `ops`: each tensor's."""
    g = lib.g
    empty, opt_step = _write_ops(g)
    copied = np.zeros(len(parsed.tensors), np.bool_)
    copied[[info.index for info in read]] = True
    find = copy_written_kernel if accel.enabled() else _copy_written_plain
    views = not profile.host_addressable
    t, j = find(nodes, ops, empty, opt_step, parsed.src_index, parsed.view_src_index, copied, views)
    if t >= 0:
        op = g.op_names[int(ops[j])]
        why = (
            f"row ids read before compute are written by node {j} ({op}) after their readers, "
            f"through the tensor given the checked copy"
        )
        raise Refused(f"graph tensor {t}: {why}", node=j, op=op, reason=why, rule=_GRAPH_NEEDS)


def _copy_written_plain(nodes, ops, empty, opt_step, src_index, view_src, copied, views: bool) -> tuple:
    """(tensor, node) of the first write of `nodes` (int64 tensor indices, in graph order)
    into a tensor `copied` marks (bool per tensor), or with `views` into a view of one
    (`view_src`: int32 per tensor, -1 none); (-1, -1) where none is. The writes: each node
    itself unless its op (`ops`, per tensor) writes nothing (`empty[op]`), then the sources
    (`src_index`, int32[n, S], -1 none) of each node whose op updates them in place
    (`opt_step[op]`: OPT_STEP_*), both in graph order."""
    node_ops = ops[nodes].astype(np.int64)
    written = [nodes[~empty[node_ops]]]  # (each node writes itself, unless its op writes nothing)
    writer = list(written)
    steps = nodes[opt_step[node_ops]]
    if len(steps):  # (OPT_STEP_* updates its sources in place)
        srcs = src_index[steps]
        written.append(srcs[srcs >= 0].astype(np.int64))
        writer.append(np.repeat(steps, (srcs >= 0).sum(axis=1)))
    w, by = np.concatenate(written), np.concatenate(writer)
    through = copied[w]
    if views:
        v = view_src[w].astype(np.int64)
        through |= (v >= 0) & copied[np.maximum(v, 0)]
    hit = np.flatnonzero(through)
    return (int(w[hit[0]]), int(by[hit[0]])) if len(hit) else (-1, -1)


@functools.lru_cache(maxsize=8)
def _write_ops(g) -> tuple:
    """(empty, opt_step): bool per op of build `g`, the ops whose nodes write nothing
    (ggml_op_is_empty) and the OPT_STEP_* ops (which update sources in place)."""
    names = [g.op_names.get(o, "") for o in range(g.op_count)]
    empty = np.array([name in _EMPTY_OPS for name in names], np.bool_)
    return empty, np.array([name.startswith("OPT_STEP") for name in names], np.bool_)


def _graph_writes_plain(g, nodes, ops, src_index, buf, recs: _Records) -> tuple:
    """(memory, lo, hi, position) int64 arrays of every write of `nodes`, in graph order: a
    node writes itself unless its op writes nothing (ggml_op_is_empty), and an OPT_STEP_* op
    the sources it updates in place; `buf` per tensor its memory, its bytes from `recs`."""
    empty, opt_step = _write_ops(g)
    offsets, extents = recs.offsets.tolist(), recs.extents.tolist()
    written: List[int] = []  # tensors written, and the position of the node writing each
    at: List[int] = []
    for p, j in enumerate(nodes.tolist()):
        op = int(ops[j])
        if empty[op]:
            continue
        for t in [j] + ([s for s in src_index[j].tolist() if s >= 0] if opt_step[op] else []):
            written.append(t)
            at.append(p)
    w_lo = np.array([offsets[t] for t in written], np.int64)
    w_hi = np.array([offsets[t] + extents[t] for t in written], np.int64)
    return np.asarray(buf[written], np.int64), w_lo, w_hi, np.array(at, np.int64)


def _first_overlap_plain(writes: tuple, buf, recs: _Records, q_t: np.ndarray) -> np.ndarray:
    """Per tensor of `q_t`: the position of the first of `writes` (`_graph_writes_plain`) over
    its bytes, in its memory, -1 where none is; an empty range overlaps one that strictly
    contains its offset. One sweep for all the tensors at once (apir.host.graph.overlap: a
    guest's graph of many readers makes comparing each with each write quadratic)."""
    q_lo, q_hi = recs.offsets[q_t], recs.offsets[q_t] + recs.extents[q_t]
    w_buf, w_lo, w_hi, w_pos = writes
    return first_overlap(w_buf, w_lo, w_hi, w_pos, buf[q_t], q_lo, q_hi)


def _graph_writes(g, nodes, ops, src_index, buf, recs: _Records) -> tuple:
    """`_graph_writes_plain` in a kernel."""
    empty, opt_step = _write_ops(g)
    space = np.empty((4, len(nodes) * (1 + src_index.shape[1])), np.int64)
    m = graph_writes_kernel(nodes, ops, empty, opt_step, src_index, buf, recs.offsets, recs.extents, *space)
    return tuple(a[:m] for a in space)  # buffer, lo, hi, position


def _first_overlap(writes: tuple, buf, recs: _Records, q_t: np.ndarray) -> np.ndarray:
    """`_first_overlap_plain` in a kernel."""
    first = np.empty(len(q_t), np.int64)
    q = (buf[q_t], recs.offsets[q_t], recs.offsets[q_t] + recs.extents[q_t])
    first_overlap_kernel(*writes, *q, first, _DIRECT_PAIRS)
    return first


def _first_writes_plain(g, nodes, ops, src_index, buf, recs: _Records, q_t: np.ndarray) -> np.ndarray:
    """Per tensor of `q_t`: the position in `nodes` of the first node that writes over its
    bytes (in the same memory, `buf`), -1 where none does."""
    return _first_overlap_plain(_graph_writes_plain(g, nodes, ops, src_index, buf, recs), buf, recs, q_t)


def _first_writes(g, nodes, ops, src_index, buf, recs: _Records, q_t: np.ndarray) -> np.ndarray:
    """`_first_writes_plain` in two kernels."""
    return _first_overlap(_graph_writes(g, nodes, ops, src_index, buf, recs), buf, recs, q_t)


# Up to this many (write, ids tensor) pairs first_overlap_kernel compares one by one (the
# sweep's sorts would cost more)
_DIRECT_PAIRS = 1 << 16


# (the `rule` of _check_graph_needs' refusals: apir.host.errors.Refused)
_GRAPH_NEEDS = f"{__name__}._check_graph_needs"


class _Records(NamedTuple):
    """What the record checks found: per tensor its buffer (`found[inverse[i]]`), data offset,
    extent and op."""

    handles: List[int]  # the graph's buffer handles, each once
    found: List[HostBuffer]  # the HostBuffer of each of `handles`
    inverse: np.ndarray  # int64 per tensor: its handle's index in `handles`
    offsets: np.ndarray  # int64
    extents: np.ndarray  # int64
    # int64: the records' ops side by side (the whole-graph checks read each node's; read from
    # the records, a record apart, each read misses the CPU's cache)
    ops: np.ndarray
    # the tensors whose span may not fit their buffer (_check_spans), None: not yet sought
    suspects: Optional[List[int]] = None

    @property
    def bufs(self) -> List[HostBuffer]:
        """The HostBuffer of every tensor."""
        return [self.found[k] for k in self.inverse.tolist()]

    def per_tensor(self, values: list) -> np.ndarray:
        """`values` (one per handle) as an array with one per tensor."""
        return np.asarray(values)[self.inverse]


def _first_alike(keys: list) -> np.ndarray:
    """int64 per entry of `keys`: the index of the first entry equal to it."""
    first: Dict[object, int] = {}
    return np.array([first.setdefault(key, k) for k, key in enumerate(keys)], dtype=np.int64)


def _same_buffer(found: List[HostBuffer]) -> np.ndarray:
    """int64 per handle: the index of the first handle naming the same HostBuffer object (two
    handles may name one buffer)."""
    return _first_alike([id(b) for b in found])


def _same_memory(found: List[HostBuffer]) -> np.ndarray:
    """int64 per handle: the index of the first handle naming the same memory, offsets
    measured from the same base: the same HostBuffer, or a buffer_from_ptr buffer of the same
    resource (each wraps the resource from its start; the guest may wrap one resource twice,
    and a write through one handle then overwrites what the other reads)."""
    return _first_alike([("res", b.res_id) if b.res_id is not None else id(b) for b in found])


def _check_spans(lib: GraphLibrary, parsed, infos: TensorInfos, recs: _Records) -> None:
    """Every tensor's span (`base.span_nbytes`: its elements' bytes with each 0 dimension
    taken as 1) within its buffer's size, an empty tensor's within the larger of that and the
    context's work budget (`base.check_span`: an empty tensor is
    never read, but ggml plans work buffers from its other dimensions). Estimated in float for
    the whole graph; the few tensors near or over their buffer are then checked exactly."""
    t = parsed.tensors
    if not len(t):
        return
    suspects = recs.suspects
    if suspects is None:  # (the record checks' kernel found them on its way)
        chk = lib.checker
        type_ = t["type"].astype(np.int64)
        ne = np.maximum(t["ne"].astype(np.float64), 1.0)
        span = np.ceil(ne[:, 0] / chk.blck_size_arr[type_]) * chk.type_size_arr[type_] * ne[:, 1:].prod(axis=1)
        sizes = recs.per_tensor([float(b.size) for b in recs.found])
        suspects = np.flatnonzero(span > sizes * (1 - 1e-9)).tolist()
    budget = work_budget(lib) if suspects else 0
    for i in suspects:
        size = recs.found[recs.inverse[i]].size
        check_span(infos[i], size if 0 not in infos[i].ne else max(size, budget), f"graph tensor {i}")


def _check_records_one_by_one(lib: GraphLibrary, parsed) -> _Records:
    """The per-tensor checks, in tensor order: each record against this context
    (`TensorChecker.check_rpc`), in a buffer with data, and each view in its source's buffer
    at its source's data + view_offs, inside its source's extent. Raises the first Refused."""
    chk, recs = lib.checker, parsed.tensors
    n = len(recs)
    bufs: list = [None] * n
    offsets = [0] * n
    extents = [0] * n
    for i in range(n):
        rec = chk.rpc_tensor(recs[i].tobytes())
        buf, extent = chk.check_rpc(rec, lib.buffers, f"graph tensor {i}")
        if buf is None or not buf.base:
            raise Refused(f"graph tensor {i}: no buffer with data")
        bufs[i], offsets[i], extents[i] = buf, rec.data, extent
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
    handles: Dict[int, int] = {}  # handle -> its index
    found: List[HostBuffer] = []
    for rec, b in zip(recs["buffer"].tolist(), bufs):
        if rec not in handles:
            handles[rec] = len(found)
            found.append(b)
    inverse = np.array([handles[h] for h in recs["buffer"].tolist()], dtype=np.int64)
    ops = recs["op"].astype(np.int64)
    return _Records(list(handles), found, inverse, np.array(offsets, np.int64), np.array(extents, np.int64), ops)


def _check_records(lib: GraphLibrary, parsed) -> Optional[_Records]:
    """`_check_records_one_by_one` on whole arrays: the same checks (check_common, extent,
    check_rpc, a buffer with data, views inside their source), or None when any fails or a
    value leaves the range where int64 arithmetic is exact (the caller then runs the
    per-tensor checks, which refuse or accept exactly). Two kernels
    (`apir.host.graph.kernels.record_fields_kernel`, `record_bounds_kernel`) around the look-up
    of each buffer handle; they also find the tensors whose span may not fit (`suspects`)."""
    chk, t = lib.checker, parsed.tensors
    n = len(t)
    if n == 0:
        none = np.zeros(0, np.int64)
        return _Records([], [], none, none, none, none)
    fields: Mapping[str, tuple] = t.dtype.fields or {}
    width = _entries(fields["ne"][0])[0]
    if width not in (4, 8) or {_entries(fields["ne"][0]), _entries(fields["nb"][0])} != {(width, 4)}:
        return None  # (the kernel reads GGML_MAX_DIMS = 4 entries of 4 or 8 bytes)
    rows = np.ascontiguousarray(t)
    off = np.array([fields[f][1] for f in ("type", "op", "ne", "nb", "name", "data", "view_offs", "buffer")], np.int64)
    extents, offsets, voffs, ops, handle_of, handles, suspects = (np.empty(n, np.int64) for _ in range(7))
    spans = np.empty(n, np.float64)
    n_handles = record_fields_kernel(
        rows.ctypes.data,
        n,
        t.dtype.itemsize,
        off,
        width,
        fields["name"][0].itemsize,
        chk.valid_types.astype(np.uint8),
        chk.custom_op_mask[: chk.g.op_count].astype(np.uint8),
        chk.type_size_arr,
        chk.blck_size_arr,
        extents,
        offsets,
        voffs,
        ops,
        handle_of,
        spans,
        handles,
        TABLE_KEY,
    )
    if n_handles < 0:
        return None
    # check_rpc: a known buffer (never handle 0 here: every graph tensor needs data) with a
    # base, data + extent inside it
    found: List[HostBuffer] = []
    keys = [h % (1 << 64) for h in handles[:n_handles].tolist()]  # (the u64 handles)
    for h in keys:
        b = lib.buffers.get(h)
        if b is None or not b.base or not 0 <= b.size < _NE_MAX:
            return None
        found.append(b)
    same = _same_buffer(found)
    sizes = np.array([b.size for b in found], dtype=np.int64)
    view_src = np.ascontiguousarray(parsed.view_src_index, np.int32)
    n_suspects = record_bounds_kernel(extents, offsets, voffs, handle_of, sizes, same, view_src, spans, suspects)
    if n_suspects < 0:
        return None
    return _Records(keys, found, handle_of, offsets, extents, ops, suspects[:n_suspects].tolist())


class TensorInfos(Sequence[TensorInfo]):
    """The `tensor_info` of each tensor of a parsed graph (with `address`, `room` and, where
    kernels do not read host memory, `fetch`), each made when first asked for: in a graph of
    repeated layers the rules run on few of the tensors (apir.host.graph.rule_memo). Only an info
    that was made can hold what a rule left on it (`snapshot`, `read_by`, `id_bounds`,
    `one_thread`): `made()` lists those."""

    def __init__(self, lib: GraphLibrary, parsed, recs: _Records, fetch: bool, id_writers: frozenset = ID_WRITERS):
        self._lib, self._t, self._recs, self._fetch = lib, parsed.tensors, recs, fetch
        self._parsed = parsed
        self._writers = id_writers  # (the profile's: apir.host.graph.computed_ids)
        self._writer_ops = writer_ops(lib.g, id_writers)  # (bool per op: see computed_by)
        # the fields tensor_info reads, as columns (read faster than a record's fields)
        self._columns = tuple(self._t[f] for f in ("type", "op", "ne", "nb", "op_params"))
        self._made: Dict[int, TensorInfo] = {}
        # the row ids its rules copy: at most the bytes of its buffers (each once)
        self._id_reads = IdReads(sum({id(b): b.size for b in recs.found}.values()))

    def __len__(self) -> int:
        return len(self._t)

    def __getitem__(self, i):  # an int index only
        info = self._made.get(i)
        if info is None:
            if not 0 <= i < len(self._t):
                raise IndexError(i)
            recs = self._recs
            buf, offset = recs.found[recs.inverse[i]], int(recs.offsets[i])
            type_, op, ne, nb, params = self._columns
            info = _tensor_info(self._lib, i, type_[i], op[i], ne[i], nb[i], params[i], buf.base + offset)
            info.room = buf.size - offset  # bytes to the end of its buffer (TensorInfo.room)
            info.id_reads = self._id_reads
            if candidate(self._writer_ops, op, self._parsed.view_src_index, i):
                info.computed_by = computed_by(self._lib.g, self._parsed, recs, i, self._writers)
            if self._fetch:
                info.fetch = _Fetcher(self._lib, buf, offset)
            self._made[i] = info
        return info

    @property
    def nbytes(self) -> int:
        """Bytes of the records the infos are made from (kept alive with them)."""
        return int(self._t.nbytes)

    def made(self) -> List[TensorInfo]:
        """The infos made so far, in tensor order."""
        return [self._made[i] for i in sorted(self._made)]


# struct ggml_tensor's fields write_tensors_kernel writes (its `off`), and the record's it reads
_WRITTEN = ("ne", "nb", "op", "op_params", "flags", "name", "buffer", "data", "src", "view_src", "view_offs", "type")
_READ = ("ne", "nb", "op", "op_params", "flags", "name", "view_offs")


def _entries(dt: np.dtype) -> tuple:
    """(bytes of one entry, number of entries) of a field's dtype."""
    return (dt.base.itemsize, dt.shape[0]) if dt.shape else (dt.itemsize, 1)


@functools.lru_cache(maxsize=8)
def _kernel_layout(tensor: np.dtype, rpc: np.dtype, max_src: int) -> Optional[tuple]:
    """write_tensors_kernel's (`off`, `roff`, `width`) for ggml's tensor layout `tensor` and
    the records' `rpc`, or None when a field is not of the width the kernel reads or writes
    (the caller then writes field by field). Once per layout (graph_scratch and
    _create_tensors both ask on every build); the arrays read-only."""
    f: Mapping[str, tuple] = tensor.fields or {}
    r: Mapping[str, tuple] = rpc.fields or {}
    if any(name not in r for name in _READ) or any(name not in f for name in _WRITTEN):
        return None
    width, params, name_len = _entries(r["ne"][0])[0], _entries(r["op_params"][0])[1], _entries(r["name"][0])[1]
    read = {"ne": (width, 4), "nb": (width, 4), "op": (4, 1), "op_params": (4, params), "flags": (4, 1)}
    read.update(name=(1, name_len), view_offs=(8, 1))
    written = dict(read, ne=(8, 4), nb=(8, 4), buffer=(8, 1), data=(8, 1), src=(8, max_src), view_src=(8, 1))
    written.update(type=(4, 1))
    if width not in (4, 8) or any(_entries(r[k][0]) != v for k, v in read.items()):
        return None
    if any(_entries(f[k][0]) != v for k, v in written.items()):
        return None
    off = np.array([f[k][1] for k in _WRITTEN], np.int64)
    roff = np.array([r[k][1] for k in _READ] + [params, name_len], np.int64)
    off.flags.writeable = roff.flags.writeable = False
    return off, roff, width


def _create_tensors(lib: GraphLibrary, parsed, scratch: Scratch, recs: _Records) -> Tuple[np.ndarray, np.ndarray]:
    """The host twins of the checked records (as `TensorChecker.host_from_rpc`, with src and
    view_src pointing at the twins): their addresses (int64) by tensor index, and how many
    source slots name each (int32, `source_uses`: the kernel counts them on its way). Created in
    sources-first order by ggml_new_tensor_1d in the scratch's context and written field by
    field through numpy; where the kernels run and ggml's tensor layout is the one they
    write (`_kernel_layout`), written whole by `write_tensors_kernel` side by side in the
    scratch's `tensor_block` instead (10,000 ggml calls would cost more)."""
    g, chk, t = lib.g, lib.checker, parsed.tensors
    n = len(t)
    type_ = t["type"].astype(np.int64)
    host = np.zeros(n, dtype=np.int64)
    src = np.ascontiguousarray(parsed.src_index, np.int32)
    v = np.ascontiguousarray(parsed.view_src_index, np.int32)
    buffers = np.array([b.ptr for b in recs.found], np.int64)
    bases = np.array([b.base for b in recs.found], np.int64)
    layout = _kernel_layout(chk.tensor_dtype, t.dtype, src.shape[1]) if accel.enabled() else None
    if layout is not None:
        off, roff, width = layout
        stride = chk.tensor_dtype.itemsize  # sizeof(struct ggml_tensor), as check_layout found
        base = scratch.tensor_block(n, stride)
        rows = np.ascontiguousarray(t)  # (kept alive through the call: the kernel reads its address)
        record = (off, rows.ctypes.data, t.dtype.itemsize, roff, width, type_)
        uses = np.zeros(n, np.int32)
        write_tensors_kernel(base, stride, *record, recs.inverse, buffers, bases, recs.offsets, src, v, host, uses)
        return host, uses
    order = parsed.order.astype(np.int64)
    blocks = np.asarray(chk.blck_size_arr, np.int64)[type_]
    scratch.check_room(n)  # (ggml aborts on a full context: its NULL below is never seen)
    for i in order.tolist():  # (each one's ne[0]: a whole block; every field is written below)
        host[i] = g.ggml_new_tensor_1d(scratch.ctx, int(type_[i]), int(blocks[i])) or 0
        if not host[i]:
            raise MemoryError("scratch ggml_context full")
    # Every field as host_from_rpc writes it, tensor by tensor in creation order.
    names = t["name"].view(np.uint8)[order]
    # ggml_set_name on a fresh (zeroed) name: the bytes up to the first NUL, zeros after (the
    # checks found a NUL in every name, so the result's last byte is one too)
    names[np.cumsum(names == 0, axis=1) > 0] = 0
    fields = {
        "ne": t["ne"][order].astype(np.int64),
        "nb": t["nb"][order].astype(np.uint64),
        "op": t["op"][order],
        "op_params": t["op_params"][order],
        "flags": t["flags"][order],
        "buffer": buffers[recs.inverse][order],
        "data": (bases[recs.inverse] + recs.offsets)[order],
        "src": np.where(src >= 0, host[src], 0)[order],
        "view_src": np.where(v >= 0, host[v], 0)[order],
        "view_offs": np.where(v >= 0, t["view_offs"], 0).astype(np.uint64)[order],
    }
    for k, addr in enumerate(host[order].tolist()):
        rec = tensor_record(addr, chk.tensor_dtype)
        for name, values in fields.items():
            rec[name] = values[k]
        rec["name"].view(np.uint8)[...] = names[k]
    return host, source_uses(src, n)


def _node_graph(
    lib: GraphLibrary, parsed, scratch: Scratch, host_at: np.ndarray, uses: np.ndarray, pinned: Optional[np.ndarray]
) -> int:
    """A cgraph in the scratch's context with the guest's nodes (host tensors `host_at`, by
    tensor index), in its order, and their use counts (`uses`, by tensor index) with one more
    for each node of `pinned` (tensor indices; None: no use counts, for a library without the
    setting); MemoryError when the context has no room for it."""
    g, size = lib.g, max(len(parsed.node_index), 1)
    scratch.check_room(0, size)
    graph = g.ggml_new_graph_custom(scratch.ctx, size, False)
    if accel.enabled():  # (one ggml call a node, from a kernel)
        add_nodes_kernel(c_address(g.ggml_graph_add_node), graph, parsed.node_index.astype(np.int64), host_at)
    else:
        for j in parsed.node_index.tolist():
            g.ggml_graph_add_node(graph, int(host_at[j]))
    if pinned is not None:
        # ids writers are never fused away: computed_ids relies on every byte of theirs being
        # written, and ggml-vulkan's fused MoE router writes only the top-k view (and asserts
        # on its strides, which no single op's rule asks of it)
        write = use_counts_kernel if accel.enabled() else None
        wire = guest_use_counts(parsed) if lib.wire_use_counts else None
        fill_use_counts(g, graph, host_at, parsed.node_index, uses, pinned, write, wire)
    return graph


def guest_use_counts(parsed) -> np.ndarray:
    """Each record's `padding` as a little-endian int32: the tensor's use count in the guest's
    whole graph, under the USE_COUNTS extension (docs/protocol.md 12.5)."""
    t = parsed.tensors
    return np.ascontiguousarray(t["padding"]).view("<i4").reshape(len(t))


class BuiltGraph(NamedTuple):
    """A built host graph and what its checks saw (for `apir.host.graph.cache`)."""

    graph: int  # the ggml_cgraph, in the scratch context
    host: np.ndarray  # int64: host tensor address by tensor index
    infos: TensorInfos  # as the rules saw them (snapshots and readers of row ids included)
    src_rows: np.ndarray  # int32[n_tensors, max_src]: src indices per tensor (-1: none)
    buffers: Dict[int, HostBuffer]  # handle -> the HostBuffer the checks saw


def graph_scratch(lib: GraphLibrary, parsed) -> Scratch:
    """A Scratch for `build_graph_parts` of `parsed`: its context has room for the cgraph,
    and for every tensor only where they are made there (a ggml layout `write_tensors_kernel`
    does not write: `_create_tensors`); otherwise they go in its tensor block, and room for
    them in the context would count twice in `Scratch.size` (the graph cache's budget)."""
    t = parsed.tensors
    layout = _kernel_layout(lib.checker.tensor_dtype, t.dtype, parsed.src_index.shape[1]) if accel.enabled() else None
    in_context = layout is None
    return Scratch(lib.g, len(t) if in_context else 0, max(len(parsed.node_index), 1))


def build_graph_parts(lib: GraphLibrary, parsed, scratch: Scratch, enums: OpEnums) -> BuiltGraph:
    """A host cgraph (in `scratch`) for `parsed`, with what its checks saw; raises Refused.
    Every check runs before the first host tensor is made."""
    if len(parsed.node_index) and np.bincount(parsed.node_index).max() > 1:
        raise Refused("graph: a node is listed twice")
    groups = rule_groups(parsed)
    recs = _check_records(lib, parsed) if accel.enabled() else None
    if recs is None:  # (the plain path, or a record the kernels left to the exact checks)
        recs = _check_records_one_by_one(lib, parsed)
    profile = profile_of(lib)
    infos = TensorInfos(lib, parsed, recs, fetch=not profile.host_addressable, id_writers=profile.id_writers)
    _check_spans(lib, parsed, infos, recs)
    check_nodes(infos, parsed.src_index, enums, profile.rules, groups)
    made = infos.made()
    _check_graph_needs(lib, parsed, made, recs, profile)
    # ids writers are pinned (_node_graph)
    pinned = ids_writer_nodes(lib.g, parsed.node_index, recs.ops) if lib.use_counts else None
    host_at, uses = _create_tensors(lib, parsed, scratch, recs)  # per tensor: address, source slots naming it
    graph = _node_graph(lib, parsed, scratch, host_at, uses, pinned)

    # row ids: the kernel reads the copy the rule checked (the guest may write the original,
    # e.g. in a buffer of its memory, between the check and the kernel)
    readers = [info for info in made if info.snapshot is not None]
    if profile.host_addressable:
        for info in readers:
            snapshot = info.snapshot
            assert snapshot is not None
            tensor_record(int(host_at[info.index]), lib.checker.tensor_dtype)["data"] = ctypes.addressof(snapshot)
            scratch.pinned.append(snapshot)
    else:
        point_at_device_copies(lib, [(info, int(host_at[info.index])) for info in readers])
    if profile.device_checks_nodes:
        _check_device_supports(lib, parsed, host_at.tolist())
    return BuiltGraph(graph, host_at, infos, parsed.src_index, dict(zip(recs.handles, recs.found)))


def c_address(fn) -> int:
    """The address of ctypes function `fn` (for the kernels that call it in bulk)."""
    return ctypes.cast(fn, ctypes.c_void_p).value or 0


def _check_device_supports(lib: GraphLibrary, parsed, host) -> None:
    """Every node that computes something passes the device's own `supports_op` (a GPU
    backend aborts on a node it has no kernel for; apir.host.graph.profiles)."""
    supports, op_names, ops = lib.g.ggml_backend_dev_supports_op, lib.g.op_names, parsed.tensors["op"]
    for j in parsed.node_index.tolist():
        op = op_names[int(ops[j])]
        if op not in _EMPTY_OPS and not supports(lib.dev, host[j]):
            raise Refused(f"node {j}: the device does not support {op} of this shape and types")


def _bytes_tensor(lib: GraphLibrary, scratch: Scratch, buffer: int, data: int, n: int) -> int:
    """A 1-d I8 tensor over the `n` bytes at `data` of ggml buffer `buffer`, for copies
    through the backend (ggml_backend_tensor_get / _set)."""
    g = lib.g
    return lib.checker.host_tensor(
        scratch, g.types["I8"], [n, 1, 1, 1], [1, n, n, n], 0, (), 0, b"row ids\0", buffer, data
    )


class _Fetcher:
    """`TensorInfo.fetch` of a tensor at `offset` in HostBuffer `buf`: `fetch(n)`, its first
    `n` bytes copied out through the backend (`ggml_backend_tensor_get` on a byte tensor over
    them). `fetch_row_ids` batches several."""

    __slots__ = ("lib", "buf", "offset")

    def __init__(self, lib: GraphLibrary, buf: HostBuffer, offset: int):
        self.lib, self.buf, self.offset = lib, buf, offset

    def __call__(self, n: int) -> ctypes.Array:
        out = ctypes.create_string_buffer(max(n, 1))
        if n:
            with Scratch(self.lib.g, 1) as s:
                t = _bytes_tensor(self.lib, s, self.buf.ptr, self.buf.base + self.offset, n)
                self.lib.g.ggml_backend_tensor_get(t, ctypes.addressof(out), 0, n)
        return out


def fetch_row_ids(lib: GraphLibrary, infos: List[TensorInfo]) -> List[ctypes.Array]:
    """`shapes.base.copy_ids` of each of `infos` (the copies, in order), with the reads through
    the backend of tensors in buffers that allow it (apir.host.backend.transfers: a device buffer of
    the backend's default type) made asynchronously, one synchronize for all; every other
    tensor read as copy_ids reads it (synchronously)."""
    transfers = lib.transfers
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


def point_at_device_copies(lib: GraphLibrary, snaps) -> None:
    """Where kernels read device memory: the checked row ids (`snaps`: (TensorInfo with a
    snapshot, host tensor)) copied, in one transfer, into a buffer of the device's own type
    (the context's `ids_buffer`, kept between graphs), and each host tensor pointed at its copy (its view_src cleared:
    ggml-vulkan addresses a view through its source). The copies are at most the bytes of
    the graph's buffers, which the context's budget charged (IdReads)."""
    if not snaps:
        return
    g = lib.g
    buft = g.ggml_backend_dev_buffer_type(lib.dev)
    align = max(1, g.ggml_backend_buft_get_alignment(buft))
    offsets, total = [], 0
    for info, _ in snaps:
        offsets.append(total)
        total += -(-len(info.snapshot) // align) * align
    buf = lib.ids_buffer(total)
    if not buf:
        raise Refused(f"graph: no device buffer of {total} bytes for the checked row ids")
    base = g.ggml_backend_buffer_get_base(buf)
    staging = (ctypes.c_char * total)()
    for (info, _), off in zip(snaps, offsets):
        copy_bytes(staging, info.snapshot, dst_offset=off)
    with Scratch(g, 1) as copies:
        g.ggml_backend_tensor_set(_bytes_tensor(lib, copies, buf, base, total), ctypes.addressof(staging), 0, total)
    dtype = lib.checker.tensor_dtype
    for (_, addr), off in zip(snaps, offsets):
        rec = tensor_record(addr, dtype)
        rec["buffer"], rec["data"], rec["view_src"], rec["view_offs"] = buf, base + off, 0, 0
