"""apir.host.graph.shapes.conv: the convolution, pooling and image ops (IM2COL[_BACK|_3D],
COL2IM_1D, CONV_2D[_DW], CONV_3D, CONV_TRANSPOSE_1D/_2D, POOL_1D/_2D[_BACK], UPSCALE,
PAD_REFLECT_1D, ROLL, WIN_PART / WIN_UNPART, GET_REL_POS / ADD_REL_POS). Each case, built with
ggml's own constructor, computes through the host to ggml CPU's own bytes; a lying shape or
op_param is refused by that op's rule (before the CPU kernel would walk off a tensor or abort;
asserted on the refusal's node, op, rule and reason), and the host serves on. Every
GGML_ASSERT of these ops' CPU kernels (and ggml_graph_plan's for them) is in KERNEL_ASSERTS,
with a graph against it that the rule refuses or the reason none reaches it
(tests/host/kernelkit.py)."""

import ctypes
import logging

import numpy as np
import pytest

from apir.codec.constants import ApirBackendCommandType as Cmd
from apir.codec.records import rpc_tensor_dtype
from apir.host.errors import Refused
from apir.host.graph.shapes import base
from apir.host.graph.shapes import conv as rules
from apir.host.graph.shapes import op_enums
from tests.host.hostkit import DATA_RES, GgmlScratch, RemoteGraph
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
from tests.host.shapekit import (
    ERROR,
    Case,
    Remote,
    _direct,
    _graph,
    _in,
    _Refusals,
    assert_matches_ggml_cpu,
    assert_refused_by_rule,
    case_id,
    ctor,
    info,
    lie_refusal,
    refusal,
)


def _t(g, name):
    return g.types[name]


# --- builders ---------------------------------------------------------------------------------
def _im2col(kt, dt, ne_k, ne_x, s0, s1, p0, p1, d0, d1, is_2d):
    def build(g, ctx):
        k, x = _in(g, ctx, kt, *ne_k), _in(g, ctx, "F32", *ne_x)
        return ctor(g, "ggml_im2col")(ctx, k, x, s0, s1, p0, p1, d0, d1, is_2d, _t(g, dt)), [k, x]
    return build


def _im2col_back(g, ctx):
    """The gradient of im2col([3, 3, 2] kernel over [8, 7, 2, 2], s 1, p 1) back onto the input."""
    k, grad = _in(g, ctx, "F32", 3, 3, 2, 1), _in(g, ctx, "F32", 18, 8, 7, 2)
    ne = (ctypes.c_int64 * 4)(8, 7, 2, 2)
    return ctor(g, "ggml_im2col_back")(ctx, grad, k, ne, 1, 1, 1, 1, 1, 1, True), [k, grad]


def _im2col_3d(g, ctx):
    k, x = _in(g, ctx, "F32", 2, 2, 2, 6), _in(g, ctx, "F32", 5, 4, 4, 4)  # IC 2: OC 3, N 2
    return ctor(g, "ggml_im2col_3d")(ctx, k, x, 2, 1, 2, 1, 0, 1, 1, 1, 1, 1, _t(g, "F32")), [k, x]


def _col2im_1d(g, ctx):
    a = _in(g, ctx, "F32", 12, 5)  # K 4 x OC 3, T_in 5
    return ctor(g, "ggml_col2im_1d")(ctx, a, 2, 3, 1), [a]


def _conv_2d(kt):
    def build(g, ctx):
        k, x = _in(g, ctx, kt, 3, 3, 3, 4), _in(g, ctx, "F32", 9, 8, 3, 2)
        return ctor(g, "ggml_conv_2d_direct")(ctx, k, x, 2, 1, 1, 0, 1, 2), [k, x]
    return build


def _conv_3d(g, ctx):
    k, x = _in(g, ctx, "F32", 2, 3, 2, 6), _in(g, ctx, "F32", 6, 5, 4, 4)  # c 2, oc 3, n 2
    return ctor(g, "ggml_conv_3d_direct")(ctx, k, x, 1, 2, 1, 1, 0, 1, 1, 1, 1, 2, 2, 3), [k, x]


def _conv_2d_dw(cwhn):
    def build(g, ctx):
        k, x = _in(g, ctx, "F32", 3, 3, 1, 4), _in(g, ctx, "F32", 7, 6, 4, 2)
        kk, xx = k, x
        if cwhn:  # test-backend-ops' channels-first layout: a permuted contiguous [C, W, H, N]
            xx = g.ggml_permute(ctx, g.ggml_cont(ctx, g.ggml_permute(ctx, x, 1, 2, 0, 3)), 2, 0, 1, 3)
            kk = g.ggml_permute(ctx, g.ggml_cont(ctx, g.ggml_permute(ctx, k, 2, 3, 1, 0)), 3, 2, 0, 1)
        return ctor(g, "ggml_conv_2d_dw_direct")(ctx, kk, xx, 1, 2, 1, 1, 1, 1), [k, x]
    return build


