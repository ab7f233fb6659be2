"""Per-op shape checks: what ggml's constructors and CPU kernels assume, checked first.

Theory of operation: a graph node's ne/nb/type come from the guest. ggml's constructors
(`ggml_add`, `ggml_mul_mat`, ...) would derive them from the sources, and its CPU kernels
trust that they did: a lying shape walks a kernel out of its tensors, and a violated
GGML_ASSERT aborts the whole host. So before compute, every node goes through the rule of
its op here, which re-derives the node's shape from its sources (the constructor's
arithmetic) and checks the constructor's and kernel's assertions on types and strides.
An op with no rule here is refused: the host computes only what it can check.

Each rule takes the node and its sources as `TensorInfo` (and the build's enum sizes,
`OpEnums`) and raises Refused. Rules are keyed by op name: an op this ggml build lacks simply
has no rule. Where ggml only `assert`s (compiled out in release builds) the rule still
checks, and a rule may be stricter than ggml (e.g. rows packed where ggml would accept a
gap) when that is what keeps the kernel's pointer arithmetic inside the checked extents:
every tensor's extent (ne, nb) is already checked against its buffer by the caller, so what
a rule must prove is that the kernel walks each tensor only within its own ne and nb.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Callable, Dict, FrozenSet, List, Optional, Sequence

import numpy as np

from apir.host.errors import Refused


@dataclass(frozen=True)
class OpEnums:
    """Facts of the loaded ggml build the rules need: sizes of the enums some ops carry in
    op_params, which types its CPU backend converts rows of F32 into and out of, and its
    version."""

    unary_count: int
    glu: Dict[str, int] = field(default_factory=dict)  # `enum ggml_glu_op`, COUNT included
    rope: Dict[str, int] = field(default_factory=dict)  # the GGML_ROPE_TYPE_* modes
    # types whose `ggml_type_traits_cpu.from_float` is set (CPY / DUP into them; without it
    # the CPU kernel aborts)
    from_float: FrozenSet[str] = frozenset()
    # quantized types whose `ggml_type_traits.to_float` is set (CPY from them into F32)
    to_float: FrozenSet[str] = frozenset()
    version: tuple = (0, 0, 0)  # ggml_version(), for kernels that changed between versions

    @property
    def glu_count(self) -> int:
        return self.glu.get("COUNT", 0)  # 0: this build has no GLU (GLU nodes are refused)


def op_enums(g) -> OpEnums:
    """`OpEnums` of build `g`, from its ggml.h (`enum ggml_unary_op`, `enum ggml_glu_op`,
    `#define GGML_ROPE_TYPE_*`), `ggml_get_type_traits_cpu` (whose first field is
    `from_float`), `ggml_get_type_traits` (`to_float`) and `ggml_version`."""
    import re

    from apir.ggml.lib import _parse_enum

    text = (g.include_dir / "ggml.h").read_text()
    unary = _parse_enum(text, "ggml_unary_op", "GGML_UNARY_OP_")["COUNT"]
    glu = _parse_enum(text, "ggml_glu_op", "GGML_GLU_OP_") if "enum ggml_glu_op" in text else {}
    rope = {m.group(1): int(m.group(2)) for m in re.finditer(r"#\s*define\s+GGML_ROPE_TYPE_(\w+)\s+(\d+)", text)}
    from_float, to_float = set(), set()
    for t, name in g.type_names.items():
        traits = g.ggml_get_type_traits_cpu(t)
        if traits and ctypes.c_void_p.from_address(traits).value:
            from_float.add(name)
        base = _TypeTraits.from_address(g.ggml_get_type_traits(t))
        # The mirrored layout is trusted only where it reads back what ggml reports.
        if (base.is_quantized and base.to_float and base.blck_size == g.ggml_blck_size(t)
                and base.type_size == g.ggml_type_size(t)):
            to_float.add(name)
    version = tuple(int(x) for x in re.findall(r"\d+", g.ggml_version().decode())[:3])
    return OpEnums(unary, glu, rope, frozenset(from_float), frozenset(to_float), version)


class _TypeTraits(ctypes.Structure):
    """`struct ggml_type_traits` (ggml.h, the same in ggml 0.10 and 0.20)."""

    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]


__all__ = ["TensorInfo", "OpEnums", "op_enums", "check_node", "node_refusal", "CHECKED_OPS"]


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
    # real address of its data (for GET_ROWS row ids); 0 without data; None where no data is
    # known (device_supports_op): checks of the data are then left to graph_compute
    address: Optional[int]

    def nelements(self) -> int:
        return int(np.prod(self.ne, dtype=object))

    def rows_contiguous(self) -> bool:
        return self.nb[0] == self.type_size

    def rows_packed(self) -> bool:
        """ggml_is_contiguous_1 with nb[0] == the element size: rows may have gaps, but a
        kernel that walks all rows as `i * nb[1]` stays on the tensor's rows."""
        if self.nb[0] != self.type_size:
            return False
        expect = self.ne[1] * self.nb[1]
        for i in range(2, len(self.ne)):
            if self.ne[i] != 1 and self.nb[i] != expect:
                return False
            expect *= self.ne[i]
        return True

    def is_scalar(self) -> bool:
        return all(n == 1 for n in self.ne)

    def nrows(self) -> int:
        return int(np.prod(self.ne[1:], dtype=object))

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


