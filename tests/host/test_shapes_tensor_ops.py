"""apir.host.shapes.tensor_ops (ACC, SET, CUMSUM, FILL, DIAG, TRI, SOLVE_TRI): each op, built with ggml's own constructor, computes through the
host to ggml CPU's own bytes; a lying shape or op_param is refused by that op's rule, and the
host serves on."""

import logging

import numpy as np
import pytest

from apir.host.shapes import op_enums
from tests.host.shapekit import ERROR, Case, Remote, _in, case_tests, ctor, g_nb


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


CASES = [
    Case("ACC", _acc()),
    Case("ACC", _acc(inplace=True), lie=(-1, 0, -1)),
    Case("ACC", _acc(b_view=True), lie=(-1, 2, -1)),
    Case("SET", _set("F32")),
    Case("SET", _set("F32", inplace=True), lie=(-1, 0, -1)),
    Case("SET", _set("I32"), data={0: _ints, 1: _ints}),
    Case("SET", _set("I32", inplace=True), data={0: _ints, 1: _ints}),
    Case("SET", _set_2d_of_view, lie=(-1, 1, -1)),
    Case("CUMSUM", _cumsum()),
    Case("CUMSUM", _cumsum(view=True), lie=(-1, 2, -1)),
    Case("FILL", _fill("F32", 2.5)),
    Case("FILL", _fill("F32", -3.25, inplace=True), lie=(-1, 1, -1)),
    Case("FILL", _fill("F16", 1.5)),
    Case("DIAG", _diag),
    Case("DIAG", _diag, lie=(0, 0, -1)),
    Case("TRI", _tri(0)),
    Case("TRI", _tri(3), lie=(0, 1, -1)),
    Case("SOLVE_TRI", _solve_tri, lie=(0, 0, -1), data={0: _lower_triangular(6, 2)}),
    Case("SOLVE_TRI", _solve_tri, lie=(1, 1, -1), data={0: _lower_triangular(6, 2)}),
]
IDS = [f"{c.op}-{i}" for i, c in enumerate(CASES)]
remote, test_op_matches_ggml_cpu, test_lying_shape_is_refused = case_tests(CASES, IDS)


# (case, op_params slot, value): each would make ggml's CPU kernel write or read past a
# tensor, or hit a GGML_ASSERT / GGML_ABORT.
_ACC_OFFSET_PAST = 16 * 5 * 2 * 4  # one past a's last byte
BAD_PARAMS = [
    (0, 3, _ACC_OFFSET_PAST),  # ACC: offset past the result
    (0, 0, -4),  # ACC: a negative nb1 (size_t: wraps)
    (0, 1, 16 * 5 * 4 * 2),  # ACC: nb2 walks the second matrix past the end
    (3, 3, -1),  # SET: negative offset
    (3, 1, 1 << 20),  # SET: nb2 far past the result
    (16, 0, 4),  # TRI: no such tri type (GGML_ABORT)
    (16, 0, -1),
]


@pytest.mark.parametrize("case_index,slot,value", BAD_PARAMS)
def test_bad_op_params_are_refused(guest, ggml, case_index, slot, value, caplog):
    case = CASES[case_index]
    r = Remote(guest, ggml, case)
    recs = r.recs.copy()
    i = r.index(r.out)
    recs["op_params"][i][slot] = value
    with caplog.at_level(logging.WARNING, logger="apir.host"):
        rc, _ = r.compute(recs)
    assert rc == ERROR and f"({case.op})" in caplog.text, caplog.text
    rc, dec = r.compute()
    assert rc == 0 and dec.i32() == 0
    r.close()


def test_set_last_element_past_the_end_is_refused(guest, ggml, caplog):
    """ggml's set kernel GGML_ASSERTs only that the last element *starts* at or before
    ggml_nbytes(dst): an offset putting it exactly at the end passes that assertion and writes
    4 bytes past the result. The rule wants the element's end inside."""
    r = Remote(guest, ggml, CASES[3])
    recs = r.recs.copy()
    i = r.index(r.out)
    nb1, nb2 = (int(recs["op_params"][i][k]) for k in range(2))
    last_start = 5 * 4 + 2 * nb1 + 1 * nb2  # src [6, 3, 2]: im0, im1, im2 = 5, 2, 1
    nbytes = 12 * 6 * 2 * 4
    recs["op_params"][i][3] = nbytes - last_start  # ggml: offset + last_start <= nbytes holds
    with caplog.at_level(logging.WARNING, logger="apir.host"):
        rc, _ = r.compute(recs)
    assert rc == ERROR and "(SET)" in caplog.text and "past the result" in caplog.text, caplog.text
    recs["op_params"][i][3] = nbytes - last_start - 4  # the last element ends at the end: fine
    rc, dec = r.compute(recs)
    assert rc == 0 and dec.i32() == 0
    r.close()


def test_fill_of_another_type_is_refused(guest, ggml, caplog):
    """The fill kernel writes src0's type into the result (and aborts on types it lacks)."""
    case = CASES[12]  # FILL F16
    r = Remote(guest, ggml, case)
    recs = r.recs.copy()
    i = r.index(r.inputs[0])
    recs["type"][i] = ggml.types["BF16"]
    with caplog.at_level(logging.WARNING, logger="apir.host"):
        rc, _ = r.compute(recs)
    assert rc == ERROR and "(FILL)" in caplog.text, caplog.text
    r.close()