def _conv_transpose_1d(kt):
    def build(g, ctx):
        k, x = _in(g, ctx, kt, 3, 2, 4), _in(g, ctx, "F32", 6, 4)
        return ctor(g, "ggml_conv_transpose_1d")(ctx, k, x, 2, 0, 1), [k, x]
    return build


def _conv_transpose_2d(g, ctx):
    k, x = _in(g, ctx, "F16", 3, 2, 3, 4), _in(g, ctx, "F32", 5, 4, 4, 1)
    return ctor(g, "ggml_conv_transpose_2d_p0")(ctx, k, x, 2), [k, x]


def _pool_2d(op, p):
    def build(g, ctx):
        a = _in(g, ctx, "F32", 9, 8, 3, 2)
        return ctor(g, "ggml_pool_2d")(ctx, a, op, 3, 2, 2, 2, p, p), [a]
    return build


def _pool_2d_back(g, ctx):
    af = _in(g, ctx, "F32", 8, 6, 3)
    grad = _in(g, ctx, "F32", 4, 3, 3)  # pool_2d(af, k 2, s 2, p 0)
    return ctor(g, "ggml_pool_2d_back")(ctx, grad, af, 0, 2, 2, 2, 2, 0.0, 0.0), [af, grad]


def _upscale(ne, mode):
    def build(g, ctx):
        a = _in(g, ctx, "F32", 5, 4, 3, 2)
        return ctor(g, "ggml_interpolate")(ctx, a, *ne, mode), [a]
    return build


def _one(name, *args, ne=(8, 3, 2), type_name="F32"):
    def build(g, ctx):
        a = _in(g, ctx, type_name, *ne)
        return ctor(g, name)(ctx, a, *args), [a]
    return build


def _win_unpart(g, ctx):
    a = _in(g, ctx, "F32", 4, 3, 3, 6)  # windows of 3 of a [4, 7, 5] image: 3 x 2
    return ctor(g, "ggml_win_unpart")(ctx, a, 7, 5, 3), [a]


def _add_rel_pos(g, ctx):
    a = _in(g, ctx, "F32", 9, 6, 2)
    pw, ph = _in(g, ctx, "F32", 3, 2, 3, 2), _in(g, ctx, "F32", 3, 2, 3, 2)
    return ctor(g, "ggml_add_rel_pos")(ctx, a, pw, ph), [a, pw, ph]


CASES = [
    Case("IM2COL", _im2col("F32", "F32", (3, 3, 2, 4), (8, 7, 2, 2), 1, 2, 1, 0, 1, 1, True), name="f32"),
    Case("IM2COL", _im2col("F16", "F16", (3, 3, 2, 4), (8, 7, 2, 2), 2, 1, 0, 1, 2, 1, True), lie=(1, 2, -1), name="f16-2d"),
    Case("IM2COL", _im2col("F16", "F16", (3, 2, 4), (10, 2, 3), 2, 0, 1, 0, 1, 0, False), lie=(1, 1, -1), name="f16-1d"),
    Case("IM2COL_BACK", _im2col_back, lie=(1, 0, -1), name="2d"),
    Case("IM2COL_3D", _im2col_3d, name="f32"),
    Case("IM2COL_3D", _im2col_3d, lie=(1, 3, -1), name="f32-ic-lie"),
    Case("COL2IM_1D", _col2im_1d, lie=(0, 0, -1), name="k4-oc3"),
    Case("CONV_2D", _conv_2d("F32"), name="f32"),
    Case("CONV_2D", _conv_2d("F16"), lie=(0, 2, -1), name="f16"),
    Case("CONV_3D", _conv_3d, lie=(0, 3, -1), name="f32"),
    Case("CONV_2D_DW", _conv_2d_dw(False), name="whcn"),
    Case("CONV_2D_DW", _conv_2d_dw(True), lie=(-1, 2, -1), name="cwhn"),
    Case("CONV_TRANSPOSE_1D", _conv_transpose_1d("F32"), name="f32"),
    Case("CONV_TRANSPOSE_1D", _conv_transpose_1d("F16"), lie=(1, 1, -1), name="f16"),
    Case("CONV_TRANSPOSE_2D", _conv_transpose_2d, lie=(0, 3, -1), name="f16-p0"),
    Case("POOL_1D", _one("ggml_pool_1d", 1, 3, 2, 1), name="k3-s2"),
    Case("POOL_2D", _pool_2d(0, 1.0), name="max-p1"),
    Case("POOL_2D", _pool_2d(1, 0.0), lie=(-1, 1, -1), name="avg"),
    Case("POOL_2D_BACK", _pool_2d_back, lie=(1, 2, -1), name="max"),
    Case("UPSCALE", _upscale((10, 8, 3, 2), 0), lie=None, name="nearest"),
    Case("UPSCALE", _upscale((7, 3, 6, 2), 1 | 1 << 8), lie=None, name="bilinear-align-corners"),
    Case("UPSCALE", _upscale((9, 9, 3, 1), 2), lie=None, name="bicubic"),
    Case("UPSCALE", _upscale((3, 3, 3, 2), 1 | 1 << 9), lie=None, name="bilinear-antialias"),
    Case("PAD_REFLECT_1D", _one("ggml_pad_reflect_1d", 3, 2), name="pad-3-2"),
    Case("ROLL", _one("ggml_roll", 3, -1, 1, 0), name="shift-3-1"),
    Case("WIN_PART", _one("ggml_win_part", 3, ne=(4, 7, 5)), name="w3"),
    Case("WIN_UNPART", _win_unpart, lie=(0, 3, -1), name="w3"),
    Case("GET_REL_POS", _one("ggml_get_rel_pos", 4, 4, ne=(6, 7), type_name="F16"), name="f16"),
    Case("ADD_REL_POS", _add_rel_pos, lie=(1, 0, -1), name="pw-ph"),
]
LIES = [c for c in CASES if c.lie is not None]


