"""Rules of the element-wise and row-wise ops: binary and unary arithmetic, GLU, norms, soft_max."""

from __future__ import annotations


from apir.ggml.features import Feature
from apir.host.graph.shapes.base import (
    CPU_QUANTIZED_ROW_TYPES,
    INT_MAX,
    dst_contiguous,
    fail,
    int_counted_rules,
    need,
    param_f32,
    param_i32,
    same_shape,
)


# (src0, src1, result) types binary_op (binary-ops.cpp) instantiates; ggml_add_impl & co. give
# the result src0's type, ggml_add_cast (ADD only) any type, so F16 / BF16 + F32 into F32 too.
_BINARY_TYPES = {
    ("F32", "F32", "F32"),
    ("F16", "F16", "F16"),
    ("BF16", "BF16", "BF16"),
    ("BF16", "F32", "BF16"),
    ("F16", "F32", "F16"),
}
_ADD_CAST_TYPES = {("BF16", "F32", "F32"), ("F16", "F32", "F32")}


def _add_quantized(node, a, b, enums):
    """ADD of a quantized src0 (ggml_add, or ggml_add_cast into another type):
    ggml_compute_forward_add_q_f32 GGML_ASSERTs src0, src1 and the result are one shape,
    nb00 is src0's block size, src1 is F32 with nb10 == 4 and the result's nb ascend; each row
    of src0 is dequantized (its to_float), src1's row added, and the sum written to the
    result's row with the result type's from_float, or, where that type has none, memcpy'd as
    ne0 * nb0 bytes (blck_size times a quantized row): so the result type needs from_float."""
    if a.type_name not in CPU_QUANTIZED_ROW_TYPES or a.type_name not in enums.to_float:
        fail(node, f"ADD of {a.type_name} has no CPU kernel")
    if b.type_name != "F32" or b.ne != a.ne or b.nb[0] != 4:
        fail(node, f"src1 of a quantized ADD must be F32 of src0's shape, not {b.type_name} {b.ne} nb {b.nb}")
    if node.type_name not in enums.from_float:
        fail(node, f"the CPU cannot convert F32 rows into {node.type_name}")
    if a.nb[0] != a.type_size:
        fail(node, f"src0's blocks are not packed (nb[0] {a.nb[0]})")
    if not node.nb[0] <= node.nb[1] <= node.nb[2] <= node.nb[3]:
        fail(node, f"result strides {node.nb} do not ascend")


def _binary(node, srcs, enums=None):
    """ADD, SUB, MUL, DIV: ggml_add_impl & co. (ggml_can_repeat(src1, src0); the result a copy
    or, in place, a view of src0) and apply_binary_op (binary-ops.cpp), which GGML_ASSERTs
    the shapes and nb0, nb00 are the element sizes, and walks every row of src0 and the
    result at its own nb[1..3]: any row strides (views, in place into a permuted src0)."""
    a, b = need(node, srcs, 2)
    same_shape(node, a, "src0")
    if node.op_name == "ADD" and a.blck_size > 1:
        return _add_quantized(node, a, b, enums)
    if any(b.ne[i] == 0 or a.ne[i] % b.ne[i] for i in range(len(a.ne))):
        fail(node, f"src1 {b.ne} cannot be repeated to src0 {a.ne}")
    types = (a.type_name, b.type_name, node.type_name)
    if types not in _BINARY_TYPES and not (node.op_name == "ADD" and types in _ADD_CAST_TYPES):
        fail(node, f"types {a.type_name}, {b.type_name} -> {node.type_name}")
    # src1 is read at i10 * nb10 (or as packed rows when nb10 is its element size) within its
    # own ne and nb, so any src1 strides stay inside its extent.
    if not (a.rows_contiguous() and node.rows_contiguous()):
        fail(node, f"elements are not packed (nb[0] {a.nb[0]} -> {node.nb[0]})")


