"""Rules of the matrix and row-indexing ops: MUL_MAT, MUL_MAT_ID, OUT_PROD, GET_ROWS,
GET_ROWS_BACK, SET_ROWS, ADD_ID.

Row ids (GET_ROWS, GET_ROWS_BACK, SET_ROWS, MUL_MAT_ID, ADD_ID) are read and range-checked
before compute (`base.row_ids`): the CPU kernels GGML_ASSERT an id in range (an abort of the
host), or only `assert` it (MUL_MAT_ID: compiled out, then it writes past its work buffer),
or do not check at all (GET_ROWS_BACK: writes past its result). So the ids are copied
(`TensorInfo.snapshot`), checked in the copy, and the kernel is given the copy (the guest
may write its buffers during compute); and they must be data the guest wrote: ids computed
by the graph, or overlapped by any node's result, are refused (graph.py); a view of input
ids (test-backend-ops' ids) is fine.
"""

from __future__ import annotations

from typing import Dict

from apir.ggml.features import Feature
from apir.host.graph.shapes.base import (
    Rule,
    CPU_QUANTIZED_ROW_TYPES,
    FLOAT,
    INT_MAX,
    check_row_ids,
    dst_contiguous,
    empty_sources_ok,
    extent,
    fail,
    int_rows,
    need,
    param_i32,
)

_INT_MAX = INT_MAX  # kernels that count rows in an `int`
# ggml-cpu's vec.h GGML_VEC_MAD_UNROLL: out_prod's F32 kernel passes src0's and src1's nb[1]
# to ggml_vec_mad_f32_unroll as `int`s and steps them `i * xs` for i below it.
_VEC_MAD_UNROLL = 32

_GET_ROWS_Q = CPU_QUANTIZED_ROW_TYPES | {"Q8_1"}  # get_rows also dequantizes Q8_1

# The most work buffer a MUL_MAT_ID's row mappings may take (ggml-cpu allocates the work
# buffer with `new` and aborts when it cannot): far above any model's (experts x ids x 8).
_MMID_WORK_MAX = 1 << 30

# ggml 0.20's mul_mat takes op_params[1] as a hint: GGML_HINT_SRC0_IS_HADAMARD (`enum
# ggml_op_hint`, enums.hints) routes it to ggml_compute_forward_fwht (src1's rows transformed;
# src0 not read); other values are ignored.
# (Feature.MUL_MAT_HINT, apir.ggml.features)
# ggml 0.25's mul_mat widens an F16 or BF16 src1 into the F32 work buffer when src0's
# vec_dot_type is F32 (GGML_ASSERTs `!widen || vec_dot_type == F32`, `!widen || src1 F16 or
# BF16`), and its fwht (the Hadamard hint) reads F16 src1 rows too. mul_mat_id does neither.
# ggml 0.25's tiled matmul (ggml-cpu/tiled/tiled.cpp, x86 AVX/AVX2 builds; used for src0 of
# these types from 8 src1 rows on): when src1 is already src0's vec_dot_type (Q8_K) it reads
# src1's row r at `r * nb[1]` over all ne[1]*ne[2]*ne[3] rows (MUL_MAT_ID: (i11 + i12 * ne11)
# * nb[1]), ignoring nb[2] and nb[3]: such a src1 must have its rows packed.
_TILED_SRC0 = frozenset(
    (
        "Q6_K",
        "Q5_K",
        "Q4_K",
        "Q3_K",
        "Q2_K",
        "IQ4_XS",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ2_S",
        "IQ3_XXS",
        "IQ3_S",
        "IQ1_S",
        "IQ1_M",
    )
)
# ggml 0.20's out_prod takes F16 src0 (ggml 0.10 aborts: "todo").
# (Feature.OUT_PROD_F16, apir.ggml.features)
# ggml 0.20's set_rows also takes F16 rows (ggml 0.10: F32 only).
# (Feature.SET_ROWS_F16, apir.ggml.features)


