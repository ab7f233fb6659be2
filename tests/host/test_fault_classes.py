"""Issue 13, classes 1 and 2, the general mechanisms: empty sources (`base.check_empty_sources`),
spans of empty or aliasing tensors (`base.check_span`) and the compute-time work-size bound
(`apir.host.graph.work_plan`), and the class 3 bounds of the conv, matrix and tensor_ops rules. The
issue's examples abort, hang or misread in the host, so each runs in a child process
(tests.host.childkit; its address space limited, so that a regression's huge allocation fails
at once): a regression fails the test, not pytest."""

import logging

import numpy as np
import pytest

from tests.host.childkit import run_in_child
from apir.host.graph.shapes import CHECKED_OPS
from apir.host.graph.shapes.base import check_empty_sources, check_span, rule_name
from tests.host.shapekit import ERROR, Case, Remote, _in, assert_refused_by_rule, ctor, refusal, rule_check

HUGE = (1 << 32) - 1  # the largest ne an apir_rpc_tensor carries (uint32)


# --- builders ---------------------------------------------------------------------------------
def _ct1d(g, ctx):
    k, x = _in(g, ctx, "F32", 3, 2, 4), _in(g, ctx, "F32", 6, 4)
    return ctor(g, "ggml_conv_transpose_1d")(ctx, k, x, 2, 0, 1), [k, x]


def _ct2d(g, ctx):
    k, x = _in(g, ctx, "F16", 3, 2, 3, 4), _in(g, ctx, "F32", 5, 4, 4, 1)
    return ctor(g, "ggml_conv_transpose_2d_p0")(ctx, k, x, 2), [k, x]


def _add_id(g, ctx):
    a, b = _in(g, ctx, "F32", 16, 5, 4), _in(g, ctx, "F32", 16, 5)
    ids = _in(g, ctx, "I32", 5, 4)
    return g.ggml_add_id(ctx, a, b, ids), [a, b, ids]


def _mul_mat_f16(g, ctx):
    a, b = _in(g, ctx, "F16", 64, 8), _in(g, ctx, "F32", 64, 16)
    return g.ggml_mul_mat(ctx, a, b), [a, b]


def _ids(n, rng):
    return rng.integers(0, 5, n).astype(np.int32)


# --- children: each builds its graph, sends the hostile variant, then the valid one ---------
AS_LIMIT = 2 << 30  # a child's address space: a planned work buffer beyond it fails at once


def _in_child(name: str) -> list:
    """In the child: runs `name()` of this module with the address space limited and returns
    the `Refused` objects on apir.host's records (the refusal)."""
    import resource

    from tests.host.shapekit import _Refusals

    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))
    handler = _Refusals()
    log = logging.getLogger("apir.host")
    log.addHandler(handler)
    try:
        globals()[name]()
    finally:
        log.removeHandler(handler)
    return handler.seen


def child_refusal(name: str, timeout: float = 300):
    """`name()` runs in a child process (it asserts the refusal and the next graph itself);
    the one `Refused` it got."""
    seen = run_in_child(_in_child, name, timeout=timeout)
    assert len(seen) == 1, seen
    return seen[0]

def _child_remote(case):
    import apir.ggml
    from tests.host.hostkit import Guest

    g = apir.ggml.load()
    return g, Remote(Guest(), g, case)


def _refused_then_serves(r, recs):
    rc, _ = r.compute(recs)
    assert rc == ERROR, f"hostile graph accepted (rc {rc})"
    rc, dec = r.compute()
    assert rc == 0 and dec.i32() == 0, "the host does not serve the next graph"


def _child_conv_transpose_2d_empty_huge():
    """Issue 13 class 1: CONV_TRANSPOSE_2D whose input has a dimension 0 and huge others.
    Result and sources are empty (extent 0), but ggml_graph_plan sizes the work buffer
    from the input's and kernel's other dimensions: 2 * 26 * (2^32 - 1) bytes (208 GiB), `new`
    throws, SIGABRT."""
    _, r = _child_remote(Case("CONV_TRANSPOSE_2D", _ct2d))
    recs = r.recs.copy()
    k, x, o = r.index(r.inputs[0]), r.index(r.inputs[1]), r.index(r.out)
    recs["ne"][k] = [3, 2, 0, HUGE]  # Cout 0, Cin huge
    recs["ne"][x] = [5, 4, HUGE, 0]  # Cin huge, N 0
    recs["ne"][o][2:] = [0, 0]
    recs["nb"][o][3] = 0  # contiguous, as ggml lays out [OW, OH, 0, 0]
    _refused_then_serves(r, recs)