def _skip_missing(ggml, case):
    if case.op not in ggml.ops:
        pytest.skip(f"{case.op} is not in this ggml")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_op_matches_ggml_cpu(guest, ggml, case):
    _skip_missing(ggml, case)
    assert_matches_ggml_cpu(guest, ggml, case)


@pytest.mark.parametrize("case", LIES, ids=case_id)
def test_lying_shape_is_refused(guest, ggml, case):
    _skip_missing(ggml, case)
    lie_refusal(guest, ggml, case)


def _case(op, n=0):
    return [c for c in CASES if c.op == op][n]


# (case, op_params slot, value, reason): params a kernel divides by, aborts on, or that walk
# it off its tensors.
@pytest.mark.parametrize("case,slot,value,reason", [
    pytest.param(_case("IM2COL_BACK"), 0, 0, "'s0': 0", id="IM2COL_BACK-s0-0"),  # `% s0`: SIGFPE
    pytest.param(_case("IM2COL"), 6, 2, "is_2D 2", id="IM2COL-is_2D-2"),
    pytest.param(_case("IM2COL_3D"), 9, 0, "'IC': 0", id="IM2COL_3D-IC-0"),  # the kernel divides by IC
    pytest.param(_case("IM2COL_3D"), 9, 5, "im2col_3d gives", id="IM2COL_3D-IC-5"),  # N = ne13 / IC = 0
    pytest.param(_case("CONV_TRANSPOSE_1D"), 0, -1, "'s0': -1", id="CONV_TRANSPOSE_1D-s0-negative"),
    pytest.param(_case("CONV_TRANSPOSE_2D"), 0, 0, "'stride': 0", id="CONV_TRANSPOSE_2D-stride-0"),
    pytest.param(_case("POOL_2D"), 0, 2, "pool op 2", id="POOL_2D-op-2"),  # POOL_COUNT: GGML_ABORT
    pytest.param(_case("POOL_2D_BACK"), 0, 2, "pool op 2", id="POOL_2D_BACK-op-2"),
    pytest.param(_case("POOL_1D"), 2, 0, "'s0': 0", id="POOL_1D-s0-0"),
    pytest.param(_case("UPSCALE"), 0, 3, "scale mode 0x3", id="UPSCALE-mode-3"),  # GGML_ABORT
    pytest.param(_case("UPSCALE"), 0, 2 | 1 << 9, "antialias is bilinear only", id="UPSCALE-antialias-bicubic"),
    # |shift| >= ne: the kernel wraps once, then reads past the row
    pytest.param(_case("ROLL"), 0, 8, "shifts", id="ROLL-shift-8"),
    pytest.param(_case("PAD_REFLECT_1D"), 1, 8, "padding", id="PAD_REFLECT_1D-p1-8"),
    pytest.param(_case("WIN_PART"), 2, 0, "'w': 0", id="WIN_PART-w-0"),
    pytest.param(_case("WIN_UNPART"), 0, 2, "windows", id="WIN_UNPART-w-2"),
    pytest.param(_case("ADD_REL_POS"), 0, 7, "inplace 7", id="ADD_REL_POS-inplace-7"),
    pytest.param(_case("COL2IM_1D"), 1, 5, "no whole number", id="COL2IM_1D-p0-5"),
])
def test_bad_op_params_are_refused(guest, ggml, case, slot, value, reason):
    _skip_missing(ggml, case)
    r = Remote(guest, ggml, case)
    recs = r.recs.copy()
    recs["op_params"][r.index(r.out)][slot] = value
    got = refusal(r, recs)
    assert_refused_by_rule(got, case.op, r.index(r.out))
    assert reason in got.reason, got.reason
    r.close()