def _soft_max(node, srcs, _enums=None):
    (a,) = need(node, srcs, 1)
    same_shape(node, a, "src0")
    if a.type_name != "F32" or node.type_name != "F32":
        fail(node, "soft_max computes F32 only")
    mask = srcs[1] if len(srcs) > 1 else None
    if mask is not None:
        if mask.type_name not in ("F32", "F16") or not mask.contiguous():
            fail(node, "mask must be contiguous F32 or F16")
        if (
            mask.ne[0] != a.ne[0]
            or mask.ne[1] < a.ne[1]
            or mask.ne[2] == 0
            or mask.ne[3] == 0
            or a.ne[2] % mask.ne[2]
            or a.ne[3] % mask.ne[3]
        ):
            fail(node, f"mask {mask.ne} does not fit src0 {a.ne}")
    sinks = srcs[2] if len(srcs) > 2 else None
    if sinks is not None:
        # ggml_soft_max_add_sinks: one F32 per head (ne[2]), read as a plain array
        if sinks.type_name != "F32" or sinks.ne[0] != a.ne[2] or not sinks.rows_contiguous():
            fail(node, f"sinks {sinks.type_name} {sinks.ne} do not fit src0 {a.ne}")
    if param_f32(node, 1) > 0.0 and mask is None:
        fail(node, "max_bias needs a mask")
    if not a.contiguous():
        fail(node, "src0 is not contiguous")
    dst_contiguous(node)


def _norm(node, srcs, _enums=None):
    """NORM, RMS_NORM, L2_NORM: F32 rows; the kernels GGML_ASSERT(eps >= 0) (NaN fails it)."""
    (a,) = need(node, srcs, 1)
    same_shape(node, a, "src0")
    if a.type_name != "F32" or node.type_name != "F32":
        fail(node, "F32 only")
    if not (a.rows_contiguous() and node.rows_contiguous()):
        fail(node, "rows are not contiguous")
    if not param_f32(node, 0) >= 0.0:
        fail(node, f"eps {param_f32(node, 0)} is not >= 0")


# ggml 0.25 adds BF16 kernels: ggml_compute_forward_unary_bf16_rows (GELU, GELU_ERF,
# GELU_QUICK, SILU), ..._glu_bf16_rows (REGLU, GEGLU, SWIGLU, GEGLU_ERF, GEGLU_QUICK) and
# ..._scale_bf16, each with the same layout assertions as its F32 / F16 kernel.
_GLU_BF16 = ("REGLU", "GEGLU", "SWIGLU", "GEGLU_ERF", "GEGLU_QUICK")


def _scale(node, srcs, enums=None):
    """SCALE (ggml_scale_impl; ggml_compute_forward_scale_f32, and _bf16 since ggml 0.25, which
    GGML_ASSERTs src0 and the result contiguous): same shape and type."""
    (a,) = need(node, srcs, 1)
    same_shape(node, a, "src0")
    types = ("F32", "BF16") if enums is not None and Feature.BF16_KERNELS in enums.features else ("F32",)
    if a.type_name not in types or node.type_name != a.type_name:
        fail(node, f"types {a.type_name} -> {node.type_name}")
    if not a.contiguous():
        fail(node, "src0 is not contiguous")
    dst_contiguous(node)


# Unary ops with their own kernel in ops.cpp (ggml_compute_forward_gelu & co.): F32 and F16
# only (anything else GGML_ABORTs); the others are unary_op / unary_op_functor of
# unary-ops.cpp, which also compute BF16.
_UNARY_F32_F16 = ("GELU", "GELU_ERF", "GELU_QUICK", "SILU")  # and BF16 since ggml 0.25
# unary_op_functor (XIELU) GGML_ASSERTs ggml_is_contiguous_1 of src0 and the result.
_UNARY_ROWS_PACKED = ("XIELU",)


def _unary(node, srcs, enums):
    """UNARY: ggml_unary_impl (src0's rows contiguous; the result a copy or, in place, a view
    of src0, so of its type) and ggml_compute_forward_unary's kernels, which GGML_ASSERT
    nb0 and nb00 are the element sizes and walk each row at its tensor's nb[1..3]."""
    (a,) = need(node, srcs, 1)
    op = param_i32(node, 0)
    name = next((k for k, v in enums.unary.items() if v == op and k != "COUNT"), None)
    if name is None:
        fail(node, f"unary op {op} out of range")
    same_shape(node, a, "src0")
    bf16 = name not in _UNARY_F32_F16 or Feature.BF16_KERNELS in enums.features
    types = ("F32", "F16", "BF16") if bf16 else ("F32", "F16")
    if a.type_name not in types or node.type_name != a.type_name:
        fail(node, f"{name} of {a.type_name} -> {node.type_name}")
    if not (a.rows_contiguous() and node.rows_contiguous()):
        fail(node, f"elements are not packed (nb[0] {a.nb[0]} -> {node.nb[0]})")
    if name in _UNARY_ROWS_PACKED and not (a.rows_packed() and node.rows_packed()):
        fail(node, f"{name} needs rows packed (ggml_is_contiguous_1)")


