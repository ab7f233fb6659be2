"""Rules of the ops that copy, view, reshape, reduce, sort or generate tensors."""

from __future__ import annotations

from typing import Dict

import numpy as np

from apir.ggml.features import Feature
from apir.host.graph.shapes.base import (
    Rule,
    FLOAT,
    OpEnums,
    TensorInfo,
    dst_contiguous,
    extent,
    fail,
    int_counted_rules,
    need,
    param_f32,
    param_i32,
)


_INT_CONVERSIONS = {("F32", "I32"), ("I32", "F32")}


def _copy_types(node, src: TensorInfo, dst: TensorInfo, enums: OpEnums, is_cpy: bool = False):
    if src.nelements() != dst.nelements():
        fail(node, f"{src.nelements()} elements copied into {dst.nelements()}")
    if src.blck_size > 1 and dst.type_name == "F32" and is_cpy and src.type_name in enums.to_float:
        # ggml_compute_forward_dup_from_q (reads the result's layout from src1, so CPY only):
        # whole blocks dequantized to blck_size floats at a flat index mapped through the
        # result's ne/nb; GGML_ASSERTs nb[0] is 4 and rows hold whole blocks or it is contiguous.
        if not dst.rows_contiguous() or not (dst.ne[0] % src.blck_size == 0 or dst.contiguous()):
            fail(node, f"{src.type_name} dequantized into F32 {dst.ne} nb {dst.nb}")
        # it keeps the flat element index of each block in a uint32_t (`uint32_t i = ir * qk`)
        if dst.nelements() > 0xFFFFFFFF:
            fail(node, f"{dst.nelements()} elements: past the kernel's 32-bit element index")
        return
    if src.type_name == dst.type_name:
        # ggml_compute_forward_dup_bytes: any type, each tensor walked within its ne and nb;
        # except that with a contiguous result and a source that is not, it copies
        # ne[0] * type_size bytes per row, i.e. blck_size times a quantized row: only the
        # same-shape row copy (both rows contiguous) is taken before that path.
        if (
            src.blck_size > 1
            and dst.contiguous()
            and not src.contiguous()
            and not (src.ne == dst.ne and src.rows_contiguous() and dst.rows_contiguous())
        ):
            fail(node, f"{src.type_name} copy of a non-contiguous source into a contiguous result")
        return
    if (src.type_name, dst.type_name) in _INT_CONVERSIONS:
        return
    if src.type_name not in FLOAT:
        fail(node, f"cannot convert from {src.type_name}")
    if dst.type_name not in FLOAT:
        # ggml_compute_forward_dup_to_q: dst contiguous, src rows of elements (nb00 == size),
        # each src row converted to F32 in a work buffer the graph plan sizes by the result's
        # ne[0] (so src ne[0] may not exceed it), then quantized as whole blocks.
        # (the work buffer exists only for a quantized result: ggml_is_quantized(node->type))
        if dst.blck_size == 1 or dst.type_name not in enums.from_float:
            fail(node, f"cannot convert {src.type_name} to {dst.type_name} here")
        if not (src.rows_contiguous() and dst.contiguous()):
            fail(node, f"copy into {dst.type_name} needs contiguous rows and a contiguous result")
        if src.ne[0] > dst.ne[0] or src.ne[0] % dst.blck_size:
            fail(node, f"src0 rows of {src.ne[0]} do not fit {dst.type_name} rows of {dst.ne[0]}")


def _cpy(node, srcs, enums):
    a, b = need(node, srcs, 2)
    if node.ne != b.ne or node.nb != b.nb or node.type_name != b.type_name:
        fail(node, "result is not a view of src1")
    _copy_types(node, a, b, enums, is_cpy=True)


def _dup(node, srcs, enums):
    (a,) = need(node, srcs, 1)
    _copy_types(node, a, node, enums)
    dst_contiguous(node)