def _child_add_id_empty_ids():
    """Issue 13 class 1: ADD_ID whose ids have no elements (ne[2] = 0) placed at the very end
    of the buffer: the kernel reads ids[i1, i2] for every row of src0, past the buffer, and
    then rows of src1 at whatever it read there."""
    g, r = _child_remote(Case("ADD_ID", _add_id, data={2: _ids}))
    recs = r.recs.copy()
    i = r.index(r.inputs[2])
    recs["ne"][i][2] = 0
    recs["data"][i] = g.ggml_backend_buffer_get_size(r.remote.local)
    _refused_then_serves(r, recs)


def _child_conv_transpose_1d_channel_stride_0():
    """Issue 13 class 2: CONV_TRANSPOSE_1D whose kernel and input have 2^26 channels at
    stride 0: both fit their few bytes, the rule's int bounds hold, but ggml plans (and
    memsets) 4 * (3*2*2^26 + 6*2^26) bytes = 3 GiB of work buffer."""
    _, r = _child_remote(Case("CONV_TRANSPOSE_1D", _ct1d))
    recs = r.recs.copy()
    k, x = r.index(r.inputs[0]), r.index(r.inputs[1])
    recs["ne"][k][2], recs["nb"][k][2] = 1 << 26, 0
    recs["ne"][x][1], recs["nb"][x][1] = 1 << 26, 0
    _refused_then_serves(r, recs)


def _child_conv_transpose_2d_channel_stride_0():
    """Issue 13 class 2, the 2D variant: 2^26 input channels at stride 0 in the F16 kernel and
    the F32 input: 2 * (18 + 20) * 2^26 bytes = 4.75 GiB of work buffer planned."""
    _, r = _child_remote(Case("CONV_TRANSPOSE_2D", _ct2d))
    recs = r.recs.copy()
    k, x = r.index(r.inputs[0]), r.index(r.inputs[1])
    recs["ne"][k][3], recs["nb"][k][3] = 1 << 26, 0
    recs["ne"][x][2], recs["nb"][x][2] = 1 << 26, 0
    _refused_then_serves(r, recs)


@pytest.mark.parametrize("child, op, rule, why", [
    ("_child_conv_transpose_2d_empty_huge", None, check_span, "ne "),
    ("_child_add_id_empty_ids", "ADD_ID", check_empty_sources, "src2 "),
    ("_child_conv_transpose_1d_channel_stride_0", None, check_span, "ne "),
    ("_child_conv_transpose_2d_channel_stride_0", None, check_span, "ne "),
])
def test_issue_example_is_refused_in_a_child(child, op, rule, why):
    got = child_refusal(child)
    assert (got.op, got.rule) == (op, rule_name(rule)), (got.op, got.rule, str(got))
    assert got.reason.startswith(why), got.reason


# --- the mechanisms, one by one ---------------------------------------------------------------
def _refused(r, recs, rule, why, op=None, node=None):
    """`recs` refused by the check `rule` (a function), for node `node` of op `op` (None: not a
    node's check), its reason containing `why`; the host then serves the unedited graph."""
    got = refusal(r, recs)
    assert (got.node, got.op, got.rule) == (node, op, rule_name(rule)), (got.node, got.op, got.rule, str(got))
    assert why in got.reason, got.reason


@pytest.fixture
def mm(guest, ggml):
    r = Remote(guest, ggml, Case("MUL_MAT", _mul_mat_f16))
    yield r
    r.close()


