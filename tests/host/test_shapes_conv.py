"""apir.host.shapes.conv: each convolution, pooling or image op, built with ggml's own
constructor, computes through the host to ggml CPU's own bytes; a lying shape or op_param
is refused by that op's rule (before the CPU kernel would walk off a tensor or abort), and
the host serves on."""

import ctypes
import logging

import pytest

from apir.codec.constants import ApirBackendCommandType as Cmd
from apir.host.shapes import op_enums
from tests.host.hostkit import DATA_RES, GgmlScratch, RemoteGraph
from tests.host.shapekit import ERROR, Case, Remote, _direct, _graph, _in, ctor


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
    Case("IM2COL", _im2col("F32", "F32", (3, 3, 2, 4), (8, 7, 2, 2), 1, 2, 1, 0, 1, 1, True)),
    Case("IM2COL", _im2col("F16", "F16", (3, 3, 2, 4), (8, 7, 2, 2), 2, 1, 0, 1, 2, 1, True), lie=(1, 2, -1)),
    Case("IM2COL", _im2col("F16", "F16", (3, 2, 4), (10, 2, 3), 2, 0, 1, 0, 1, 0, False), lie=(1, 1, -1)),
    Case("IM2COL_BACK", _im2col_back, lie=(1, 0, -1)),
    Case("IM2COL_3D", _im2col_3d),
    Case("IM2COL_3D", _im2col_3d, lie=(1, 3, -1)),
    Case("COL2IM_1D", _col2im_1d, lie=(0, 0, -1)),
    Case("CONV_2D", _conv_2d("F32")),
    Case("CONV_2D", _conv_2d("F16"), lie=(0, 2, -1)),
    Case("CONV_3D", _conv_3d, lie=(0, 3, -1)),
    Case("CONV_2D_DW", _conv_2d_dw(False)),
    Case("CONV_2D_DW", _conv_2d_dw(True), lie=(-1, 2, -1)),
    Case("CONV_TRANSPOSE_1D", _conv_transpose_1d("F32")),
    Case("CONV_TRANSPOSE_1D", _conv_transpose_1d("F16"), lie=(1, 1, -1)),
    Case("CONV_TRANSPOSE_2D", _conv_transpose_2d, lie=(0, 3, -1)),
    Case("POOL_1D", _one("ggml_pool_1d", 1, 3, 2, 1)),
    Case("POOL_2D", _pool_2d(0, 1.0)),
    Case("POOL_2D", _pool_2d(1, 0.0), lie=(-1, 1, -1)),
    Case("POOL_2D_BACK", _pool_2d_back, lie=(1, 2, -1)),
    Case("UPSCALE", _upscale((10, 8, 3, 2), 0), lie=None),
    Case("UPSCALE", _upscale((7, 3, 6, 2), 1 | 1 << 8), lie=None),
    Case("UPSCALE", _upscale((9, 9, 3, 1), 2), lie=None),
    Case("UPSCALE", _upscale((3, 3, 3, 2), 1 | 1 << 9), lie=None),
    Case("PAD_REFLECT_1D", _one("ggml_pad_reflect_1d", 3, 2)),
    Case("ROLL", _one("ggml_roll", 3, -1, 1, 0)),
    Case("WIN_PART", _one("ggml_win_part", 3, ne=(4, 7, 5))),
    Case("WIN_UNPART", _win_unpart, lie=(0, 3, -1)),
    Case("GET_REL_POS", _one("ggml_get_rel_pos", 4, 4, ne=(6, 7), type_name="F16")),
    Case("ADD_REL_POS", _add_rel_pos, lie=(1, 0, -1)),
]
IDS = [f"{c.op}-{i}" for i, c in enumerate(CASES)]


def _skip_missing(ggml, case):
    if case.op not in ggml.ops:
        pytest.skip(f"{case.op} is not in this ggml")


@pytest.fixture
def conv_remote(guest, ggml, request):
    case = request.param
    _skip_missing(ggml, case)
    r = Remote(guest, ggml, case)
    yield r
    r.close()


@pytest.mark.parametrize("conv_remote", CASES, ids=IDS, indirect=True)
def test_op_matches_ggml_cpu(conv_remote, ggml, request):
    case = request.node.callspec.params["conv_remote"]
    rc, dec = conv_remote.compute()
    assert rc == 0 and dec.i32() == 0
    got, expect = conv_remote.result(), _direct(ggml, case)
    assert got == expect
    assert len(set(got)) > 1  # not an untouched buffer


def _refused(r, recs, op, caplog, why=""):
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="apir.host"):
        rc, _ = r.compute(recs)
    assert rc == ERROR
    assert f"({op})" in caplog.text and why in caplog.text, caplog.text  # refused by the op's own rule
    rc, dec = r.compute()  # the host serves the next valid command
    assert rc == 0 and dec.i32() == 0