def _cont(node, srcs, enums):
    """CONT (ggml_cont_impl: a contiguous copy of src0, of its type) computed as DUP; and of
    its type it must be: ggml_graph_plan sizes no work buffer for CONT (only for CPY and DUP),
    while a conversion into a quantized type (dup_to_q) writes each row's F32 copy into it
    (a NULL or too-small work buffer: a crash). Both ggml 0.10 and 0.20."""
    (a,) = need(node, srcs, 1)
    if node.type_name != a.type_name:
        fail(node, f"CONT of {a.type_name} into {node.type_name}: the copy keeps its type")
    _dup(node, srcs, enums)


def _view(node, srcs, _enums=None):
    need(node, srcs, 1)  # data within the source is checked with the view_src


def _reshape(node, srcs, _enums=None):
    (a,) = need(node, srcs, 1)
    if node.nelements() != a.nelements():
        fail(node, f"{node.nelements()} elements reshaped from {a.nelements()}")


def _leaf(node, srcs, _enums=None):
    pass


# --- reductions -----------------------------------------------------------------------------
def _sum(node, srcs, _enums=None):
    (a,) = need(node, srcs, 1)
    if a.type_name not in FLOAT or node.type_name != a.type_name or not node.is_scalar():
        fail(node, f"sum of {a.type_name} gives a scalar of the same type, not {node.type_name} {node.ne}")
    # The kernel sums ne[0] packed elements from each row's start whatever nb[0] is (ggml only
    # asserts it); the checked extent includes a packed row at every row start
    # (TensorChecker.extent), so any strides stay inside the tensor, as ggml CPU computes it.


def _row_reduce(node, srcs, _enums=None):
    """SUM_ROWS, MEAN: F32, one value per row."""
    (a,) = need(node, srcs, 1)
    if node.ne != [1] + a.ne[1:]:
        fail(node, f"shape {node.ne}, expected {[1] + a.ne[1:]}")
    if a.type_name != "F32" or node.type_name != "F32":
        fail(node, "F32 only")
    if not (a.rows_contiguous() and node.rows_contiguous()):
        fail(node, "rows are not contiguous")


def _argmax(node, srcs, _enums=None):
    (a,) = need(node, srcs, 1)
    if a.ne[2] != 1 or a.ne[3] != 1 or a.ne[0] > 0x7FFFFFFF:
        fail(node, f"src0 {a.ne} is not a matrix")
    if node.ne != [a.ne[1], 1, 1, 1] or node.type_name != "I32" or a.type_name != "F32":
        fail(node, f"argmax of F32 {a.ne} is I32 [{a.ne[1]}], not {node.type_name} {node.ne}")
    if not (a.rows_contiguous() and node.rows_contiguous()):
        fail(node, "rows are not contiguous")


def _count_equal(node, srcs, _enums=None):
    a, b = need(node, srcs, 2)
    if a.ne != b.ne or a.type_name != "I32" or b.type_name != "I32":
        fail(node, f"sources {a.type_name} {a.ne} and {b.type_name} {b.ne} differ or are not I32")
    # The kernel's row index arithmetic is only right for matrices (ggml's test shapes).
    if a.ne[2] != 1 or a.ne[3] != 1:
        fail(node, f"sources {a.ne} are not matrices")
    if node.type_name != "I64" or not node.is_scalar():
        fail(node, "count_equal gives an I64 scalar")


# --- shape changers -------------------------------------------------------------------------
def _repeat(node, srcs, _enums=None):
    (a,) = need(node, srcs, 1)
    if any(a.ne[i] == 0 or node.ne[i] % a.ne[i] for i in range(4)):
        fail(node, f"src0 {a.ne} cannot be repeated to {node.ne}")
    if a.type_name not in ("F32", "I32", "F16", "BF16", "I16") or node.type_name != a.type_name:
        fail(node, f"types {a.type_name} -> {node.type_name}")
    if not (a.rows_contiguous() and node.rows_contiguous()):
        fail(node, "rows are not contiguous")


