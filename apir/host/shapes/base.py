"""What every rule shares: `TensorInfo` (one tensor as the rules see it), `OpEnums` (facts of
the loaded ggml build) and the small checks rules are written with."""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Optional, Sequence

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
    # types whose CPU `vec_dot` is set and whose `vec_dot_type` has a `from_float` (a row of
    # F32 converted to it and dotted with a row of the type) -> the row length, in elements,
    # that the blocks of both divide
    vec_dot: Dict[str, int] = field(default_factory=dict)

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
    from_float, to_float, cpu = set(), set(), {}
    for t, name in g.type_names.items():
        traits = g.ggml_get_type_traits_cpu(t)
        if traits:
            cpu[t] = _TypeTraitsCpu.from_address(traits)
            if cpu[t].from_float:
                from_float.add(name)
        base = _TypeTraits.from_address(g.ggml_get_type_traits(t))
        # The mirrored layout is trusted only where it reads back what ggml reports.
        if (base.is_quantized and base.to_float and base.blck_size == g.ggml_blck_size(t)
                and base.type_size == g.ggml_type_size(t)):
            to_float.add(name)
    version = tuple(int(x) for x in re.findall(r"\d+", g.ggml_version().decode())[:3])
    vec_dot = {}
    for t, traits in cpu.items():
        other = cpu.get(traits.vec_dot_type)
        if traits.vec_dot and other is not None and other.from_float:
            a, b = g.ggml_blck_size(t), g.ggml_blck_size(traits.vec_dot_type)
            vec_dot[g.type_names[t]] = a * b // math.gcd(a, b)
    return OpEnums(unary, glu, rope, frozenset(from_float), frozenset(to_float), version, vec_dot)


class _TypeTraitsCpu(ctypes.Structure):
    """`struct ggml_type_traits_cpu` (ggml-cpu.h, the same in ggml 0.10 and 0.20)."""

    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p),
                ("vec_dot_type", ctypes.c_int), ("nrows", ctypes.c_int64)]


class _TypeTraits(ctypes.Structure):
    """`struct ggml_type_traits` (ggml.h, the same in ggml 0.10 and 0.20)."""

    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]


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


FLOAT = ("F32", "F16", "BF16")

FLOAT = ("F32", "F16", "BF16")


def param_i32(node: TensorInfo, i: int) -> int:
    return int(np.asarray(node.op_params, dtype=np.int32)[i])


def param_f32(node: TensorInfo, i: int) -> float:
    return float(np.asarray(node.op_params, dtype=np.int32)[i : i + 1].view(np.float32)[0])


def need(node: TensorInfo, srcs: Sequence[Optional[TensorInfo]], n: int) -> List[TensorInfo]:
    got = list(srcs[:n])
    if len(got) < n or any(s is None for s in got):
        raise Refused(f"node {node.index} ({node.op_name}) needs {n} sources")
    return got  # type: ignore[return-value]


def fail(node: TensorInfo, why: str) -> None:
    raise Refused(f"node {node.index} ({node.op_name}): {why}")


def same_shape(node: TensorInfo, a: TensorInfo, what: str) -> None:
    if node.ne != a.ne:
        fail(node, f"shape {node.ne} differs from {what} {a.ne}")


def dst_contiguous(node: TensorInfo) -> None:
    if not node.contiguous():
        fail(node, f"destination is not contiguous (nb {node.nb})")


def check_row_ids(node: TensorInfo, ids: TensorInfo, n_rows: int) -> None:
    """The CPU kernels GGML_ASSERT each row id is in [0, n_rows): an id out of range would
    abort the host. Ids are read here, which needs them to be guest-written input (a leaf
    with data), contiguous I32 or I64, not computed by the graph."""
    dtype = {"I32": np.int32, "I64": np.int64}.get(ids.type_name)
    if dtype is None or not ids.contiguous():
        fail(node, f"row ids must be contiguous I32 or I64, not {ids.type_name} nb {ids.nb}")
    if not ids.is_leaf or ids.address == 0:
        fail(node, "row ids must be an input tensor of the graph")
    n = ids.nelements() if ids.address is not None else 0
    if n:
        import ctypes

        raw = (ctypes.c_char * (n * np.dtype(dtype).itemsize)).from_address(ids.address)
        values = np.frombuffer(raw, dtype=dtype)
        if values.min() < 0 or values.max() >= n_rows:
            fail(node, f"row id out of [0, {n_rows})")
