"""apir.host.shapes.backward and .rope: the training ops (SILU_BACK, RMS_NORM_BACK,
SOFT_MAX_BACK, CROSS_ENTROPY_LOSS[_BACK], OPT_STEP_ADAMW / _SGD) and ROPE / ROPE_BACK in the
forms test-backend-ops builds. Each op, built with ggml's own constructor, computes through
the host to ggml CPU's own bytes; a lying shape or parameter is refused by that op's rule,
and the host serves on."""

import ctypes
import logging

import numpy as np
import pytest

from apir.ggml.layout import tensor_record
from apir.host.shapes import op_enums
from tests.host.shapekit import ERROR, Case, Remote, _in, _ints, case_tests, g_nb


def _same(fn, n, type_name="F32", ne=(8, 3, 2)):
    """A case of `n` sources of one type and shape through `fn(g, ctx, *srcs)`."""
    def build(g, ctx):
        srcs = [_in(g, ctx, type_name, *ne) for _ in range(n)]
        return fn(g, ctx, *srcs), srcs
    return build


def _param(g, ctx, *ne):
    t = _in(g, ctx, "F32", *ne)
    g.ggml_set_param(t)  # ggml_opt_step_* GGML_ASSERT the weights are a parameter
    return t


def _adamw(g, ctx):
    w = _param(g, ctx, 8, 3, 2)
    grad, m, v = (_in(g, ctx, "F32", 8, 3, 2) for _ in range(3))
    p = _in(g, ctx, "F32", 7)
    return g.ggml_opt_step_adamw(ctx, w, grad, m, v, p), [w, grad, m, v, p]


def _sgd(g, ctx):
    w, grad, p = _param(g, ctx, 8, 3, 2), _in(g, ctx, "F32", 8, 3, 2), _in(g, ctx, "F32", 2)
    return g.ggml_opt_step_sgd(ctx, w, grad, p), [w, grad, p]


def _ce_back(g, ctx):
    d, a, b = _in(g, ctx, "F32", 1), _in(g, ctx, "F32", 8, 3, 2), _in(g, ctx, "F32", 8, 3, 2)
    return g.ggml_cross_entropy_loss_back(ctx, d, a, b), [d, a, b]


_ARGS = (10000.0, 1.0, 0.0, 1.0, 1.0, 1.0)  # freq_base, fs, ef, af, beta_fast, beta_slow