def _repeat_back(node, srcs, _enums=None):
    (a,) = need(node, srcs, 1)
    if any(node.ne[i] == 0 or a.ne[i] % node.ne[i] for i in range(4)):
        fail(node, f"{node.ne} cannot be repeated to src0 {a.ne}")
    if a.type_name != "F32" or node.type_name != "F32":
        fail(node, "F32 only")
    if not (a.rows_contiguous() and node.rows_contiguous()):
        fail(node, "rows are not contiguous")


# ggml 0.20's concat walks quantized rows block by block (ggml 0.10's walks them as elements,
# blck_size times past each row).
# (Feature.CONCAT_QUANTIZED, apir.ggml.features)


# ggml 0.25's concat_any (every type without its own kernel below: quantized, F64, I64) copies
# whole rows with memcpy: it GGML_ASSERTs both sources' rows contiguous (all types, not only
# quantized ones) and writes ggml_row_size bytes per row of the result.
# types with their own element-wise kernel (ggml_compute_forward_concat_f16 / _i8 / _f32)
_CONCAT_ELEMENT_TYPES = ("F16", "BF16", "I16", "I8", "F32", "I32")


def _concat(node, srcs, enums):
    """CONCAT (ggml_concat; ggml_compute_forward_concat): sources of one type, equal but on
    `dim`; the F32 / F16 / I8 kernels walk every element at its own strides; concat_any walks
    quantized rows block by block (ggml 0.20) or copies whole rows (ggml 0.25, see above)."""
    a, b = need(node, srcs, 2)
    dim = param_i32(node, 0)
    if not 0 <= dim < 4:
        fail(node, f"dim {dim} out of range")
    if a.type_name != b.type_name or node.type_name != a.type_name:
        fail(node, f"types {a.type_name}, {b.type_name} -> {node.type_name}")
    if Feature.CONCAT_ROWS in enums.features and a.type_name not in _CONCAT_ELEMENT_TYPES:
        if not (a.rows_contiguous() and b.rows_contiguous()):  # GGML_ASSERTed
            fail(node, "sources' rows are not contiguous")
        if not node.rows_contiguous():  # a row of ggml_row_size bytes is memcpy'd into each
            fail(node, "result rows are not contiguous")
        if a.ne[0] % a.blck_size or b.ne[0] % b.blck_size:  # GGML_ASSERTed for dim 0
            fail(node, "rows are not whole blocks")
    elif a.blck_size != 1:
        if Feature.CONCAT_QUANTIZED not in enums.features:
            fail(node, f"this ggml cannot concatenate {a.type_name}")
        if not (a.rows_contiguous() and b.rows_contiguous()):  # GGML_ASSERTed
            fail(node, "sources' rows are not contiguous")
    want = [a.ne[d] + b.ne[d] if d == dim else a.ne[d] for d in range(4)]
    if any(a.ne[d] != b.ne[d] for d in range(4) if d != dim) or node.ne != want:
        fail(node, f"shape {node.ne}, concat of {a.ne} and {b.ne} on {dim} gives {want}")


def _pad(node, srcs, _enums=None):
    """PAD: F32; the result is written as one flat array, the source read where it lies."""
    (a,) = need(node, srcs, 1)
    pads = [param_i32(node, i) for i in range(8)]
    if any(p < 0 for p in pads):
        fail(node, f"negative padding {pads}")
    want = [a.ne[d] + pads[2 * d] + pads[2 * d + 1] for d in range(4)]
    if node.ne != want:
        fail(node, f"shape {node.ne}, pad gives {want}")
    if a.type_name != "F32" or node.type_name != "F32":
        fail(node, "F32 only")
    if param_i32(node, 8) and any(n == 0 for n in a.ne):
        fail(node, "circular padding of an empty source")  # wraps modulo ne
    dst_contiguous(node)