def _dst_ordered(node) -> None:
    """The GGML_ASSERTs of mul_mat / mul_mat_id on the result: nb0 == 4, nb0 <= nb1 <= nb2 <= nb3
    (a contiguous result may still break them in a dimension of 1); and no aliasing."""
    nb = node.nb
    if nb[0] != 4 or not (nb[0] <= nb[1] <= nb[2] <= nb[3]):
        fail(node, f"result strides {nb} are not ordered")
    # The kernels count chunks of the result in `int`s: a result whose elements alias (nb of
    # 0 under a huge ne) could have more than INT_MAX chunks in a small buffer.
    if node.nelements() * 4 > extent(node):
        fail(node, f"result elements overlap (ne {node.ne}, nb {nb})")


def _vec_dot(node, a, b, enums, widen: bool = False) -> None:
    """src0 has a CPU dot product, and src1 is F32 (converted row by row into src0's
    vec_dot_type in the work buffer), or F16 / BF16 widened to an F32 vec_dot_type (`widen`:
    MUL_MAT since ggml 0.25), or already of the vec_dot_type (ggml-cpu's supports_op; anything
    else is GGML_ASSERTed). Both have rows of elements (GGML_ASSERTed)."""
    vdt = enums.vec_dot.get(a.type_name)
    if vdt is None:
        fail(node, f"src0 type {a.type_name} has no dot product")
    if b.type_name != vdt:
        widened = widen and vdt == "F32" and b.type_name in ("F16", "BF16")
        if not widened and (b.type_name != "F32" or vdt not in enums.from_float):
            fail(node, f"src1 {b.type_name} is neither F32 nor {vdt}, the dot type of {a.type_name}")
        # the work buffer is sized as ggml_row_size(vec_dot_type, nelements(src1)): whole blocks
        if b.ne[0] % enums.blck_size.get(vdt, 1):
            fail(node, f"src1 rows of {b.ne[0]} are not whole {vdt} blocks")
        # ... and by src1's element count, not its extent: elements that alias (strides of 0)
        # would make the CPU allocate it far beyond any buffer of the guest's (and abort when
        # it cannot). Any layout whose elements do not overlap has nelements * 4 <= extent.
        if b.nelements() * b.type_size > extent(b):
            fail(node, f"src1 elements overlap (ne {b.ne}, nb {b.nb})")
    if a.nb[0] != a.type_size or b.nb[0] != b.type_size:
        fail(node, "src0 or src1 is permuted (nb[0] is not the element size)")
    if a.ne[0] > _INT_MAX:  # ggml_vec_dot_t takes the row length as an `int n`
        fail(node, f"rows of {a.ne[0]} exceed the dot product's int")
    if (
        Feature.TILED_MATMUL in enums.features
        and b.type_name == vdt
        and a.type_name in _TILED_SRC0
        and not b.rows_packed()
    ):
        fail(node, f"src1 {vdt} rows are not packed (nb {b.nb}): the tiled kernel reads them as r * nb[1]")


def _mul_mat(node, srcs, enums):
    """ggml_mul_mat / ggml_compute_forward_mul_mat (ggml-cpu.c): result [src0 ne1, src1 ne1,
    src1 ne2, src1 ne3] F32; src0 broadcast over src1's ne2, ne3; src0 and src1 rows read at
    their nb[1..3] (any layout with rows of elements), the result written at its nb."""
    a, b = need(node, srcs, 2)
    if a.ne[0] != b.ne[0]:
        fail(node, f"ne[0] of src0 ({a.ne[0]}) and src1 ({b.ne[0]}) differ")
    if a.ne[2] == 0 or a.ne[3] == 0 or b.ne[2] % a.ne[2] or b.ne[3] % a.ne[3]:
        fail(node, f"src0 {a.ne} cannot be broadcast to src1 {b.ne}")
    if node.ne != [a.ne[1], b.ne[1], b.ne[2], b.ne[3]]:
        fail(node, f"shape {node.ne}, mul_mat of {a.ne} and {b.ne} gives {[a.ne[1], b.ne[1], b.ne[2], b.ne[3]]}")
    if node.type_name != "F32":
        fail(node, f"result {node.type_name} is not F32")
    hint = param_i32(node, 1) if Feature.MUL_MAT_HINT in enums.features else 0
    if hint and hint == enums.hints.get("SRC0_IS_HADAMARD"):
        # ggml_compute_forward_fwht: each src1 row of n = ne10 floats (GGML_ASSERTed a power
        # of 2; src1 and result GGML_ASSERTed F32) transformed into n floats of a result row.
        n = b.ne[0]
        rows = ("F32", "F16") if Feature.MUL_MAT_WIDEN in enums.features else ("F32",)
        if b.type_name not in rows or n & (n - 1) or node.ne[0] < n:
            fail(node, f"Hadamard hint on src1 {b.type_name} rows of {n} into rows of {node.ne[0]}")
    # (the plain kernel runs instead when the CPU is asked for reference results)
    _vec_dot(node, a, b, enums, widen=Feature.MUL_MAT_WIDEN in enums.features)
    _dst_ordered(node)


