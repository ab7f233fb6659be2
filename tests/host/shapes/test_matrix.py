"""apir.host.graph.shapes.matrix: MUL_MAT, MUL_MAT_ID, OUT_PROD, GET_ROWS, GET_ROWS_BACK, SET_ROWS and
ADD_ID in the layouts test-backend-ops uses (permuted and broadcast sources, F16 / BF16 /
quantized types, ids that are views). Each case, built with ggml's own constructor, computes
through the host to ggml CPU's own bytes; a lying shape is refused by the op's rule (asserted
on the refusal's node, op, rule and reason) and the host serves on; row ids out of range, ids
the graph computes or overwrites, and kernel layouts ggml would abort on are refused. Every
GGML_ASSERT of these ops' CPU kernels is in KERNEL_ASSERTS, with a graph against it that the
rule refuses or the reason none reaches it (tests/host/kernelkit.py)."""

import ctypes

import re

import numpy as np
import pytest

from apir.codec.constants import ApirBackendCommandType as Cmd
from apir.host.graph.shapes import matrix as rules
from apir.host.graph.shapes import op_enums
from apir.host.graph.shapes.base import check_span, rule_name
from tests.host.kernelkit import (
    I32,
    Cover,
    Why,
    cpu_sources,
    found_any,
    missing_asserts,
    v,
    violation_refusal,
    violations,
)
from apir.ggml.features import Feature
from tests.host.shapekit import (
    edited_refusal,
    Case,
    Remote,
    _data,
    _direct,
    _in,
    _ints,
    assert_computes_like_cpu,
    assert_matches_ggml_cpu,
    assert_refused_by_rule,
    case_id,
    g_nb,
    lie_refusal,
    random_blocks,
    refusal,
    rule_check,
)