def test_conv_2d_dw_cwhn_result_laid_out_flat_is_refused(guest, ggml):
    """CONV_2D_DW writes its result as one flat array: a channels-first result claimed
    contiguous (nb of a [OW, OH, C, N] tensor) is refused; so is an input neither contiguous
    nor channels-first (the kernel's GGML_ABORT)."""
    case = _case("CONV_2D_DW", 1)
    r = Remote(guest, ggml, case)
    recs = r.recs.copy()
    i, ne = r.index(r.out), [int(x) for x in r.recs["ne"][r.index(r.out)]]
    recs["nb"][i] = [4, 4 * ne[0], 4 * ne[0] * ne[1], 4 * ne[0] * ne[1] * ne[2]]
    got = refusal(r, recs)
    assert_refused_by_rule(got, "CONV_2D_DW", i)
    assert "conv_2d_dw lays it out as" in got.reason, got.reason
    r.close()


@pytest.mark.parametrize("op", ["POOL_2D", "POOL_2D_BACK"])
def test_pool_2d_plane_stride_lie_is_refused(guest, ggml, op):
    """POOL_2D(_BACK) walk planes by nb[2] up to ggml_nbytes: a one-plane tensor claiming a
    4-byte nb[2] (any nb[2] is contiguous where ne[2] is 1) would be walked as 72 planes,
    each written into the next plane of the result."""
    def build(g, ctx):
        a = _in(g, ctx, "F32", 8, 9)
        if op == "POOL_2D":
            return ctor(g, "ggml_pool_2d")(ctx, a, 0, 2, 2, 2, 2, 0.0, 0.0), [a]
        grad = _in(g, ctx, "F32", 4, 4)
        return ctor(g, "ggml_pool_2d_back")(ctx, grad, a, 0, 2, 2, 2, 2, 0.0, 0.0), [a, grad]

    r = Remote(guest, ggml, Case(op, build))
    rc, dec = r.compute()
    assert rc == 0 and dec.i32() == 0
    recs = r.recs.copy()
    t = r.inputs[0] if op == "POOL_2D" else r.out
    for k in ([r.index(t)] if op == "POOL_2D" else [r.index(t), r.index(r.inputs[0])]):
        recs["nb"][k][2] = recs["nb"][k][3] = 4
    got = refusal(r, recs)
    assert_refused_by_rule(got, op, r.index(r.out))
    assert "is not a plane" in got.reason, got.reason
    r.close()


def test_conv_2d_work_buffer_overflow_is_refused(guest, ggml):
    """CONV_2D GGML_ASSERTs one patch fits GGML_IM2COL_WORK_SIZE: a kernel of 64 x 64 x 1100
    F32 (about 18 MB) per output channel would abort the host."""
    def build(g, ctx):
        k, x = _in(g, ctx, "F32", 64, 64, 1100, 1), _in(g, ctx, "F32", 64, 64, 1100, 1)
        return ctor(g, "ggml_conv_2d_direct")(ctx, k, x, 1, 1, 0, 0, 1, 1), [k, x]

    s = GgmlScratch(ggml)
    graph, _, _ = _graph(ggml, s.ctx, Case("CONV_2D", build))
    remote = RemoteGraph(guest, ggml, s.ctx, graph)
    wire = remote.wire
    guest.data[: len(wire)] = wire
    handler = _Refusals()
    logging.getLogger("apir.host").addHandler(handler)
    try:
        rc, _ = guest.forward(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(DATA_RES), e.size_t(len(wire))))
    finally:
        logging.getLogger("apir.host").removeHandler(handler)
    assert rc == ERROR and len(handler.seen) == 1, handler.seen
    n_nodes = int(np.frombuffer(wire, "<u4", 1)[0])
    recs = np.frombuffer(wire[4 + 8 * n_nodes + 4:], rpc_tensor_dtype(ggml.limits))
    node = int(np.nonzero(recs["op"] == ggml.ops["CONV_2D"])[0][0])
    assert_refused_by_rule(handler.seen[0], "CONV_2D", node, "a patch of")
    remote.close()
    s.close()


