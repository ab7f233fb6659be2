"""Rules of the ops that write into (a copy of) a tensor or build one from a tensor's values:
ACC, SET, CUMSUM, FILL, DIAG, TRI, SOLVE_TRI."""

from __future__ import annotations

from typing import Dict

from apir.ggml.features import Feature
from apir.host.graph.shapes.base import (
    Rule,
    TensorInfo,
    fail,
    int_rows,
    need,
    param_i32,
    same_shape,
)

_INT_MAX = 0x7FFFFFFF

# ggml 0.20's fill has an F16 kernel; 0.10's writes F32 into whatever the result is.
# (Feature.FILL_F16, apir.ggml.features)


def _int_sized(node, *tensors: TensorInfo) -> None:
    """These kernels count elements and rows in `int`: keep every ne and row count in range."""
    for t in tensors:
        if any(n > _INT_MAX for n in t.ne) or t.nrows() > _INT_MAX:
            fail(node, f"tensor {t.index} {t.ne} is too large for the kernel's int counts")


def _nbytes_contiguous(t: TensorInfo) -> int:
    return t.nelements() * t.type_size // t.blck_size


def _viewed_region(node, a: TensorInfo, b: TensorInfo, elem_types) -> None:
    """ACC and SET (ggml_compute_forward_acc_f32 / set_f32 / set_i32): src0 and the result are
    contiguous of one shape (GGML_ASSERTed); the result starts as a copy of src0 (one memcpy
    of ggml_nbytes unless op_params[4], in place); src1's rows (nb10 == 4, GGML_ASSERTed) are
    then written at `offset + i1*nb1 + i2*nb2 + i3*nb3` of the result (and, ACC, read at the
    same place of src0), with nb1, nb2, nb3 and offset the int32 op_params[0..3] taken as
    size_t. The kernels only assert the last element's *start* is inside ggml_nbytes; the rule
    needs its end inside (and the op_params >= 0: a negative one would wrap)."""
    same_shape(node, a, "src0")
    if a.type_name not in elem_types or node.type_name != a.type_name:
        fail(node, f"types {a.type_name} -> {node.type_name}")
    if not (a.contiguous() and node.contiguous()):
        fail(node, "src0 and the result must be contiguous")
    if b.nelements() > a.nelements():  # the constructors' assertion
        fail(node, f"src1 {b.ne} has more elements than src0 {a.ne}")
    if b.nb[0] != 4 or b.type_size != 4 or b.blck_size != 1:
        fail(node, f"src1 must be rows of 4-byte elements, not {b.type_name} nb {b.nb}")
    _int_sized(node, b)
    int_rows(node, b.nrows(), "src1's rows")  # split among threads
    nb1, nb2, nb3, offset = (param_i32(node, i) for i in range(4))
    if min(nb1, nb2, nb3, offset) < 0:
        fail(node, f"negative strides or offset {[nb1, nb2, nb3, offset]}")
    last = [max(n - 1, 0) for n in b.ne]  # the kernels' im0..im3 (0 for an empty dim)
    end = offset + last[0] * 4 + last[1] * nb1 + last[2] * nb2 + last[3] * nb3 + 4
    if end > _nbytes_contiguous(node):
        fail(
            node,
            f"src1 {b.ne} at offset {offset} strides {[nb1, nb2, nb3]} ends at byte {end}, "
            f"past the result's {_nbytes_contiguous(node)}",
        )


def _acc(node, srcs, _enums=None):
    """ACC: ggml_acc_impl (src0, src1 F32; src0 contiguous) and ggml_compute_forward_acc_f32."""
    a, b = need(node, srcs, 2)
    if b.type_name != "F32":
        fail(node, f"src1 must be F32, not {b.type_name}")
    _viewed_region(node, a, b, ("F32",))


def _set(node, srcs, _enums=None):
    """SET: ggml_set_impl (offset < 2**30) and ggml_compute_forward_set_f32 / _i32 (src0 F32 or
    I32; src1 copied as 4-byte elements)."""
    a, b = need(node, srcs, 2)
    _viewed_region(node, a, b, ("F32", "I32"))
    if param_i32(node, 3) >= 1 << 30:
        fail(node, f"offset {param_i32(node, 3)} >= 2**30")