def test_empty_source_of_a_node_with_elements_is_refused(mm):
    """MUL_MAT with k = 0: the result has elements, its sources none (the general rule,
    before MUL_MAT's own)."""
    recs = mm.recs.copy()
    for t in mm.inputs:
        recs["ne"][mm.index(t)][0] = 0
    _refused(mm, recs, check_empty_sources, "has no elements but the result", "MUL_MAT", mm.index(mm.out))


def test_empty_node_with_empty_sources_is_accepted(mm):
    """Nothing to compute: ggml skips an empty node, so an empty source is fine there."""
    recs = mm.recs.copy()
    b, o = mm.index(mm.inputs[1]), mm.index(mm.out)
    recs["ne"][b][1] = recs["ne"][o][1] = 0
    rc, dec = mm.compute(recs)
    assert rc == 0 and dec.i32() == 0


def test_span_of_an_empty_tensor_beyond_its_buffer_is_refused(mm):
    recs = mm.recs.copy()
    b, o = mm.index(mm.inputs[1]), mm.index(mm.out)
    recs["ne"][b][1] = recs["ne"][o][1] = 0
    recs["ne"][b][2] = recs["ne"][o][2] = HUGE
    _refused(mm, recs, check_span, "spans")


def test_span_of_aliasing_elements_beyond_the_buffer_is_refused(mm):
    recs = mm.recs.copy()
    b, o = mm.index(mm.inputs[1]), mm.index(mm.out)
    recs["ne"][b][2] = recs["ne"][o][2] = 1 << 20
    recs["nb"][b][2] = recs["nb"][b][3] = 0
    recs["nb"][o][2] = recs["nb"][o][3] = 0
    _refused(mm, recs, check_span, "spans")


def test_work_budget_bounds_the_planned_work_buffer(guest, mm, ggml):
    """F16 x F32 MUL_MAT: ggml plans src1 converted to F16 (2 * 64 * 16 bytes) plus a cache
    line per thread; a budget below that refuses the graph, the default computes it."""
    from apir.host.config import CONFIG_KEY_WORK_BUDGET

    lib = guest.ctx._library
    assert lib.n_threads >= 1
    guest.ctx.set_config(CONFIG_KEY_WORK_BUDGET, "1024")
    got = refusal(mm, serves_next=False)
    assert (got.node, got.op, got.rule) == (None, None, "apir.host.graph.work_plan.check_work_size"), str(got)
    assert "work buffer, over the context's work budget of 1024 bytes" in got.reason, got.reason
    guest.ctx.set_config(CONFIG_KEY_WORK_BUDGET, str(2 * 64 * 16 + 64 * lib.n_threads))
    rc, dec = mm.compute()
    assert rc == 0 and dec.i32() == 0
    guest.ctx.set_config(CONFIG_KEY_WORK_BUDGET, "not a number")  # 0: refused
    rc, _ = mm.compute()
    assert rc == ERROR
    del guest.ctx.config[CONFIG_KEY_WORK_BUDGET]
    rc, dec = mm.compute()
    assert rc == 0 and dec.i32() == 0


def test_planned_work_size_is_ggml_graph_plan(ggml):
    """planned_work_size reads ggml_graph_plan's struct result: 2 * 64 * 16 bytes of F16 src1
    plus a 64-byte cache line per thread (CACHE_LINE_SIZE on x86-64 and aarch64)."""
    from apir.host.config import DEFAULT_WORK_BUDGET
    from apir.host.graph.work_plan import planned_work_size
    from tests.host.hostkit import GgmlScratch
    from tests.host.shapekit import _graph

    s = GgmlScratch(ggml)
    try:
        graph, _, _ = _graph(ggml, s.ctx, Case("MUL_MAT", _mul_mat_f16))
        for n_threads in (1, 3):
            assert planned_work_size(ggml, graph, n_threads) == 2 * 64 * 16 + 64 * n_threads
    finally:
        s.close()
    assert DEFAULT_WORK_BUDGET == 1 << 30


# --- class 3: loop counts and `int` arithmetic driven by op_params -----------------------------
BIG = 2**31 - 1


def _pool_1d(g, ctx):
    a = _in(g, ctx, "F32", 4, 1000)
    return ctor(g, "ggml_pool_1d")(ctx, a, 1, 3, 2, 1), [a]