def test_conv_2d_dw_f16_kernel_by_version(guest, ggml):
    """ggml 0.20 reads an F16 depthwise kernel; ggml 0.10 reads every kernel as F32 (an F16
    one would be read past its end): computed to ggml CPU's bytes, or refused."""
    def build(g, ctx):
        k, x = _in(g, ctx, "F16", 3, 3, 1, 4), _in(g, ctx, "F32", 7, 6, 4, 2)
        return ctor(g, "ggml_conv_2d_dw_direct")(ctx, k, x, 1, 1, 1, 1, 1, 1), [k, x]

    case = Case("CONV_2D_DW", build)
    r = Remote(guest, ggml, case)
    rc, dec = r.compute()
    if op_enums(ggml).version < (0, 20, 0):
        assert rc == ERROR
        assert_refused_by_rule(refusal(r, serves_next=False), "CONV_2D_DW", r.index(r.out))
    else:
        assert rc == 0 and dec.i32() == 0
        assert r.result() == _direct(ggml, case)
    r.close()


@pytest.mark.parametrize("n_dst,n_src,align,ok", [
    (10, 5, False, True), (3, 5, False, True), (7, 5, True, True), (1, 5, True, True),
    (2**24 + 1, 3, False, False), (5, 0, False, False),
])
def test_nearest_index_fits(n_dst, n_src, align, ok):
    """UPSCALE's nearest index `i / sf` in float: 2**24 + 1 from 3 rounds sf to 2**24 / 3, so
    the last index, (float) 2**24 / sf, is 3.0: one past src0's 3 (ggml CPU would read it)."""
    from apir.host.graph.shapes.conv import _nearest_index_fits

    assert _nearest_index_fits(n_dst, n_src, align) is ok


# --- every GGML_ASSERT of these ops' CPU kernels (tests/host/kernelkit.py) ---
_WORK = Why("conv._conv_work bounds one patch by GGML_IM2COL_WORK_SIZE "
            "(test_conv.py::test_conv_2d_work_buffer_overflow_is_refused)")
_F16_010 = Why("ggml 0.10's F16 kernel: the rule asks an F16 src0 with nb[0] 2 below 0.20 "
               "(test_conv.py::test_op_matches_ggml_cpu F16 cases under APIR_GGML_LIB_DIR=0.10)")