def _mul_mat_id(node, srcs, enums):
    """ggml_mul_mat_id / ggml_compute_forward_mul_mat_id (ggml-cpu.c): src0 [k, m, n_as] (one
    matrix per expert), src1 [k, n_b, n_tokens], ids I32 [n_used, n_tokens]: result row i1 of
    token i2 is src0[ids[i1, i2]] times src1 row i1 % n_b of token i2. The kernel only
    `assert`s 0 <= id < n_as (compiled out: an id out of range writes past its work buffer)."""
    a, b, ids = need(node, srcs, 3)
    if a.ne[3] != 1 or b.ne[3] != 1 or ids.ne[2] != 1 or ids.ne[3] != 1:
        fail(node, f"src0 {a.ne} and src1 {b.ne} must be 3-d, ids {ids.ne} 2-d")
    if ids.ne[1] != b.ne[2] or a.ne[0] != b.ne[0] or b.ne[1] == 0 or ids.ne[0] % b.ne[1]:
        fail(node, f"ids {ids.ne} do not select src0 {a.ne} for src1 {b.ne}")
    if node.ne != [a.ne[1], ids.ne[0], b.ne[2], 1]:
        fail(node, f"shape {node.ne}, mul_mat_id gives {[a.ne[1], ids.ne[0], b.ne[2], 1]}")
    if node.type_name != "F32":
        fail(node, f"result {node.type_name} is not F32")
    if ids.nelements() > _INT_MAX or a.ne[2] > _INT_MAX:  # counted in `int`s
        fail(node, "too many ids or experts")
    # The work buffer holds n_as * nelements(ids) row mappings (8 bytes) and n_as cache lines;
    # a size ggml-cpu cannot allocate aborts the host.
    if a.ne[2] * (ids.nelements() * 8 + 64) > _MMID_WORK_MAX:
        fail(node, f"{a.ne[2]} experts and {ids.nelements()} ids need more than {_MMID_WORK_MAX} bytes of work buffer")
    _vec_dot(node, a, b, enums)
    _dst_ordered(node)
    check_row_ids(node, ids, a.ne[2], ("I32",), "expert id")