def _pool_2d(g, ctx):
    a = _in(g, ctx, "F32", 9, 8, 64, 4)
    return ctor(g, "ggml_pool_2d")(ctx, a, 1, 3, 2, 2, 2, 1.0, 1.0), [a]


def _pool_2d_back(g, ctx):
    af, grad = _in(g, ctx, "F32", 8, 6, 64), _in(g, ctx, "F32", 4, 3, 64)
    return ctor(g, "ggml_pool_2d_back")(ctx, grad, af, 0, 2, 2, 2, 2, 0.0, 0.0), [af, grad]


def _packed(ne, size=4):
    nb = [size]
    for n in ne[:3]:
        nb.append(nb[-1] * n)
    return nb


def _child_pool_1d_huge_window():
    """POOL_1D loops k0 times per result element, k0 an op_param: k0 = s0 = INT_MAX with
    p0 = 2^30 pools a row of 4 into 1 element, through 2^31 iterations; 1000 rows keep the
    host busy for hours from a 16 KiB graph."""
    _, r = _child_remote(Case("POOL_1D", _pool_1d))
    recs = r.recs.copy()
    o = r.index(r.out)
    recs["op_params"][o][1:4] = [BIG, BIG, 1 << 30]
    recs["ne"][o] = [1, 1000, 1, 1]
    recs["nb"][o] = _packed([1, 1000, 1, 1])
    _refused_then_serves(r, recs)


def _child_pool_2d_huge_window():
    """POOL_2D: a window of INT_MAX rows (stride INT_MAX, padding 2^30) over 9 x 8 planes:
    the kernel loops over every window row (skipping those outside the plane), 2^31
    iterations for each of the 2304 results."""
    _, r = _child_remote(Case("POOL_2D", _pool_2d))
    recs = r.recs.copy()
    o = r.index(r.out)
    recs["op_params"][o][1:7] = [1, BIG, 1, BIG, 0, 1 << 30]  # k0, k1, s0, s1, p0, p1
    recs["ne"][o] = [9, 1, 64, 4]
    recs["nb"][o] = _packed([9, 1, 64, 4])
    _refused_then_serves(r, recs)


def _child_pool_2d_back_huge_window():
    """POOL_2D_BACK: the same window rows, spread from each of 256 gradient elements (whose
    shape the rule did not check against the window)."""
    _, r = _child_remote(Case("POOL_2D_BACK", _pool_2d_back))
    recs = r.recs.copy()
    o, gr = r.index(r.out), r.index(r.inputs[1])
    recs["op_params"][o][1:7] = [2, BIG, 2, BIG, 0, 1 << 30]
    recs["ne"][gr] = [4, 1, 64, 1]
    recs["nb"][gr] = _packed([4, 1, 64, 1])
    _refused_then_serves(r, recs)


@pytest.mark.parametrize("child, op, why", [
    ("_child_pool_1d_huge_window", "POOL_1D", "padding 1073741824 of dimension 0 exceeds"),
    ("_child_pool_2d_huge_window", "POOL_2D", "padding 1073741824 of dimension 1 exceeds"),
    ("_child_pool_2d_back_huge_window", "POOL_2D_BACK", "padding 1073741824 of dimension 1 exceeds"),
])
def test_op_param_loop_count_is_refused_in_a_child(child, op, why):
    got = child_refusal(child, timeout=120)
    assert (got.op, got.rule) == (op, rule_name(CHECKED_OPS[op])), (got.op, got.rule, str(got))
    assert got.reason.startswith(why), got.reason


def test_pool_2d_back_gradient_shape_is_checked(guest, ggml):
    r = Remote(guest, ggml, Case("POOL_2D_BACK", _pool_2d_back))
    try:
        recs = r.recs.copy()
        gr = r.index(r.inputs[1])
        recs["ne"][gr] = [3, 3, 64, 1]
        recs["nb"][gr] = _packed([3, 3, 64, 1])
        _refused(r, recs, CHECKED_OPS["POOL_2D_BACK"], "src0 [3, 3, 64, 1] is not pool_2d's [4, 3]", "POOL_2D_BACK",
                 r.index(r.out))
    finally:
        r.close()