def _f16_blocks(block_bytes, blck=32):
    """Blocks whose leading F16 scale is a small finite number (Q8_0, Q4_0), the rest random."""
    def make(n, rng):
        raw = rng.integers(0, 256, (n // blck, block_bytes)).astype(np.uint8)
        raw[:, :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        return raw.ravel()
    return make


def _bf16(n, rng):
    return (rng.standard_normal(n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


Q8_0, Q4_0 = _f16_blocks(34), _f16_blocks(18)


def _mul_mat(ta, tb, ne_a=(64, 5, 2, 1), ne_b=(64, 3, 4, 1), permute_b=False):
    """mul_mat(a, b); with permute_b, b is made [k, n, ...] permuted (0, 2, 1, 3) as
    test-backend-ops' per=[0,2,1,3] (rows of elements at strides that are not packed)."""
    def build(g, ctx):
        a = _in(g, ctx, ta, *ne_a)
        if permute_b:
            b = _in(g, ctx, tb, ne_b[0], ne_b[2], ne_b[1], ne_b[3])
            bp = g.ggml_permute(ctx, b, 0, 2, 1, 3)
        else:
            b = bp = _in(g, ctx, tb, *ne_b)
        return g.ggml_mul_mat(ctx, a, bp), [a, b]
    return build


def _mul_mat_id(ta, n_mats=4, n_used=2, n_tokens=3, k=32, m=5, b1=False):
    """test-backend-ops' mul_mat_id: ids a view of the first n_used of n_mats columns."""
    def build(g, ctx):
        as_ = _in(g, ctx, ta, k, m, n_mats)
        ids = _in(g, ctx, "I32", n_mats, n_tokens)
        idv = g.ggml_view_2d(ctx, ids, n_used, n_tokens, n_mats * 4, 0) if n_used != n_mats else ids
        b = _in(g, ctx, "F32", k, 1 if b1 else n_used, n_tokens)
        return g.ggml_mul_mat_id(ctx, as_, b, idv), [as_, ids, b]
    return build


def _out_prod(ta, trans_b=False, ne_a=(8, 6, 2, 1), nr=1):
    def build(g, ctx):
        m, k, b2, b3 = ne_a
        a = _in(g, ctx, ta, *ne_a)
        if trans_b:
            b = _in(g, ctx, "F32", k, 5, b2 * nr, b3)
            bp = g.ggml_transpose(ctx, b)
        else:
            b = bp = _in(g, ctx, "F32", 5, k, b2 * nr, b3)
        return g.ggml_out_prod(ctx, a, bp), [a, b]
    return build


def _get_rows(ta, n=32, m=6, r=4, be1=2, view=False):
    def build(g, ctx):
        a = _in(g, ctx, ta, n, m, be1)
        rows = _in(g, ctx, "I32", r, be1)
        rv = g.ggml_view_2d(ctx, rows, r // 2, be1, r * 4, 0) if view else rows
        return g.ggml_get_rows(ctx, a, rv), [a, rows]
    return build


def _get_rows_back(ta, view=False):
    def build(g, ctx):
        grad = _in(g, ctx, ta, 8, 4)
        rows = _in(g, ctx, "I32", 4)
        rv = g.ggml_view_1d(ctx, rows, 2, 0) if view else rows
        fwd = _in(g, ctx, "F32", 8, 6)
        return g.ggml_get_rows_back(ctx, grad, rv, fwd), [grad, rows, fwd]
    return build


def _set_rows(t_src, t_dst, t_idx, ne0=64, r=3, view=False):
    def build(g, ctx):
        dst = _in(g, ctx, t_dst, ne0, 10, 2, 3)
        src = _in(g, ctx, t_src, ne0, r, 2, 3)
        ids = _in(g, ctx, t_idx, r, 1, 3)
        sv, iv = src, ids
        if view:
            sv = g.ggml_view_4d(ctx, src, ne0, r // 2, 2, 3, *(g_nb(g, src, i) for i in (1, 2, 3)), 0)
            iv = g.ggml_view_3d(ctx, ids, r // 2, 1, 3, g_nb(g, ids, 1), g_nb(g, ids, 2), 0)
        return g.ggml_set_rows(ctx, dst, sv, iv), [dst, src, ids]
    return build


def _add_id(n_experts=5, n_used=3, n_tokens=4, view=True):
    def build(g, ctx):
        a = _in(g, ctx, "F32", 16, n_used, n_tokens)
        b = _in(g, ctx, "F32", 16, n_experts)
        ids = _in(g, ctx, "I32", n_experts, n_tokens)
        iv = g.ggml_view_2d(ctx, ids, n_used, n_tokens, n_experts * 4, 0) if view else ids
        return g.ggml_add_id(ctx, a, b, iv), [a, b, ids]
    return build


def _set_rows_f32_to_f16(g, ctx):
    dst, src, ids = _in(g, ctx, "F16", 8, 10, 2), _in(g, ctx, "F32", 8, 3, 2), _in(g, ctx, "I64", 3, 2)
    return g.ggml_set_rows(ctx, dst, src, ids), [dst, src, ids]


CASES = [
    Case("MUL_MAT", _mul_mat("F32", "F32"), lie=(1, 0, -1), name="f32"),
    Case("MUL_MAT", _mul_mat("F32", "F32", permute_b=True), name="f32-src1-permuted"),
    Case("MUL_MAT", _mul_mat("F16", "F16", permute_b=True), lie=(-1, 1, -1), name="f16-src1-permuted"),
    Case("MUL_MAT", _mul_mat("F16", "F32", ne_a=(64, 5, 1, 1), ne_b=(64, 3, 4, 2)), lie=(0, 2, 2),
         name="f16-f32-broadcast"),
    Case("MUL_MAT", _mul_mat("BF16", "BF16"), data={0: _bf16, 1: _bf16}, name="bf16"),
    Case("MUL_MAT", _mul_mat("Q8_0", "F32", permute_b=True), data={0: Q8_0}, name="q8_0-src1-permuted"),
    Case("MUL_MAT", _mul_mat("Q4_0", "F32"), lie=(-1, 2, -1), data={0: Q4_0}, name="q4_0"),
    Case("MUL_MAT_ID", _mul_mat_id("F32"), lie=(-1, 1, -1), data={1: _ints(4)}, name="f32-ids-view"),
    Case("MUL_MAT_ID", _mul_mat_id("Q8_0", b1=True), lie=(2, 2, 1), data={0: Q8_0, 1: _ints(4)},
         name="q8_0-src1-broadcast"),
    Case("MUL_MAT_ID", _mul_mat_id("F16", n_used=4), data={1: _ints(4)}, name="f16-all-used"),
    Case("OUT_PROD", _out_prod("F32"), lie=(-1, 0, -1), name="f32"),
    Case("OUT_PROD", _out_prod("F32", trans_b=True, nr=2), lie=(0, 1, 1), name="f32-src1-transposed-broadcast"),
    Case("OUT_PROD", _out_prod("Q8_0", ne_a=(32, 6, 2, 1)), lie=(-1, 1, -1), data={0: Q8_0}, name="q8_0"),
    Case("GET_ROWS", _get_rows("F32", view=True), lie=(-1, 0, -1), data={1: _ints(6)}, name="f32-ids-view"),
    Case("GET_ROWS", _get_rows("I32"), data={0: lambda n, r: r.integers(-99, 99, n).astype(np.int32), 1: _ints(6)},
         name="i32"),
    Case("GET_ROWS", _get_rows("BF16"), data={0: _bf16, 1: _ints(6)}, name="bf16"),
    Case("GET_ROWS", _get_rows("Q6_K", n=256, view=True), lie=(0, 2, 1), data={0: random_blocks(210, 256), 1: _ints(6)},
         name="q6_k-ids-view"),
    Case("GET_ROWS_BACK", _get_rows_back("F32"), lie=(0, 1, -2), data={1: _ints(6)}, name="f32"),
    Case("GET_ROWS_BACK", _get_rows_back("F16", view=True), lie=(0, 0, -2), data={1: _ints(6)}, name="f16-ids-view"),
    Case("SET_ROWS", _set_rows("F32", "Q8_0", "I32", view=True), lie=(0, 2, 1), data={0: Q8_0, 2: _ints(10, np.int32)},
         name="f32-to-q8_0-views"),
    Case("SET_ROWS", _set_rows("F32", "F32", "I64"), data={2: _ints(10, np.int64)}, name="f32-i64"),
    Case("SET_ROWS", _set_rows("F32", "IQ4_NL", "I64"), lie=(-1, 1, -1), data={0: random_blocks(18), 2: _ints(10, np.int64)},
         name="f32-to-iq4_nl"),
    Case("ADD_ID", _add_id(), lie=(1, 0, -1), data={2: _ints(5)}, name="ids-view"),
    Case("ADD_ID", _add_id(view=False, n_used=5), lie=(-1, 1, -1), data={2: _ints(5)}, name="all-used"),
    Case("SET_ROWS", _set_rows_f32_to_f16, lie=(-1, 1, -1), data={2: _ints(10, np.int64)}, name="f32-to-f16-3d"),
]
# ggml >= 0.20 only (0.10 refuses them: its kernels abort)
CASES_020 = [
    Case("SET_ROWS", _set_rows("F16", "F16", "I32"), lie=(-1, 1, -1), data={2: _ints(10, np.int32)}, name="f16-i32"),
    Case("SET_ROWS", _set_rows("F16", "Q4_0", "I64", r=1), lie=(2, 0, 1), data={0: Q4_0, 2: _ints(10, np.int64)},
         name="f16-to-q4_0"),
    Case("OUT_PROD", _out_prod("F16"), lie=(0, 2, 1), name="f16"),
]
ALL = CASES + CASES_020


def _too_old(ggml, case):
    if case in CASES_020 and op_enums(ggml).version < (0, 20, 0):
        return "ggml 0.10's constructor or kernel aborts on this case"
    return None


@pytest.mark.parametrize("case", ALL, ids=case_id)
def test_op_matches_ggml_cpu(guest, ggml, case):
    if _too_old(ggml, case):
        pytest.skip(_too_old(ggml, case))
    assert_matches_ggml_cpu(guest, ggml, case)


@pytest.mark.parametrize("case", ALL, ids=case_id)
def test_lying_shape_is_refused(guest, ggml, case):
    if _too_old(ggml, case):
        pytest.skip(_too_old(ggml, case))
    lie_refusal(guest, ggml, case)


def _refused(guest, ggml, case, reason, recs_edit=None, op=None):
    """`case` (its records edited by `recs_edit(r, recs)`) refused by the rule of `op` (default
    the case's) for the case's node, its reason containing `reason`; the host serves on."""
    r = Remote(guest, ggml, case)
    try:
        recs = None
        if recs_edit is not None:
            recs = r.recs.copy()
            recs_edit(r, recs)
        got = refusal(r, recs, serves_next=False)
        assert_refused_by_rule(got, op or case.op, r.index(r.out))
        assert reason in got.reason, got.reason
        assert guest.forward(Cmd.DEVICE_GET_COUNT)[0] == 0  # the host serves on
    finally:
        r.close()


def _bad(values, dtype=np.int32):
    return lambda n, rng: np.resize(np.array(values, dtype), n)


_OUT_OF_RANGE = [
    pytest.param("GET_ROWS", _get_rows("F32", view=True), 1, [0, 6], "row id out of [0, 6)", id="GET_ROWS-id-past-view"),
    pytest.param("GET_ROWS", _get_rows("F32"), 1, [-1, 0], "row id out of [0, 6)", id="GET_ROWS-id-negative"),
    pytest.param("MUL_MAT_ID", _mul_mat_id("F32"), 1, [0, 4], "expert id out of [0, 4)", id="MUL_MAT_ID-id-past"),
    pytest.param("ADD_ID", _add_id(), 2, [1, 5, 0], "row id out of [0, 5)", id="ADD_ID-id-past"),
    pytest.param("GET_ROWS_BACK", _get_rows_back("F32"), 1, [0, 1, 6, 2], "row id out of [0, 6)",
                 id="GET_ROWS_BACK-id-past"),
    pytest.param("SET_ROWS", _set_rows("F32", "F32", "I32"), 2, [0, 10, 1], "row id out of [0, 10)",
                 id="SET_ROWS-i32-id-past"),
    pytest.param("SET_ROWS", _set_rows_f32_to_f16, 2, [0, 10, 1, 2, 3, 4], "row id out of [0, 10)",
                 id="SET_ROWS-i64-id-past"),
    pytest.param("SET_ROWS", _set_rows_f32_to_f16, 2, [0, -1, 1, 2, 3, 4], "row id out of [0, 10)",
                 id="SET_ROWS-i64-id-negative"),
    # ids whose low 32 bits are in range (2**40: 0; -2**63: 0): read as I64, not I32
    pytest.param("SET_ROWS", _set_rows_f32_to_f16, 2, [0, 1, 2, 3, 4, 2**40], "row id out of [0, 10)",
                 id="SET_ROWS-i64-id-huge"),
    pytest.param("SET_ROWS", _set_rows_f32_to_f16, 2, [-2**63, 1, 2, 3, 4, 5], "row id out of [0, 10)",
                 id="SET_ROWS-i64-id-min"),
    pytest.param("MUL_MAT_ID", _mul_mat_id("F32"), 1, [0, 2**31 - 1], "expert id out of [0, 4)",
                 id="MUL_MAT_ID-id-max"),
    pytest.param("GET_ROWS", _get_rows("F32"), 1, [0, -2**31], "row id out of [0, 6)", id="GET_ROWS-id-min"),
]


@pytest.mark.parametrize("op,build,ids_at,bad,text", _OUT_OF_RANGE)
def test_row_ids_out_of_range(guest, ggml, op, build, ids_at, bad, text):
    """An id out of range: GGML_ASSERT (abort) in get_rows / set_rows / add_id, a write past
    the work buffer in mul_mat_id (only `assert`ed), past the result in get_rows_back."""
    dtype = np.int64 if build is _set_rows_f32_to_f16 else np.int32  # (its ids are I64)
    _refused(guest, ggml, Case(op, build, data={ids_at: _bad(bad, dtype)}), text)


@pytest.mark.parametrize("op,build,ids_at,bad,text", _OUT_OF_RANGE)
def test_row_ids_out_of_range_on_a_cache_hit(guest, ggml, op, build, ids_at, bad, text):
    """The same graph again (served from the graph cache, which re-checks fresh ids against
    the bounds the rule recorded): ids out of range are refused by the op's rule with the
    same reason, and the largest id in range is computed to ggml CPU's bytes."""
    dtype = np.int64 if build is _set_rows_f32_to_f16 else np.int32
    n_rows = int(re.search(r"\[0, (\d+)\)", text).group(1))
    first, last = Case(op, build, data={ids_at: _bad([0], dtype)}), Case(op, build, data={ids_at: _bad([n_rows - 1], dtype)})
    r = Remote(guest, ggml, first)
    try:
        cache = guest.ctx._library.graph_cache
        ids = r.inputs[ids_at]
        n = ggml.ggml_nelements(ids)

        def write(values):
            assert guest.set_tensor(r.remote.handle, r.remote.rpc(ids), np.resize(np.array(values, dtype), n).tobytes()) == 0

        rc, dec = r.compute()
        assert rc == 0 and dec.i32() == 0
        write(bad)
        got = refusal(r, serves_next=False)
        assert cache.hits == 1  # found, re-checked, refused
        assert_refused_by_rule(got, op, r.index(r.out))
        assert text in got.reason, got.reason
        for _ in range(2):  # rebuilt (the refused entry was dropped), then a hit
            for t, d in zip(r.inputs, _data(ggml, last, r.inputs)):  # SET_ROWS wrote into dst
                assert guest.set_tensor(r.remote.handle, r.remote.rpc(t), d) == 0
            rc, dec = r.compute()
            assert rc == 0 and dec.i32() == 0
        assert cache.hits == 2
        assert r.result() == _direct(ggml, last)
    finally:
        r.close()


def _get_rows_of_argsort(columns, rows=None, data=None):
    def build(g, ctx):
        a, x = _in(g, ctx, "F32", 8, rows or columns), _in(g, ctx, "F32", columns)
        return g.ggml_get_rows(ctx, a, g.ggml_argsort(ctx, x, 0)), [a, x]

    return Case("GET_ROWS", build, data=data)


def _with_nans(n, rng):
    x = rng.standard_normal(n).astype(np.float32)
    x[rng.random(n) < 0.4] = np.nan
    return x


def test_row_ids_argsorted_from_nans_stay_in_range(guest, ggml):
    """ggml-cpu's argsort is std::sort with `<`, which NaN makes no strict weak order: the
    bound relied on (a permutation of 0..ne00-1) held on NaN-laden rows (long ones: past
    std::sort's insertion-sort threshold), and the result is ggml CPU's."""
    assert_matches_ggml_cpu(guest, ggml, _get_rows_of_argsort(300, data={1: _with_nans}))


def test_row_ids_computed_in_range_by_the_graph_compute_like_cpu(guest, ggml):
    """Ids the graph computes in range whatever its inputs (argsort of 6 columns, for 6 rows:
    apir.host.graph.computed_ids): not read before compute, and the result is ggml CPU's."""
    assert_matches_ggml_cpu(guest, ggml, _get_rows_of_argsort(6))


def test_row_ids_computed_in_range_on_a_cached_graph_follow_each_input(guest, ggml):
    """The same graph again (a graph-cache hit: nothing of its ids to re-check), with the
    argsort's input changed: each result is ggml CPU's for that input."""
    from tests.host.hostkit import GgmlScratch, cpu_compute
    from tests.host.shapekit import _graph

    case = _get_rows_of_argsort(6)
    r = Remote(guest, ggml, case)
    cache = guest.ctx._library.graph_cache
    try:
        a, x = r.inputs
        table = np.random.default_rng(5).standard_normal(48).astype(np.float32).tobytes()
        assert guest.set_tensor(r.remote.handle, r.remote.rpc(a), table) == 0
        for k, order in enumerate(([5, 0, 3, 1, 4, 2], [0, 1, 2, 3, 4, 5], [2, 4, 1, 5, 3, 0])):
            xs = np.empty(6, np.float32)
            xs[order] = np.arange(6)  # (argsort gives `order`)
            assert guest.set_tensor(r.remote.handle, r.remote.rpc(x), xs.tobytes()) == 0
            rc, dec = r.compute()
            assert rc == 0 and dec.i32() == 0
            s = GgmlScratch(ggml)
            graph, out, inputs = _graph(ggml, s.ctx, case)
            want = cpu_compute(ggml, s.ctx, graph, zip(inputs, [table, xs.tobytes()]), out)
            s.close()
            assert r.result() == want == np.frombuffer(table, np.float32).reshape(6, 8)[order].tobytes()
            assert cache.hits == k
    finally:
        r.close()


def test_row_ids_computed_by_the_graph_out_of_range_are_refused(guest, ggml):
    """Ids the graph computes that may leave the range (argsort of 7 columns, for 6 rows)
    cannot be read before compute: refused."""
    r = Remote(guest, ggml, _get_rows_of_argsort(7, rows=6))
    got = refusal(r, serves_next=False)
    # refused for the values found there before compute (GET_ROWS' rule), or else by the
    # graph's check of what the rules read, naming the argsort node that writes them
    by_rule = (got.op, got.rule) == ("GET_ROWS", rule_name(rules.RULES["GET_ROWS"]))
    assert by_rule or (got.op, got.rule) == ("ARGSORT", "apir.host.graph.build._check_graph_needs"), (got.rule, str(got))
    assert got.reason.startswith("row id out of" if by_rule else "row ids read before compute"), got.reason
    assert guest.forward(Cmd.DEVICE_GET_COUNT)[0] == 0
    r.close()


def test_row_ids_written_by_a_copy_are_refused(guest, ggml):
    """Input ids that a node of the same graph overwrites (a CPY into them) before get_rows
    reads them: refused (the ids checked would not be the ids used)."""
    def build(g, ctx):
        a, ids, new = _in(g, ctx, "F32", 8, 6), _in(g, ctx, "I32", 3), _in(g, ctx, "I32", 3)
        return g.ggml_get_rows(ctx, a, g.ggml_cpy(ctx, new, ids)), [a, ids, new]

    case = Case("GET_ROWS", build, data={1: _ints(6), 2: _bad([0, 99, 1])})
    r = Remote(guest, ggml, case)
    got = refusal(r, serves_next=False)
    # refused by the graph's check of what the rules read (apir.host.graph.build), naming the CPY
    assert (got.op, got.rule) == ("CPY", "apir.host.graph.build._check_graph_needs"), (got.op, got.rule, str(got))
    assert got.reason.startswith("row ids read before compute, but node"), got.reason
    assert guest.forward(Cmd.DEVICE_GET_COUNT)[0] == 0
    r.close()


def test_row_ids_written_after_their_last_reader_are_accepted(guest, ggml):
    """ggml's allocator reuses the memory of consumed inputs: a node that writes over the ids
    after get_rows read them (here a CPY into them, ordered after get_rows) is accepted, and
    the result is ggml CPU's."""
    def build(g, ctx):
        a, ids = _in(g, ctx, "F32", 8, 6), _in(g, ctx, "I32", 3)
        x, y = _in(g, ctx, "F32", 3), _in(g, ctx, "F32", 3)
        rows = g.ggml_get_rows(ctx, a, ids)  # node 0 reads ids
        later = g.ggml_cpy(ctx, g.ggml_cpy(ctx, x, ids), y)  # node 1 writes them, as I32
        return g.ggml_add(ctx, rows, g.ggml_reshape_2d(ctx, later, 1, 3)), [a, ids, x, y]

    assert_computes_like_cpu(guest, ggml, Case("GET_ROWS", build, data={1: _ints(6)}))


def test_set_rows_f16_on_several_threads_is_refused(guest, ggml):
    """F16 rows set into F32 convert through a work buffer the plan sizes for one thread
    (ggml 0.20): with a multi-task node (ADD) in the graph the CPU runs several, refused."""
    if op_enums(ggml).version < (0, 20, 0):
        pytest.skip("ggml 0.10's set_rows takes only F32 rows (its constructor asserts it)")

    def build(g, ctx):
        out, ins = _set_rows("F16", "F32", "I64")(g, ctx)
        return g.ggml_add(ctx, out, ins[0]), ins

    case = Case("SET_ROWS", build, data={2: _ints(10, np.int64)})
    r = Remote(guest, ggml, case)
    got = refusal(r, serves_next=False)
    # the SET_ROWS rule marks its node one-thread; the graph check refuses the graph
    assert (got.op, got.rule) == ("SET_ROWS", "apir.host.graph.build._check_graph_needs"), (got.op, got.rule, str(got))
    assert got.reason.startswith("only safe on one thread"), got.reason
    r.close()


def test_mul_mat_unordered_result_strides_are_refused(guest, ggml):
    """mul_mat GGML_ASSERTs nb1 <= nb2 <= nb3 of its result, even in a dimension of 1."""
    def edit(r, recs):
        recs["nb"][r.index(r.out)][3] = 4

    case = Case("MUL_MAT", _mul_mat("F32", "F32", ne_b=(64, 3, 2, 1), ne_a=(64, 5, 2, 1)))
    _refused(guest, ggml, case, "result strides", edit)


@pytest.mark.parametrize("k,m,ok", [(64, 64, True), (48, 48, False), (64, 32, False)])
def test_mul_mat_hadamard_hint(guest, ggml, k, m, ok):
    """ggml 0.20 routes a mul_mat with hint GGML_HINT_SRC0_IS_HADAMARD to fwht: src1 rows of
    k floats (a power of 2, GGML_ASSERTed) written into result rows of m >= k floats."""
    if op_enums(ggml).version < (0, 20, 0):
        pytest.skip("ggml 0.10 has no mul_mat hint")

    def build(g, ctx):
        out, ins = _mul_mat("F32", "F32", ne_a=(k, m, 1, 1), ne_b=(k, 3, 2, 1))(g, ctx)
        g.ggml_mul_mat_set_hint(out, 1)
        return out, ins

    case = Case("MUL_MAT", build)
    if ok:
        assert_computes_like_cpu(guest, ggml, case)
    else:
        _refused(guest, ggml, case, "Hadamard hint")


def test_mul_mat_src1_of_another_dot_type_is_refused(guest, ggml):
    """src1 must be F32 or src0's vec_dot_type (ggml-cpu GGML_ASSERTs it): F16 src1 with Q8_0
    src0 (whose dot type is Q8_0) is refused."""
    def edit(r, recs):
        i = r.index(r.inputs[1])
        recs["type"][i] = ggml.types["F16"]
        recs["nb"][i] = [2, 128, 384, 1536]

    case = Case("MUL_MAT", _mul_mat("Q8_0", "F32"), data={0: Q8_0})
    _refused(guest, ggml, case, "src1 F16 is neither F32 nor Q8_0", edit)


def test_kernel_reads_the_ids_that_were_checked(guest, ggml, monkeypatch):
    """The guest may write its buffers while the host computes: the ids checked are copied and
    the kernel reads the copy. Here the ids' buffer is zeroed right after the checks (as a
    racing guest would): the result is still that of the ids checked."""
    from apir.host.graph import build as host_graph
    from apir.host.graph.shapes.base import extent

    real = host_graph._check_graph_needs

    def racing(lib, parsed, made, *rest):
        real(lib, parsed, made, *rest)
        for info in made:
            if info.snapshot is not None:
                ctypes.memset(info.address, 0, extent(info))

    monkeypatch.setattr(host_graph, "_check_graph_needs", racing)
    case = Case("GET_ROWS", _get_rows("F32", view=True), data={1: lambda n, r: np.resize(np.int32([5, 3, 4, 1]), n)})
    assert_computes_like_cpu(guest, ggml, case)


def test_mul_mat_src1_aliasing_elements_are_refused(guest, ggml):
    """src1 converted to src0's dot type goes through a work buffer sized by its element count:
    a src1 whose strides alias (nb[2] = 0 under a huge ne[2]) would make ggml-cpu allocate far
    beyond the guest's buffers (aborting when it cannot): refused, through the host by the
    span check (graph.py, first), and by MUL_MAT's own rule as well."""
    def edit(r, recs):
        for t, n in ((r.inputs[1], 1 << 31), (r.out, 1 << 31)):
            i = r.index(t)
            recs["ne"][i][2] = n
            recs["nb"][i][2] = 0
            recs["nb"][i][3] = 0

    case = Case("MUL_MAT", _mul_mat("Q8_0", "F32", ne_a=(64, 5, 1, 1), ne_b=(64, 3, 1, 1)), data={0: Q8_0})
    r = Remote(guest, ggml, case)
    try:
        recs = r.recs.copy()
        edit(r, recs)
        got = refusal(r, recs)
        assert (got.node, got.op, got.rule) == (None, None, rule_name(check_span)), (got.rule, str(got))
        assert "spans" in got.reason, got.reason
        got = rule_check(guest, r, recs)
        assert_refused_by_rule(got, "MUL_MAT", r.index(r.out), "src1 elements overlap")
    finally:
        r.close()


def test_mul_mat_aliasing_result_is_refused(guest, ggml):
    """A result whose elements alias (ordered strides smaller than its rows) could hold more
    chunks than the kernel's `int` counters in a small buffer: refused."""
    def edit(r, recs):
        recs["nb"][r.index(r.out)] = [4, 4, 4, 4]

    _refused(guest, ggml, Case("MUL_MAT", _mul_mat("F32", "F32")), "result elements overlap", edit)


# --- every GGML_ASSERT of these ops' CPU kernels (tests/host/kernelkit.py) ---
_IDS = Why("row id in range: base.row_ids reads the ids before compute (test_matrix.py::test_row_ids_out_of_range)")

# op -> {assert text as in the C source (whitespace collapsed): how it is covered}
KERNEL_ASSERTS: dict[str, dict[str, Cover]] = {
    "ADD_ID": {
        "dst->type == GGML_TYPE_F32": v(("type", "dst", 0, I32)),
        "src0->type == GGML_TYPE_F32": v(("type", "src0", 0, I32)),
        "src1->type == GGML_TYPE_F32": v(("type", "src1", 0, I32)),
        "src2->type == GGML_TYPE_I32": v(("type", "src2", 0, "F32")),
        "src0->nb[0] == sizeof(float)": v(("nb", "src0", 0, 2)),
        "src1->nb[0] == sizeof(float)": v(("nb", "src1", 0, 2)),
        "nb0 == sizeof(float)": v(("nb", "dst", 0, 2)),
        "nb10 == sizeof(float)": v(("nb", "src1", 0, 2)),
        "i11 >= 0 && i11 < ne11": _IDS,
    },
    "OUT_PROD": {
        "dst->type == GGML_TYPE_F32": v(("type", "dst", 0, I32)),
        "src0->type == GGML_TYPE_F32": v(("type", "src0", 0, I32)),
        "src1->type == GGML_TYPE_F32": v(("type", "src1", 0, I32)),
        "ne0 == ne00": v(("ne", "dst", 0, 7)),
        "ne1 == ne10": v(("ne", "dst", 1, 4)),
        "ne2 == ne12": v(("ne", "dst", 2, 1)),
        "ne3 == ne13": v(("ne", "dst", 2, 1), ("ne", "dst", 3, 2), ("nb", "dst", 3, 160)),
        "ne2 % ne02 == 0": v(("ne", "src1", 2, 1), ("ne", "dst", 2, 1)),
        "ne3 % ne03 == 0": v(("ne", "src0", 2, 1), ("ne", "src0", 3, 2), ("nb", "src0", 3, 192)),
        "nb00 == sizeof(float)": v(("nb", "src0", 0, 2)),
        "nb0 == sizeof(float)": v(("nb", "dst", 0, 2)),
        # the quantized (case 2: Q8_0) and F16 (case 3, ggml 0.20) kernels
        "ne02 == ne12": v(("ne", "src1", 2, 1), ("ne", "dst", 2, 1), case=2),
        "ne03 == ne13": v(("ne", "src1", 2, 1), ("ne", "src1", 3, 2), ("ne", "dst", 2, 1), ("ne", "dst", 3, 2),
                          ("nb", "dst", 3, 640), case=2),
        "nb00 == ggml_type_size(type)": v(("nb", "src0", 0, 17), case=2),
        "ne2 == ne02": v(("ne", "src0", 2, 1), case=2),
        "ne3 == ne03": v(("ne", "src0", 2, 1), ("ne", "src0", 3, 2), case=2),
        "src0->type == GGML_TYPE_F16": v(("type", "src0", 0, "BF16"), case=3),
        "nb00 == sizeof(ggml_fp16_t)": v(("nb", "src0", 0, 1), case=3),
    },
    "GET_ROWS": {
        "i01 >= 0 && i01 < ne01": _IDS,
    },
    "SET_ROWS": {
        "src0->type == GGML_TYPE_F32 || src0->type == GGML_TYPE_F16": v(("type", "src0", 0, I32)),
        "i1 >= 0 && i1 < ne1": _IDS,
    },
    "GET_ROWS_BACK": {
        "ggml_is_contiguous(dst)": v(("nb", "dst", 0, 2)),
        "dst->ne[0] == nc": v(("ne", "dst", 0, 7)),
        "src0->nb[0] == sizeof(ggml_fp16_t)": v(("nb", "src0", 0, 2)),  # the F16 kernel: the same rule
        "src0->nb[0] == sizeof(float)": v(("nb", "src0", 0, 2)),
    },
    "MUL_MAT": {
        "ne0 == ne01": v(("ne", "dst", 0, 4)),
        "ne1 == ne11": v(("ne", "dst", 1, 2)),
        "ne2 == ne12": v(("ne", "dst", 2, 3)),
        "ne3 == ne13": v(("ne", "dst", 2, 2), ("ne", "dst", 3, 2), ("nb", "dst", 3, 120)),
        "nb00 == ggml_type_size(src0->type)": v(("nb", "src0", 0, 2)),
        "nb10 == ggml_type_size(src1->type)": v(("nb", "src1", 0, 2)),
        "nb0 == sizeof(float)": v(("nb", "dst", 0, 2)),
        "nb0 <= nb1": v(("nb", "dst", 1, 2)),
        "nb1 <= nb2": v(("nb", "dst", 2, 16)),
        "nb2 <= nb3": v(("nb", "dst", 3, 50)),
        "src1->type == GGML_TYPE_F32": v(("type", "src1", 0, I32)),
        # ggml_compute_forward_fwht (op_params[1] = GGML_HINT_SRC0_IS_HADAMARD, ggml 0.20)
        "dst->type == GGML_TYPE_F32": v(("param", "dst", 1, 1), ("type", "dst", 0, I32)),
        "(n & (n - 1)) == 0": v(("param", "dst", 1, 1), ("ne", "src0", 0, 48), ("ne", "src1", 0, 48),
                                since=(0, 20, 0)),
    },
    "MUL_MAT_ID": {
        "nb00 == ggml_type_size(type)": v(("nb", "src0", 0, 2)),
        "nb10 == ggml_type_size(src1->type)": v(("nb", "src1", 0, 2)),
        "nb0 == sizeof(float)": v(("nb", "dst", 0, 2)),
        "nb0 <= nb1": v(("nb", "dst", 1, 2)),
        "nb1 <= nb2": v(("nb", "dst", 2, 16)),
        "nb2 <= nb3": v(("nb", "dst", 3, 30)),
        "params->wsize >= (size_t)((char *) wdata_cur - (char *) params->wdata)":
            Why("ggml_graph_plan sizes the work buffer with this formula; apir.host.graph.work_plan bounds the plan"),
        "src1->type == GGML_TYPE_F32": v(("type", "src1", 0, I32)),
    },
}
# op -> the kernel functions (ggml_compute_forward_<name>) whose asserts it can reach
KERNEL_FUNCTIONS = {
    "ADD_ID": ["add_id_f32", "add_id"],
    "OUT_PROD": ["out_prod_f32", "out_prod_q_f32", "out_prod_f16_f32", "out_prod"],
    "GET_ROWS": ["get_rows_q", "get_rows_f16", "get_rows_bf16", "get_rows_f32", "get_rows"],
    "SET_ROWS": ["set_rows_impl", "set_rows"],
    "GET_ROWS_BACK": ["get_rows_back_f32_f16", "get_rows_back_f32", "get_rows_back"],
    "MUL_MAT": ["mul_mat_one_chunk", "mul_mat", "fwht_f32", "fwht"],
    "MUL_MAT_ID": ["mul_mat_id_one_chunk", "mul_mat_id"],
}


@pytest.mark.parametrize("version,folder", cpu_sources())
def test_every_kernel_assert_is_in_the_table(version, folder):
    missing = missing_asserts(folder, KERNEL_FUNCTIONS, KERNEL_ASSERTS)
    assert not missing, f"ggml {version}: kernel asserts without a rule in KERNEL_ASSERTS: {missing}"
    assert found_any(folder, KERNEL_FUNCTIONS["MUL_MAT"])  # the parser works


def test_kernel_assert_table_has_the_modules_ops():
    assert set(KERNEL_ASSERTS) == set(rules.RULES) == set(KERNEL_FUNCTIONS)


@pytest.mark.parametrize("op,text,cover", violations(KERNEL_ASSERTS))
def test_violating_graph_is_refused_by_the_rule(guest, ggml, op, text, cover):
    if op_enums(ggml).version < cover.since:
        pytest.skip(f"ggml {op_enums(ggml).version} has no such kernel")
    cases = [c for c in ALL if c.op == op]
    if cover.case >= len(cases) or _too_old(ggml, cases[cover.case]):
        pytest.skip("this ggml has no such case")
    violation_refusal(guest, ggml, cases[cover.case], op, text, cover)


# ggml >= 0.25 (llama.cpp's build; tests/llama/test_host_ggml025.py runs this folder on it):
# MUL_MAT's widened F16 / BF16 src1 and F16 Hadamard rows (Feature.MUL_MAT_WIDEN), the tiled
# matmul's packed Q8_K rows (Feature.TILED_MATMUL).
def _hadamard_f16(g, ctx):
    out, ins = _mul_mat("F32", "F16", ne_a=(64, 64, 1, 1), ne_b=(64, 3, 2, 1))(g, ctx)
    g.ggml_mul_mat_set_hint(out, 1)
    return out, ins


MUL_MAT_F16_SRC1 = Case("MUL_MAT", _mul_mat("F32", "F16"), lie=(1, 0, -1), name="f32-f16-widened",
                        feature=Feature.MUL_MAT_WIDEN)
CASES_025 = [
    MUL_MAT_F16_SRC1,
    Case("MUL_MAT", _mul_mat("F32", "BF16", ne_a=(64, 5, 1, 1), ne_b=(64, 3, 2, 2)), data={1: _bf16},
         name="f32-bf16-widened", feature=Feature.MUL_MAT_WIDEN),
    Case("MUL_MAT", _hadamard_f16, name="hadamard-f16", feature=Feature.MUL_MAT_WIDEN),
]


@pytest.mark.parametrize("case", CASES_025, ids=case_id)
def test_op_matches_ggml_cpu_025(guest, ggml, case):
    assert_matches_ggml_cpu(guest, ggml, case)


@pytest.mark.parametrize("case", [c for c in CASES_025 if c.lie is not None], ids=case_id)
def test_lying_shape_is_refused_025(guest, ggml, case):
    lie_refusal(guest, ggml, case)


def test_mul_mat_widening_needs_an_f32_dot_type(guest, ggml):
    """The widening of F16 / BF16 src1 is for src0 whose vec_dot_type is F32 (GGML_ASSERTed):
    BF16 src1 with Q4_0 src0 (dot type Q8_0) is refused."""
    def edit(r, recs):
        i = r.index(r.inputs[1])
        recs["type"][i] = ggml.types["BF16"]
        recs["nb"][i] = [n // 2 for n in recs["nb"][i]]

    case = Case("MUL_MAT", _mul_mat("Q4_0", "F32"), data={0: Q4_0}, feature=Feature.MUL_MAT_WIDEN)
    edited_refusal(guest, ggml, case, "src1 BF16 is neither F32 nor Q8_0", edit)


def test_mul_mat_q8_k_rows_not_packed_are_refused(guest, ggml):
    """The tiled matmul reads Q8_K src1 rows as r * nb[1] over all rows: a permuted Q8_K src1
    (batches not at ne[1] * nb[1]) would be read past its extent."""
    def build(g, ctx):
        a = _in(g, ctx, "Q4_K", 256, 4, 2)
        b = _in(g, ctx, "Q8_K", 256, 2, 8)
        return g.ggml_mul_mat(ctx, a, g.ggml_permute(ctx, b, 0, 2, 1, 3)), [a, b]

    zeros = {0: lambda n, rng: np.zeros(n // 256 * 144, np.uint8), 1: lambda n, rng: np.zeros(n // 256 * 292, np.uint8)}
    case = Case("MUL_MAT", build, data=zeros, feature=Feature.TILED_MATMUL)
    edited_refusal(guest, ggml, case, "src1 Q8_K rows are not packed", then=MUL_MAT_F16_SRC1)