def _out_prod(node, srcs, enums):
    """ggml_out_prod / ggml_compute_forward_out_prod (ops.cpp): result [src0 ne0, src1 ne0,
    src1 ne2, src1 ne3] F32, zeroed as one flat array (so contiguous); src0 rows of elements
    (GGML_ASSERTed), src1 read element by element at its nb (transposed is fine). F32 src0 is
    broadcast over ne2, ne3; F16 (ggml >= 0.20) and quantized src0 are dequantized row by row
    into the work buffer and need src1's ne2, ne3."""
    a, b = need(node, srcs, 2)
    if a.ne[1] != b.ne[1] or a.ne[2] == 0 or a.ne[3] == 0 or b.ne[2] % a.ne[2] or b.ne[3] % a.ne[3]:
        fail(node, f"out_prod of {a.ne} and {b.ne}")
    if node.ne != [a.ne[0], b.ne[0], b.ne[2], b.ne[3]]:
        fail(node, f"shape {node.ne}, out_prod gives {[a.ne[0], b.ne[0], b.ne[2], b.ne[3]]}")
    if node.type_name != "F32" or b.type_name != "F32":
        fail(node, f"src1 {b.type_name} and result {node.type_name} must be F32")
    f16 = a.type_name == "F16" and Feature.OUT_PROD_F16 in enums.features
    if a.type_name != "F32":
        if not (f16 or a.type_name in CPU_QUANTIZED_ROW_TYPES):
            fail(node, f"src0 type {a.type_name} has no out_prod here")
        if a.ne[2] != b.ne[2] or a.ne[3] != b.ne[3]:
            fail(node, f"{a.type_name} src0 {a.ne} is not broadcast to src1 {b.ne}")
    if a.nb[0] != a.type_size:
        fail(node, "src0 is permuted (nb[0] is not the element size)")
    # ggml_vec_mad_f32(_unroll) take the row length and (F32 src0) both sources' nb[1] as
    # `int`s, the latter stepped `i * nb[1]` for i < GGML_VEC_MAD_UNROLL: a wrapped product
    # reads before or after the rows.
    if a.ne[0] > _INT_MAX:
        fail(node, f"rows of {a.ne[0]} exceed the kernel's int")
    if a.type_name == "F32" and max(a.nb[1], b.nb[1]) * (_VEC_MAD_UNROLL - 1) > _INT_MAX:
        fail(node, f"row strides {a.nb[1]}, {b.nb[1]} exceed the kernel's int steps")
    dst_contiguous(node)


def _get_rows(node, srcs, _enums=None):
    """ggml_get_rows / ggml_compute_forward_get_rows (ops.cpp): result [src0 ne0, ids ne0,
    ids ne1, ids ne2], F32 (I32 for I32 src0, copied as is); row ids[i10, i11, i12] of src0's
    matrix (i11, i12) converted into result row (i10, i11, i12); ids read at their nb (a view
    is fine). Each row is read and written as ne0 packed elements (the kernels only `assert`
    nb[0]), so both need rows of elements."""
    a, b = need(node, srcs, 2)
    if b.ne[3] != 1 or a.ne[2] != b.ne[1] or a.ne[3] != b.ne[2]:
        fail(node, f"rows {b.ne} do not index src0 {a.ne}")
    if node.ne != [a.ne[0], b.ne[0], b.ne[1], b.ne[2]]:
        fail(node, f"shape {node.ne}, get_rows gives {[a.ne[0], b.ne[0], b.ne[1], b.ne[2]]}")
    want = "I32" if a.type_name == "I32" else "F32"
    if node.type_name != want or a.type_name not in FLOAT + ("I32",) + tuple(_GET_ROWS_Q):
        fail(node, f"types {a.type_name} -> {node.type_name}")
    if not (a.rows_contiguous() and node.rows_contiguous()):
        fail(node, "rows are not contiguous")
    if b.nelements() > _INT_MAX:
        fail(node, "too many rows")
    check_row_ids(node, b, a.ne[1], ("I32",))


def _get_rows_back(node, srcs, _enums=None):
    """ggml_get_rows_back / ggml_compute_forward_get_rows_back (ops.cpp): src0 F32 or F16
    [n, r] (the gradient of get_rows' result), src1 I32 ids vector; the result F32 [n, m] (m
    from the constructor's third tensor, not a source) zeroed, then src0 row i added into
    result row ids[i]. The kernel reads the ids as one packed array, src0's rows at
    i * nb[1] and the result's at id * nb[1], and does not check the ids at all: each must
    be a row of the result."""
    a, b = need(node, srcs, 2)
    if a.ne[2:] != [1, 1] or b.ne[1:] != [1, 1, 1]:
        fail(node, f"get_rows_back of {a.ne} at {b.ne}")
    if node.ne[0] != a.ne[0] or node.ne[2:] != [1, 1] or node.type_name != "F32":
        fail(node, f"shape {node.type_name} {node.ne}, get_rows_back gives F32 [{a.ne[0]}, m]")
    if a.type_name not in ("F32", "F16") or a.nb[0] != a.type_size:
        fail(node, f"src0 {a.type_name} nb {a.nb}: F32 or F16 rows of elements")
    if b.ne[0] > a.ne[1] or b.ne[0] > _INT_MAX or a.ne[0] > _INT_MAX:
        fail(node, f"{b.ne[0]} ids for {a.ne[1]} rows of src0")
    dst_contiguous(node)
    check_row_ids(node, b, node.ne[1], ("I32",), flat=True)