# Bounds that need a tensor larger than a test can allocate are checked at the rule itself
# (shapekit.rule_check: the records as the rules see them, without buffers).
ROWS = 2**31 - 1 - 100  # an `int` row count that wraps once the threads' `nth - 1` is added


def _set_ne(recs, i, ne, size=4):
    """ne and packed nb (a dimension of 1 takes any nb: capped to the wire's uint32)."""
    recs["ne"][i] = ne
    recs["nb"][i] = [b if n != 1 else min(b, 2**32 - 1) for b, n in zip(_packed(ne, size), [2] + list(ne[1:]))]


def _mm_long_rows(r, recs):  # ggml_vec_dot_t(int n, ...): n = ne00 wraps
    for t in r.inputs:  # one row each (a longer F32 row stride would not fit the wire's nb)
        _set_ne(recs, r.index(t), [2**31 + 64, 1, 1, 1], int(recs["nb"][r.index(t)][0]))
    recs["ne"][r.index(r.out)][:2] = [1, 1]


def _out_prod_strides(r, recs):  # ggml_vec_mad_f32_unroll(n, int xs = nb01, int vs = nb11): i * xs wraps
    recs["nb"][r.index(r.inputs[0])][1:] = [1 << 27, 1 << 28, 1 << 28]


def _add_id_rows(r, recs):  # const int nr = ggml_nrows(src0); (nr + nth - 1)/nth wraps
    for t in (r.inputs[0], r.out):
        _set_ne(recs, r.index(t), [16, 5, 4, 1 << 27])


def _acc_rows(r, recs):  # const int nr = ggml_nrows(src1)
    a, b, o = r.index(r.inputs[0]), r.index(r.inputs[1]), r.index(r.out)
    _set_ne(recs, a, [2**31, 1, 1, 1])
    _set_ne(recs, o, [2**31, 1, 1, 1])
    recs["ne"][b] = [1, ROWS, 1, 1]
    recs["op_params"][o][:4] = 0


def _ct1d_rows(r, recs):  # const int nr = ne1 (Cout)
    k, x, o = r.index(r.inputs[0]), r.index(r.inputs[1]), r.index(r.out)
    _set_ne(recs, k, [1, ROWS, 1, 1])
    _set_ne(recs, x, [6, 1, 1, 1])
    _set_ne(recs, o, [11, ROWS, 1, 1])


def _ct2d_planes(r, recs):  # const int np = ne2 (Cout)
    k, x, o = r.index(r.inputs[0]), r.index(r.inputs[1]), r.index(r.out)
    _set_ne(recs, k, [1, 1, ROWS, 1], 2)
    _set_ne(recs, x, [5, 4, 1, 1])
    _set_ne(recs, o, [9, 7, ROWS, 1])


def _mm_f32(g, ctx):
    a, b = _in(g, ctx, "F32", 64, 8), _in(g, ctx, "F32", 64, 16)
    return g.ggml_mul_mat(ctx, a, b), [a, b]


def _out_prod_f32(g, ctx):
    a, b = _in(g, ctx, "F32", 8, 6), _in(g, ctx, "F32", 5, 6)
    return g.ggml_out_prod(ctx, a, b), [a, b]


def _acc(g, ctx):
    a, b = _in(g, ctx, "F32", 16, 5), _in(g, ctx, "F32", 8, 3)
    return ctor(g, "ggml_acc")(ctx, a, b, 64, 320, 320, 0), [a, b]


INT_BOUNDS = [
    ("MUL_MAT", _mm_f32, _mm_long_rows, "rows of 2147483712 exceed the dot product's int"),
    ("MUL_MAT", _mul_mat_f16, _mm_long_rows, "rows of 2147483712 exceed the dot product's int"),
    ("OUT_PROD", _out_prod_f32, _out_prod_strides, "row strides 134217728, 20 exceed"),
    ("ADD_ID", _add_id, _add_id_rows, "src0's rows (2684354560) exceed the kernel's int row count"),
    ("ACC", _acc, _acc_rows, f"src1's rows ({ROWS}) exceed the kernel's int row count"),
    ("CONV_TRANSPOSE_1D", _ct1d, _ct1d_rows, f"result rows ({ROWS}) exceed"),
    ("CONV_TRANSPOSE_2D", _ct2d, _ct2d_planes, f"result planes ({ROWS}) exceed"),
]


