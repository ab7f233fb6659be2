"""apir.host.graph.shapes.rope: ROPE and ROPE_BACK in the forms test-backend-ops builds (normal,
NeoX, multi-section, interleaved and vision modes; frequency factors; F16; views; in place).
Each case, built with ggml's own constructor, computes through the host to ggml CPU's own
bytes; a lying shape or parameter is refused by the rope rule (asserted on the refusal's node,
op, rule and reason), and the host serves on."""

import ctypes

import numpy as np
import pytest

from apir.ggml.layout import tensor_record
from apir.host.graph.shapes import base, op_enums
from apir.ggml.features import Feature
from tests.host.shapekit import (
    edited_refusal,
    ctor,
    op_param_edit,
    assert_computes_like_cpu,
    Case,
    Remote,
    _in,
    _ints,
    assert_matches_ggml_cpu,
    assert_refused_by_rule,
    case_id,
    g_nb,
    lie_refusal,
    refusal,
    with_op_params,
)

_ARGS = (10000.0, 1.0, 0.0, 1.0, 1.0, 1.0)  # freq_base, fs, ef, af, beta_fast, beta_slow
_ARGS_32 = (10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)  # beta_fast 32 (llama's)


def _rope(mode_name, ne=(16, 2, 3), n_dims=16, ff=False, back=False, type_name="F32", view=0,
          inplace=False, args=_ARGS, n_ff=None, sections=None):
    """test_rope's graph: src0 of `ne` (view 1: a view with gaps of one twice as wide, four
    times as tall, three times as deep; view 2: the second half of each row of one twice as
    wide), positions, frequency factors (`n_ff` of them; default n_dims / 2, fewer than
    ne[0] / 2 when n_dims < ne[0], as test-backend-ops builds them), and rope_ext /
    rope_multi (_back, _inplace); multi-section modes get test_rope's sections unless
    `sections` says otherwise."""
    def build(g, ctx):
        enums = op_enums(g)
        mode = enums.rope[mode_name]
        vision, multi = mode_name == "VISION", bool(mode & enums.rope["MROPE"])
        if view == 1:
            base_ = _in(g, ctx, type_name, ne[0] * 2, ne[1] * 4, ne[2] * 3)
            a = g.ggml_view_3d(ctx, base_, *ne, g_nb(g, base_, 1), g_nb(g, base_, 2), 0)
        elif view == 2:
            base_ = _in(g, ctx, type_name, ne[0] * 2, *ne[1:])
            a = g.ggml_view_3d(ctx, base_, *ne, g_nb(g, base_, 1), g_nb(g, base_, 2), ne[0] * g_nb(g, base_, 0))
        else:
            base_ = a = _in(g, ctx, type_name, *ne)
        pos = _in(g, ctx, "I32", ne[2] * (4 if multi else 1))
        # (vision uses every factor the kernel reads: one per pair of ne[0])
        count = n_ff if n_ff is not None else (ne[0] + 1) // 2 if vision else n_dims // 2
        c = _in(g, ctx, "F32", count) if ff else None
        ins = [base_, pos] + ([c] if ff else [])
        if multi:
            if sections is not None:
                secs = sections
            else:
                secs = (n_dims // 4, n_dims // 4, 0, 0) if vision else (n_dims // 3,) * 3 + (0,)
            fn = g.ggml_rope_multi_back if back else g.ggml_rope_multi
            nd = n_dims // 2 if vision else n_dims
            return fn(ctx, a, pos, c, nd, (ctypes.c_int * 4)(*secs), mode, 0, *args), ins
        fn = g.ggml_rope_ext_back if back else g.ggml_rope_ext_inplace if inplace else g.ggml_rope_ext
        return fn(ctx, a, pos, c, n_dims, mode, 0, *args), ins
    return build


_POS = {1: _ints(100)}
_FF = {1: _ints(100), 2: lambda n, r: r.random(n).astype(np.float32) + 1}

ROPE_NORMAL = Case("ROPE", _rope("NORMAL", n_dims=12, args=_ARGS_32), lie=(1, 0, -1), data=_POS, name="normal")
ROPE_NEOX_FF = Case("ROPE", _rope("NEOX", n_dims=12, ff=True, n_ff=8, args=_ARGS_32), lie=(2, 0, -6), data=_FF,
                    name="neox-ff")
ROPE_FF_SHORT = Case("ROPE", _rope("NORMAL", ff=True, n_dims=6), lie=(-1, 0, -1), data=_FF, name="normal-ff-ndims6")
ROPE_BACK_NORMAL = Case("ROPE_BACK", _rope("NORMAL", back=True), lie=(1, 0, -1), data=_POS, name="normal")
ROPE_BACK_IMROPE = Case("ROPE_BACK", _rope("IMROPE", n_dims=12, back=True), lie=(1, 0, -2), data=_POS,
                        name="imrope")

CASES = [
    ROPE_NORMAL,
    ROPE_NEOX_FF,
    Case("ROPE", _rope("MROPE", n_dims=12, args=_ARGS_32, sections=(2, 3, 3, 0)), lie=(1, 0, -3), data=_POS,
         name="mrope"),
    Case("ROPE", _rope("VISION", args=_ARGS_32), lie=(-1, 0, -2), data=_POS, name="vision"),
    # test-backend-ops' ROPE forms: frequency factors for n_dims only, F16, views, in place
    ROPE_FF_SHORT,
    Case("ROPE", _rope("MROPE", ff=True, n_dims=12, view=1), lie=(1, 0, -1), data=_FF, name="mrope-ff-view"),
    Case("ROPE", _rope("IMROPE", n_dims=12, view=2, type_name="F16"), lie=(1, 0, -3), data=_POS,
         name="imrope-f16-half-rows"),
    Case("ROPE", _rope("VISION", ff=True, view=2), lie=(2, 0, -5), data=_FF, name="vision-ff-half-rows"),
    Case("ROPE", _rope("VISION", ne=(17, 2, 3), ff=True), lie=(-1, 0, -1), data=_FF, name="vision-odd-ne0"),
    Case("ROPE", _rope("NEOX", n_dims=8, inplace=True, type_name="F16",
                       args=(10000.0, 1.4245, 0.7465, 1.4245, 32.0, 1.0)), data=_POS, name="neox-f16-inplace-yarn"),
    ROPE_BACK_NORMAL,
    Case("ROPE_BACK", _rope("NEOX", ff=True, n_dims=8, back=True), lie=(2, 0, -1), data=_FF, name="neox-ff"),
    ROPE_BACK_IMROPE,
    Case("ROPE_BACK", _rope("VISION", back=True, type_name="F16"), lie=(-1, 0, -2), data=_POS, name="vision-f16"),
]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_op_matches_ggml_cpu(guest, ggml, case):
    assert_matches_ggml_cpu(guest, ggml, case)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_lying_shape_is_refused(guest, ggml, case):
    lie_refusal(guest, ggml, case)


@pytest.mark.parametrize("case,slot,value,reason", [
    pytest.param(ROPE_NORMAL, 1, 7, "n_dims 7 does not fit", id="ROPE-n_dims-odd"),
    pytest.param(ROPE_NORMAL, 1, 3, "n_dims 3 does not fit", id="ROPE-n_dims-odd-small"),
    pytest.param(ROPE_NORMAL, 1, 18, "n_dims 18 does not fit", id="ROPE-n_dims-past-ne0"),
    # the copy past n_dims would start before the row
    pytest.param(ROPE_BACK_NORMAL, 1, -2, "n_dims -2 does not fit", id="ROPE_BACK-n_dims-negative"),
    pytest.param(ROPE_BACK_NORMAL, 2, 1, "rope mode 1 unknown", id="ROPE_BACK-mode-unknown"),  # the kernel's switch aborts
])
def test_bad_op_params_are_refused(guest, ggml, case, slot, value, reason):
    r = Remote(guest, ggml, case)
    assert_refused_by_rule(refusal(r, with_op_params(r, slot, value)), case.op, r.index(r.out), reason)
    r.close()


def test_imrope_sections_that_would_divide_by_zero_are_refused(guest, ggml):
    """ggml_mrope_cache_init takes (i0 / 2) % (sum of sections): sections [4, -4, 0, 0] pass
    the kernel's "one of the first three > 0" assertion and sum to 0."""
    r = Remote(guest, ggml, ROPE_BACK_IMROPE)
    recs = r.recs.copy()
    recs["op_params"][r.index(r.out)][11:15] = [4, -4, 0, 0]
    assert_refused_by_rule(refusal(r, recs), "ROPE_BACK", r.index(r.out), "sections [4, -4, 0, 0] do not fit")
    r.close()


def test_frequency_factors_read_past_the_buffer_are_refused(guest, ggml):
    """With n_dims < ne[0] the kernel reads ne[0] / 2 frequency factors from a tensor of
    n_dims / 2 (as test-backend-ops builds it): computed while that read stays in the
    factors' buffer (test_op_matches_ggml_cpu[ROPE-normal-ff-ndims6]), refused when the
    factors end the buffer."""
    r = Remote(guest, ggml, ROPE_FF_SHORT)  # ne[0] 16, n_dims 6: 3 factors, 8 read
    g, ff = ggml, r.inputs[2]
    local = r.remote.local
    offset = int(tensor_record(ff, g.tensor_dtype)["data"]) - g.ggml_backend_buffer_get_base(local)
    shift = g.ggml_backend_buffer_get_size(local) - g.ggml_nbytes(ff) - offset
    recs = r.recs.copy()
    i = r.index(ff)
    recs["data"][i] = int(recs["data"][i]) + shift
    assert_refused_by_rule(refusal(r, recs), "ROPE", r.index(r.out),
                           "frequency factors: 32 bytes read past the end of their buffer (12 bytes left)")
    r.close()


def test_empty_frequency_factors_are_refused(guest, ggml):
    """Factors [8, 0]: the cache still reads one factor per pair of ne[0];
    refused before the rope rule, by the empty-source check."""
    r = Remote(guest, ggml, ROPE_NEOX_FF)
    recs = r.recs.copy()
    recs["ne"][r.index(r.inputs[2])][1] = 0
    assert_refused_by_rule(refusal(r, recs), "ROPE", r.index(r.out), "src2 [8, 0, 1, 1] has no elements",
                           rule=base.check_empty_sources)
    r.close()


# ggml >= 0.25 (llama.cpp's build; tests/llama/test_host_ggml025.py runs this folder on it):
# ROPE rotates n_dims channels from n_offs (op_params[15]; Feature.ROPE_OFFSET).
def _rope_offset(n_dims, n_offs, mode=2, ne0=16):
    """rope_ext (NEOX by default) of [ne0, 3 heads, 4 tokens] with n_dims rotated from n_offs."""
    def build(g, ctx):
        a, pos = _in(g, ctx, "F32", ne0, 3, 4), _in(g, ctx, "I32", 4)
        out = g.ggml_rope_ext(ctx, a, pos, None, n_dims, mode, 0, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)
        return ctor(g, "ggml_rope_set_offset")(out, n_offs), [a, pos]
    return build


CASES_025 = [
    Case("ROPE", _rope_offset(8, 2), name="neox-offset-2", feature=Feature.ROPE_OFFSET),
    Case("ROPE", _rope_offset(4, 12, mode=0), lie=(-1, 1, -1), name="normal-offset-12", feature=Feature.ROPE_OFFSET),
]


@pytest.mark.parametrize("case", CASES_025, ids=case_id)
def test_op_matches_ggml_cpu_025(guest, ggml, case):
    assert_matches_ggml_cpu(guest, ggml, case)


@pytest.mark.parametrize("case", CASES_025, ids=case_id)
def test_lying_shape_is_refused_025(guest, ggml, case):
    lie_refusal(guest, ggml, case)


@pytest.mark.parametrize(
    "n_dims, n_offs, mode, reason",
    [
        (8, 3, 2, "n_offs 3 with n_dims 8 does not fit"),  # odd: GGML_ASSERTed
        (8, 10, 2, "n_offs 10 with n_dims 8 does not fit"),  # past ne[0] 16: GGML_ASSERTed
        (8, -2, 0, "n_offs -2 with n_dims 8 does not fit"),
        (0, 4, 2, "n_dims 0 at n_offs 4"),  # the copy loop would step back forever
        (0, 0, 0, "n_dims 0 at n_offs 0"),
    ],
)
def test_rope_offset_out_of_the_row_is_refused(guest, ggml, n_dims, n_offs, mode, reason):
    """rope_flt GGML_ASSERTs 0 <= n_offs, n_offs even and n_offs + n_dims <= ne[0]; its copy of
    the unrotated channels never ends with n_dims 0 at an offset inside the row."""
    def edit(r, recs):
        op_param_edit(1, n_dims)(r, recs)
        op_param_edit(15, n_offs)(r, recs)

    case = Case("ROPE", _rope_offset(8, 2, mode=mode), feature=Feature.ROPE_OFFSET)
    edited_refusal(guest, ggml, case, reason, edit)


def test_rope_vision_with_an_offset_is_refused(guest, ggml):
    """The vision mode (24) GGML_ASSERTs n_offs == 0 (and ggml_rope_set_offset refuses it)."""
    def build(g, ctx):
        a, pos = _in(g, ctx, "F32", 16, 3, 4), _in(g, ctx, "I32", 16)
        sections = (ctypes.c_int * 4)(2, 2, 2, 2)
        out = g.ggml_rope_multi(ctx, a, pos, None, 8, sections, 24, 0, 10000.0, 1.0, 0.0, 1.0, 32.0, 1.0)
        return out, [a, pos]

    case = Case("ROPE", build, data={1: _ints(100)}, name="vision", feature=Feature.ROPE_OFFSET)
    assert_computes_like_cpu(guest, ggml, case)
    edited_refusal(guest, ggml, case, "n_offs 2 with the vision mode", op_param_edit(15, 2))