# op -> {assert text as in the C source (whitespace collapsed): how it is covered}
KERNEL_ASSERTS: dict[str, dict[str, Cover]] = {
    "CONV_TRANSPOSE_1D": {
        "src0->type == GGML_TYPE_F16": v(("type", "src0", 0, I32)),
        "src0->type == GGML_TYPE_F32": v(("type", "src0", 0, I32)),
        "src1->type == GGML_TYPE_F32": v(("type", "src1", 0, I32)),
        "dst->type == GGML_TYPE_F32": v(("type", "dst", 0, I32)),
        "nb00 == sizeof(ggml_fp16_t)": v(("nb", "src0", 0, 2)),
        "nb00 == sizeof(float)": v(("nb", "src0", 0, 2)),
        "nb10 == sizeof(float)": v(("nb", "src1", 0, 2)),
        # ggml_graph_plan's own (planned for every node, even an empty one)
        "node->src[0]->ne[3] == 1": v(("ne", "src0", 2, 2), ("ne", "src0", 3, 2)),
        "node->src[1]->ne[2] == 1": v(("ne", "src1", 1, 2), ("ne", "src1", 2, 2)),
        "node->src[1]->ne[3] == 1": v(("ne", "src1", 1, 2), ("ne", "src1", 3, 2)),
    },
    "IM2COL": {
        "src1->type == GGML_TYPE_F32": v(("type", "src1", 0, I32)),
        "dst->type == GGML_TYPE_F32": v(("type", "dst", 0, I32)),
        "nb10 == sizeof(float)": v(("nb", "src1", 0, 2)),
        "src1->type == GGML_TYPE_F16 || src1->type == GGML_TYPE_F32": v(("type", "src1", 0, "BF16"), case=1),
        "dst->type == GGML_TYPE_F16": v(("type", "dst", 0, "BF16"), case=1),
        "nb10 == ggml_type_size(src1->type)": v(("nb", "src1", 0, 1), case=1),
        "src0->type == GGML_TYPE_F16": _F16_010,
        "nb00 == sizeof(ggml_fp16_t)": _F16_010,
    },
    "IM2COL_BACK": {
        "src0->type == GGML_TYPE_F32": v(("type", "src0", 0, I32)),
        "src1->type == GGML_TYPE_F32 || src1->type == GGML_TYPE_F16": v(("type", "src1", 0, I32)),
        "src1->type == GGML_TYPE_F32": v(("type", "src1", 0, I32)),  # ggml 0.10
        "dst->type == GGML_TYPE_F32": v(("type", "dst", 0, I32)),
        "nb0 == sizeof(float)": v(("nb", "dst", 0, 2)),
    },
    "IM2COL_3D": {
        "src1->type == GGML_TYPE_F32": v(("type", "src1", 0, I32)),
        "dst->type == GGML_TYPE_F16": v(("type", "dst", 0, I32)),
        "dst->type == GGML_TYPE_F32": v(("type", "dst", 0, I32)),
        "nb10 == sizeof(float)": v(("nb", "src1", 0, 2)),
        "src0->type == GGML_TYPE_F16": _F16_010,
    },
    "COL2IM_1D": {
        "ggml_is_contiguous(src)": v(("nb", "src0", 0, 2)),
        "ggml_is_contiguous(dst)": v(("nb", "dst", 0, 2)),
    },
    "CONV_2D": {
        "ggml_is_contiguous(kernel)": v(("nb", "src0", 0, 2)),
        "kernel_type == GGML_TYPE_F16 || kernel_type == GGML_TYPE_F32": v(("type", "src0", 0, I32)),
        "kernel->type == kernel_type": v(("type", "src0", 0, I32)),
        "c_in == kernel->ne[2]": v(("ne", "src0", 2, 2)),
        "patches_per_batch > 0 && batch_size >= 1": _WORK,
        "gemm_output + patch_n * c_out <= (float*)tmp + params->wsize": _WORK,
    },
    "CONV_3D": {
        "ggml_is_contiguous(kernel)": v(("nb", "src0", 0, 2)),
        "kernel_type == GGML_TYPE_F16 || kernel_type == GGML_TYPE_F32": v(("type", "src0", 0, I32)),
        "kernel->type == kernel_type": v(("type", "src0", 0, I32)),
        "patches_per_batch > 0 && batch_size >= 1": _WORK,
    },
    "CONV_TRANSPOSE_2D": {
        "src0->type == GGML_TYPE_F16 || src0->type == GGML_TYPE_F32": v(("type", "src0", 0, "BF16")),
        "src1->type == GGML_TYPE_F32": v(("type", "src1", 0, I32)),
        "dst->type == GGML_TYPE_F32": v(("type", "dst", 0, I32)),
        "nb00 == ggml_type_size(src0->type)": v(("nb", "src0", 0, 1)),
        "nb10 == sizeof(float)": v(("nb", "src1", 0, 2)),
        # ggml_graph_plan's own
        "node->src[0]->type == GGML_TYPE_F16 || node->src[0]->type == GGML_TYPE_F32": v(("type", "src0", 0, "BF16")),
        "node->src[1]->type == GGML_TYPE_F32": v(("type", "src1", 0, I32)),
    },
    "CONV_2D_DW": {
        "kernel->type == GGML_TYPE_F32 || kernel->type == GGML_TYPE_F16": v(("type", "src0", 0, I32)),
        "kernel->ne[3] == p.channels": v(("ne", "src0", 3, 3)),
        "dst->ne[3] == p.batch": v(("ne", "dst", 3, 1)),
        "kernel->nb[0] >= kernel->nb[2] && kernel->nb[1] >= kernel->nb[0]":
            v(("nb", "src0", 0, 4), ("nb", "src0", 1, 12), ("nb", "src0", 2, 36), ("nb", "src0", 3, 36), case=1),
    },
    "POOL_1D": {},
    "POOL_2D": {},
    "POOL_2D_BACK": {
        "params->ith == 0": Why("POOL_2D_BACK runs as one task (ggml_get_n_tasks)"),
        "false": v(("param", "dst", 0, 2)),  # the pool op switch's default
    },
    "UPSCALE": {
        "src0->type == GGML_TYPE_F32": v(("type", "src0", 0, I32)),
    },
    "PAD_REFLECT_1D": {
        "src0->type == GGML_TYPE_F32": v(("type", "src0", 0, I32)),
        "dst->type == GGML_TYPE_F32": v(("type", "dst", 0, I32)),
    },
    "ROLL": {},
    "WIN_PART": {},
    "WIN_UNPART": {},
    "GET_REL_POS": {},
    "ADD_REL_POS": {},
}
# op -> the kernel functions (ggml_compute_forward_<name>) whose asserts it can reach
KERNEL_FUNCTIONS = {
    "CONV_TRANSPOSE_1D": ["conv_transpose_1d_f16_f32", "conv_transpose_1d_f32", "conv_transpose_1d"],
    "IM2COL": ["im2col_f32", "im2col_f16", "im2col"],
    "IM2COL_BACK": ["im2col_back_f32"],
    "IM2COL_3D": ["im2col_3d_f16", "im2col_3d_f32", "im2col_3d"],
    "COL2IM_1D": ["col2im_1d_impl", "col2im_1d"],
    "CONV_2D": ["conv_2d_impl", "conv_2d"],
    "CONV_3D": ["conv_3d_impl", "conv_3d"],
    "CONV_TRANSPOSE_2D": ["conv_transpose_2d_impl", "conv_transpose_2d"],
    "CONV_2D_DW": ["conv_2d_dw_cwhn", "conv_2d_dw_whcn", "conv_2d_dw"],
    "POOL_1D": ["pool_1d_ksp", "pool_1d"],
    "POOL_2D": ["pool_2d"],
    "POOL_2D_BACK": ["pool_2d_back"],
    "UPSCALE": ["upscale_f32", "upscale"],
    "PAD_REFLECT_1D": ["pad_reflect_1d"],
    "ROLL": ["roll_f32", "roll"],
    "WIN_PART": ["win_part_f32", "win_part"],
    "WIN_UNPART": ["win_unpart_f32", "win_unpart"],
    "GET_REL_POS": ["get_rel_pos_f16", "get_rel_pos"],
    "ADD_REL_POS": ["add_rel_pos_f32", "add_rel_pos"],
}
# ggml_graph_plan's asserts, by the op whose `case` holds them
PLAN_OPS = ("CONV_TRANSPOSE_1D", "CONV_TRANSPOSE_2D")