@pytest.mark.parametrize("op, build, edit, why", INT_BOUNDS, ids=[f"{c[0]}-{c[2].__name__}" for c in INT_BOUNDS])
def test_int_arithmetic_bound_is_refused_by_the_rule(guest, ggml, op, build, edit, why):
    r = Remote(guest, ggml, Case(op, build, data={2: _ids} if op == "ADD_ID" else None))
    try:
        assert rule_check(guest, r, r.recs) is None  # the unedited graph passes its rule
        recs = r.recs.copy()
        edit(r, recs)
        assert_refused_by_rule(rule_check(guest, r, recs), op, r.index(r.out), why)
    finally:
        r.close()


def test_empty_sources_ok_marks_a_rule_that_allows_them():
    """`base.empty_sources_ok` exempts a rule from `check_empty_sources` (no rule of this host
    is marked: every rule is refused an empty source under a result with elements); and
    int_counted_rules' wrappers keep the mark."""
    import numpy as np

    from apir.host.errors import Refused
    from apir.host.graph.shapes.base import (TensorInfo, allows_empty_sources, check_empty_sources, empty_sources_ok,
                                       int_counted_rules)

    def info(index, ne):
        return TensorInfo(index, "F32", ne, [4, 4 * ne[0], 4 * ne[0] * ne[1], 4 * ne[0] * ne[1] * ne[2]],
                          "ADD", np.zeros(16, np.int32), 4, 1, False, None)

    node, empty = info(1, [4, 2, 1, 1]), info(0, [4, 0, 1, 1])

    def rule(node, srcs, enums=None):
        pass

    assert not allows_empty_sources(rule)
    with pytest.raises(Refused, match="src1 \\[4, 0, 1, 1\\] has no elements"):
        check_empty_sources(node, [node, empty], allows_empty_sources(rule))
    marked = empty_sources_ok(rule)
    assert allows_empty_sources(marked) and allows_empty_sources(int_counted_rules({"ADD": marked})["ADD"])
    check_empty_sources(node, [node, empty], allows_empty_sources(marked))  # no Refused
    check_empty_sources(empty, [node, empty])  # an empty result: not computed, nothing to refuse


def _set_rows_none(g, ctx):
    """test-backend-ops' SET_ROWS of 0 rows: src0 [16, 0, 1, 3] into dst [16, 5, 1, 3]."""
    dst, src = _in(g, ctx, "F32", 16, 5, 1, 3), _in(g, ctx, "F32", 16, 0, 1, 3)
    ids = _in(g, ctx, "I64", 0, 1, 3)
    return g.ggml_set_rows(ctx, dst, src, ids), [dst, src, ids]


def test_set_rows_of_no_rows_computes_like_cpu(guest, ggml):
    """SET_ROWS is marked empty_sources_ok: its kernel loops over src0's rows only. (Refused
    by the general rule before, which failed 93 test-backend-ops cases that pass on CPU.)"""
    from tests.host.shapekit import assert_computes_like_cpu

    assert_computes_like_cpu(guest, ggml, Case("SET_ROWS", _set_rows_none))


def test_empty_tensor_a_little_past_its_buffer_is_accepted(mm):
    """An empty tensor's span may pass its buffer up to the work budget (test-backend-ops'
    empty IM2COL_3D / CONV_3D tensors do): nothing reads it, and ggml's planning of it is
    bounded by the work budget."""
    recs = mm.recs.copy()
    b, o = mm.index(mm.inputs[1]), mm.index(mm.out)
    recs["ne"][b][1] = recs["ne"][o][1] = 0
    recs["ne"][b][2] = recs["ne"][o][2] = 1000  # 256 KB of F32 with ne[1] taken as 1
    rc, dec = mm.compute(recs)
    assert rc == 0 and dec.i32() == 0
