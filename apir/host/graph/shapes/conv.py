"""Rules of the convolution, pooling and image ops: IM2COL (2D, 3D, back), COL2IM_1D, CONV_*,
CONV_TRANSPOSE_*, POOL_*, UPSCALE, PAD_REFLECT_1D, ROLL, WIN_PART / WIN_UNPART and the
relative-position ops of SAM (GET_REL_POS, ADD_REL_POS).

Most of these kernels index their tensors as flat arrays (`dst->data + i * ne...`), not through
nb: a rule then asks for the layout the constructor made (contiguous), or at least that the
flat walk stays inside the tensor's checked extent (`_flat`). Several keep byte offsets or
indices in C `int`s: a rule bounds those to int32.
"""

from __future__ import annotations

from typing import Dict

import numpy as np

from apir.ggml.features import Feature
from apir.host.graph.shapes.base import (
    Rule,
    TensorInfo,
    check_empty_sources,
    cpu_empty_sources_ok,
    dst_contiguous,
    extent,
    fail,
    int_rows,
    need,
    param_i32,
)

_INT_MAX = 2**31 - 1

# ggml 0.20 reads F16 (and BF16, as halves) kernels where ggml 0.10 reads F32 only, and
# lets im2col's F16 result come from any src0 (0.10 asserts F16).
# (Feature.CONV_F16_KERNELS, apir.ggml.features)

# `enum ggml_op_pool`: MAX, AVG (COUNT aborts); `enum ggml_scale_mode` and its flags.
_POOL_OPS = (0, 1)
_SCALE_NEAREST, _SCALE_BILINEAR, _SCALE_BICUBIC = 0, 1, 2
_SCALE_ALIGN_CORNERS, _SCALE_ANTIALIAS = 1 << 8, 1 << 9

# ops.h GGML_IM2COL_WORK_SIZE: the work buffer CONV_2D / CONV_3D gather patches into; the
# kernel GGML_ASSERTs one patch (and its row of results) fits.
_IM2COL_WORK_SIZE = 16 * 1024 * 1024


def _p(node: TensorInfo, *idx: int):
    return [param_i32(node, i) for i in idx]


