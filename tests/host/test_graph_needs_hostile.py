"""Row ids overwritten before their reader (apir.host.graph.build._check_graph_needs: only the
writes of the nodes up to the last row-id reader count).
Each case is a graph built with ggml's own constructors in one local CPU buffer, its tensors
then moved (`_Built.alias`) so that nodes write over row ids; the same layout goes to the host
through BACKEND_GRAPH_COMPUTE in a child process and is computed by ggml CPU locally. A case
that must be refused is refused naming the node that writes first, and the host then serves
the unedited graph; an accepted case leaves the host buffer byte for byte as ggml CPU leaves
the local one.
- Reader positions: writers before, between and after one or two readers of one ids tensor,
  two ids tensors, a reader writing over its own ids; SET_ROWS, MUL_MAT_ID, GET_ROWS_BACK and
  ADD_ID readers.
- Views: ids a view at offset 16, writers ending exactly at or starting exactly past them
  (accepted) or overlapping one byte (refused); RESHAPE / VIEW of the ids (accepted).
- OPT_STEP_SGD updating in place a tensor over the ids; a reader dropped from the node list.
- Many readers (300 GET_ROWS and 300 CPY writers: first_overlap_kernel's sweep).
- Two buffer handles over one memory (buffer_from_ptr twice on one resource): a CPY through
  one handle over ids named through the other is refused, as in one buffer (`_same_memory`).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import struct
from typing import Callable, Dict, List, NamedTuple, Optional

import numpy as np
import pytest

from apir.codec.constants import ApirBackendCommandType as Cmd
from apir.codec.graph import BufferTable, serialize_graph
from apir.codec.records import rpc_tensor_dtype
from apir.ggml.layout import tensor_record
from apir.ggml.lib import InitParams
from tests.host.childkit import run_in_child

WRAP_RES = 3
GRAPH_NEEDS = "apir.host.graph.build._check_graph_needs"
COMPUTED = "apir.host.graph.computed_ids.check_computed_reads"


# --- building a case ------------------------------------------------------------------------
class _Built(NamedTuple):
    graph: int
    out: int
    named: Dict[str, int]  # name -> tensor
    inputs: List[int]  # written in this order, on both sides


def _in(g, ctx, t, *ne):
    x = getattr(g, f"ggml_new_tensor_{len(ne)}d")(ctx, g.types[t], *ne)
    g.ggml_set_input(x)
    return x


def _graph(g, ctx, *outs, size=0):
    gr = g.ggml_new_graph_custom(ctx, size, False) if size else g.ggml_new_graph(ctx)
    for o in outs:  # expanded in this order: their nodes in this order
        g.ggml_build_forward_expand(gr, o)
    return gr


class Case(NamedTuple):
    build: Callable  # (g, ctx) -> (graph, out, named, inputs, aliases, data)
    refused_by: Optional[str]  # the name of the node that must be named, None: accepted
    wraps: bool = False  # laid out in two buffer_from_ptr wraps of one resource
    drop: tuple = ()  # names of nodes taken out of the node list (leaves with an op)
    size: int = 64
    rule: str = GRAPH_NEEDS  # the check that must refuse it


# aliases: [(name, over, byte offset)]: tensor `name`'s data at tensor `over`'s data + offset
def _ids(n, hi, dtype=np.int32):
    return lambda rng: rng.integers(0, hi, n).astype(dtype)


def _f32(n):
    return lambda rng: rng.standard_normal(n).astype(np.float32)


def _get_then_copy(g, ctx):
    """node 0 reads ids; node 1 (a CPY) writes new ids over them."""
    a, ids, new = _in(g, ctx, "F32", 8, 6), _in(g, ctx, "I32", 3), _in(g, ctx, "I32", 3)
    rows = g.ggml_get_rows(ctx, a, ids)
    cpy = g.ggml_cpy(ctx, new, ids)
    out = g.ggml_add(ctx, rows, rows)
    gr = _graph(g, ctx, rows, cpy, out)
    return gr, out, dict(cpy=cpy, rows=rows), [(a, _f32(48)), (ids, _ids(3, 6)), (new, _ids(3, 6))], []


def _copy_then_get(g, ctx):
    """node 0 (a CPY) writes over ids; the GET_ROWS reads them last."""
    a, ids, new = _in(g, ctx, "F32", 8, 6), _in(g, ctx, "I32", 3), _in(g, ctx, "I32", 3)
    cpy = g.ggml_cpy(ctx, new, ids)
    x = g.ggml_scale(ctx, a, 2.0)
    rows = g.ggml_get_rows(ctx, a, ids)
    gr = _graph(g, ctx, cpy, x, rows)
    return gr, rows, dict(cpy=cpy, rows=rows), [(a, _f32(48)), (ids, _ids(3, 6)), (new, _ids(3, 6))], []


def _middle(writer_first: bool):
    def build(g, ctx):
        a, ids, new = _in(g, ctx, "F32", 8, 6), _in(g, ctx, "I32", 3), _in(g, ctx, "I32", 3)
        s0 = g.ggml_scale(ctx, a, 3.0)
        cpy = g.ggml_cpy(ctx, new, ids)
        rows = g.ggml_get_rows(ctx, s0, ids)
        s1 = g.ggml_scale(ctx, rows, 0.5)
        order = (s0, cpy, rows, s1) if writer_first else (s0, rows, cpy, s1)
        gr = _graph(g, ctx, *order)
        return gr, s1, dict(cpy=cpy), [(a, _f32(48)), (ids, _ids(3, 6)), (new, _ids(3, 6))], []

    return build


def _two_readers(equal: bool):
    """readers at nodes 0 and 2 of one ids tensor, a CPY over them at node 1."""

    def build(g, ctx):
        a, b, ids, new = (
            _in(g, ctx, "F32", 8, 6),
            _in(g, ctx, "F32", 8, 6),
            _in(g, ctx, "I32", 3),
            _in(g, ctx, "I32", 3),
        )
        r0 = g.ggml_get_rows(ctx, a, ids)
        cpy = g.ggml_cpy(ctx, new, ids)
        r1 = g.ggml_get_rows(ctx, a if equal else b, ids)
        out = g.ggml_add(ctx, r0, r1)
        gr = _graph(g, ctx, r0, cpy, r1, out)
        data = [(a, _f32(48)), (b, _f32(48)), (ids, _ids(3, 6)), (new, _ids(3, 6))]
        return gr, out, dict(cpy=cpy), data, []

    return build


def _two_ids(late_writer_before: bool):
    """ids0 read at node 0, ids1 read last; a CPY over ids0 at node 1 (after its only reader),
    and with `late_writer_before` a CPY over ids1 at node 2 (before its reader)."""

    def build(g, ctx):
        a = _in(g, ctx, "F32", 8, 6)
        ids0, ids1, new0, new1 = (_in(g, ctx, "I32", 3) for _ in range(4))
        r0 = g.ggml_get_rows(ctx, a, ids0)
        c0 = g.ggml_cpy(ctx, new0, ids0)
        c1 = g.ggml_cpy(ctx, new1, ids1)
        s = g.ggml_scale(ctx, r0, 2.0)
        r1 = g.ggml_get_rows(ctx, a, ids1)
        out = g.ggml_add(ctx, s, r1)
        order = (r0, c0, c1, s, r1, out) if late_writer_before else (r0, c0, s, r1, c1, out)
        gr = _graph(g, ctx, *order)
        data = [(a, _f32(48)), (ids0, _ids(3, 6)), (ids1, _ids(3, 6)), (new0, _ids(3, 6)), (new1, _ids(3, 6))]
        return gr, out, dict(c0=c0, c1=c1), data, []

    return build


def _reader_over_own_ids(g, ctx):
    """GET_ROWS of an I32 table (ids are I32 too) whose result lies over its own ids."""
    a, ids = _in(g, ctx, "I32", 3, 6), _in(g, ctx, "I32", 3)
    rows = g.ggml_get_rows(ctx, a, ids)  # [3, 3] I32
    gr = _graph(g, ctx, rows)
    return gr, rows, dict(rows=rows), [(a, _ids(18, 6)), (ids, _ids(3, 6))], [("rows", "ids_of_rows", 0)]


def _set_rows_over_ids(g, ctx):
    """SET_ROWS whose destination (an I64-sized F32 table) lies over its own I64 ids."""
    dst, src, ids = _in(g, ctx, "F32", 2, 4), _in(g, ctx, "F32", 2, 2), _in(g, ctx, "I64", 2)
    out = g.ggml_set_rows(ctx, dst, src, ids)
    gr = _graph(g, ctx, out)
    data = [(dst, _f32(8)), (src, _f32(4)), (ids, lambda rng: np.array([0, 1], np.int64))]
    return gr, out, dict(out=out), data, [("dst", "ids_of_out", 0)]


def _mul_mat_id(writer_first: bool):
    def build(g, ctx):
        as_ = _in(g, ctx, "F32", 16, 4, 3)  # 3 experts
        b = _in(g, ctx, "F32", 16, 2, 5)
        ids, new = _in(g, ctx, "I32", 2, 5), _in(g, ctx, "I32", 2, 5)
        cpy = g.ggml_cpy(ctx, new, ids)
        mm = g.ggml_mul_mat_id(ctx, as_, b, ids)
        out = g.ggml_scale(ctx, mm, 1.0)
        gr = _graph(g, ctx, *((cpy, mm, out) if writer_first else (mm, cpy, out)))
        data = [(as_, _f32(192)), (b, _f32(160)), (ids, _ids(10, 3)), (new, _ids(10, 3))]
        return gr, out, dict(cpy=cpy), data, []

    return build


def _get_rows_back(writer_first: bool):
    def build(g, ctx):
        grad, ids, new, like = (
            _in(g, ctx, "F32", 4, 3),
            _in(g, ctx, "I32", 3),
            _in(g, ctx, "I32", 3),
            _in(g, ctx, "F32", 4, 5),
        )
        cpy = g.ggml_cpy(ctx, new, ids)
        back = g.ggml_get_rows_back(ctx, grad, ids, like)
        out = g.ggml_scale(ctx, back, 1.0)
        gr = _graph(g, ctx, *((cpy, back, out) if writer_first else (back, cpy, out)))
        data = [(grad, _f32(12)), (ids, _ids(3, 5)), (new, _ids(3, 5)), (like, _f32(20))]
        return gr, out, dict(cpy=cpy), data, []

    return build


def _add_id(writer_first: bool):
    def build(g, ctx):
        a, b = _in(g, ctx, "F32", 8, 2, 3), _in(g, ctx, "F32", 8, 4)
        ids, new = _in(g, ctx, "I32", 2, 3), _in(g, ctx, "I32", 2, 3)
        cpy = g.ggml_cpy(ctx, new, ids)
        add = g.ggml_add_id(ctx, a, b, ids)
        out = g.ggml_scale(ctx, add, 1.0)
        gr = _graph(g, ctx, *((cpy, add, out) if writer_first else (add, cpy, out)))
        data = [(a, _f32(48)), (b, _f32(32)), (ids, _ids(6, 4)), (new, _ids(6, 4))]
        return gr, out, dict(cpy=cpy), data, []

    return build


def _view_edge(lo: int, n: int, empty_first: bool = False):
    """ids: the 3 I32 at bytes [16, 28) of an 8-element I32 tensor `t`; a CPY (before the
    reader) writes `n` I32 at byte `lo` of t (a view); with `empty_first` a RESHAPE and a VIEW
    of the ids are nodes before the reader too."""

    def build(g, ctx):
        a, t = _in(g, ctx, "F32", 8, 6), _in(g, ctx, "I32", 8)
        new = _in(g, ctx, "I32", n)
        ids = g.ggml_view_1d(ctx, t, 3, 16)
        part = g.ggml_view_1d(ctx, t, n, lo)
        cpy = g.ggml_cpy(ctx, new, part)
        first = [cpy]
        reads = ids
        if empty_first:
            r = g.ggml_reshape_2d(ctx, ids, 3, 1)
            reads = g.ggml_view_1d(ctx, r, 3, 0)
            first = [reads, cpy]
        rows = g.ggml_get_rows(ctx, a, reads)
        gr = _graph(g, ctx, *first, rows)
        return gr, rows, dict(cpy=cpy), [(a, _f32(48)), (t, _ids(8, 6)), (new, _ids(n, 6))], []

    return build


def _opt_step(writer_first: bool):
    """OPT_STEP_SGD updates its parameters `w` (F32, over the I32 ids' bytes) in place."""

    def build(g, ctx):
        a, ids = _in(g, ctx, "F32", 8, 6), _in(g, ctx, "I32", 4)
        w, grad, params = _in(g, ctx, "F32", 4), _in(g, ctx, "F32", 4), _in(g, ctx, "F32", 2)
        g.ggml_set_param(w)
        step = g.ggml_opt_step_sgd(ctx, w, grad, params)
        rows = g.ggml_get_rows(ctx, a, ids)
        out = g.ggml_scale(ctx, rows, 1.0)
        gr = _graph(g, ctx, *((step, rows, out) if writer_first else (rows, step, out)))
        data = [
            (a, _f32(48)),
            (w, lambda rng: np.zeros(4, np.float32)),
            (ids, _ids(4, 6)),
            (grad, lambda rng: np.full(4, -1e-44, np.float32)),
            (params, lambda rng: np.array([1.0, 0.0], np.float32)),
        ]
        return gr, out, dict(step=step, rows=rows), data, [("w", "ids_of_rows", 0)]

    return build


def _leaf_reader(g, ctx):
    """GET_ROWS taken out of the node list: a leaf with an op, read as data by the ADD; a CPY
    over its ids before the ADD."""
    a, ids, new, x = _in(g, ctx, "F32", 8, 6), _in(g, ctx, "I32", 3), _in(g, ctx, "I32", 3), _in(g, ctx, "F32", 8, 3)
    rows = g.ggml_get_rows(ctx, a, ids)
    cpy = g.ggml_cpy(ctx, new, ids)
    out = g.ggml_add(ctx, rows, x)
    gr = _graph(g, ctx, cpy, out)
    data = [
        (a, _f32(48)),
        (ids, _ids(3, 6)),
        (new, lambda rng: np.array([99, -5, 7], np.int32)),
        (x, _f32(24)),
        (rows, _f32(24)),
    ]
    return gr, out, dict(rows=rows, cpy=cpy), data, []


def _many(bad: Optional[int], n=300):
    """n GET_ROWS, each of its own ids, and n CPYs each over one reader's ids after it (reader
    `bad`'s writer before it instead)."""

    def build(g, ctx):
        a = _in(g, ctx, "F32", 4, 6)
        ids = [_in(g, ctx, "I32", 2) for _ in range(n)]
        new = _in(g, ctx, "I32", 2)
        order, named, acc = [], {}, None
        readers = [g.ggml_get_rows(ctx, a, i) for i in ids]
        writers = [g.ggml_cpy(ctx, new, i) for i in ids]
        for k in range(n):
            order += [writers[k], readers[k]] if k == bad else [readers[k], writers[k]]
        acc = readers[0]
        for r in readers[1:4]:
            acc = g.ggml_add(ctx, acc, r)
        order.append(acc)
        named["bad"] = writers[bad if bad is not None else 0]
        data = [(a, _f32(24))] + [(i, _ids(2, 6)) for i in ids] + [(new, _ids(2, 6))]
        return _graph(g, ctx, *order, size=4096), acc, named, data, []

    return build


def _two_handles(writer_first: bool):
    """A CPY writes `ids_w`; GET_ROWS reads `ids_r`, another record over the same bytes. With
    the case's `wraps`, laid out in one resource wrapped twice: the CPY and ids_w named through
    the second handle, ids_r through the first."""

    def build(g, ctx):
        a, ids_w, ids_r, new = (
            _in(g, ctx, "F32", 8, 6),
            _in(g, ctx, "I32", 3),
            _in(g, ctx, "I32", 3),
            _in(g, ctx, "I32", 3),
        )
        cpy = g.ggml_cpy(ctx, new, ids_w)
        rows = g.ggml_get_rows(ctx, a, ids_r)
        out = g.ggml_scale(ctx, rows, 1.0)
        gr = _graph(g, ctx, *((cpy, rows, out) if writer_first else (rows, cpy, out)))
        data = [
            (a, _f32(48)),
            (ids_w, _ids(3, 6)),
            (ids_r, _ids(3, 6)),
            (new, lambda rng: np.array([5, 5, 5], np.int32)),
        ]
        return gr, out, dict(cpy=cpy, second=cpy, ids_w=ids_w, ids_r=ids_r), data, [("ids_r", "ids_w", 0)]

    return build


def _computed_ids(op: str, order: str = "natural", reader: str = "get_rows", bound: int = 6):
    """Row ids a node of the graph computes (ARGSORT, or TOP_K 2, of `bound` columns), read by
    `reader` out of 6 rows (GET_ROWS, MUL_MAT_ID's experts, SET_ROWS); `order`: "natural"
    (writer, reader), "view" (the reader reads a view of the result), "reader_first" (the
    reader listed before its writer: it reads the guest's stale ids), "cpy_between" (a CPY
    over the ids between the two), "not_computed" (the writer without GGML_TENSOR_FLAG_COMPUTE)."""

    def build(g, ctx):
        x, new = _in(g, ctx, "F32", bound, 2), _in(g, ctx, "I32", 2)
        t = g.ggml_argsort(ctx, x, 0) if op == "ARGSORT" else g.ggml_top_k(ctx, x, 2)
        ids = t
        if order == "view" or (reader == "mul_mat_id" and op == "ARGSORT"):
            ids = g.ggml_view_2d(ctx, t, 2, 2, int(tensor_record(t, g.tensor_dtype)["nb"][1]), 0)
        data = [(x, _f32(2 * bound)), (new, _ids(2, 6))]
        if reader == "get_rows":
            a = _in(g, ctx, "F32", 8, 6, 2)
            rd = g.ggml_get_rows(ctx, a, ids)
            data = [(a, _f32(96))] + data
        elif reader == "mul_mat_id":
            as_, b = _in(g, ctx, "F32", 16, 4, 6), _in(g, ctx, "F32", 16, 2, 2)  # 6 experts
            rd = g.ggml_mul_mat_id(ctx, as_, b, ids)
            data = [(as_, _f32(384)), (b, _f32(64))] + data
        else:  # 2 rows of `src` into a table of 6
            dst, src = _in(g, ctx, "F32", 4, 6), _in(g, ctx, "F32", 4, 2)
            rd = g.ggml_set_rows(ctx, dst, src, g.ggml_view_1d(ctx, ids, 2, 0))
            data = [(dst, _f32(24)), (src, _f32(8))] + data
        out = g.ggml_scale(ctx, rd, 1.0)
        named = dict(writer=t, rd=rd, second=ids)  # (`wraps`: the view and the result in the second)
        steps = [t, rd, out]
        if order == "cpy_between":
            named["cpy"] = g.ggml_cpy(ctx, new, g.ggml_view_1d(ctx, t, 2, 0))
            steps = [t, named["cpy"], rd, out]
        gr = _graph(g, ctx, *steps)
        if order == "not_computed":  # (ggml skips the writer: the ids would be the buffer's)
            tensor_record(t, g.tensor_dtype)["flags"] &= ~g.tensor_flags["COMPUTE"]
            n = int(np.prod(tensor_record(t, g.tensor_dtype)["ne"]))
            data.append((t, lambda rng: np.zeros(n, np.int32)))
        if order == "reader_first":
            _swap_nodes(g, gr, t, rd)
            n = int(np.prod(tensor_record(t, g.tensor_dtype)["ne"]))
            data.append((t, lambda rng: np.zeros(n, np.int32)))  # (the stale ids: in range)
        return gr, out, named, data, []

    return build


CASES = {
    "argsort_get_rows": Case(_computed_ids("ARGSORT"), None),
    "argsort_view_get_rows": Case(_computed_ids("ARGSORT", "view"), None),
    "top_k_get_rows": Case(_computed_ids("TOP_K"), None),
    "argsort_mul_mat_id": Case(_computed_ids("ARGSORT", reader="mul_mat_id"), None),
    "top_k_mul_mat_id": Case(_computed_ids("TOP_K", reader="mul_mat_id"), None),
    "argsort_set_rows": Case(_computed_ids("ARGSORT", reader="set_rows"), None),
    "argsort_out_of_bound": Case(_computed_ids("ARGSORT", bound=7), "writer"),
    "argsort_cpy_between": Case(_computed_ids("ARGSORT", "cpy_between"), "cpy", rule=COMPUTED),
    "top_k_cpy_between": Case(_computed_ids("TOP_K", "cpy_between", "mul_mat_id"), "cpy", rule=COMPUTED),
    "argsort_after_reader": Case(_computed_ids("ARGSORT", "reader_first"), "rd", rule=COMPUTED),
    # a writer ggml skips: the ids are read before compute (in range here, so the graph is
    # refused for the writer listed before the reader, though it writes nothing)
    "argsort_not_computed": Case(_computed_ids("ARGSORT", "not_computed"), "writer"),
    # in a guest resource: the guest may write them during compute, so they are read (and refused)
    "argsort_in_guest_memory": Case(_computed_ids("ARGSORT", "view"), "writer", wraps=True),
    # read before compute (ids up to 7 for 6 rows), then written through the copy's tensor
    "argsort_written_after_copy": Case(_computed_ids("ARGSORT", "reader_first", bound=7), "writer"),
    "top_k_written_after_copy": Case(_computed_ids("TOP_K", "reader_first", "mul_mat_id", 7), "writer"),
    "reader_first": Case(_get_then_copy, None),
    "reader_last": Case(_copy_then_get, "cpy"),
    "middle_writer_before": Case(_middle(True), "cpy"),
    "middle_writer_after": Case(_middle(False), None),
    "two_readers": Case(_two_readers(False), "cpy"),
    "two_equal_readers": Case(_two_readers(True), "cpy"),
    "two_ids_ok": Case(_two_ids(False), None),
    "two_ids_late_before": Case(_two_ids(True), "c1"),
    "reader_over_own_ids": Case(_reader_over_own_ids, "rows"),
    "set_rows_over_ids": Case(_set_rows_over_ids, "out"),
    "mul_mat_id_before": Case(_mul_mat_id(True), "cpy"),
    "mul_mat_id_after": Case(_mul_mat_id(False), None),
    "get_rows_back_before": Case(_get_rows_back(True), "cpy"),
    "get_rows_back_after": Case(_get_rows_back(False), None),
    "add_id_before": Case(_add_id(True), "cpy"),
    "add_id_after": Case(_add_id(False), None),
    "view_ends_at_ids": Case(_view_edge(8, 2), None),
    "view_starts_past_ids": Case(_view_edge(28, 1), None),
    "view_last_byte_before": Case(_view_edge(12, 2), "cpy"),
    "view_first_byte_after": Case(_view_edge(24, 2), "cpy"),
    "empty_ops_before_reader": Case(_view_edge(0, 1, empty_first=True), None),
    "opt_step_before": Case(_opt_step(True), "step"),
    "opt_step_after": Case(_opt_step(False), None),
    "leaf_reader": Case(_leaf_reader, None, drop=("rows",)),
    "many_one_before": Case(_many(137), "bad", size=4096),
    "many_none_before": Case(_many(None), None, size=4096),
    "other_record_writer_first": Case(_two_handles(True), "cpy"),
    "two_handles_writer_first": Case(_two_handles(True), "cpy", wraps=True),
    "two_handles_writer_after": Case(_two_handles(False), None, wraps=True),
}


# --- in the child: lay out, compute on both sides, compare ----------------------------------
def _data_of(t):
    return int(tensor_record(t, _G.tensor_dtype)["data"])


_G = None


def _all_tensors(g, graph) -> List[int]:
    """Every tensor the graph reaches (nodes, their sources and view sources), sources first."""
    seen: Dict[int, None] = {}

    def walk(t):
        if not t or t in seen:
            return
        r = tensor_record(t, g.tensor_dtype)
        for s in r["src"].tolist() + [int(r["view_src"])]:
            walk(int(s))
        seen[t] = None

    for i in range(g.ggml_graph_n_nodes(graph)):
        walk(g.ggml_graph_node(graph, i))
    return list(seen)


def _drop_node(g, graph, t) -> None:
    """Takes tensor t out of the cgraph's node list (struct ggml_cgraph: int size, n_nodes,
    n_leafs, then the nodes array pointer)."""
    n = g.ggml_graph_n_nodes(graph)
    nodes = (ctypes.c_void_p * n).from_address(ctypes.c_void_p.from_address(graph + 16).value)
    kept = [p for p in nodes if p != t]
    assert len(kept) == n - 1
    for i, p in enumerate(kept):
        nodes[i] = p
    ctypes.c_int.from_address(graph + 4).value = n - 1
    assert g.ggml_graph_n_nodes(graph) == n - 1 and t not in [g.ggml_graph_node(graph, i) for i in range(n - 1)]


def _swap_nodes(g, graph, a, b) -> None:
    """Swaps tensors a and b in the cgraph's node list (as `_drop_node` reads it)."""
    n = g.ggml_graph_n_nodes(graph)
    nodes = (ctypes.c_void_p * n).from_address(ctypes.c_void_p.from_address(graph + 16).value)
    i, j = list(nodes).index(a), list(nodes).index(b)
    nodes[i], nodes[j] = b, a


class Outcome(NamedTuple):
    rc: int
    refused: Optional[tuple]  # (node, op, rule, reason) of the one Refused, or None
    want_node: Optional[int]  # the record index of the node the case names
    same_as_cpu: Optional[bool]  # accepted: the host buffer equals ggml CPU's local buffer
    result_changed: Optional[bool]  # accepted: the result is not the buffer's bytes before
    next_rc: int  # the host serving on: a device count after it


def _run_case(g, guest, name: str) -> Outcome:
    from apir.host.errors import Refused

    case = CASES[name]
    room = g.ggml_tensor_overhead() * (4 * case.size + 64) + g.ggml_graph_overhead_custom(max(case.size, 2048), False)
    ctx = g.ggml_init(InitParams(room, None, True))
    try:
        graph, out, named, data, aliases = case.build(g, ctx)
        for d in case.drop:
            _drop_node(g, graph, named[d])
        g.ggml_set_output(out)
        dev = g.ggml_backend_dev_by_type(0)
        local = g.ggml_backend_alloc_ctx_tensors_from_buft(ctx, g.ggml_backend_dev_buffer_type(dev))
        base, size = g.ggml_backend_buffer_get_base(local), g.ggml_backend_buffer_get_size(local)
        everything = _all_tensors(g, graph)

        # the aliases: "x" a name, "ids_of_y": the ids source of named tensor y
        def resolve(key):
            if key.startswith("ids_of_"):
                r = tensor_record(named[key[7:]], g.tensor_dtype)
                op = g.op_names[int(r["op"])]
                slot = {"GET_ROWS": 1, "SET_ROWS": 1}[op]  # (SET_ROWS: rows, ids, destination)
                return int(r["src"][slot])
            if key in named:
                return named[key]
            # an input by role: the SET_ROWS destination (its src[2]), the OPT_STEP parameters
            r = tensor_record(named["out" if key == "dst" else "step"], g.tensor_dtype)
            return int(r["src"][2 if key == "dst" else 0])

        for who, over, off in aliases:
            t = resolve(who)
            tensor_record(t, g.tensor_dtype)["data"] = _data_of(resolve(over)) + off
        for t in everything:  # views follow their sources
            r = tensor_record(t, g.tensor_dtype)
            if int(r["view_src"]):
                r["data"] = _data_of(int(r["view_src"])) + int(r["view_offs"])
        ctypes.memset(base, 0, size)
        # the host side: an allocated buffer, or two wraps of one resource
        if case.wraps:
            mem = mmap.mmap(-1, 4 * mmap.PAGESIZE)
            guest.ctx.add_resource(WRAP_RES, mem)
            handles = []
            for _ in range(2):
                rc, d = guest.forward(
                    Cmd.DEVICE_BUFFER_FROM_PTR, lambda e: (e.u32(WRAP_RES), e.size_t(size), e.size_t(size))
                )
                assert rc == 0
                handles.append(d.handle())
            handle = handles[0]
        else:
            handle = guest.alloc(size)
        hbuf = guest.ctx._library.buffers.get(handle)
        assert hbuf.size >= size
        ctypes.memset(hbuf.base, 0, hbuf.size)
        table = BufferTable()
        table.register(local, handle, base)
        wire = bytearray(serialize_graph(g, graph, table).tobytes())
        n_nodes = struct.unpack_from("<I", wire, 0)[0]
        head = 4 + 8 * n_nodes + 4
        recs = np.frombuffer(wire, rpc_tensor_dtype(g.limits), offset=head)
        index = {int(t): i for i, t in enumerate(recs["id"].tolist())}
        if case.wraps:  # the second handle names the CPY and its destination's tensors
            cpy = tensor_record(named["second"], g.tensor_dtype)
            for t in (named["second"], int(cpy["view_src"])):
                recs["buffer"][index[t]] = handles[1]
        wire = bytes(wire)
        # inputs, the same bytes on both sides, in order
        rng = np.random.default_rng(7)
        for t, make in data:
            b = make(rng).tobytes()
            assert len(b) == g.ggml_nbytes(t), (name, len(b), g.ggml_nbytes(t))
            ctypes.memmove(_data_of(t), b, len(b))
            ctypes.memmove(hbuf.base + _data_of(t) - base, b, len(b))
        before = ctypes.string_at(base, size)
        assert ctypes.string_at(hbuf.base, size) == before
        # the host
        seen: list = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda r: seen.append(r.refusal) if isinstance(getattr(r, "refusal", None), Refused) else None
        log = logging.getLogger("apir.host")
        log.addHandler(handler)
        try:
            guest.data[: len(wire)] = wire
            rc, dec = guest.forward(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(2), e.size_t(len(wire))))
            status = dec.i32() if rc == 0 else None
        finally:
            log.removeHandler(handler)
        refused = None
        if len(seen) == 1:
            f = seen[0]
            refused = (f.node, f.op, f.rule, f.reason)
        assert len(seen) <= 1, seen
        want = index[named[case.refused_by]] if case.refused_by else None
        same = changed = None
        if rc == 0:
            assert status == 0, status
            backend = g.ggml_backend_dev_init(dev, None)
            g.ggml_backend_cpu_set_n_threads(backend, 2)
            assert g.ggml_backend_graph_compute(backend, graph) == 0
            g.ggml_backend_free(backend)
            got = ctypes.string_at(hbuf.base, size)
            same = got == ctypes.string_at(base, size)
            o = _data_of(out) - base
            changed = got[o : o + g.ggml_nbytes(out)] != before[o : o + g.ggml_nbytes(out)]
        next_rc = guest.forward(Cmd.DEVICE_GET_COUNT)[0]
        if case.wraps:
            for h in handles:
                assert guest.forward(Cmd.BUFFER_FREE_BUFFER, lambda e, h=h: e.handle(h))[0] == 0
            guest.ctx.remove_resource(WRAP_RES)
        else:
            assert guest.forward(Cmd.BUFFER_FREE_BUFFER, lambda e: e.handle(handle))[0] == 0
        g.ggml_backend_buffer_free(local)
        return Outcome(rc, refused, want, same, changed, next_rc)
    finally:
        g.ggml_free(ctx)