def _param_i32(node: TensorInfo, i: int) -> int:
    return int(np.asarray(node.op_params, dtype=np.int32)[i])


def _param_f32(node: TensorInfo, i: int) -> float:
    return float(np.asarray(node.op_params, dtype=np.int32)[i : i + 1].view(np.float32)[0])


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


def _binary(node, srcs, _enums=None):
    a, b = _need(node, srcs, 2)
    _same_shape(node, a, "src0")
    if any(b.ne[i] == 0 or a.ne[i] % b.ne[i] for i in range(len(a.ne))):
        _fail(node, f"src1 {b.ne} cannot be repeated to src0 {a.ne}")
    if a.type_name not in _FLOAT or node.type_name != a.type_name or b.type_name not in ("F32", a.type_name):
        _fail(node, f"types {a.type_name}, {b.type_name} -> {node.type_name}")
    # apply_binary_op GGML_ASSERTs src0's (and dst's) nb[0] is the element size; src1 is read
    # at i10 * nb10 within its own ne and nb, so any src1 strides stay inside its extent.
    if not a.rows_contiguous():
        _fail(node, "src0's rows are not contiguous")
    _dst_contiguous(node)


def _mul_mat(node, srcs, _enums=None):
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


def _soft_max(node, srcs, _enums=None):
    (a,) = _need(node, srcs, 1)
    _same_shape(node, a, "src0")
    if a.type_name != "F32" or node.type_name != "F32":
        _fail(node, "soft_max computes F32 only")
    mask = srcs[1] if len(srcs) > 1 else None
    if mask is not None:
        if mask.type_name not in ("F32", "F16") or not mask.contiguous():
            _fail(node, "mask must be contiguous F32 or F16")
        if (mask.ne[0] != a.ne[0] or mask.ne[1] < a.ne[1] or mask.ne[2] == 0 or mask.ne[3] == 0
                or a.ne[2] % mask.ne[2] or a.ne[3] % mask.ne[3]):
            _fail(node, f"mask {mask.ne} does not fit src0 {a.ne}")
    sinks = srcs[2] if len(srcs) > 2 else None
    if sinks is not None:
        # ggml_soft_max_add_sinks: one F32 per head (ne[2]), read as a plain array
        if sinks.type_name != "F32" or sinks.ne[0] != a.ne[2] or not sinks.rows_contiguous():
            _fail(node, f"sinks {sinks.type_name} {sinks.ne} do not fit src0 {a.ne}")
    if _param_f32(node, 1) > 0.0 and mask is None:
        _fail(node, "max_bias needs a mask")
    if not a.contiguous():
        _fail(node, "src0 is not contiguous")
    _dst_contiguous(node)


def _same_f32(node, srcs, _enums=None):
    (a,) = _need(node, srcs, 1)
    _same_shape(node, a, "src0")
    if a.type_name != "F32" or node.type_name != "F32":
        _fail(node, "F32 only")
    if not a.rows_contiguous():
        _fail(node, "src0's rows are not contiguous")
    _dst_contiguous(node)


def _norm(node, srcs, _enums=None):
    """NORM, RMS_NORM, L2_NORM: F32 rows; the kernels GGML_ASSERT(eps >= 0) (NaN fails it)."""
    (a,) = _need(node, srcs, 1)
    _same_shape(node, a, "src0")
    if a.type_name != "F32" or node.type_name != "F32":
        _fail(node, "F32 only")
    if not (a.rows_contiguous() and node.rows_contiguous()):
        _fail(node, "rows are not contiguous")
    if not _param_f32(node, 0) >= 0.0:
        _fail(node, f"eps {_param_f32(node, 0)} is not >= 0")


