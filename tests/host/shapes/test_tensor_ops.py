"""apir.host.graph.shapes.tensor_ops: ACC, SET, CUMSUM, FILL, DIAG, TRI and SOLVE_TRI in the forms
test-backend-ops builds (in place, views, I32). Each case, built with ggml's own constructor,
computes through the host to ggml CPU's own bytes; a lying shape, type or op_param is refused
by that op's rule (asserted on the refusal's node, op, rule and reason), and the host serves
on. Every GGML_ASSERT of these ops' CPU kernels is in KERNEL_ASSERTS, with a graph against it
that the rule refuses or the reason none reaches it (tests/host/kernelkit.py)."""

import numpy as np
import pytest

from apir.host.graph.shapes import op_enums
from apir.host.graph.shapes import tensor_ops as rules
from tests.host.kernelkit import (
    I32,
    Cover,
    cpu_sources,
    found_any,
    missing_asserts,
    v,
    violation_refusal,
    violations,
)
from tests.host.shapekit import (
    Case,
    Remote,
    _in,
    assert_matches_ggml_cpu,
    assert_refused_by_rule,
    case_id,
    ctor,
    g_nb,
    lie_refusal,
    refusal,
    with_op_params,
)


def _ints(n, rng):
    return rng.integers(-1000, 1000, n).astype(np.int32)


def _acc(inplace=False, b_view=False):
    """ggml_acc of b [8, 3, 2] into a [16, 5, 2] at row 1, column 2, with a's strides; b
    optionally a view at a non-zero offset into a larger tensor (test-backend-ops' stride_dim)."""
    def build(g, ctx):
        a = _in(g, ctx, "F32", 16, 5, 2)
        if b_view:
            pad = _in(g, ctx, "F32", 8, 4, 2)
            b = ctor(g, "ggml_view_4d")(ctx, pad, 8, 3, 2, 1, g_nb(g, pad, 1), g_nb(g, pad, 2),
                                      g_nb(g, pad, 3), g_nb(g, pad, 1))
            ins = [a, pad]
        else:
            b = _in(g, ctx, "F32", 8, 3, 2)
            ins = [a, b]
        f = ctor(g, "ggml_acc_inplace" if inplace else "ggml_acc")
        return f(ctx, a, b, g_nb(g, a, 1), g_nb(g, a, 2), g_nb(g, a, 3), g_nb(g, a, 1) + 2 * 4), ins
    return build


def _set(type_name, inplace=False):
    """ggml_set of src [6, 3, 2] into dst [12, 6, 2] (test-backend-ops' dim=2 layout: src's own
    strides, offset to the middle)."""
    def build(g, ctx):
        dst, src = _in(g, ctx, type_name, 12, 6, 2), _in(g, ctx, type_name, 6, 3, 2)
        offset = 3 * g_nb(g, dst, 0) + 1 * g_nb(g, dst, 1)
        f = ctor(g, "ggml_set_inplace" if inplace else "ggml_set")
        return f(ctx, dst, src, g_nb(g, src, 1), g_nb(g, src, 2), g_nb(g, src, 3), offset), [dst, src]
    return build


def _set_2d_of_view(g, ctx):
    """ggml_set_2d_inplace of a column slice (rows with gaps) into dst's rows."""
    dst, src = _in(g, ctx, "F32", 10, 4), _in(g, ctx, "F32", 9, 3)
    v = g.ggml_view_2d(ctx, src, 5, 3, g_nb(g, src, 1), 4 * 4)
    return ctor(g, "ggml_set_2d_inplace")(ctx, dst, v, g_nb(g, dst, 1), 2 * 4), [dst, src]


def _cumsum(view=False):
    def build(g, ctx):
        a = _in(g, ctx, "F32", 13, 5, 3)
        src = g.ggml_view_3d(ctx, a, 9, 5, 3, g_nb(g, a, 1), g_nb(g, a, 2), 4 * 4) if view else a
        return ctor(g, "ggml_cumsum")(ctx, src), [a]
    return build