def _arange(node, srcs, _enums=None):
    """ARANGE: no source; the kernel asserts ne == ceilf((stop - start) / step) in float."""
    start, stop, step = (np.float32(param_f32(node, i)) for i in range(3))
    if not (np.isfinite([start, stop, step]).all() and stop > start and step > 0):
        fail(node, f"arange({start}, {stop}, {step})")
    with np.errstate(all="ignore"):
        steps = np.ceil(np.float32((stop - start) / step))
    if not np.isfinite(steps) or node.nelements() != int(steps) or node.type_name != "F32":
        fail(node, f"{node.nelements()} elements, arange gives {steps}")
    dst_contiguous(node)


def _timestep_embedding(node, srcs, _enums=None):
    (a,) = need(node, srcs, 1)
    dim = param_i32(node, 0)
    if dim < 0 or node.ne != [dim, a.ne[0], 1, 1]:
        fail(node, f"shape {node.ne}, timestep_embedding gives {[dim, a.ne[0], 1, 1]}")
    if a.type_name != "F32" or node.type_name != "F32":
        fail(node, "F32 only")
    if not (a.rows_contiguous() and node.rows_contiguous()):
        fail(node, "rows are not contiguous")


def _sorted_apart(node, a) -> None:
    """ggml-cpu's argsort is std::sort of the result with a comparator reading the input: a
    result over its input changes the order as it sorts, and std::sort then runs past the
    row (a segfault). ggml never makes one in place; refused where both addresses are known."""
    if node.address and a.address:
        lo, hi = max(node.address, a.address), min(node.address + extent(node), a.address + extent(a))
        if lo < hi:
            fail(node, "the result overlaps its input")


def _argsort(node, srcs, _enums=None):
    (a,) = need(node, srcs, 1)
    if node.ne != a.ne or node.type_name != "I32" or a.type_name != "F32":
        fail(node, f"argsort of F32 {a.ne} is I32 of the same shape, not {node.type_name} {node.ne}")
    if param_i32(node, 0) not in (0, 1):  # ASC, DESC; anything else aborts
        fail(node, f"sort order {param_i32(node, 0)}")
    if a.ne[0] > 0x7FFFFFFF or not (a.rows_packed() and node.rows_packed()):
        fail(node, "rows are not packed")
    _sorted_apart(node, a)


def _top_k(node, srcs, _enums=None):
    (a,) = need(node, srcs, 1)
    if node.ne[0] > a.ne[0] or node.ne[1:] != a.ne[1:]:
        fail(node, f"shape {node.ne}: top_k of {a.ne}")
    if node.type_name != "I32" or a.type_name != "F32":
        fail(node, f"types {a.type_name} -> {node.type_name}")
    if not (a.rows_packed() and node.rows_packed()):
        fail(node, "rows are not packed")
    _sorted_apart(node, a)


# Leaves and views are not computed (ggml_op_is_empty): no kernel counts anything of them.
# Every other kernel here counts rows (and most elements) in C `int` (base.int_counted).
RULES: Dict[str, Rule] = {
    "NONE": _leaf,
    "VIEW": _view,
    "PERMUTE": _view,
    "TRANSPOSE": _view,
    "RESHAPE": _reshape,
    **int_counted_rules(
        {
            "CPY": _cpy,
            "DUP": _dup,
            "CONT": _cont,
            "SUM": _sum,
            "SUM_ROWS": _row_reduce,
            "MEAN": _row_reduce,
            "ARGMAX": _argmax,
            "COUNT_EQUAL": _count_equal,
            "REPEAT": _repeat,
            "REPEAT_BACK": _repeat_back,
            "CONCAT": _concat,
            "PAD": _pad,
            "ARANGE": _arange,
            "TIMESTEP_EMBEDDING": _timestep_embedding,
            "ARGSORT": _argsort,
            "TOP_K": _top_k,
        }
    ),
}