# Conversions ggml_compute_forward_dup_flt instantiates besides float to float.


# --- element-wise ----------------------------------------------------------------------------
# (src type, dst type) pairs the CPU's templated unary kernels (unary-ops.cpp) instantiate.
_UNARY_TYPES = {("F32", "F32"), ("F16", "F16"), ("BF16", "BF16"), ("BF16", "F32"), ("F16", "F32")}


def _elementwise(node, srcs, _enums=None):
    """SQR, SQRT, LOG, SIN, COS: same shape, each row walked with its own nb."""
    (a,) = need(node, srcs, 1)
    same_shape(node, a, "src0")
    if (a.type_name, node.type_name) not in _UNARY_TYPES:
        fail(node, f"types {a.type_name} -> {node.type_name}")
    if not (a.rows_contiguous() and node.rows_contiguous()):
        fail(node, "rows are not contiguous")


def _same_rows(node, srcs, types):
    """One source, same shape and type (one of `types`), and both walked as flat rows
    (`i * nb[1]` over all rows): CLAMP, LEAKY_RELU."""
    (a,) = need(node, srcs, 1)
    same_shape(node, a, "src0")
    if a.type_name not in types or node.type_name != a.type_name:
        fail(node, f"types {a.type_name} -> {node.type_name}")
    if not (a.rows_packed() and node.rows_packed()):
        fail(node, "rows are not packed")
    return a


def _clamp(node, srcs, _enums=None):
    _same_rows(node, srcs, ("F32", "F16"))


def _leaky_relu(node, srcs, _enums=None):
    _same_rows(node, srcs, ("F32", "F16"))


# ggml 0.20's norm and l2_norm read and write each element at i00 * nb[0] unless rows are
# packed (0.10's assert or assume packed rows).
# (Feature.NORM_STRIDED_ROWS, apir.ggml.features)


def _strided_norm(node, srcs, enums):
    """NORM, L2_NORM: rows of any strides on ggml >= 0.20, else as `_norm`."""
    (a,) = need(node, srcs, 1)
    if Feature.NORM_STRIDED_ROWS not in enums.features:
        return _norm(node, srcs)
    same_shape(node, a, "src0")
    if a.type_name != "F32" or node.type_name != "F32":
        fail(node, "F32 only")
    if not param_f32(node, 0) >= 0.0:
        fail(node, f"eps {param_f32(node, 0)} is not >= 0")


def _group_norm(node, srcs, _enums=None):
    """GROUP_NORM (ggml_group_norm; ggml_compute_forward_group_norm_f32, the same in ggml 0.10
    and 0.20): F32 rows; the kernel loops over n_groups = op_params[0] (a divisor: > 0), each
    taking (ne[2] + n_groups - 1) / n_groups channels, all in C `int`. More groups than
    channels only adds groups with no channel, but n_groups near INT32_MAX makes that sum wrap
    and the loop run 2^31 times per ne[3] (a hang): so 0 < n_groups <= ne[2]."""
    (a,) = need(node, srcs, 1)
    same_shape(node, a, "src0")
    if a.type_name != "F32" or node.type_name != "F32":
        fail(node, "F32 only")
    if not (a.rows_contiguous() and node.rows_contiguous()):
        fail(node, "rows are not contiguous")
    n_groups = param_i32(node, 0)
    if not 0 < n_groups <= a.ne[2] or a.ne[2] + n_groups - 1 > INT_MAX:
        fail(node, f"n_groups {n_groups} is not in [1, {a.ne[2]} channels]")


def _add1(node, srcs, _enums=None):
    a, b = need(node, srcs, 2)
    same_shape(node, a, "src0")
    if not b.is_scalar():
        fail(node, f"src1 {b.ne} is not a scalar")
    ok = {("F32", "F32"), ("F16", "F16"), ("F16", "F32"), ("BF16", "BF16"), ("BF16", "F32")}
    if (a.type_name, b.type_name) not in ok or node.type_name != a.type_name:
        fail(node, f"types {a.type_name}, {b.type_name} -> {node.type_name}")
    if not (a.rows_contiguous() and node.rows_contiguous()):
        fail(node, "rows are not contiguous")


