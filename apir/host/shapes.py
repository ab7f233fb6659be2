"""Per-op shape checks: what ggml's constructors and CPU kernels assume, checked first.

Theory of operation: a graph node's ne/nb/type come from the guest. ggml's constructors
(`ggml_add`, `ggml_mul_mat`, ...) would derive them from the sources, and its CPU kernels
trust that they did: a lying shape walks a kernel out of its tensors, and a violated
GGML_ASSERT aborts the whole host. So before compute, every node goes through the rule of
its op here, which re-derives the node's shape from its sources (the constructor's
arithmetic) and checks the constructor's and kernel's assertions on types and strides.
An op with no rule here is refused: the host computes only what it can check.

Each rule takes the op name, the node and its sources as `TensorInfo` and raises Refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from apir.host.errors import Refused

__all__ = ["TensorInfo", "check_node", "CHECKED_OPS"]


@dataclass
class TensorInfo:
    """What a rule needs of one tensor: its index in the graph, fields, and element sizes."""

    index: int
    type_name: str
    ne: List[int]
    nb: List[int]
    op_name: str
    op_params: np.ndarray
    type_size: int
    blck_size: int
    is_leaf: bool  # op NONE: its data is only what the guest wrote
    address: int  # real address of its data (for GET_ROWS row ids); 0 without data

    def nelements(self) -> int:
        return int(np.prod(self.ne, dtype=object))

    def rows_contiguous(self) -> bool:
        return self.nb[0] == self.type_size

    def contiguous(self) -> bool:
        expect = self.type_size
        if self.nb[0] != expect:
            return False
        expect = self.type_size * (self.ne[0] // self.blck_size)
        for i in range(1, len(self.ne)):
            if self.ne[i] != 1 and self.nb[i] != expect:
                return False
            expect *= self.ne[i]
        return True


_FLOAT = ("F32", "F16", "BF16")


def _need(node: TensorInfo, srcs: Sequence[Optional[TensorInfo]], n: int) -> List[TensorInfo]:
    got = list(srcs[:n])
    if len(got) < n or any(s is None for s in got):
        raise Refused(f"node {node.index} ({node.op_name}) needs {n} sources")
    return got  # type: ignore[return-value]


def _fail(node: TensorInfo, why: str) -> None:
    raise Refused(f"node {node.index} ({node.op_name}): {why}")


def _same_shape(node: TensorInfo, a: TensorInfo, what: str) -> None:
    if node.ne != a.ne:
        _fail(node, f"shape {node.ne} differs from {what} {a.ne}")


def _dst_contiguous(node: TensorInfo) -> None:
    if not node.contiguous():
        _fail(node, f"destination is not contiguous (nb {node.nb})")


def _binary(node, srcs):
    a, b = _need(node, srcs, 2)
    _same_shape(node, a, "src0")
    if any(b.ne[i] == 0 or a.ne[i] % b.ne[i] for i in range(len(a.ne))):
        _fail(node, f"src1 {b.ne} cannot be repeated to src0 {a.ne}")
    if a.type_name not in _FLOAT or node.type_name != a.type_name or b.type_name not in ("F32", a.type_name):
        _fail(node, f"types {a.type_name}, {b.type_name} -> {node.type_name}")
    if not (a.rows_contiguous() and b.rows_contiguous()):
        _fail(node, "sources' rows are not contiguous")
    _dst_contiguous(node)


def _mul_mat(node, srcs):
    a, b = _need(node, srcs, 2)
    if a.ne[0] != b.ne[0]:
        _fail(node, f"ne[0] of src0 ({a.ne[0]}) and src1 ({b.ne[0]}) differ")
    if a.ne[2] == 0 or a.ne[3] == 0 or b.ne[2] % a.ne[2] or b.ne[3] % a.ne[3]:
        _fail(node, f"src0 {a.ne} cannot be broadcast to src1 {b.ne}")
    if node.ne != [a.ne[1], b.ne[1], b.ne[2], b.ne[3]]:
        _fail(node, f"shape {node.ne}, mul_mat of {a.ne} and {b.ne} gives "
                    f"{[a.ne[1], b.ne[1], b.ne[2], b.ne[3]]}")
    if b.type_name != "F32" or node.type_name != "F32":
        _fail(node, f"src1 {b.type_name} and result {node.type_name} must be F32")
    if a.type_name not in _FLOAT and a.blck_size == 1:
        _fail(node, f"src0 type {a.type_name} has no dot product")
    if not (a.rows_contiguous() and b.rows_contiguous()):
        _fail(node, "sources' rows are not contiguous")
    _dst_contiguous(node)


def _soft_max(node, srcs):
    (a,) = _need(node, srcs, 1)
    _same_shape(node, a, "src0")
    if a.type_name != "F32" or node.type_name != "F32":
        _fail(node, "soft_max computes F32 only")
    if len(srcs) > 2 and srcs[2] is not None:
        _fail(node, "attention sinks (src2) are not supported by this host")
    mask = srcs[1] if len(srcs) > 1 else None
    if mask is not None:
        if mask.type_name not in ("F32", "F16") or not mask.contiguous():
            _fail(node, "mask must be contiguous F32 or F16")
        if (mask.ne[0] != a.ne[0] or mask.ne[1] < a.ne[1] or mask.ne[2] == 0 or mask.ne[3] == 0
                or a.ne[2] % mask.ne[2] or a.ne[3] % mask.ne[3]):
            _fail(node, f"mask {mask.ne} does not fit src0 {a.ne}")
    if not a.contiguous():
        _fail(node, "src0 is not contiguous")
    _dst_contiguous(node)


def _same_f32(node, srcs):
    (a,) = _need(node, srcs, 1)
    _same_shape(node, a, "src0")
    if a.type_name != "F32" or node.type_name != "F32":
        _fail(node, "F32 only")
    if not a.rows_contiguous():
        _fail(node, "src0's rows are not contiguous")
    _dst_contiguous(node)


def _scale(node, srcs):
    _same_f32(node, srcs)
    if not srcs[0].contiguous():
        _fail(node, "src0 is not contiguous")


def _unary(node, srcs, unary_count: int):
    (a,) = _need(node, srcs, 1)
    if not 0 <= int(node.op_params[0]) < unary_count:
        _fail(node, f"unary op {int(node.op_params[0])} out of range")
    _same_shape(node, a, "src0")
    if a.type_name not in ("F32", "F16") or node.type_name != a.type_name:
        _fail(node, f"types {a.type_name} -> {node.type_name}")
    if not a.rows_contiguous():
        _fail(node, "src0's rows are not contiguous")
    _dst_contiguous(node)


def _copy_types(node, src: TensorInfo, dst: TensorInfo):
    if src.nelements() != dst.nelements():
        _fail(node, f"{src.nelements()} elements copied into {dst.nelements()}")
    if src.type_name not in _FLOAT:
        _fail(node, f"cannot convert from {src.type_name}")
    if dst.type_name not in _FLOAT:
        if src.type_name != "F32" or not (src.contiguous() and dst.contiguous()) or dst.type_name.startswith("IQ"):
            _fail(node, f"cannot convert {src.type_name} to {dst.type_name} here")


def _cpy(node, srcs):
    a, b = _need(node, srcs, 2)
    if node.ne != b.ne or node.nb != b.nb or node.type_name != b.type_name:
        _fail(node, "result is not a view of src1")
    _copy_types(node, a, b)


def _dup(node, srcs):
    (a,) = _need(node, srcs, 1)
    _copy_types(node, a, node)
    _dst_contiguous(node)


def _get_rows(node, srcs):
    a, b = _need(node, srcs, 2)
    if b.type_name != "I32" or b.ne[3] != 1 or a.ne[2] != b.ne[1] or a.ne[3] != b.ne[2]:
        _fail(node, f"rows {b.type_name} {b.ne} do not index src0 {a.ne}")
    if node.ne != [a.ne[0], b.ne[0], b.ne[1], b.ne[2]]:
        _fail(node, f"shape {node.ne}, get_rows gives {[a.ne[0], b.ne[0], b.ne[1], b.ne[2]]}")
    if node.type_name != "F32" or (a.type_name not in _FLOAT and a.blck_size == 1):
        _fail(node, f"types {a.type_name} -> {node.type_name}")
    if not (a.rows_contiguous() and b.contiguous()):
        _fail(node, "sources are not contiguous")
    # The CPU kernel asserts each row id is in range: an id out of range aborts the host.
    # Ids are checked here, which needs them to be guest-written input, not computed.
    if not b.is_leaf or not b.address:
        _fail(node, "row ids must be an input tensor of the graph")
    n = b.nelements()
    if n:
        import ctypes

        ids = np.frombuffer((ctypes.c_int32 * n).from_address(b.address), dtype=np.int32)
        if ids.min() < 0 or ids.max() >= a.ne[1]:
            _fail(node, f"row id out of [0, {a.ne[1]})")
    _dst_contiguous(node)


def _view(node, srcs):
    _need(node, srcs, 1)  # data within the source is checked with the view_src


def _reshape(node, srcs):
    (a,) = _need(node, srcs, 1)
    if node.nelements() != a.nelements():
        _fail(node, f"{node.nelements()} elements reshaped from {a.nelements()}")


def _leaf(node, srcs):
    pass


CHECKED_OPS: Dict[str, Callable] = {
    "NONE": _leaf, "ADD": _binary, "SUB": _binary, "MUL": _binary, "DIV": _binary,
    "MUL_MAT": _mul_mat, "SOFT_MAX": _soft_max, "SCALE": _scale, "NORM": _same_f32,
    "RMS_NORM": _same_f32, "CPY": _cpy, "DUP": _dup, "CONT": _dup, "GET_ROWS": _get_rows,
    "VIEW": _view, "PERMUTE": _view, "TRANSPOSE": _view, "RESHAPE": _reshape,
}


def check_node(node: TensorInfo, srcs: Sequence[Optional[TensorInfo]], unary_count: int) -> None:
    """Raises Refused unless `node` is what ggml would build from `srcs`."""
    if node.op_name == "UNARY":
        _unary(node, srcs, unary_count)
        return
    rule = CHECKED_OPS.get(node.op_name)
    if rule is None:
        raise Refused(f"node {node.index}: op {node.op_name} has no shape check on this host")
    rule(node, srcs)
