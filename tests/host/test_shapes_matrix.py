"""apir.host.shapes.matrix (MUL_MAT, MUL_MAT_ID, OUT_PROD, GET_ROWS, GET_ROWS_BACK, SET_ROWS,
ADD_ID): each op, built with ggml's own constructor in the layouts test-backend-ops uses
(permuted and broadcast sources, F16 / BF16 / quantized types, ids that are views), computes
through the host to ggml CPU's own bytes; a lying shape is refused by the op's rule and the
host serves on; row ids out of range, ids the graph computes or overwrites, and kernel
layouts ggml would abort on are refused."""

import logging

import numpy as np
import pytest

from apir.codec.constants import ApirBackendCommandType as Cmd
from apir.host.shapes import op_enums
from tests.host.shapekit import (
    ERROR,
    Case,
    Remote,
    _in,
    _ints,
    assert_computes_like_cpu,
    case_tests,
    random_blocks,
    rule_refusal,
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


def _cpy(t_src, t_dst, perm=(0, 1, 2, 3), dst_perm=None, ne=(64, 2, 3, 1)):
    """test-backend-ops' cpy: src made so that its permutation has shape ne; dst of shape ne,
    or made so that its permutation dst_perm has shape ne (a non-contiguous result)."""
    def made(g, ctx, type_name, p):
        inv = [0] * 4
        for i, j in enumerate(p):
            inv[j] = i
        t = _in(g, ctx, type_name, *(ne[inv[k]] for k in range(4)))
        return t, g.ggml_permute(ctx, t, *p)

    def build(g, ctx):
        src, sp = made(g, ctx, t_src, perm)
        if dst_perm is None:
            dst = dp = _in(g, ctx, t_dst, *ne)
        else:
            dst, dp = made(g, ctx, t_dst, dst_perm)
        return g.ggml_cpy(ctx, sp, dp), [src, dst]
    return build


def g_nb(g, t, i):
    from apir.ggml.layout import tensor_record

    return int(tensor_record(t, g.tensor_dtype)["nb"][i])


CASES = [
    Case("MUL_MAT", _mul_mat("F32", "F32"), lie=(1, 0, -1)),
    Case("MUL_MAT", _mul_mat("F32", "F32", permute_b=True)),
    Case("MUL_MAT", _mul_mat("F16", "F16", permute_b=True), lie=(-1, 1, -1)),
    Case("MUL_MAT", _mul_mat("F16", "F32", ne_a=(64, 5, 1, 1), ne_b=(64, 3, 4, 2)), lie=(0, 2, 2)),
    Case("MUL_MAT", _mul_mat("BF16", "BF16"), data={0: _bf16, 1: _bf16}),
    Case("MUL_MAT", _mul_mat("Q8_0", "F32", permute_b=True), data={0: Q8_0}),
    Case("MUL_MAT", _mul_mat("Q4_0", "F32"), lie=(-1, 2, -1), data={0: Q4_0}),
    Case("MUL_MAT_ID", _mul_mat_id("F32"), lie=(-1, 1, -1), data={1: _ints(4)}),
    Case("MUL_MAT_ID", _mul_mat_id("Q8_0", b1=True), lie=(2, 2, 1), data={0: Q8_0, 1: _ints(4)}),
    Case("MUL_MAT_ID", _mul_mat_id("F16", n_used=4), data={1: _ints(4)}),
    Case("OUT_PROD", _out_prod("F32"), lie=(-1, 0, -1)),
    Case("OUT_PROD", _out_prod("F32", trans_b=True, nr=2), lie=(0, 1, 1)),
    Case("OUT_PROD", _out_prod("Q8_0", ne_a=(32, 6, 2, 1)), lie=(-1, 1, -1), data={0: Q8_0}),
    Case("GET_ROWS", _get_rows("F32", view=True), lie=(-1, 0, -1), data={1: _ints(6)}),
    Case("GET_ROWS", _get_rows("I32"), data={0: lambda n, r: r.integers(-99, 99, n).astype(np.int32), 1: _ints(6)}),
    Case("GET_ROWS", _get_rows("BF16"), data={0: _bf16, 1: _ints(6)}),
    Case("GET_ROWS", _get_rows("Q6_K", n=256, view=True), lie=(0, 2, 1), data={0: random_blocks(210, 256), 1: _ints(6)}),
    Case("GET_ROWS_BACK", _get_rows_back("F32"), lie=(0, 1, -2), data={1: _ints(6)}),
    Case("GET_ROWS_BACK", _get_rows_back("F16", view=True), lie=(0, 0, -2), data={1: _ints(6)}),
    Case("SET_ROWS", _set_rows("F32", "Q8_0", "I32", view=True), lie=(0, 2, 1), data={0: Q8_0, 2: _ints(10, np.int32)}),
    Case("SET_ROWS", _set_rows("F32", "F32", "I64"), data={2: _ints(10, np.int64)}),
    Case("SET_ROWS", _set_rows("F32", "IQ4_NL", "I64"), lie=(-1, 1, -1), data={0: random_blocks(18), 2: _ints(10, np.int64)}),
    Case("ADD_ID", _add_id(), lie=(1, 0, -1), data={2: _ints(5)}),
    Case("ADD_ID", _add_id(view=False, n_used=5), lie=(-1, 1, -1), data={2: _ints(5)}),
]
# SET_ROWS of F32 rows into F16 with I64 ids (from test_shapes_more.py)
CASES += [
    Case("SET_ROWS", lambda g, ctx: (lambda dst, src, ids: (g.ggml_set_rows(ctx, dst, src, ids), [dst, src, ids]))(
        _in(g, ctx, "F16", 8, 10, 2), _in(g, ctx, "F32", 8, 3, 2), _in(g, ctx, "I64", 3, 2)),
        lie=(-1, 1, -1), data={2: _ints(10, np.int64)}),
]
# ggml >= 0.20 only (0.10 refuses them: its kernels abort)
CASES_020 = [
    Case("SET_ROWS", _set_rows("F16", "F16", "I32"), lie=(-1, 1, -1), data={2: _ints(10, np.int32)}),
    Case("SET_ROWS", _set_rows("F16", "Q4_0", "I64", r=1), lie=(2, 0, 1), data={0: Q4_0, 2: _ints(10, np.int64)}),
    Case("OUT_PROD", _out_prod("F16"), lie=(0, 2, 1)),
]
ALL = CASES + CASES_020
IDS = [f"{c.op}-{i}" for i, c in enumerate(ALL)]


def _too_old(ggml, case):
    if case in CASES_020 and op_enums(ggml).version < (0, 20, 0):
        return "ggml 0.10's constructor or kernel aborts on this case"
    return None


remote, test_op_matches_ggml_cpu, test_lying_shape_is_refused = case_tests(ALL, IDS, skip=_too_old)


def _refused(guest, ggml, case, text, caplog, recs_edit=None):
    r = Remote(guest, ggml, case)
    try:
        recs = None
        if recs_edit is not None:
            recs = r.recs.copy()
            recs_edit(r, recs)
        with caplog.at_level(logging.WARNING, logger="apir.host"):
            rc, _ = r.compute(recs)
        assert rc == ERROR and text in caplog.text, caplog.text
        assert guest.forward(Cmd.DEVICE_GET_COUNT)[0] == 0  # the host serves on
    finally:
        r.close()


def _bad(values, dtype=np.int32):
    return lambda n, r: np.resize(np.array(values, dtype), n)


@pytest.mark.parametrize("op,build,ids_at,bad,text", [
    ("GET_ROWS", _get_rows("F32", view=True), 1, [0, 6], "row id out of [0, 6)"),
    ("GET_ROWS", _get_rows("F32"), 1, [-1, 0], "row id out of [0, 6)"),
    ("MUL_MAT_ID", _mul_mat_id("F32"), 1, [0, 4], "expert id out of [0, 4)"),
    ("ADD_ID", _add_id(), 2, [1, 5, 0], "row id out of [0, 5)"),
    ("GET_ROWS_BACK", _get_rows_back("F32"), 1, [0, 1, 6, 2], "row id out of [0, 6)"),
    ("SET_ROWS", _set_rows("F32", "F32", "I32"), 2, [0, 10, 1], "row id out of [0, 10)"),
])
def test_row_ids_out_of_range(guest, ggml, op, build, ids_at, bad, text, caplog):
    """An id out of range: GGML_ASSERT (abort) in get_rows / set_rows / add_id, a write past
    the work buffer in mul_mat_id (only `assert`ed), past the result in get_rows_back."""
    _refused(guest, ggml, Case(op, build, data={ids_at: _bad(bad)}), text, caplog)


def test_row_ids_computed_by_the_graph_are_refused(guest, ggml, caplog):
    """Ids the graph computes (here argsort's) cannot be read before compute: refused."""
    def build(g, ctx):
        a, x = _in(g, ctx, "F32", 8, 6), _in(g, ctx, "F32", 6)
        return g.ggml_get_rows(ctx, a, g.ggml_argsort(ctx, x, 0)), [a, x]

    # (refused for the values found there before compute, or else for the argsort node)
    _refused(guest, ggml, Case("GET_ROWS", build), "row id", caplog)


def test_row_ids_written_by_a_copy_are_refused(guest, ggml, caplog):
    """Input ids that a node of the same graph overwrites (a CPY into them) before get_rows
    reads them: refused (the ids checked would not be the ids used)."""
    def build(g, ctx):
        a, ids, new = _in(g, ctx, "F32", 8, 6), _in(g, ctx, "I32", 3), _in(g, ctx, "I32", 3)
        return g.ggml_get_rows(ctx, a, g.ggml_cpy(ctx, new, ids)), [a, ids, new]

    case = Case("GET_ROWS", build, data={1: _ints(6), 2: _bad([0, 99, 1])})
    _refused(guest, ggml, case, "row ids read before compute, but node", caplog)


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


def test_set_rows_f16_on_several_threads_is_refused(guest, ggml, caplog):
    """F16 rows set into F32 convert through a work buffer the plan sizes for one thread
    (ggml 0.20): with a multi-task node (ADD) in the graph the CPU runs several, refused."""
    if op_enums(ggml).version < (0, 20, 0):
        pytest.skip("ggml 0.10's set_rows takes only F32 rows (its constructor asserts it)")

    def build(g, ctx):
        out, ins = _set_rows("F16", "F32", "I64")(g, ctx)
        return g.ggml_add(ctx, out, ins[0]), ins

    case = Case("SET_ROWS", build, data={2: _ints(10, np.int64)})
    _refused(guest, ggml, case, "only safe on one thread", caplog)


def test_mul_mat_unordered_result_strides_are_refused(guest, ggml, caplog):
    """mul_mat GGML_ASSERTs nb1 <= nb2 <= nb3 of its result, even in a dimension of 1."""
    def edit(r, recs):
        recs["nb"][r.index(r.out)][3] = 4

    case = Case("MUL_MAT", _mul_mat("F32", "F32", ne_b=(64, 3, 2, 1), ne_a=(64, 5, 2, 1)))
    _refused(guest, ggml, case, "(MUL_MAT): result strides", caplog, edit)


@pytest.mark.parametrize("k,m,ok", [(64, 64, True), (48, 48, False), (64, 32, False)])
def test_mul_mat_hadamard_hint(guest, ggml, k, m, ok, caplog):
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
        _refused(guest, ggml, case, "(MUL_MAT): Hadamard hint", caplog)


def test_mul_mat_src1_of_another_dot_type_is_refused(guest, ggml, caplog):
    """src1 must be F32 or src0's vec_dot_type (ggml-cpu GGML_ASSERTs it): F16 src1 with Q8_0
    src0 (whose dot type is Q8_0) is refused."""
    def edit(r, recs):
        i = r.index(r.inputs[1])
        recs["type"][i] = ggml.types["F16"]
        recs["nb"][i] = [2, 128, 384, 1536]

    case = Case("MUL_MAT", _mul_mat("Q8_0", "F32"), data={0: Q8_0})
    _refused(guest, ggml, case, "(MUL_MAT): src1 F16 is neither F32 nor Q8_0", caplog, edit)


def test_kernel_reads_the_ids_that_were_checked(guest, ggml, monkeypatch):
    """The guest may write its buffers while the host computes: the ids checked are copied and
    the kernel reads the copy. Here the ids' buffer is zeroed right after the checks (as a
    racing guest would): the result is still that of the ids checked."""
    import ctypes

    from apir.host import graph as host_graph
    from apir.host.shapes.base import extent

    real = host_graph._check_graph_needs

    def racing(parsed, infos, *rest):
        real(parsed, infos, *rest)
        for info in infos:
            if info.snapshot is not None:
                ctypes.memset(info.address, 0, extent(info))

    monkeypatch.setattr(host_graph, "_check_graph_needs", racing)
    case = Case("GET_ROWS", _get_rows("F32", view=True), data={1: lambda n, r: np.resize(np.int32([5, 3, 4, 1]), n)})
    assert_computes_like_cpu(guest, ggml, case)


def test_mul_mat_src1_aliasing_elements_are_refused(guest, ggml, caplog):
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
    _refused(guest, ggml, case, "spans", caplog, edit)
    r = Remote(guest, ggml, case)
    try:
        recs = r.recs.copy()
        edit(r, recs)
        assert "(MUL_MAT): src1 elements overlap" in rule_refusal(guest, r, recs)
    finally:
        r.close()


def test_mul_mat_aliasing_result_is_refused(guest, ggml, caplog):
    """A result whose elements alias (ordered strides smaller than its rows) could hold more
    chunks than the kernel's `int` counters in a small buffer: refused."""
    def edit(r, recs):
        recs["nb"][r.index(r.out)] = [4, 4, 4, 4]

    _refused(guest, ggml, Case("MUL_MAT", _mul_mat("F32", "F32")), "(MUL_MAT): result elements overlap", caplog, edit)


@pytest.mark.parametrize("bad", [[0, 10, 1, 2, 3, 4], [0, -1, 1, 2, 3, 4]])
def test_set_rows_i64_ids_out_of_range(guest, ggml, bad):
    from tests.host.shapekit import assert_refused_by_rule, refusal

    def build(g, ctx):
        dst, src, ids = _in(g, ctx, "F16", 8, 10, 2), _in(g, ctx, "F32", 8, 3, 2), _in(g, ctx, "I64", 3, 2)
        return g.ggml_set_rows(ctx, dst, src, ids), [dst, src, ids]

    r = Remote(guest, ggml, Case("SET_ROWS", build, data={2: lambda n, rng: np.array(bad, dtype=np.int64)[:n]}))
    assert_refused_by_rule(refusal(r, serves_next=False), "SET_ROWS", r.index(r.out), "row id out of [0, 10)")
    assert guest.forward(Cmd.DEVICE_GET_COUNT)[0] == 0
    r.close()