def _diag_mask(node, srcs, _enums=None):
    """DIAG_MASK_INF / _ZERO: F32; the kernel copies src0 with one memcpy (both contiguous)
    unless in place, then writes `k * nb[2]` over ne[2]*ne[3] "matrices" (packed)."""
    (a,) = need(node, srcs, 1)
    same_shape(node, a, "src0")
    if a.type_name != "F32" or node.type_name != "F32":
        fail(node, "F32 only")
    if not (a.contiguous() and node.contiguous()):
        fail(node, "not contiguous")
    # contiguous() lets a dimension of 1 have any stride, but the kernel writes the result's
    # ne[2]*ne[3] matrices at k * nb[2], also when ne[2] is 1 (found by the fuzz campaign)
    matrix = node.type_size * node.ne[0] * node.ne[1]
    if node.ne[2] * node.ne[3] > 1 and node.nb[2] != matrix:
        fail(node, f"nb[2] {node.nb[2]} is not the {matrix}-byte matrix its ne[2]*ne[3] matrices are walked by")
    if param_i32(node, 0) < 0:
        fail(node, f"n_past {param_i32(node, 0)} < 0")


# --- GLU ------------------------------------------------------------------------------------
def _glu(node, srcs, enums):
    """ggml_glu_impl: src0 (and src1 of the same shape) rows packed; the result has half of
    src0's ne[0] (or all of it with src1); rows are walked flat. The op (op_params[0]) is one of
    this build's `enum ggml_glu_op` (ggml 0.25 adds SWIGLU_CLAMP, whose kernels have the same
    layout as SWIGLU's and read a float limit from op_params[3]); BF16 since ggml 0.25 for the
    ops with a BF16 kernel."""
    a = need(node, srcs, 1)[0]
    b = srcs[1] if len(srcs) > 1 else None
    op = param_i32(node, 0)
    if not 0 <= op < enums.glu_count:
        fail(node, f"glu op {op} out of range")
    name = next((k for k, v in enums.glu.items() if v == op), "")
    # SWIGLU_OAI's kernel is F32 only; SWIGLU_CLAMP (ggml 0.25) F32 and F16
    if name == "SWIGLU_OAI":
        types: tuple = ("F32",)
    elif name in _GLU_BF16 and Feature.BF16_KERNELS in enums.features:
        types = ("F32", "F16", "BF16")
    else:
        types = ("F32", "F16")
    if a.type_name not in types or node.type_name != a.type_name:
        fail(node, f"types {a.type_name} -> {node.type_name}")
    if b is not None:
        if b.ne != a.ne or b.type_name != a.type_name or not b.rows_packed():
            fail(node, f"src1 {b.type_name} {b.ne} does not match src0 {a.type_name} {a.ne}")
    want = [a.ne[0] if b is not None else a.ne[0] // 2] + a.ne[1:]
    if node.ne != want:
        fail(node, f"shape {node.ne}, glu gives {want}")
    if not (a.rows_packed() and node.rows_packed()):
        fail(node, "rows are not packed")


# Every kernel here counts rows (and most elements) in C `int` (base.int_counted).
RULES = int_counted_rules(
    {
        "ADD": _binary,
        "SUB": _binary,
        "MUL": _binary,
        "DIV": _binary,
        "SOFT_MAX": _soft_max,
        "SCALE": _scale,
        "NORM": _strided_norm,
        "RMS_NORM": _norm,
        "L2_NORM": _strided_norm,
        "GROUP_NORM": _group_norm,
        "UNARY": _unary,
        "GLU": _glu,
        "SQR": _elementwise,
        "SQRT": _elementwise,
        "LOG": _elementwise,
        "SIN": _elementwise,
        "COS": _elementwise,
        "CLAMP": _clamp,
        "LEAKY_RELU": _leaky_relu,
        "ADD1": _add1,
        "DIAG_MASK_INF": _diag_mask,
        "DIAG_MASK_ZERO": _diag_mask,
    }
)