def run_cases(names) -> Dict[str, object]:
    """In the child: every case on one host context; each outcome, or the exception's text."""
    global _G
    import apir.ggml
    from tests.host.hostkit import Guest

    g = _G = apir.ggml.load()
    guest = Guest()
    out: Dict[str, object] = {}
    for name in names:
        try:
            out[name] = _run_case(g, guest, name)
        except Exception as e:  # noqa: BLE001 (reported to the parent, which fails the case)
            out[name] = f"{type(e).__name__}: {e}"
    guest.close()
    return out


@pytest.fixture(scope="module")
def outcomes():
    return run_in_child(run_cases, list(CASES), timeout=240)


@pytest.mark.parametrize("name", list(CASES))
def test_row_ids_overwritten_before_a_reader(outcomes, name):
    got = outcomes[name]
    assert isinstance(got, Outcome), got
    case = CASES[name]
    assert got.next_rc == 0, got  # the host serves on
    if case.refused_by is not None:
        assert got.rc == 1, got  # BACKEND_RC_ERROR
        node, op, rule, reason = got.refused
        assert (node, rule) == (got.want_node, case.rule), got
        assert reason.startswith("row ids"), reason
    else:
        assert (got.rc, got.refused) == (0, None), got
        assert got.same_as_cpu, got
        assert got.result_changed, got