def _cdiv(a: int, b: int) -> int:
    """C's integer division (truncates toward zero)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


def _conv_out(ins: int, ks: int, s: int, p: int, d: int) -> int:
    """ggml_calc_conv_output_size."""
    return _cdiv(ins + 2 * p - d * (ks - 1) - 1, s) + 1


def _flat(node: TensorInfo, t: TensorInfo, what: str) -> None:
    """A kernel that walks `t` as a flat array of its elements stays inside its extent."""
    if t.blck_size != 1 or (t.nelements() and t.nelements() * t.type_size > extent(t)):
        fail(node, f"{what} {t.ne} nb {t.nb} is walked as a flat array")


def _ggml_contiguous(t: TensorInfo) -> bool:
    """ggml_is_contiguous (ggml_is_contiguous_n(t, 0)), exactly: the kernels branch on it."""
    next_nb = t.type_size
    if t.ne[0] != t.blck_size and t.nb[0] != next_nb:
        return False
    next_nb *= t.ne[0] // t.blck_size
    for i in range(1, 4):
        if t.ne[i] != 1:
            if t.nb[i] != next_nb:
                return False
            next_nb *= t.ne[i]
    return True


def _contiguous_channels(t: TensorInfo) -> bool:
    """ggml_is_contiguous_channels."""
    return t.nb[0] > t.nb[2] and t.nb[1] > t.nb[0] and t.nb[2] == t.type_size


def _types(node: TensorInfo, ok: bool, *ts: TensorInfo) -> None:
    if not ok:
        fail(node, "types " + ", ".join(t.type_name for t in ts) + f" -> {node.type_name}")


def _shape(node: TensorInfo, want, what: str) -> None:
    if node.ne != list(want):
        fail(node, f"shape {node.ne}, {what} gives {list(want)}")


def _positive(node: TensorInfo, **values: int) -> None:
    bad = {k: v for k, v in values.items() if v <= 0}
    if bad:
        fail(node, f"{bad} must be > 0")


def _int32(node: TensorInfo, what: str, *values: int) -> None:
    if any(abs(v) > _INT_MAX for v in values):
        fail(node, f"{what} exceed the kernel's int")


# --- im2col ---------------------------------------------------------------------------------
def _im2col(node, srcs, enums):
    """IM2COL: ggml_im2col and ggml_compute_forward_im2col_f32/_f16. src0 (the kernel) gives
    only its ne; src1 is read per channel as a packed [IH, IW] plane from byte offsets the
    kernel keeps in `int`s; the result is written as one flat array."""
    a, b = need(node, srcs, 2)
    s0, s1, p0, p1, d0, d1, is_2d = _p(node, 0, 1, 2, 3, 4, 5, 6)
    if is_2d not in (0, 1):
        fail(node, f"is_2D {is_2d}")
    _positive(node, s0=s0, **({"s1": s1} if is_2d else {}))
    if is_2d:
        if a.ne[2] != b.ne[2]:
            fail(node, f"channels of src0 {a.ne} and src1 {b.ne} differ")
        oh = _conv_out(b.ne[1], a.ne[1], s1, p1, d1)
    else:
        if b.ne[1] != a.ne[1] or b.ne[3] != 1:
            fail(node, f"channels of src0 {a.ne} and src1 {b.ne} differ")
        oh = 0
    ow = _conv_out(b.ne[0], a.ne[0], s0, p0, d0)
    if (is_2d and oh <= 0) or ow <= 0:
        fail(node, f"src1 {b.ne} too small for src0 {a.ne}")
    want = [a.ne[2] * a.ne[1] * a.ne[0], ow, oh, b.ne[3]] if is_2d else [a.ne[1] * a.ne[0], ow, b.ne[2], 1]
    _shape(node, want, "im2col")
    if node.type_name == "F32":
        _types(node, b.type_name == "F32", a, b)
    elif node.type_name == "F16":
        _types(node, b.type_name in ("F16", "F32"), a, b)
        if Feature.CONV_F16_KERNELS not in enums.features and (a.type_name != "F16" or a.nb[0] != 2):
            fail(node, f"this ggml makes an F16 im2col from an F16 src0 only, not {a.type_name}")
    else:
        _types(node, False, a, b)
    if b.nb[0] != b.type_size:  # GGML_ASSERTed
        fail(node, "src1's rows are not contiguous")
    if is_2d and b.ne[1] > 1 and b.nb[1] < b.ne[0] * b.type_size:
        fail(node, f"src1's rows overlap (nb {b.nb}) but are read as a packed plane")
    _int32(node, "src1's strides", *(b.nb[2:] if is_2d else b.nb[1:3]))
    dst_contiguous(node)


def _im2col_back(node, srcs, enums):
    """IM2COL_BACK: ggml_im2col_back (the result's ne are the caller's) and
    ggml_compute_forward_im2col_back_f32: src0, the gradient of im2col's result, is read
    flat as [N, OH, OW, IC*KH*KW]; the result is written per channel through `int` offsets."""
    a, k = need(node, srcs, 2)
    s0, s1, is_2d = _p(node, 0, 1, 6)  # p and d: any (the kernel bounds-checks)
    if is_2d not in (0, 1):
        fail(node, f"is_2D {is_2d}")
    _positive(node, s0=s0, **({"s1": s1} if is_2d else {}))  # the kernel takes `% s`
    kernels = ("F32", "F16") if Feature.CONV_F16_KERNELS in enums.features else ("F32",)
    _types(node, a.type_name == "F32" and node.type_name == "F32" and k.type_name in kernels, a, k)
    n, ic = (node.ne[3], node.ne[2]) if is_2d else (node.ne[2], node.ne[1])
    kh, kw = (k.ne[1] if is_2d else 1), k.ne[0]
    if not is_2d and node.ne[3] != 1:
        fail(node, f"1D result {node.ne} has ne[3] != 1")
    want = [ic * kh * kw, a.ne[1], a.ne[2] if is_2d else n, n if is_2d else 1]
    if a.ne != want:
        fail(node, f"src0 {a.ne} is not the im2col of {node.ne} by {k.ne} ({want})")
    if not a.contiguous():
        fail(node, "src0 is not contiguous")
    _int32(node, "the result's strides", *node.nb)
    dst_contiguous(node)


def _im2col_3d(node, srcs, enums):
    """IM2COL_3D: ggml_im2col_3d and ggml_compute_forward_im2col_3d_f32/_f16. src1
    [IW, IH, ID, N*IC] is read through its nb; the result is written as one flat array."""
    a, b = need(node, srcs, 2)
    s0, s1, s2, p0, p1, p2, d0, d1, d2, ic = _p(node, *range(10))
    _positive(node, s0=s0, s1=s1, s2=s2, IC=ic)
    # N = 0 (fewer than IC planes) makes an empty result: ggml_compute_forward skips empty
    # nodes, so the kernel never divides by it.
    n = b.ne[3] // ic
    od = _conv_out(b.ne[2], a.ne[2], s2, p2, d2)
    oh = _conv_out(b.ne[1], a.ne[1], s1, p1, d1)
    ow = _conv_out(b.ne[0], a.ne[0], s0, p0, d0)
    if min(od, oh, ow) <= 0:
        fail(node, f"src1 {b.ne} too small for src0 {a.ne}")
    _shape(node, [a.ne[0] * a.ne[1] * a.ne[2] * ic, ow, oh, od * n], "im2col_3d")
    ok = b.type_name == "F32" and node.type_name in ("F32", "F16")
    if node.type_name == "F16" and Feature.CONV_F16_KERNELS not in enums.features:
        ok = ok and a.type_name == "F16"
    _types(node, ok, a, b)
    if b.nb[0] != b.type_size:  # GGML_ASSERTed
        fail(node, "src1's rows are not contiguous")
    dst_contiguous(node)


def _col2im_1d(node, srcs, _enums=None):
    """COL2IM_1D (ggml 0.20): ggml_col2im_1d and ggml_compute_forward_col2im_1d_impl, which
    GGML_ASSERT both tensors contiguous and walk them flat."""
    (a,) = need(node, srcs, 1)
    s0, oc, p0 = _p(node, 0, 1, 2)
    _positive(node, s0=s0, oc=oc)
    if p0 < 0 or a.ne[2] != 1 or a.ne[3] != 1:
        fail(node, f"padding {p0} or src0 {a.ne} not a matrix")
    k = a.ne[0] // oc
    t_out = (a.ne[1] - 1) * s0 + k - 2 * p0
    if k * oc != a.ne[0] or k <= 0 or t_out <= 0:
        fail(node, f"src0 {a.ne} is no whole number of {oc} kernels")
    _shape(node, [t_out, oc, 1, 1], "col2im_1d")
    _types(node, a.type_name in ("F32", "F16", "BF16") and node.type_name == a.type_name, a)
    if not a.contiguous():
        fail(node, "src0 is not contiguous")
    dst_contiguous(node)


# --- direct convolutions ----------------------------------------------------------------------
def _conv_work(node, a: TensorInfo, per_patch: int, n_out: int) -> None:
    # One patch of the kernel's type and its row of F32 results must fit the work buffer
    # (`GGML_ASSERT(patches_per_batch > 0 && batch_size >= 1)`).
    if per_patch * a.type_size + n_out * 4 > _IM2COL_WORK_SIZE:
        fail(node, f"a patch of {per_patch} and {n_out} results exceeds the work buffer")


def _conv_2d(node, srcs, _enums=None):
    """CONV_2D: ggml_conv_2d_direct and ggml_compute_forward_conv_2d_impl: the kernel
    [KW, KH, IC, OC] contiguous F32/F16, the input [W, H, IC, N] read as F32 through its nb,
    the F32 result written through its nb."""
    a, b = need(node, srcs, 2)
    s0, s1, p0, p1, d0, d1 = _p(node, *range(6))
    _positive(node, s0=s0, s1=s1)
    if a.ne[2] != b.ne[2]:
        fail(node, f"channels of src0 {a.ne} and src1 {b.ne} differ")
    _shape(
        node,
        [_conv_out(b.ne[0], a.ne[0], s0, p0, d0), _conv_out(b.ne[1], a.ne[1], s1, p1, d1), a.ne[3], b.ne[3]],
        "conv_2d",
    )
    # The result has src1's type (the constructor) and is written as F32 (the kernel).
    _types(node, a.type_name in ("F32", "F16") and b.type_name == "F32" and node.type_name == "F32", a, b)
    if not _ggml_contiguous(a):  # GGML_ASSERTed
        fail(node, "src0 is not contiguous")
    _conv_work(node, a, a.ne[0] * a.ne[1] * a.ne[2], a.ne[3])


@cpu_empty_sources_ok
def _conv_3d(node, srcs, _enums=None):
    """CONV_3D: ggml_conv_3d_direct and ggml_compute_forward_conv_3d_impl: the kernel
    [KW, KH, KD, IC*OC] contiguous F32/F16, the input [W, H, D, IC*N] read as F32 through
    its nb, the F32 result [OW, OH, OD, OC*N] written through its nb.

    A kernel with KW, KH or KD 0 (test-backend-ops of ggml 0.25) is computed on the CPU
    (`base.cpu_empty_sources_ok`): ggml-cpu's kernel (the same in ggml 0.10, 0.20 and 0.25)
    then reads nothing of it nor of the input (the gather loops over kx < KW, ky < KH, kz < KD
    run no iteration), its GEMM (ggml_call_mul_mat) has k = KW*KH*KD*IC = 0 and writes each
    of its OC outputs per patch as an empty sum, 0, into the work buffer (a patch needs OC*4
    bytes there: > 0, `_conv_work`), and every result element is written from there. Any
    other empty source (the input; the kernel's IC*OC, refused by the shape) is refused as by
    `base.check_empty_sources`."""
    a, b = need(node, srcs, 2)
    check_empty_sources(node, [None, *srcs[1:]])  # the kernel may be empty, nothing else
    s0, s1, s2, p0, p1, p2, d0, d1, d2, c, n, oc = _p(node, *range(12))
    _positive(node, s0=s0, s1=s1, s2=s2, c=c, n=n, oc=oc)
    if a.ne[3] != c * oc or b.ne[3] != c * n:
        fail(node, f"src0 {a.ne} / src1 {b.ne} do not hold {c} channels x {oc} / {n}")
    _shape(
        node,
        [
            _conv_out(b.ne[0], a.ne[0], s0, p0, d0),
            _conv_out(b.ne[1], a.ne[1], s1, p1, d1),
            _conv_out(b.ne[2], a.ne[2], s2, p2, d2),
            oc * n,
        ],
        "conv_3d",
    )
    _types(node, a.type_name in ("F32", "F16") and b.type_name == "F32" and node.type_name == "F32", a, b)
    if not _ggml_contiguous(a):  # GGML_ASSERTed
        fail(node, "src0 is not contiguous")
    _conv_work(node, a, a.ne[0] * a.ne[1] * a.ne[2] * c, oc)


def _conv_2d_dw(node, srcs, enums):
    """CONV_2D_DW: ggml_conv_2d_dw_direct and ggml_compute_forward_conv_2d_dw: the kernel
    [KW, KH, 1, C] and the input [W, H, C, N] (contiguous, or channels-first "CWHN" with the
    result laid out the same way) are all walked as flat arrays; the input is read as F32."""
    a, b = need(node, srcs, 2)
    s0, s1, p0, p1, d0, d1 = _p(node, *range(6))
    _positive(node, s0=s0, s1=s1)
    if a.ne[2] != 1 or a.ne[3] != b.ne[2]:
        fail(node, f"src0 {a.ne} is no depthwise kernel of src1 {b.ne}")
    _shape(
        node,
        [_conv_out(b.ne[0], a.ne[0], s0, p0, d0), _conv_out(b.ne[1], a.ne[1], s1, p1, d1), b.ne[2], b.ne[3]],
        "conv_2d_dw",
    )
    kernels = ("F32", "F16") if Feature.CONV_F16_KERNELS in enums.features else ("F32",)  # 0.10 reads F32
    _types(node, a.type_name in kernels and b.type_name == "F32" and node.type_name == "F32", a, b)
    ts, ne = node.type_size, node.ne
    if _ggml_contiguous(b):
        want_nb = [ts, ne[0] * ts, ne[0] * ne[1] * ts]
    elif _contiguous_channels(b):
        # GGML_ASSERTed by the kernel: the kernel tensor channels-first as well
        if not (a.nb[0] >= a.nb[2] and a.nb[1] >= a.nb[0]):
            fail(node, f"src0 nb {a.nb} is not channels-first like src1")
        want_nb = [ne[2] * ts, ne[2] * ne[0] * ts, ts]  # the constructor's CWHN result
    else:
        fail(node, f"src1 nb {b.nb} is neither contiguous nor channels-first")  # GGML_ABORT
    want_nb.append(ne[0] * ne[1] * ne[2] * ts if ne[3] > 1 else node.nb[3])
    if node.nb != want_nb:  # the result is written as one flat array
        fail(node, f"result nb {node.nb}, conv_2d_dw lays it out as {want_nb}")
    _flat(node, a, "src0")
    _flat(node, b, "src1")


def _conv_transpose_1d(node, srcs, _enums=None):
    """CONV_TRANSPOSE_1D: ggml_conv_transpose_1d (p0 0, d0 1), ggml_graph_plan's work size and
    ggml_compute_forward_conv_transpose_1d_*: src0 [K, Cout, Cin] F32/F16 and src1 [L, Cin]
    F32 copied into the work buffer, the result's rows written at `i10*s0 + i00` (ints)."""
    a, b = need(node, srcs, 2)
    s0, p0, d0 = _p(node, 0, 1, 2)
    _positive(node, s0=s0)  # a negative stride would write before each row
    if p0 != 0 or d0 != 1:
        fail(node, f"p0 {p0}, d0 {d0}: only 0, 1")
    if b.ne[2] != 1 or b.ne[3] != 1 or a.ne[3] != 1 or a.ne[2] != b.ne[1]:
        fail(node, f"src0 {a.ne} and src1 {b.ne} do not match")
    _shape(node, [(b.ne[0] - 1) * s0 + a.ne[0], a.ne[1], b.ne[2], 1], "conv_transpose_1d")
    _types(node, a.type_name in ("F32", "F16") and b.type_name == "F32" and node.type_name == "F32", a, b)
    if a.nb[0] != a.type_size or b.nb[0] != b.type_size:  # GGML_ASSERTed
        fail(node, "sources' rows are not contiguous")
    _int32(node, "sizes", a.nelements(), b.nelements(), node.ne[0])
    int_rows(node, node.ne[1], "result rows")  # `const int nr = ne1`, split among threads
    dst_contiguous(node)


def _conv_transpose_2d(node, srcs, _enums=None):
    """CONV_TRANSPOSE_2D: ggml_conv_transpose_2d_p0 and ggml_compute_forward_conv_transpose_2d:
    src0 [KW, KH, Cout, Cin] F32/F16 read as packed [KH, KW] planes, src1 [W, H, Cin, N] F32
    (its first batch only before ggml 0.25, every batch since), the result written as packed
    planes, indices in ints."""
    a, b = need(node, srcs, 2)
    (s,) = _p(node, 0)
    _positive(node, stride=s)
    if a.ne[3] != b.ne[2]:
        fail(node, f"src0 {a.ne} and src1 {b.ne} do not match")
    _shape(node, [(b.ne[0] - 1) * s + a.ne[0], (b.ne[1] - 1) * s + a.ne[1], a.ne[2], b.ne[3]], "conv_transpose_2d")
    _types(node, a.type_name in ("F32", "F16") and b.type_name == "F32" and node.type_name == "F32", a, b)
    if a.nb[0] != a.type_size or b.nb[0] != b.type_size:  # GGML_ASSERTed
        fail(node, "sources' rows are not contiguous")
    if a.ne[1] > 1 and a.nb[1] < a.ne[0] * a.type_size:
        fail(node, f"src0's rows overlap (nb {a.nb}) but are read as packed planes")
    _int32(node, "sizes", a.nelements(), b.nelements(), node.ne[0] * node.ne[1])
    int_rows(node, node.ne[2], "result planes")  # `const int np = ne2`, split among threads
    dst_contiguous(node)


# --- pooling ----------------------------------------------------------------------------------
def _pool_out(ins: int, k: int, s: int, p: int) -> int:
    """ggml_calc_pool_output_size: `(ins + 2 * p - ks) / s + 1` in float (p is a float),
    truncated to int64."""
    f = np.float32
    with np.errstate(all="ignore"):
        v = (f(ins) + f(2) * f(p) - f(k)) / f(s) + f(1)
    return int(v) if np.isfinite(v) else -1


def _plane_stride(node, t: TensorInfo, what: str) -> None:
    """POOL_2D(_BACK) step `nb[2]` through ggml_nbytes: nb[2] must be a packed plane even
    where ne[2] is 1 (contiguous() lets it be anything there), or the walk takes more planes
    than the tensors hold."""
    if t.nelements() and t.nb[2] != t.ne[0] * t.ne[1] * t.type_size:
        fail(node, f"{what} nb[2] {t.nb[2]} is not a plane of {t.ne[:2]}")


def _pool_window(node, n: int, k: int, s: int, p: int, dim: int) -> int:
    """The pooled size of a dimension of n (ggml_calc_pool_output_size, > 0), with the
    window's loops bounded by the data: the kernels loop k times per
    result element, with k only an op_param; |p| <= n keeps k <= n + 2p <= 3n (a window
    that is mostly padding is refused), and n + 2|p| + s within the `int`s the kernels keep
    `ox * s - p` and `ix + kx` in."""
    if abs(p) > n:
        fail(node, f"padding {p} of dimension {dim} exceeds its size {n}")
    _int32(node, "padded sizes", n + 2 * abs(p) + s)
    out = _pool_out(n, k, s, p)
    if out <= 0:
        fail(node, f"dimension {dim} of {n} too small for a window of {k}")
    return out


def _pool_op(node, op: int) -> None:
    if op not in _POOL_OPS:  # POOL_COUNT (or anything else) aborts
        fail(node, f"pool op {op}")


def _pool_1d(node, srcs, _enums=None):
    """POOL_1D: ggml_pool_1d and ggml_compute_forward_pool_1d_ksp: F32/F16 rows of src0 and
    F32 rows of the result walked as `i * nb[1]` over all rows."""
    (a,) = need(node, srcs, 1)
    op, k0, s0, p0 = _p(node, 0, 1, 2, 3)
    _pool_op(node, op)
    _positive(node, k0=k0, s0=s0)
    ow = _pool_window(node, a.ne[0], k0, s0, p0, 0)
    _shape(node, [ow] + a.ne[1:], "pool_1d")
    _types(node, a.type_name in ("F32", "F16") and node.type_name == "F32", a)
    if not (a.rows_packed() and node.rows_packed()):
        fail(node, "rows are not packed")


def _pool_2d(node, srcs, _enums=None):
    """POOL_2D: ggml_pool_2d and ggml_compute_forward_pool_2d: src0 F32/F16 walked plane by
    plane (`nb[2]` up to ggml_nbytes), the F32 result as packed planes."""
    (a,) = need(node, srcs, 1)
    op, k0, k1, s0, s1, p0, p1 = _p(node, *range(7))
    _pool_op(node, op)
    _positive(node, k0=k0, k1=k1, s0=s0, s1=s1)
    ow, oh = _pool_window(node, a.ne[0], k0, s0, p0, 0), _pool_window(node, a.ne[1], k1, s1, p1, 1)
    _int32(node, "the window", k0 * k1)  # `const int ka = k0 * k1`
    _shape(node, [ow, oh] + a.ne[2:], "pool_2d")
    _types(node, a.type_name in ("F32", "F16") and node.type_name == "F32", a)
    if not a.contiguous():
        fail(node, "src0 is not contiguous")
    _plane_stride(node, a, "src0")
    dst_contiguous(node)


def _pool_2d_back(node, srcs, _enums=None):
    """POOL_2D_BACK: ggml_pool_2d_back (the result has the forward input's shape) and
    ggml_compute_forward_pool_2d_back: the result and src1 (the forward input) walked plane
    by plane with the result's nb and type, src0 (the gradient) read as packed planes, each
    of its elements spread over a k0 x k1 window (the kernel bounds-checks the window; its
    size and the gradient's shape are what pool_2d of the result gives)."""
    g, af = need(node, srcs, 2)
    op, k0, k1, s0, s1, p0, p1 = _p(node, *range(7))
    _pool_op(node, op)
    _positive(node, k0=k0, k1=k1, s0=s0, s1=s1)
    _shape(node, af.ne, "pool_2d_back")
    ow, oh = _pool_window(node, node.ne[0], k0, s0, p0, 0), _pool_window(node, node.ne[1], k1, s1, p1, 1)
    _int32(node, "the window", k0 * k1)
    if g.ne[:2] != [ow, oh]:
        fail(node, f"src0 {g.ne} is not pool_2d's [{ow}, {oh}] of the result {node.ne}")
    _types(node, g.type_name == "F32" and af.type_name == "F32" and node.type_name == "F32", g, af)
    if g.ne[2] * g.ne[3] < node.ne[2] * node.ne[3]:
        fail(node, f"src0 {g.ne} has fewer planes than the result {node.ne}")
    if not g.contiguous():
        fail(node, "src0 is not contiguous")
    if af.nb != node.nb:  # src1 is walked with the result's nb
        fail(node, f"src1 nb {af.nb} differs from the result's {node.nb}")
    dst_contiguous(node)
    _plane_stride(node, node, "result")


# --- resampling and padding -----------------------------------------------------------------
def _nearest_index_fits(n_dst: int, n_src: int, align: bool) -> bool:
    """Whether `i / sf` (float) stays below n_src for every i < n_dst, sf being the kernel's
    scale factor of that dimension (ALIGN_CORNERS: (n_dst - 1) / (n_src - 1))."""
    if n_dst <= 0:
        return True
    if n_src <= 0:
        return False
    f = np.float32
    with np.errstate(all="ignore"):
        if align and n_dst > 1 and n_src > 1:
            sf32, sf64 = f(n_dst - 1) / f(n_src - 1), (n_dst - 1) / (n_src - 1)
        else:
            sf32, sf64 = f(n_dst) / f(n_src), n_dst / n_src
        for i in (f(n_dst - 1) / sf32, np.float64(n_dst - 1) / sf64):
            if not np.isfinite(i) or not 0 <= int(i) < n_src:
                return False
    return True


def _upscale(node, srcs, _enums=None):
    """UPSCALE: ggml_interpolate_impl (any result shape; F32) and
    ggml_compute_forward_upscale_f32: each result element reads src0 through its nb at
    `i / sf` (float) per dimension; the bilinear, bicubic and antialiased modes clamp
    dimensions 0 and 1, nearest clamps none."""
    (a,) = need(node, srcs, 1)
    (flags,) = _p(node, 0)
    mode = flags & 0xFF
    if mode not in (_SCALE_NEAREST, _SCALE_BILINEAR, _SCALE_BICUBIC) or flags & ~0x3FF:
        fail(node, f"scale mode {flags:#x}")
    if flags & _SCALE_ANTIALIAS and mode != _SCALE_BILINEAR:
        fail(node, "antialias is bilinear only")
    _types(node, a.type_name == "F32" and node.type_name == "F32", a)
    if node.nelements() and any(n <= 0 for n in a.ne):
        fail(node, f"src0 {a.ne} is empty")
    align = bool(flags & _SCALE_ALIGN_CORNERS)
    for d in range(4):
        if d < 2 and mode != _SCALE_NEAREST:
            continue  # clamped to [0, ne0d - 1]
        if not _nearest_index_fits(node.ne[d], a.ne[d], align and d < 2):
            fail(node, f"dimension {d}: {node.ne[d]} from {a.ne[d]} reads past src0")


def _pad_reflect_1d(node, srcs, _enums=None):
    """PAD_REFLECT_1D: ggml_pad_reflect_1d and ggml_compute_forward_pad_reflect_1d: each F32
    row copied packed into the result's row at p0, then mirrored element by element."""
    (a,) = need(node, srcs, 1)
    p0, p1 = _p(node, 0, 1)
    if not (0 <= p0 < a.ne[0] and 0 <= p1 < a.ne[0]):
        fail(node, f"padding {p0}, {p1} does not fit ne[0] {a.ne[0]}")
    _shape(node, [a.ne[0] + p0 + p1] + a.ne[1:], "pad_reflect_1d")
    _types(node, a.type_name == "F32" and node.type_name == "F32", a)
    if not (a.rows_contiguous() and node.rows_contiguous()):
        fail(node, "rows are not contiguous")


def _roll(node, srcs, _enums=None):
    """ROLL: ggml_roll (|shift| < ne per dimension: the kernel wraps an index once) and
    ggml_compute_forward_roll_f32: F32 rows copied packed, both tensors walked by their nb."""
    (a,) = need(node, srcs, 1)
    shifts = _p(node, 0, 1, 2, 3)
    if any(abs(s) >= n for s, n in zip(shifts, a.ne)):
        fail(node, f"shifts {shifts} do not fit {a.ne}")
    _shape(node, a.ne, "roll")
    _types(node, a.type_name == "F32" and node.type_name == "F32", a)
    if not (a.rows_contiguous() and node.rows_contiguous()):
        fail(node, "rows are not contiguous")


# --- windows and relative positions (SAM) ---------------------------------------------------
def _win_part(node, srcs, _enums=None):
    """WIN_PART: ggml_win_part and ggml_compute_forward_win_part_f32 (flat F32 arrays)."""
    (a,) = need(node, srcs, 1)
    npx, npy, w = _p(node, 0, 1, 2)
    _positive(node, w=w)
    if a.ne[3] != 1:
        fail(node, f"src0 {a.ne} is not 3D")
    want_npx = ((w - a.ne[1] % w) % w + a.ne[1]) // w
    want_npy = ((w - a.ne[2] % w) % w + a.ne[2]) // w
    if (npx, npy) != (want_npx, want_npy):
        fail(node, f"windows {npx}x{npy}, src0 {a.ne} gives {want_npx}x{want_npy}")
    _shape(node, [a.ne[0], w, w, npx * npy], "win_part")
    _types(node, a.type_name == "F32" and node.type_name == "F32", a)
    _int32(node, "sizes", node.ne[3], a.ne[1] + w, a.ne[2] + w)
    if not a.contiguous():
        fail(node, "src0 is not contiguous")
    dst_contiguous(node)


def _win_unpart(node, srcs, _enums=None):
    """WIN_UNPART: ggml_win_unpart (the result's width and height are the caller's) and
    ggml_compute_forward_win_unpart_f32: src0 [C, w, w, windows] read flat at the window of
    each result element, so it must hold every window the result covers."""
    (a,) = need(node, srcs, 1)
    (w,) = _p(node, 0)
    _positive(node, w=w)
    npx, npy = -(-node.ne[1] // w), -(-node.ne[2] // w)
    if a.ne[0] != node.ne[0] or a.ne[1] != w or a.ne[2] != w or a.ne[3] < npx * npy or node.ne[3] != 1:
        fail(node, f"src0 {a.ne} does not hold the {npx}x{npy} windows of {w} of {node.ne}")
    _types(node, a.type_name == "F32" and node.type_name == "F32", a)
    _int32(node, "sizes", node.ne[1] + w, node.ne[2] + w)
    if not a.contiguous():
        fail(node, "src0 is not contiguous")
    dst_contiguous(node)


def _get_rel_pos(node, srcs, _enums=None):
    """GET_REL_POS: ggml_get_rel_pos (qh == kh, src0 has 2*qh - 1 rows; F16 result) and
    ggml_compute_forward_get_rel_pos_f16, which copies halves between flat arrays."""
    (a,) = need(node, srcs, 1)
    kh = node.ne[1]
    if node.ne != [a.ne[0], kh, kh, 1] or a.ne[1] != 2 * kh - 1:
        fail(node, f"shape {node.ne}, get_rel_pos of {a.ne}")
    _types(node, a.type_name in ("F16", "BF16") and node.type_name == "F16", a)
    if not a.contiguous():
        fail(node, "src0 is not contiguous")
    dst_contiguous(node)


def _add_rel_pos(node, srcs, _enums=None):
    """ADD_REL_POS: ggml_add_rel_pos_impl and ggml_compute_forward_add_rel_pos_f32: src0
    copied whole into the result (unless in place), then src1/src2 (same shape, F32) added
    at flat indices bounded by pw->ne[0]^2 * pw->ne[1] * pw->ne[2] * pw->ne[3]."""
    a, pw, ph = need(node, srcs, 3)
    (inplace,) = _p(node, 0)
    if inplace not in (0, 1):
        fail(node, f"inplace {inplace}")
    if pw.ne != ph.ne or pw.ne[3] != a.ne[2] or pw.ne[0] * pw.ne[0] != a.ne[0] or pw.ne[1] * pw.ne[2] != a.ne[1]:
        fail(node, f"src1 {pw.ne} / src2 {ph.ne} do not fit src0 {a.ne}")
    _shape(node, a.ne, "add_rel_pos")
    _types(node, all(t.type_name == "F32" for t in (a, pw, ph, node)), a, pw, ph)
    if not all(t.contiguous() for t in (a, pw, ph)):
        fail(node, "sources are not contiguous")
    int_rows(node, pw.ne[3], "patches")  # `const int np = ne13`, split among threads
    dst_contiguous(node)


RULES: Dict[str, Rule] = {
    "IM2COL": _im2col,
    "IM2COL_BACK": _im2col_back,
    "IM2COL_3D": _im2col_3d,
    "COL2IM_1D": _col2im_1d,
    "CONV_2D": _conv_2d,
    "CONV_3D": _conv_3d,
    "CONV_2D_DW": _conv_2d_dw,
    "CONV_TRANSPOSE_1D": _conv_transpose_1d,
    "CONV_TRANSPOSE_2D": _conv_transpose_2d,
    "POOL_1D": _pool_1d,
    "POOL_2D": _pool_2d,
    "POOL_2D_BACK": _pool_2d_back,
    "UPSCALE": _upscale,
    "PAD_REFLECT_1D": _pad_reflect_1d,
    "ROLL": _roll,
    "WIN_PART": _win_part,
    "WIN_UNPART": _win_unpart,
    "GET_REL_POS": _get_rel_pos,
    "ADD_REL_POS": _add_rel_pos,
}
