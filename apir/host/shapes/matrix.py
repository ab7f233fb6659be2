"""Rules of the matrix and row-indexing ops: MUL_MAT, GET_ROWS, SET_ROWS."""

from __future__ import annotations

from apir.host.shapes.base import FLOAT, check_row_ids, dst_contiguous, fail, need


def _mul_mat(node, srcs, _enums=None):
    a, b = need(node, srcs, 2)
    if a.ne[0] != b.ne[0]:
        fail(node, f"ne[0] of src0 ({a.ne[0]}) and src1 ({b.ne[0]}) differ")
    if a.ne[2] == 0 or a.ne[3] == 0 or b.ne[2] % a.ne[2] or b.ne[3] % a.ne[3]:
        fail(node, f"src0 {a.ne} cannot be broadcast to src1 {b.ne}")
    if node.ne != [a.ne[1], b.ne[1], b.ne[2], b.ne[3]]:
        fail(node, f"shape {node.ne}, mul_mat of {a.ne} and {b.ne} gives "
                    f"{[a.ne[1], b.ne[1], b.ne[2], b.ne[3]]}")
    if b.type_name != "F32" or node.type_name != "F32":
        fail(node, f"src1 {b.type_name} and result {node.type_name} must be F32")
    if a.type_name not in FLOAT and a.blck_size == 1:
        fail(node, f"src0 type {a.type_name} has no dot product")
    if not (a.rows_contiguous() and b.rows_contiguous()):
        fail(node, "sources' rows are not contiguous")
    dst_contiguous(node)


def _get_rows(node, srcs, _enums=None):
    a, b = need(node, srcs, 2)
    if b.type_name != "I32" or b.ne[3] != 1 or a.ne[2] != b.ne[1] or a.ne[3] != b.ne[2]:
        fail(node, f"rows {b.type_name} {b.ne} do not index src0 {a.ne}")
    if node.ne != [a.ne[0], b.ne[0], b.ne[1], b.ne[2]]:
        fail(node, f"shape {node.ne}, get_rows gives {[a.ne[0], b.ne[0], b.ne[1], b.ne[2]]}")
    if node.type_name != "F32" or (a.type_name not in FLOAT and a.blck_size == 1):
        fail(node, f"types {a.type_name} -> {node.type_name}")
    if not (a.rows_contiguous() and b.contiguous()):
        fail(node, "sources are not contiguous")
    check_row_ids(node, b, a.ne[1])
    dst_contiguous(node)


def _set_rows(node, srcs, _enums=None):
    """SET_ROWS: src0 rows written into src2 (the result is a view of it) at the ids of src1."""
    b, c, a = need(node, srcs, 3)
    if node.ne != a.ne or node.nb != a.nb or node.type_name != a.type_name:
        fail(node, "result is not a view of src2")
    if (a.ne[0] != b.ne[0] or a.ne[2] != b.ne[2] or a.ne[3] != b.ne[3] or b.ne[1] != c.ne[0]
            or c.ne[1] == 0 or c.ne[2] == 0 or b.ne[2] % c.ne[1] or b.ne[3] % c.ne[2] or c.ne[3] != 1):
        fail(node, f"set_rows of {b.ne} into {a.ne} at {c.ne}")
    if b.type_name not in ("F32", "F16") or a.type_name not in _SET_ROWS_DST:
        fail(node, f"types {b.type_name} -> {a.type_name}")
    if not (a.rows_contiguous() and b.rows_contiguous()):
        fail(node, "rows are not contiguous")
    check_row_ids(node, c, a.ne[1])


_SET_ROWS_DST = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL")


RULES = {
    "MUL_MAT": _mul_mat, "GET_ROWS": _get_rows, "SET_ROWS": _set_rows,
}