def _fill(type_name, c, inplace=False):
    def build(g, ctx):
        if type_name == "F16" and op_enums(g).version < (0, 20, 0):
            pytest.skip("ggml 0.10 fills F32 only")
        a = _in(g, ctx, type_name, 7, 4, 3)
        return ctor(g, "ggml_fill_inplace" if inplace else "ggml_fill")(ctx, a, c), [a]
    return build


def _diag(g, ctx):
    a = _in(g, ctx, "F32", 7, 1, 3, 2)
    return ctor(g, "ggml_diag")(ctx, a), [a]


def _tri(tri_type):
    def build(g, ctx):
        a = _in(g, ctx, "F32", 6, 6, 3)
        return ctor(g, "ggml_tri")(ctx, a, tri_type), [a]
    return build


def _lower_triangular(n, batches):
    """Data for an F32 [n, n, batches] A: lower triangular, its diagonal away from 0."""
    def data(count, rng):
        a = np.tril(rng.uniform(-1, 1, (batches, n, n))).astype(np.float32)
        a[:, np.arange(n), np.arange(n)] = rng.uniform(0.5, 1.5, (batches, n))
        return a.reshape(-1)
    return data


def _solve_tri(g, ctx):
    a, b = _in(g, ctx, "F32", 6, 6, 2), _in(g, ctx, "F32", 4, 6, 2)
    return ctor(g, "ggml_solve_tri")(ctx, a, b, True, True, False), [a, b]


ACC = Case("ACC", _acc(), name="f32")
SET_F32 = Case("SET", _set("F32"), name="f32")
FILL_F16 = Case("FILL", _fill("F16", 1.5), name="f16")
TRI_UPPER = Case("TRI", _tri(3), lie=(0, 1, -1), name="type-3")

CASES = [
    ACC,
    Case("ACC", _acc(inplace=True), lie=(-1, 0, -1), name="inplace"),
    Case("ACC", _acc(b_view=True), lie=(-1, 2, -1), name="src1-view"),
    SET_F32,
    Case("SET", _set("F32", inplace=True), lie=(-1, 0, -1), name="f32-inplace"),
    Case("SET", _set("I32"), data={0: _ints, 1: _ints}, name="i32"),
    Case("SET", _set("I32", inplace=True), data={0: _ints, 1: _ints}, name="i32-inplace"),
    Case("SET", _set_2d_of_view, lie=(-1, 1, -1), name="2d-inplace-of-view"),
    Case("CUMSUM", _cumsum(), name="f32"),
    Case("CUMSUM", _cumsum(view=True), lie=(-1, 2, -1), name="of-view"),
    Case("FILL", _fill("F32", 2.5), name="f32"),
    Case("FILL", _fill("F32", -3.25, inplace=True), lie=(-1, 1, -1), name="f32-inplace"),
    FILL_F16,
    Case("DIAG", _diag, name="f32"),
    Case("DIAG", _diag, lie=(0, 0, -1), name="f32-src-lie"),
    Case("TRI", _tri(0), name="type-0"),
    TRI_UPPER,
    Case("SOLVE_TRI", _solve_tri, lie=(0, 0, -1), data={0: _lower_triangular(6, 2)}, name="lower"),
    Case("SOLVE_TRI", _solve_tri, lie=(1, 1, -1), data={0: _lower_triangular(6, 2)}, name="lower-b-lie"),
]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_op_matches_ggml_cpu(guest, ggml, case):
    assert_matches_ggml_cpu(guest, ggml, case)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_lying_shape_is_refused(guest, ggml, case):
    lie_refusal(guest, ggml, case)


_ACC_OFFSET_PAST = 16 * 5 * 2 * 4  # one past a's last byte