LIES = [c for c in CASES if c.lie is not None]


@pytest.mark.parametrize("conv_remote", LIES, ids=[f"{c.op}-{i}" for i, c in enumerate(LIES)], indirect=True)
def test_lying_shape_is_refused(conv_remote, caplog, request):
    case = request.node.callspec.params["conv_remote"]
    which, dim, delta = case.lie
    t = conv_remote.out if which < 0 else conv_remote.inputs[which]
    recs = conv_remote.recs.copy()
    i = conv_remote.index(t)
    recs["ne"][i][dim] = int(recs["ne"][i][dim]) + delta
    _refused(conv_remote, recs, case.op, caplog)


def _case(op, n=0):
    return [c for c in CASES if c.op == op][n]


# (case, op_params slot, value, why): params a kernel divides by, aborts on, or that walk
# it off its tensors.
BAD_PARAMS = [
    (_case("IM2COL_BACK"), 0, 0, "'s0': 0"),  # `% s0`: SIGFPE
    (_case("IM2COL"), 6, 2, "is_2D 2"),
    (_case("IM2COL_3D"), 9, 0, "'IC': 0"),  # the kernel divides by IC
    (_case("IM2COL_3D"), 9, 5, "im2col_3d gives"),  # N = ne13 / IC = 0: an empty result
    (_case("CONV_TRANSPOSE_1D"), 0, -1, "'s0': -1"),  # writes before each row
    (_case("CONV_TRANSPOSE_2D"), 0, 0, "'stride': 0"),
    (_case("POOL_2D"), 0, 2, "pool op 2"),  # POOL_COUNT: GGML_ABORT
    (_case("POOL_2D_BACK"), 0, 2, "pool op 2"),
    (_case("POOL_1D"), 2, 0, "'s0': 0"),
    (_case("UPSCALE"), 0, 3, "scale mode 0x3"),  # GGML_ABORT("unsupported upscale mode")
    (_case("UPSCALE"), 0, 2 | 1 << 9, "antialias is bilinear only"),
    (_case("ROLL"), 0, 8, "shifts"),  # |shift| >= ne: the kernel wraps once, then reads past the row
    (_case("PAD_REFLECT_1D"), 1, 8, "padding"),
    (_case("WIN_PART"), 2, 0, "'w': 0"),
    (_case("WIN_UNPART"), 0, 2, "windows"),
    (_case("ADD_REL_POS"), 0, 7, "inplace 7"),
    (_case("COL2IM_1D"), 1, 5, "no whole number"),
]


@pytest.mark.parametrize("conv_remote,slot,value,why", BAD_PARAMS, indirect=["conv_remote"],
                         ids=[f"{c.op}-{s}-{v}" for c, s, v, _ in BAD_PARAMS])
def test_bad_op_params_are_refused(conv_remote, slot, value, why, caplog, request):
    case = request.node.callspec.params["conv_remote"]
    recs = conv_remote.recs.copy()
    recs["op_params"][conv_remote.index(conv_remote.out)][slot] = value
    _refused(conv_remote, recs, case.op, caplog, why)


def test_conv_2d_dw_cwhn_result_laid_out_flat_is_refused(guest, ggml, caplog):
    """CONV_2D_DW writes its result as one flat array: a channels-first result claimed
    contiguous (nb of a [OW, OH, C, N] tensor) is refused; so is an input neither contiguous
    nor channels-first (the kernel's GGML_ABORT)."""
    case = _case("CONV_2D_DW", 1)
    r = Remote(guest, ggml, case)
    recs = r.recs.copy()
    i, ne = r.index(r.out), [int(x) for x in r.recs["ne"][r.index(r.out)]]
    recs["nb"][i] = [4, 4 * ne[0], 4 * ne[0] * ne[1], 4 * ne[0] * ne[1] * ne[2]]
    _refused(r, recs, "CONV_2D_DW", caplog, "conv_2d_dw lays it out as")
    r.close()


@pytest.mark.parametrize("op", ["POOL_2D", "POOL_2D_BACK"])
def test_pool_2d_plane_stride_lie_is_refused(guest, ggml, op, caplog):
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
    _refused(r, recs, op, caplog, "is not a plane")
    r.close()


def test_conv_2d_work_buffer_overflow_is_refused(guest, ggml, caplog):
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
    with caplog.at_level(logging.WARNING, logger="apir.host"):
        rc, _ = guest.forward(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(DATA_RES), e.size_t(len(wire))))
    assert rc == ERROR and "(CONV_2D): a patch of" in caplog.text, caplog.text
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
    from apir.host.shapes.conv import _nearest_index_fits

    assert _nearest_index_fits(n_dst, n_src, align) is ok