def _cumsum(node, srcs, _enums=None):
    """CUMSUM: ggml_cumsum (F32, result of src0's shape) and ggml_compute_forward_cumsum_f32
    (GGML_ASSERTs nb0 and nb00 are 4 and the shapes; rows walked with each tensor's nb)."""
    (a,) = need(node, srcs, 1)
    same_shape(node, a, "src0")
    if a.type_name != "F32" or node.type_name != "F32":
        fail(node, f"types {a.type_name} -> {node.type_name}: F32 only")
    if a.nb[0] != 4 or node.nb[0] != 4:
        fail(node, f"nb[0] {a.nb[0]} -> {node.nb[0]}: elements must be packed")
    _int_sized(node, a)


def _fill(node, srcs, enums):
    """FILL: ggml_fill_impl (src0 F32 or F16, contiguous; the result is its copy or view) and
    ggml_compute_forward_fill (writes packed rows of the result at its nb[1..3]; F16 since
    ggml 0.20, where 0.10 writes F32 whatever the type)."""
    (a,) = need(node, srcs, 1)
    same_shape(node, a, "src0")
    types = ("F32", "F16") if Feature.FILL_F16 in enums.features else ("F32",)
    if a.type_name not in types or node.type_name != a.type_name:
        fail(node, f"types {a.type_name} -> {node.type_name}")
    if not (a.contiguous() and node.contiguous()):
        fail(node, "src0 and the result must be contiguous")


def _diag(node, srcs, _enums=None):
    """DIAG: ggml_diag (src0 [n, 1, ne2, ne3] gives [n, n, ne2, ne3] of its type) and
    ggml_compute_forward_diag_f32 (F32; GGML_ASSERTs the shapes and nb0 == nb00 == 4)."""
    (a,) = need(node, srcs, 1)
    want = [a.ne[0], a.ne[0], a.ne[2], a.ne[3]]
    if a.ne[1] != 1 or node.ne != want:
        fail(node, f"shape {node.ne}: diag of {a.ne} gives {want} (src0 ne[1] must be 1)")
    if a.type_name != "F32" or node.type_name != "F32":
        fail(node, f"types {a.type_name} -> {node.type_name}: F32 only")
    if a.nb[0] != 4 or node.nb[0] != 4:
        fail(node, f"nb[0] {a.nb[0]} -> {node.nb[0]}: elements must be packed")
    _int_sized(node, node)


_TRI_TYPES = range(4)  # enum ggml_tri_type (UPPER_DIAG .. LOWER); others GGML_ABORT


def _tri(node, srcs, _enums=None):
    """TRI: ggml_tri (F32, contiguous, square) and ggml_compute_forward_tri_f32
    (GGML_ASSERTs src0 contiguous; writes packed rows of the result at its nb[1..3])."""
    (a,) = need(node, srcs, 1)
    same_shape(node, a, "src0")
    if a.type_name != "F32" or node.type_name != "F32":
        fail(node, f"types {a.type_name} -> {node.type_name}: F32 only")
    if a.ne[0] != a.ne[1]:
        fail(node, f"src0 {a.ne} is not square")
    if not a.contiguous():
        fail(node, "src0 is not contiguous")
    if param_i32(node, 0) not in _TRI_TYPES:
        fail(node, f"tri type {param_i32(node, 0)}")
    _int_sized(node, a)


def _solve_tri(node, srcs, _enums=None):
    """SOLVE_TRI: ggml_solve_tri (A [n, n, B2, B3] and B [k, n, B2, B3], both F32 and
    contiguous; the result is a new F32 tensor of B's shape) and
    ggml_compute_forward_solve_tri_f32, which indexes A, B and the result as packed matrices
    (`A[i * n + t]`, `B[i * k + j]`) and only its batches by nb[2], nb[3]."""
    a, b = need(node, srcs, 2)
    if a.type_name != "F32" or b.type_name != "F32" or node.type_name != "F32":
        fail(node, f"types {a.type_name}, {b.type_name} -> {node.type_name}: F32 only")
    if a.ne[0] != a.ne[1] or a.ne[1] != b.ne[1] or a.ne[2:] != b.ne[2:]:
        fail(node, f"A {a.ne} is not square or does not match B {b.ne}")
    same_shape(node, b, "src1")
    if not (a.contiguous() and b.contiguous() and node.contiguous()):
        fail(node, "A, B and the result must be contiguous")


RULES: Dict[str, Rule] = {
    "ACC": _acc,
    "SET": _set,
    "CUMSUM": _cumsum,
    "FILL": _fill,
    "DIAG": _diag,
    "TRI": _tri,
    "SOLVE_TRI": _solve_tri,
}