@empty_sources_ok
def _set_rows(node, srcs, enums):
    """SET_ROWS (ggml_set_rows / ggml_compute_forward_set_rows, ops.cpp): src0 rows written
    into src2 (the result is a view of it) at the ids (I64 or I32) of src1, converted with the
    result type's from_float. src0 is F32 (F16 too since ggml 0.20).

    Empty sources are fine (`base.empty_sources_ok`; test-backend-ops sets 0 rows): the kernel
    loops over src0's rows only, and ids without elements mean src0 has none (ids ne0 is src0's
    ne1; their ne1, ne2 are checked > 0), so nothing is read or written."""
    b, c, a = need(node, srcs, 3)
    if node.ne != a.ne or node.nb != a.nb or node.type_name != a.type_name:
        fail(node, "result is not a view of src2")
    if (
        a.ne[0] != b.ne[0]
        or a.ne[2] != b.ne[2]
        or a.ne[3] != b.ne[3]
        or b.ne[1] != c.ne[0]
        or c.ne[1] == 0
        or c.ne[2] == 0
        or b.ne[2] % c.ne[1]
        or b.ne[3] % c.ne[2]
        or c.ne[3] != 1
    ):
        fail(node, f"set_rows of {b.ne} into {a.ne} at {c.ne}")
    src_types = ("F32", "F16") if Feature.SET_ROWS_F16 in enums.features else ("F32",)
    if b.type_name not in src_types or a.type_name not in enums.from_float:
        fail(node, f"types {b.type_name} -> {a.type_name}")
    if not (a.rows_contiguous() and b.rows_contiguous()):
        fail(node, "rows are not contiguous")
    if b.type_name == "F16" and a.type_name != "F16" and b.ne[1] > 1:
        # Each thread converts a row into F32 at work + (ne00 + 16) * ith floats, but the
        # graph plan sizes the work buffer for one task (4 * ne00 bytes): on several threads
        # (any multi-task node in the graph) thread 1 writes past it.
        node.one_thread = True
    check_row_ids(node, c, a.ne[1])


def _add_id(node, srcs, _enums=None):
    """ggml_add_id / ggml_compute_forward_add_id (ops.cpp): F32 src0 [n, n_used, n_tokens, ...]
    plus, for each row (i1, i2), row ids[i1, i2] of F32 src1; I32 ids [n_used, n_tokens] read
    at their nb; every row of elements (GGML_ASSERTed)."""
    a, b, ids = need(node, srcs, 3)
    if a.ne[0] != b.ne[0] or a.ne[1] != ids.ne[0] or a.ne[2] != ids.ne[1]:
        fail(node, f"add_id of {a.ne}, {b.ne} at {ids.ne}")
    if node.ne != a.ne:
        fail(node, f"shape {node.ne} differs from src0 {a.ne}")
    if not (node.type_name == a.type_name == b.type_name == "F32"):
        fail(node, "F32 only")
    if not (a.rows_contiguous() and b.rows_contiguous() and node.rows_contiguous()):
        fail(node, "rows are not contiguous")
    int_rows(node, a.nrows(), "src0's rows")
    check_row_ids(node, ids, b.ne[1], ("I32",))


RULES: Dict[str, Rule] = {
    "MUL_MAT": _mul_mat,
    "MUL_MAT_ID": _mul_mat_id,
    "OUT_PROD": _out_prod,
    "GET_ROWS": _get_rows,
    "GET_ROWS_BACK": _get_rows_back,
    "SET_ROWS": _set_rows,
    "ADD_ID": _add_id,
}