@pytest.mark.parametrize("case,slot,value", [
    pytest.param(ACC, 3, _ACC_OFFSET_PAST, id="ACC-offset-past-the-result"),
    pytest.param(ACC, 0, -4, id="ACC-nb1-negative"),  # size_t: wraps
    pytest.param(ACC, 1, 16 * 5 * 4 * 2, id="ACC-nb2-past-the-end"),  # walks the second matrix past the end
    pytest.param(SET_F32, 3, -1, id="SET-offset-negative"),
    pytest.param(SET_F32, 1, 1 << 20, id="SET-nb2-far-past"),
    pytest.param(TRI_UPPER, 0, 4, id="TRI-type-4"),  # no such tri type (GGML_ABORT)
    pytest.param(TRI_UPPER, 0, -1, id="TRI-type-negative"),
])
def test_bad_op_params_are_refused(guest, ggml, case, slot, value):
    """Each would make ggml's CPU kernel write or read past a tensor, or hit a GGML_ASSERT /
    GGML_ABORT."""
    r = Remote(guest, ggml, case)
    assert_refused_by_rule(refusal(r, with_op_params(r, slot, value)), case.op, r.index(r.out))
    r.close()


def test_set_last_element_past_the_end_is_refused(guest, ggml):
    """ggml's set kernel GGML_ASSERTs only that the last element *starts* at or before
    ggml_nbytes(dst): an offset putting it exactly at the end passes that assertion and writes
    4 bytes past the result. The rule wants the element's end inside."""
    r = Remote(guest, ggml, SET_F32)
    recs = r.recs.copy()
    i = r.index(r.out)
    nb1, nb2 = (int(recs["op_params"][i][k]) for k in range(2))
    last_start = 5 * 4 + 2 * nb1 + 1 * nb2  # src [6, 3, 2]: im0, im1, im2 = 5, 2, 1
    nbytes = 12 * 6 * 2 * 4
    recs["op_params"][i][3] = nbytes - last_start  # ggml: offset + last_start <= nbytes holds
    got = refusal(r, recs)
    assert_refused_by_rule(got, "SET", i)
    assert "past the result" in got.reason, got.reason
    recs["op_params"][i][3] = nbytes - last_start - 4  # the last element ends at the end: fine
    rc, dec = r.compute(recs)
    assert rc == 0 and dec.i32() == 0
    r.close()


def test_fill_of_another_type_is_refused(guest, ggml):
    """The fill kernel writes src0's type into the result (and aborts on types it lacks)."""
    r = Remote(guest, ggml, FILL_F16)
    recs = r.recs.copy()
    recs["type"][r.index(r.inputs[0])] = ggml.types["BF16"]
    assert_refused_by_rule(refusal(r, recs), "FILL", r.index(r.out))
    r.close()