@pytest.mark.parametrize("version,folder", cpu_sources())
def test_every_kernel_assert_is_in_the_table(version, folder):
    missing = missing_asserts(folder, KERNEL_FUNCTIONS, KERNEL_ASSERTS, PLAN_OPS)
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


# --- CONV_3D with a kernel dimension of 0 (test-backend-ops of ggml 0.25 has three per type) -----
def _conv_3d_zero_kernel(dim, kt, ne_x=(2, 2, 2, 1), c=1, n=1, oc=1, p=0, kernel_ne=None):
    """ggml_conv_3d_direct of a [KW, KH, KD, c*oc] kernel with ne[`dim`] 0 (the others 1, or
    `kernel_ne`) over an F32 input `ne_x` ([W, H, D, c*n]), stride 1, padding `p`, dilation 1:
    with no kernel taps every output is an empty sum. The first shape is test-backend-ops'
    (`test_conv_3d(1, 1, 2, 2, 2, 1, ...)`)."""
    def build(g, ctx):
        ne_k = list(kernel_ne or (1, 1, 1, c * oc))
        ne_k[dim] = 0
        k, x = _in(g, ctx, kt, *ne_k), _in(g, ctx, "F32", *ne_x)
        return ctor(g, "ggml_conv_3d_direct")(ctx, k, x, 1, 1, 1, p, p, p, 1, 1, 1, c, n, oc), [k, x]
    return build


_ZERO_KERNEL = [
    pytest.param(Case("CONV_3D", _conv_3d_zero_kernel(dim, kt)), id=f"k{dim}-0-{kt}")
    for dim in range(3) for kt in ("F32", "F16")
] + [
    # c 2, oc 3, n 2 with padding 1: 2 x 3 output channels of 7 x 6 x 5 empty sums
    pytest.param(Case("CONV_3D", _conv_3d_zero_kernel(1, "F32", (5, 4, 3, 4), 2, 2, 3, 1, (2, 2, 2, 6))),
                 id="k1-0-c2-oc3-n2-p1"),
]


@pytest.mark.parametrize("case", _ZERO_KERNEL)
def test_conv_3d_zero_kernel_dim_computes_like_ggml_cpu(guest, ggml, case):
    """A kernel dimension of 0 (an empty src0 under a non-empty result) is computed, to ggml
    CPU's bytes: all zeros. Memory-safe in ggml-cpu's kernel (ops.cpp
    ggml_compute_forward_conv_3d_impl, the same in ggml 0.10, 0.20 and 0.25): the gather loops
    over kx < KW (ky < KH, kz < KD) run no iteration, so neither the input nor the work buffer
    is touched; the GEMM (ggml_call_mul_mat) has k = KW*KH*KD*IC = 0, so no kernel element is
    read and each of its OC x patches outputs is written 0 (vec_dot / tinyBLAS with k 0) into the
    work buffer (space_per_patch = OC*4 > 0: no division by 0); then every result element is
    written from there. The result buffer is filled with 0x7f first: the zeros are written."""
    _skip_missing(ggml, case)
    r = Remote(guest, ggml, case)
    try:
        nbytes = ggml.ggml_nbytes(r.out)
        assert guest.set_tensor(r.remote.handle, r.remote.rpc(r.out), b"\x7f" * nbytes) == 0
        rc, dec = r.compute()
        assert rc == 0 and dec.i32() == 0
        got = r.result()
    finally:
        r.close()
    assert got == _direct(ggml, case)
    assert len(got) == nbytes > 0 and not np.frombuffer(got, np.float32).any()