def _scale(node, srcs, _enums=None):
    _same_f32(node, srcs)
    if not srcs[0].contiguous():
        _fail(node, "src0 is not contiguous")


def _unary(node, srcs, enums):
    (a,) = _need(node, srcs, 1)
    if not 0 <= int(node.op_params[0]) < enums.unary_count:
        _fail(node, f"unary op {int(node.op_params[0])} out of range")
    _same_shape(node, a, "src0")
    if a.type_name not in ("F32", "F16") or node.type_name != a.type_name:
        _fail(node, f"types {a.type_name} -> {node.type_name}")
    # Every unary kernel walks rows at i1*nb01 + i2*nb02 + i3*nb03 and reads ne[0] elements
    # of each (apply_unary_op GGML_ASSERTs nb00 is the element size).
    if not a.rows_contiguous():
        _fail(node, "src0's rows are not contiguous")
    _dst_contiguous(node)


# Conversions ggml_compute_forward_dup_flt instantiates besides float to float.
_INT_CONVERSIONS = {("F32", "I32"), ("I32", "F32")}


def _copy_types(node, src: TensorInfo, dst: TensorInfo, enums: OpEnums, is_cpy: bool = False):
    if src.nelements() != dst.nelements():
        _fail(node, f"{src.nelements()} elements copied into {dst.nelements()}")
    if src.blck_size > 1 and dst.type_name == "F32" and is_cpy and src.type_name in enums.to_float:
        # ggml_compute_forward_dup_from_q (reads the result's layout from src1, so CPY only):
        # whole blocks dequantized to blck_size floats at a flat index mapped through the
        # result's ne/nb; GGML_ASSERTs nb[0] is 4 and rows hold whole blocks or it is contiguous.
        if not dst.rows_contiguous() or not (dst.ne[0] % src.blck_size == 0 or dst.contiguous()):
            _fail(node, f"{src.type_name} dequantized into F32 {dst.ne} nb {dst.nb}")
        return
    if src.type_name == dst.type_name:
        # ggml_compute_forward_dup_bytes: any type, each tensor walked within its ne and nb;
        # except that with a contiguous result and a source that is not, it copies
        # ne[0] * type_size bytes per row, i.e. blck_size times a quantized row: only the
        # same-shape row copy (both rows contiguous) is taken before that path.
        if (src.blck_size > 1 and dst.contiguous() and not src.contiguous()
                and not (src.ne == dst.ne and src.rows_contiguous() and dst.rows_contiguous())):
            _fail(node, f"{src.type_name} copy of a non-contiguous source into a contiguous result")
        return
    if (src.type_name, dst.type_name) in _INT_CONVERSIONS:
        return
    if src.type_name not in _FLOAT:
        _fail(node, f"cannot convert from {src.type_name}")
    if dst.type_name not in _FLOAT:
        # ggml_compute_forward_dup_to_q: dst contiguous, src rows of elements (nb00 == size),
        # each src row converted to F32 in a work buffer the graph plan sizes by the result's
        # ne[0] (so src ne[0] may not exceed it), then quantized as whole blocks.
        # (the work buffer exists only for a quantized result: ggml_is_quantized(node->type))
        if dst.blck_size == 1 or dst.type_name not in enums.from_float:
            _fail(node, f"cannot convert {src.type_name} to {dst.type_name} here")
        if not (src.rows_contiguous() and dst.contiguous()):
            _fail(node, f"copy into {dst.type_name} needs contiguous rows and a contiguous result")
        if src.ne[0] > dst.ne[0] or src.ne[0] % dst.blck_size:
            _fail(node, f"src0 rows of {src.ne[0]} do not fit {dst.type_name} rows of {dst.ne[0]}")


def _cpy(node, srcs, enums):
    a, b = _need(node, srcs, 2)
    if node.ne != b.ne or node.nb != b.nb or node.type_name != b.type_name:
        _fail(node, "result is not a view of src1")
    _copy_types(node, a, b, enums, is_cpy=True)


def _dup(node, srcs, enums):
    (a,) = _need(node, srcs, 1)
    _copy_types(node, a, node, enums)
    _dst_contiguous(node)