# --- every GGML_ASSERT of these ops' CPU kernels (tests/host/kernelkit.py) ---
# op -> {assert text as in the C source (whitespace collapsed): how it is covered}
KERNEL_ASSERTS: dict[str, dict[str, Cover]] = {
    "ACC": {
        "ggml_are_same_shape(src0, dst)": v(("ne", "src0", 2, 1)),
        "ggml_is_contiguous(dst) && ggml_is_contiguous(src0)": v(("nb", "src0", 0, 2)),
        "offset + (ne10 == 0 ? 0 : ne10-1)*nb0 + (ne11 == 0 ? 0 : ne11-1)*nb1 + (ne12 == 0 ? 0 : ne12-1)*nb2 "
        "+ (ne13 == 0 ? 0 : ne13-1)*nb3 < ggml_nbytes(dst)": v(("param", "dst", 3, 600)),
        "offset + (ne10 == 0 ? 0 : ne10-1)*nb00 + (ne11 == 0 ? 0 : ne11-1)*nb01 + (ne12 == 0 ? 0 : ne12-1)*nb02 "
        "+ (ne13 == 0 ? 0 : ne13-1)*nb03 < ggml_nbytes(src0)": v(("param", "dst", 0, 200)),
        "nb10 == sizeof(float)": v(("nb", "src1", 0, 2)),
    },
    "SET": {
        "ggml_are_same_shape(src0, dst)": v(("ne", "src0", 2, 1)),
        "ggml_is_contiguous(dst) && ggml_is_contiguous(src0)": v(("nb", "dst", 0, 2)),
        "offset + im0*nb0 + im1*nb1 + im2*nb2 + im3*nb3 <= ggml_nbytes(dst)": v(("param", "dst", 3, 560)),
        "nb10 == sizeof(float)": v(("nb", "src1", 0, 2)),
        "nb10 == sizeof(int32_t)": v(("nb", "src1", 0, 2)),  # set_i32: the rule is the same
    },
    "CUMSUM": {
        "src0->nb[0] == sizeof(float)": v(("nb", "src0", 0, 2)),
        "dst->nb[0] == sizeof(float)": v(("nb", "dst", 0, 2)),
        "ne0 == ne00": v(("ne", "dst", 0, 12)),
        "ne1 == ne01": v(("ne", "dst", 1, 4)),
        "ne2 == ne02": v(("ne", "dst", 2, 2)),
        "ne3 == ne03": v(("ne", "dst", 2, 1), ("ne", "dst", 3, 3), ("nb", "dst", 3, 260)),
    },
    "FILL": {},
    "DIAG": {
        "ne00 == ne0": v(("ne", "dst", 0, 6)),
        "ne00 == ne1": v(("ne", "dst", 1, 6)),
        "ne01 == 1": v(("ne", "src0", 1, 2), ("ne", "src0", 3, 1)),
        "ne02 == ne2": v(("ne", "dst", 2, 2)),
        "ne03 == ne3": v(("ne", "dst", 3, 1)),
        "nb00 == sizeof(float)": v(("nb", "src0", 0, 2)),
        "nb0 == sizeof(float)": v(("nb", "dst", 0, 2)),
    },
    "TRI": {
        "ggml_is_contiguous(src0)": v(("nb", "src0", 0, 2)),
    },
    "SOLVE_TRI": {
        "src0->type == GGML_TYPE_F32": v(("type", "src0", 0, I32)),
        "src1->type == GGML_TYPE_F32": v(("type", "src1", 0, I32)),
        "dst->type == GGML_TYPE_F32": v(("type", "dst", 0, I32)),
        "ne00 == ne01": v(("ne", "src0", 0, 5)),
        "ne0 == ne10": v(("ne", "dst", 0, 3)),
        "ne1 == ne11": v(("ne", "dst", 1, 5)),
        "ne02 == ne12 && ne12 == ne2": v(("ne", "src0", 2, 1)),
        "ne03 == ne13 && ne13 == ne3": v(("ne", "dst", 2, 1), ("ne", "dst", 3, 2), ("nb", "dst", 3, 96)),
    },
}
# op -> the kernel functions (ggml_compute_forward_<name>) whose asserts it can reach
KERNEL_FUNCTIONS = {
    "ACC": ["acc_f32", "acc"],
    "SET": ["set_f32", "set_i32", "set"],
    "CUMSUM": ["cumsum_f32", "cumsum"],
    "FILL": ["fill_f32", "fill_f16", "fill"],
    "DIAG": ["diag_f32", "diag"],
    "TRI": ["tri_f32", "tri"],
    "SOLVE_TRI": ["solve_tri_f32", "solve_tri"],
}


@pytest.mark.parametrize("version,folder", cpu_sources())
def test_every_kernel_assert_is_in_the_table(version, folder):
    missing = missing_asserts(folder, KERNEL_FUNCTIONS, KERNEL_ASSERTS)
    assert not missing, f"ggml {version}: kernel asserts without a rule in KERNEL_ASSERTS: {missing}"
    assert found_any(folder, [n for names in KERNEL_FUNCTIONS.values() for n in names])  # the parser works


def test_kernel_assert_table_has_the_modules_ops():
    assert set(KERNEL_ASSERTS) == set(rules.RULES) == set(KERNEL_FUNCTIONS)


@pytest.mark.parametrize("op,text,cover", violations(KERNEL_ASSERTS))
def test_violating_graph_is_refused_by_the_rule(guest, ggml, op, text, cover):
    if op_enums(ggml).version < cover.since:
        pytest.skip(f"ggml {op_enums(ggml).version} has no such kernel")
    cases = [c for c in CASES if c.op == op]
    if cover.case >= len(cases):
        pytest.skip("this ggml has no such case")
    violation_refusal(guest, ggml, cases[cover.case], op, text, cover)