def _rope(mode_name, ne=(16, 2, 3), n_dims=16, ff=False, back=False, type_name="F32", view=0,
          inplace=False, args=_ARGS):
    """test_rope's graph: src0 of `ne` (view 1: a view with gaps of one twice as wide, four
    times as tall, three times as deep; view 2: the second half of each row of one twice as
    wide), positions, frequency factors of n_dims / 2 (fewer than ne[0] / 2 when
    n_dims < ne[0], as test-backend-ops builds them), and rope_ext / rope_multi (_back,
    _inplace); multi-section modes get test_rope's sections."""
    def build(g, ctx):
        enums = op_enums(g)
        mode = enums.rope[mode_name]
        vision, multi = mode_name == "VISION", bool(mode & enums.rope["MROPE"])
        if view == 1:
            base = _in(g, ctx, type_name, ne[0] * 2, ne[1] * 4, ne[2] * 3)
            a = g.ggml_view_3d(ctx, base, *ne, g_nb(g, base, 1), g_nb(g, base, 2), 0)
        elif view == 2:
            base = _in(g, ctx, type_name, ne[0] * 2, *ne[1:])
            a = g.ggml_view_3d(ctx, base, *ne, g_nb(g, base, 1), g_nb(g, base, 2), ne[0] * g_nb(g, base, 0))
        else:
            base = a = _in(g, ctx, type_name, *ne)
        pos = _in(g, ctx, "I32", ne[2] * (4 if multi else 1))
        # (vision uses every factor the kernel reads: one per pair of ne[0])
        c = _in(g, ctx, "F32", (ne[0] + 1) // 2 if vision else n_dims // 2) if ff else None
        ins = [base, pos] + ([c] if ff else [])
        if multi:
            sections = (n_dims // 4, n_dims // 4, 0, 0) if vision else (n_dims // 3,) * 3 + (0,)
            fn = g.ggml_rope_multi_back if back else g.ggml_rope_multi
            nd = n_dims // 2 if vision else n_dims
            return fn(ctx, a, pos, c, nd, (ctypes.c_int * 4)(*sections), mode, 0, *args), ins
        fn = g.ggml_rope_ext_back if back else g.ggml_rope_ext_inplace if inplace else g.ggml_rope_ext
        return fn(ctx, a, pos, c, n_dims, mode, 0, *args), ins
    return build


_POS = {1: _ints(100)}
_FF = {1: _ints(100), 2: lambda n, r: r.random(n).astype(np.float32) + 1}


def _POSITIVE(n, r):
    return r.random(n).astype(np.float32) + 0.1


def _ADAMW_PARAMS(n, r):  # alpha, beta1, beta2, eps, weight decay, beta1h, beta2h
    return np.array([1e-2, 0.9, 0.999, 1e-8, 1e-2, 10.0, 1000.0], np.float32)


CASES = [
    Case("SILU_BACK", _same(lambda g, c, a, b: g.ggml_silu_back(c, a, b), 2), lie=(1, 0, -1)),
    Case("SILU_BACK", _same(lambda g, c, a, b: g.ggml_silu_back(c, a, b), 2, "F16"), lie=(0, 1, -1)),
    Case("RMS_NORM_BACK", _same(lambda g, c, a, b: g.ggml_rms_norm_back(c, a, b, 1e-6), 2), lie=(1, 1, -1)),
    Case("SOFT_MAX_BACK", _same(lambda g, c, a, b: g.ggml_soft_max_ext_back(c, a, b, 0.5, 0.0), 2),
         data={1: _POSITIVE}),
    Case("CROSS_ENTROPY_LOSS", _same(lambda g, c, a, b: g.ggml_cross_entropy_loss(c, a, b), 2),
         lie=(1, 0, -1), data={1: _POSITIVE}),
    Case("CROSS_ENTROPY_LOSS_BACK", _ce_back, lie=(2, 1, -1), data={2: _POSITIVE}),
    Case("OPT_STEP_ADAMW", _adamw, lie=(4, 0, -1), data={3: _POSITIVE, 4: _ADAMW_PARAMS}),
    Case("OPT_STEP_SGD", _sgd, lie=(1, 1, -1), data={2: lambda n, r: np.array([1e-2, 1e-3], np.float32)}),
    Case("ROPE_BACK", _rope("NORMAL", back=True), lie=(1, 0, -1), data=_POS),
    Case("ROPE_BACK", _rope("NEOX", ff=True, n_dims=8, back=True), lie=(2, 0, -1), data=_FF),
    Case("ROPE_BACK", _rope("IMROPE", n_dims=12, back=True), lie=(1, 0, -2), data=_POS),
    Case("ROPE_BACK", _rope("VISION", back=True, type_name="F16"), lie=(-1, 0, -2), data=_POS),
    # test-backend-ops' ROPE forms: frequency factors for n_dims only, F16, views, in place
    Case("ROPE", _rope("NORMAL", ff=True, n_dims=6), lie=(-1, 0, -1), data=_FF),
    Case("ROPE", _rope("MROPE", ff=True, n_dims=12, view=1), lie=(1, 0, -1), data=_FF),
    Case("ROPE", _rope("IMROPE", n_dims=12, view=2, type_name="F16"), lie=(1, 0, -3), data=_POS),
    Case("ROPE", _rope("VISION", ff=True, view=2), lie=(2, 0, -5), data=_FF),
    Case("ROPE", _rope("VISION", ne=(17, 2, 3), ff=True), lie=(-1, 0, -1), data=_FF),  # odd ne[0]
    Case("ROPE", _rope("NEOX", n_dims=8, inplace=True, type_name="F16",
                       args=(10000.0, 1.4245, 0.7465, 1.4245, 32.0, 1.0)), data=_POS),
]
IDS = [f"{c.op}-{i}" for i, c in enumerate(CASES)]
remote, test_op_matches_ggml_cpu, test_lying_shape_is_refused = case_tests(CASES, IDS)


def _refused(r, recs, caplog, why):
    with caplog.at_level(logging.WARNING, logger="apir.host"):
        rc, _ = r.compute(recs)
    assert rc == ERROR and why in caplog.text, caplog.text
    rc, dec = r.compute()
    assert rc == 0 and dec.i32() == 0


def _case(op, i=0):
    return [c for c in CASES if c.op == op][i]


@pytest.mark.parametrize("op,slot,value,why", [
    ("SOFT_MAX_BACK", 1, np.float32(0.5), "max_bias 0.5 is not 0"),  # the kernel GGML_ASSERTs 0
    ("SOFT_MAX_BACK", 1, np.float32(np.nan), "max_bias nan is not 0"),
    ("ROPE_BACK", 1, -2, "n_dims -2 does not fit"),  # the copy past n_dims would start before the row
    ("ROPE_BACK", 2, 1, "rope mode 1 unknown"),  # the kernel's switch aborts
])
def test_bad_op_params_are_refused(guest, ggml, op, slot, value, why, caplog):
    r = Remote(guest, ggml, _case(op))
    recs = r.recs.copy()
    i = r.index(r.out)
    recs["op_params"][i][slot] = np.array([value]).view(np.int32)[0]
    _refused(r, recs, caplog, f"({op}): {why}")
    r.close()


def test_imrope_sections_that_would_divide_by_zero_are_refused(guest, ggml, caplog):
    """ggml_mrope_cache_init takes (i0 / 2) % (sum of sections): sections [4, -4, 0, 0] pass
    the kernel's "one of the first three > 0" assertion and sum to 0."""
    r = Remote(guest, ggml, _case("ROPE_BACK", 2))
    recs = r.recs.copy()
    i = r.index(r.out)
    recs["op_params"][i][11:15] = [4, -4, 0, 0]
    _refused(r, recs, caplog, "(ROPE_BACK): sections [4, -4, 0, 0] do not fit")
    r.close()


def test_opt_step_state_laid_out_otherwise_is_refused(guest, ggml, caplog):
    """OPT_STEP_ADAMW reads and writes m and v at src0's row offsets: a moment tensor of the
    same shape but other strides (its rows transposed) would be walked off its extent."""
    r = Remote(guest, ggml, _case("OPT_STEP_ADAMW"))
    recs = r.recs.copy()
    i = r.index(r.inputs[2])
    recs["nb"][i][1], recs["nb"][i][2] = recs["nb"][i][2], recs["nb"][i][1]
    _refused(r, recs, caplog, "(OPT_STEP_ADAMW): src2 F32")
    r.close()


def test_rope_frequency_factors_read_past_the_buffer_are_refused(guest, ggml, caplog):
    """With n_dims < ne[0] the kernel reads ne[0] / 2 frequency factors from a tensor of
    n_dims / 2 (as test-backend-ops builds it): computed while that read stays in the
    factors' buffer (test_op_matches_ggml_cpu), refused when the factors end the buffer."""
    r = Remote(guest, ggml, _case("ROPE", 0))  # ne[0] 16, n_dims 6: 3 factors, 8 read
    g, ff = ggml, r.inputs[2]
    local = r.remote.local
    offset = int(tensor_record(ff, g.tensor_dtype)["data"]) - g.ggml_backend_buffer_get_base(local)
    shift = g.ggml_backend_buffer_get_size(local) - g.ggml_nbytes(ff) - offset
    recs = r.recs.copy()
    i = r.index(ff)
    recs["data"][i] = int(recs["data"][i]) + shift
    _refused(r, recs, caplog, "(ROPE): frequency factors: 32 bytes read past the end of their buffer (12 bytes left)")
    r.close()