def _check_row_ids(node: TensorInfo, ids: TensorInfo, n_rows: int) -> None:
    """The CPU kernels GGML_ASSERT each row id is in [0, n_rows): an id out of range would
    abort the host. Ids are read here, which needs them to be guest-written input (a leaf
    with data), contiguous I32 or I64, not computed by the graph."""
    dtype = {"I32": np.int32, "I64": np.int64}.get(ids.type_name)
    if dtype is None or not ids.contiguous():
        _fail(node, f"row ids must be contiguous I32 or I64, not {ids.type_name} nb {ids.nb}")
    if not ids.is_leaf or ids.address == 0:
        _fail(node, "row ids must be an input tensor of the graph")
    n = ids.nelements() if ids.address is not None else 0
    if n:
        import ctypes

        raw = (ctypes.c_char * (n * np.dtype(dtype).itemsize)).from_address(ids.address)
        values = np.frombuffer(raw, dtype=dtype)
        if values.min() < 0 or values.max() >= n_rows:
            _fail(node, f"row id out of [0, {n_rows})")


def _get_rows(node, srcs, _enums=None):
    a, b = _need(node, srcs, 2)
    if b.type_name != "I32" or b.ne[3] != 1 or a.ne[2] != b.ne[1] or a.ne[3] != b.ne[2]:
        _fail(node, f"rows {b.type_name} {b.ne} do not index src0 {a.ne}")
    if node.ne != [a.ne[0], b.ne[0], b.ne[1], b.ne[2]]:
        _fail(node, f"shape {node.ne}, get_rows gives {[a.ne[0], b.ne[0], b.ne[1], b.ne[2]]}")
    if node.type_name != "F32" or (a.type_name not in _FLOAT and a.blck_size == 1):
        _fail(node, f"types {a.type_name} -> {node.type_name}")
    if not (a.rows_contiguous() and b.contiguous()):
        _fail(node, "sources are not contiguous")
    _check_row_ids(node, b, a.ne[1])
    _dst_contiguous(node)


def _view(node, srcs, _enums=None):
    _need(node, srcs, 1)  # data within the source is checked with the view_src


def _reshape(node, srcs, _enums=None):
    (a,) = _need(node, srcs, 1)
    if node.nelements() != a.nelements():
        _fail(node, f"{node.nelements()} elements reshaped from {a.nelements()}")


def _leaf(node, srcs, _enums=None):
    pass


# --- element-wise ----------------------------------------------------------------------------
# (src type, dst type) pairs the CPU's templated unary kernels (unary-ops.cpp) instantiate.
_UNARY_TYPES = {("F32", "F32"), ("F16", "F16"), ("BF16", "BF16"), ("BF16", "F32"), ("F16", "F32")}


def _elementwise(node, srcs, _enums=None):
    """SQR, SQRT, LOG, SIN, COS: same shape, each row walked with its own nb."""
    (a,) = _need(node, srcs, 1)
    _same_shape(node, a, "src0")
    if (a.type_name, node.type_name) not in _UNARY_TYPES:
        _fail(node, f"types {a.type_name} -> {node.type_name}")
    if not (a.rows_contiguous() and node.rows_contiguous()):
        _fail(node, "rows are not contiguous")


def _same_rows(node, srcs, types):
    """One source, same shape and type (one of `types`), and both walked as flat rows
    (`i * nb[1]` over all rows): CLAMP, LEAKY_RELU."""
    (a,) = _need(node, srcs, 1)
    _same_shape(node, a, "src0")
    if a.type_name not in types or node.type_name != a.type_name:
        _fail(node, f"types {a.type_name} -> {node.type_name}")
    if not (a.rows_packed() and node.rows_packed()):
        _fail(node, "rows are not packed")
    return a


def _clamp(node, srcs, _enums=None):
    _same_rows(node, srcs, ("F32", "F16"))


def _leaky_relu(node, srcs, _enums=None):
    _same_rows(node, srcs, ("F32", "F16"))


# ggml 0.20's norm and l2_norm read and write each element at i00 * nb[0] unless rows are
# packed (0.10's assert or assume packed rows).
_NORM_STRIDED_SINCE = (0, 20, 0)