def test_conv_3d_zero_kernel_not_contiguous_is_refused(guest, ggml):
    """The same kernel claiming nb[0] 8: ggml_is_contiguous(kernel) is false for an ne[0] of 0
    with nb[0] not the element size, and the kernel GGML_ASSERTs it (an abort of the host):
    refused by CONV_3D's rule, not let through with the empty kernel."""
    case = Case("CONV_3D", _conv_3d_zero_kernel(0, "F32"))
    _skip_missing(ggml, case)
    r = Remote(guest, ggml, case)
    try:
        recs = r.recs.copy()
        recs["nb"][r.index(r.inputs[0])][0] = 8
        got = refusal(r, recs)
        assert_refused_by_rule(got, "CONV_3D", r.index(r.out), "src0 is not contiguous")
    finally:
        r.close()


def test_conv_3d_empty_input_is_still_refused(guest, ggml):
    """Only the kernel may be empty: an input [0, 2, 2, 1] under a result of elements (padding
    1 gives OW 2) is refused by the generic empty-source check (`base.check_empty_sources`)."""
    def build(g, ctx):
        k, x = _in(g, ctx, "F32", 1, 1, 1, 1), _in(g, ctx, "F32", 0, 2, 2, 1)
        return ctor(g, "ggml_conv_3d_direct")(ctx, k, x, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1), [k, x]

    case = Case("CONV_3D", build)
    _skip_missing(ggml, case)
    r = Remote(guest, ggml, case)
    try:
        got = refusal(r, serves_next=False)
        assert_refused_by_rule(got, "CONV_3D", r.index(r.out), "src1 [0, 2, 2, 1] has no elements",
                               rule=base.check_empty_sources)
    finally:
        r.close()


def test_conv_2d_zero_kernel_dim_is_still_refused(guest, ggml):
    """The exemption is CONV_3D's alone: CONV_2D with a [0, 1, 1, 1] kernel stays refused by
    the generic empty-source check."""
    def build(g, ctx):
        k, x = _in(g, ctx, "F32", 0, 1, 1, 1), _in(g, ctx, "F32", 2, 2, 1, 1)
        return ctor(g, "ggml_conv_2d_direct")(ctx, k, x, 1, 1, 0, 0, 1, 1), [k, x]

    case = Case("CONV_2D", build)
    _skip_missing(ggml, case)
    r = Remote(guest, ggml, case)
    try:
        got = refusal(r, serves_next=False)
        assert_refused_by_rule(got, "CONV_2D", r.index(r.out), "src0 [0, 1, 1, 1] has no elements",
                               rule=base.check_empty_sources)
    finally:
        r.close()


def test_conv_3d_zero_kernel_is_refused_off_the_cpu(ggml):
    """The exemption is a fact of ggml-cpu's kernel: the Vulkan and RPC profiles (whose kernels
    were not read for it) keep the generic refusal; the CPU's rules accept it."""
    from apir.host.graph import profiles
    from apir.host.graph.shapes import check_node

    k = info(0, "F32", [0, 1, 1, 1])
    x = info(1, "F32", [2, 2, 2, 1])
    node = info(2, "F32", [3, 2, 2, 1], op="CONV_3D", op_params=[1, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1, 1])
    check_node(node, [k, x], op_enums(ggml), profiles.CPU.rules)  # accepted
    # CONV_3D is the only rule the other profiles replace (SET_ROWS' exemption is kept)
    changed = {op for op, rule in profiles.CPU.rules.items() if profiles.VULKAN.rules[op] is not rule}
    assert changed == {"CONV_3D"} and profiles.RPC.rules is profiles.VULKAN.rules
    for profile in (profiles.VULKAN, profiles.RPC):
        with pytest.raises(Refused) as exc:
            check_node(node, [k, x], op_enums(ggml), profile.rules)
        assert_refused_by_rule(exc.value, "CONV_3D", 2, "src0 [0, 1, 1, 1] has no elements",
                               rule=base.check_empty_sources)