def _strided_norm(node, srcs, enums):
    """NORM, L2_NORM: rows of any strides on ggml >= 0.20, else as `_norm`."""
    (a,) = _need(node, srcs, 1)
    if enums.version < _NORM_STRIDED_SINCE:
        return _norm(node, srcs)
    _same_shape(node, a, "src0")
    if a.type_name != "F32" or node.type_name != "F32":
        _fail(node, "F32 only")
    if not _param_f32(node, 0) >= 0.0:
        _fail(node, f"eps {_param_f32(node, 0)} is not >= 0")


def _group_norm(node, srcs, _enums=None):
    (a,) = _need(node, srcs, 1)
    _same_shape(node, a, "src0")
    if a.type_name != "F32" or node.type_name != "F32":
        _fail(node, "F32 only")
    if not (a.rows_contiguous() and node.rows_contiguous()):
        _fail(node, "rows are not contiguous")
    if _param_i32(node, 0) <= 0:  # the kernel divides by the group count
        _fail(node, f"n_groups {_param_i32(node, 0)} must be > 0")


def _add1(node, srcs, _enums=None):
    a, b = _need(node, srcs, 2)
    _same_shape(node, a, "src0")
    if not b.is_scalar():
        _fail(node, f"src1 {b.ne} is not a scalar")
    ok = {("F32", "F32"), ("F16", "F16"), ("F16", "F32"), ("BF16", "BF16"), ("BF16", "F32")}
    if (a.type_name, b.type_name) not in ok or node.type_name != a.type_name:
        _fail(node, f"types {a.type_name}, {b.type_name} -> {node.type_name}")
    if not (a.rows_contiguous() and node.rows_contiguous()):
        _fail(node, "rows are not contiguous")


def _diag_mask(node, srcs, _enums=None):
    """DIAG_MASK_INF / _ZERO: F32; the kernel copies src0 with one memcpy (both contiguous)
    unless in place, then writes `k * nb[2]` over ne[2]*ne[3] "matrices" (packed)."""
    (a,) = _need(node, srcs, 1)
    _same_shape(node, a, "src0")
    if a.type_name != "F32" or node.type_name != "F32":
        _fail(node, "F32 only")
    if not (a.contiguous() and node.contiguous()):
        _fail(node, "not contiguous")
    if _param_i32(node, 0) < 0:
        _fail(node, f"n_past {_param_i32(node, 0)} < 0")


# --- GLU ------------------------------------------------------------------------------------
def _glu(node, srcs, enums):
    """ggml_glu_impl: src0 (and src1 of the same shape) rows packed; the result has half of
    src0's ne[0] (or all of it with src1); rows are walked flat."""
    a = _need(node, srcs, 1)[0]
    b = srcs[1] if len(srcs) > 1 else None
    op = _param_i32(node, 0)
    if not 0 <= op < enums.glu_count:
        _fail(node, f"glu op {op} out of range")
    types = ("F32",) if op == enums.glu.get("SWIGLU_OAI") else ("F32", "F16")  # its kernel is F32 only
    if a.type_name not in types or node.type_name != a.type_name:
        _fail(node, f"types {a.type_name} -> {node.type_name}")
    if b is not None:
        if b.ne != a.ne or b.type_name != a.type_name or not b.rows_packed():
            _fail(node, f"src1 {b.type_name} {b.ne} does not match src0 {a.type_name} {a.ne}")
    want = [a.ne[0] if b is not None else a.ne[0] // 2] + a.ne[1:]
    if node.ne != want:
        _fail(node, f"shape {node.ne}, glu gives {want}")
    if not (a.rows_packed() and node.rows_packed()):
        _fail(node, "rows are not packed")


# --- reductions -----------------------------------------------------------------------------
def _sum(node, srcs, _enums=None):
    (a,) = _need(node, srcs, 1)
    if a.type_name not in _FLOAT or node.type_name != a.type_name or not node.is_scalar():
        _fail(node, f"sum of {a.type_name} gives a scalar of the same type, not {node.type_name} {node.ne}")
    # The kernel sums ne[0] packed elements from each row's start whatever nb[0] is (ggml only
    # asserts it); the checked extent includes a packed row at every row start
    # (TensorChecker.extent), so any strides stay inside the tensor, as ggml CPU computes it.


def _row_reduce(node, srcs, _enums=None):
    """SUM_ROWS, MEAN: F32, one value per row."""
    (a,) = _need(node, srcs, 1)
    if node.ne != [1] + a.ne[1:]:
        _fail(node, f"shape {node.ne}, expected {[1] + a.ne[1:]}")
    if a.type_name != "F32" or node.type_name != "F32":
        _fail(node, "F32 only")
    if not (a.rows_contiguous() and node.rows_contiguous()):
        _fail(node, "rows are not contiguous")


def _argmax(node, srcs, _enums=None):
    (a,) = _need(node, srcs, 1)
    if a.ne[2] != 1 or a.ne[3] != 1 or a.ne[0] > 0x7FFFFFFF:
        _fail(node, f"src0 {a.ne} is not a matrix")
    if node.ne != [a.ne[1], 1, 1, 1] or node.type_name != "I32" or a.type_name != "F32":
        _fail(node, f"argmax of F32 {a.ne} is I32 [{a.ne[1]}], not {node.type_name} {node.ne}")
    if not (a.rows_contiguous() and node.rows_contiguous()):
        _fail(node, "rows are not contiguous")


def _count_equal(node, srcs, _enums=None):
    a, b = _need(node, srcs, 2)
    if a.ne != b.ne or a.type_name != "I32" or b.type_name != "I32":
        _fail(node, f"sources {a.type_name} {a.ne} and {b.type_name} {b.ne} differ or are not I32")
    # The kernel's row index arithmetic is only right for matrices (ggml's test shapes).
    if a.ne[2] != 1 or a.ne[3] != 1:
        _fail(node, f"sources {a.ne} are not matrices")
    if node.type_name != "I64" or not node.is_scalar():
        _fail(node, "count_equal gives an I64 scalar")


# --- shape changers -------------------------------------------------------------------------
def _repeat(node, srcs, _enums=None):
    (a,) = _need(node, srcs, 1)
    if any(a.ne[i] == 0 or node.ne[i] % a.ne[i] for i in range(4)):
        _fail(node, f"src0 {a.ne} cannot be repeated to {node.ne}")
    if a.type_name not in ("F32", "I32", "F16", "BF16", "I16") or node.type_name != a.type_name:
        _fail(node, f"types {a.type_name} -> {node.type_name}")
    if not (a.rows_contiguous() and node.rows_contiguous()):
        _fail(node, "rows are not contiguous")


def _repeat_back(node, srcs, _enums=None):
    (a,) = _need(node, srcs, 1)
    if any(node.ne[i] == 0 or a.ne[i] % node.ne[i] for i in range(4)):
        _fail(node, f"{node.ne} cannot be repeated to src0 {a.ne}")
    if a.type_name != "F32" or node.type_name != "F32":
        _fail(node, "F32 only")
    if not (a.rows_contiguous() and node.rows_contiguous()):
        _fail(node, "rows are not contiguous")


# ggml 0.20's concat walks quantized rows block by block (ggml 0.10's walks them as elements,
# blck_size times past each row).
_CONCAT_BLOCKS_SINCE = (0, 20, 0)


def _concat(node, srcs, enums):
    a, b = _need(node, srcs, 2)
    dim = _param_i32(node, 0)
    if not 0 <= dim < 4:
        _fail(node, f"dim {dim} out of range")
    if a.type_name != b.type_name or node.type_name != a.type_name:
        _fail(node, f"types {a.type_name}, {b.type_name} -> {node.type_name}")
    if a.blck_size != 1:
        if enums.version < _CONCAT_BLOCKS_SINCE:
            _fail(node, f"this ggml cannot concatenate {a.type_name}")
        if not (a.rows_contiguous() and b.rows_contiguous()):  # GGML_ASSERTed
            _fail(node, "sources' rows are not contiguous")
    want = [a.ne[d] + b.ne[d] if d == dim else a.ne[d] for d in range(4)]
    if any(a.ne[d] != b.ne[d] for d in range(4) if d != dim) or node.ne != want:
        _fail(node, f"shape {node.ne}, concat of {a.ne} and {b.ne} on {dim} gives {want}")


def _pad(node, srcs, _enums=None):
    """PAD: F32; the result is written as one flat array, the source read where it lies."""
    (a,) = _need(node, srcs, 1)
    pads = [_param_i32(node, i) for i in range(8)]
    if any(p < 0 for p in pads):
        _fail(node, f"negative padding {pads}")
    want = [a.ne[d] + pads[2 * d] + pads[2 * d + 1] for d in range(4)]
    if node.ne != want:
        _fail(node, f"shape {node.ne}, pad gives {want}")
    if a.type_name != "F32" or node.type_name != "F32":
        _fail(node, "F32 only")
    if _param_i32(node, 8) and any(n == 0 for n in a.ne):
        _fail(node, "circular padding of an empty source")  # wraps modulo ne
    _dst_contiguous(node)


def _arange(node, srcs, _enums=None):
    """ARANGE: no source; the kernel asserts ne == ceilf((stop - start) / step) in float."""
    start, stop, step = (np.float32(_param_f32(node, i)) for i in range(3))
    if not (np.isfinite([start, stop, step]).all() and stop > start and step > 0):
        _fail(node, f"arange({start}, {stop}, {step})")
    with np.errstate(all="ignore"):
        steps = np.ceil(np.float32((stop - start) / step))
    if not np.isfinite(steps) or node.nelements() != int(steps) or node.type_name != "F32":
        _fail(node, f"{node.nelements()} elements, arange gives {steps}")
    _dst_contiguous(node)


def _timestep_embedding(node, srcs, _enums=None):
    (a,) = _need(node, srcs, 1)
    dim = _param_i32(node, 0)
    if dim < 0 or node.ne != [dim, a.ne[0], 1, 1]:
        _fail(node, f"shape {node.ne}, timestep_embedding gives {[dim, a.ne[0], 1, 1]}")
    if a.type_name != "F32" or node.type_name != "F32":
        _fail(node, "F32 only")
    if not (a.rows_contiguous() and node.rows_contiguous()):
        _fail(node, "rows are not contiguous")


def _argsort(node, srcs, _enums=None):
    (a,) = _need(node, srcs, 1)
    if node.ne != a.ne or node.type_name != "I32" or a.type_name != "F32":
        _fail(node, f"argsort of F32 {a.ne} is I32 of the same shape, not {node.type_name} {node.ne}")
    if _param_i32(node, 0) not in (0, 1):  # ASC, DESC; anything else aborts
        _fail(node, f"sort order {_param_i32(node, 0)}")
    if a.ne[0] > 0x7FFFFFFF or not (a.rows_packed() and node.rows_packed()):
        _fail(node, "rows are not packed")


def _top_k(node, srcs, _enums=None):
    (a,) = _need(node, srcs, 1)
    if node.ne[0] > a.ne[0] or node.ne[1:] != a.ne[1:]:
        _fail(node, f"shape {node.ne}: top_k of {a.ne}")
    if node.type_name != "I32" or a.type_name != "F32":
        _fail(node, f"types {a.type_name} -> {node.type_name}")
    if not (a.rows_packed() and node.rows_packed()):
        _fail(node, "rows are not packed")


def _set_rows(node, srcs, _enums=None):
    """SET_ROWS: src0 rows written into src2 (the result is a view of it) at the ids of src1."""
    b, c, a = _need(node, srcs, 3)
    if node.ne != a.ne or node.nb != a.nb or node.type_name != a.type_name:
        _fail(node, "result is not a view of src2")
    if (a.ne[0] != b.ne[0] or a.ne[2] != b.ne[2] or a.ne[3] != b.ne[3] or b.ne[1] != c.ne[0]
            or c.ne[1] == 0 or c.ne[2] == 0 or b.ne[2] % c.ne[1] or b.ne[3] % c.ne[2] or c.ne[3] != 1):
        _fail(node, f"set_rows of {b.ne} into {a.ne} at {c.ne}")
    if b.type_name not in ("F32", "F16") or a.type_name not in _SET_ROWS_DST:
        _fail(node, f"types {b.type_name} -> {a.type_name}")
    if not (a.rows_contiguous() and b.rows_contiguous()):
        _fail(node, "rows are not contiguous")
    _check_row_ids(node, c, a.ne[1])


def _rope(node, srcs, enums):
    """ROPE (ggml_rope_impl and the CPU's rope_flt): src0 F32/F16 with the result's shape,
    positions I32 (4 per row of ne[2] for the multi-section modes), optional F32 frequency
    factors. The kernel rotates pairs inside the first n_dims (or, in vision mode, both
    halves), copies the rest two at a time, and reads one frequency factor per pair of ne[0]."""
    a, pos = _need(node, srcs, 2)
    ff = srcs[2] if len(srcs) > 2 else None
    modes = enums.rope
    n_dims, mode = _param_i32(node, 1), _param_i32(node, 2)
    if not modes or mode not in modes.values():
        _fail(node, f"rope mode {mode} unknown")
    multi = bool(mode & modes.get("MROPE", 0))
    vision = mode == modes.get("VISION")
    _same_shape(node, a, "src0")
    if a.type_name not in ("F32", "F16") or node.type_name != a.type_name:
        _fail(node, f"types {a.type_name} -> {node.type_name}")
    if not (a.rows_contiguous() and node.rows_contiguous()):
        _fail(node, "rows are not contiguous")
    ne0 = a.ne[0]
    # Odd ne[0] would make the pairwise copy past n_dims read one element past the row.
    if ne0 % 2 or not 0 < n_dims <= ne0 or n_dims % 2 or (vision and n_dims != ne0 // 2):
        _fail(node, f"n_dims {n_dims} does not fit ne[0] {ne0} (mode {mode})")
    want = a.ne[2] * (4 if multi else 1)
    if pos.type_name != "I32" or pos.ne != [want, 1, 1, 1] or not pos.contiguous():
        _fail(node, f"positions {pos.type_name} {pos.ne}: need I32 [{want}]")
    if multi:
        sections = [_param_i32(node, 11 + i) for i in range(4)]
        if any(not 0 <= x <= ne0 for x in sections) or not 0 < sum(sections) <= ne0 or not any(sections[:3]):
            _fail(node, f"sections {sections} do not fit ne[0] {ne0}")
    if ff is not None:
        # ggml asserts ne[0] >= n_dims / 2, but the cache reads one factor per pair of ne[0].
        if ff.type_name != "F32" or ff.ne[0] < (ne0 + 1) // 2 or not ff.contiguous():
            _fail(node, f"frequency factors {ff.type_name} {ff.ne} do not cover ne[0] {ne0}")


# Destination types with a CPU from_float.
_SET_ROWS_DST = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL")


CHECKED_OPS: Dict[str, Callable] = {
    "NONE": _leaf, "ADD": _binary, "SUB": _binary, "MUL": _binary, "DIV": _binary,
    "MUL_MAT": _mul_mat, "SOFT_MAX": _soft_max, "SCALE": _scale, "NORM": _strided_norm,
    "RMS_NORM": _norm, "L2_NORM": _strided_norm, "GROUP_NORM": _group_norm, "CPY": _cpy, "DUP": _dup,
    "CONT": _dup, "GET_ROWS": _get_rows, "SET_ROWS": _set_rows,
    "VIEW": _view, "PERMUTE": _view, "TRANSPOSE": _view, "RESHAPE": _reshape,
    "UNARY": _unary, "GLU": _glu,
    "SQR": _elementwise, "SQRT": _elementwise, "LOG": _elementwise, "SIN": _elementwise,
    "COS": _elementwise, "CLAMP": _clamp, "LEAKY_RELU": _leaky_relu, "ADD1": _add1,
    "DIAG_MASK_INF": _diag_mask, "DIAG_MASK_ZERO": _diag_mask,
    "SUM": _sum, "SUM_ROWS": _row_reduce, "MEAN": _row_reduce, "ARGMAX": _argmax,
    "COUNT_EQUAL": _count_equal, "REPEAT": _repeat, "REPEAT_BACK": _repeat_back,
    "CONCAT": _concat, "PAD": _pad, "ARANGE": _arange, "TIMESTEP_EMBEDDING": _timestep_embedding,
    "ARGSORT": _argsort, "TOP_K": _top_k, "ROPE": _rope,
}


def check_node(node: TensorInfo, srcs: Sequence[Optional[TensorInfo]], enums: OpEnums) -> None:
    """Raises Refused unless `node` is what ggml would build from `srcs`."""
    rule = CHECKED_OPS.get(node.op_name)
    if rule is None:
        raise Refused(f"node {node.index}: op {node.op_name} has no shape check on this host")
    rule(node, srcs, enums)


def node_refusal(node: TensorInfo, srcs: Sequence[Optional[TensorInfo]], enums: OpEnums) -> Optional[str]:
    """Why check_node would refuse `node`, or None: device_supports_op's view of the rules
    (with `address=None` infos the checks of row ids' values are skipped)."""
    try:
        check_node(node, srcs, enums)
    except Refused as exc:
        return str(exc)
    return None
