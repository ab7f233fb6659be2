"""What every rule shares: `TensorInfo` (one tensor as the rules see it), `OpEnums` (facts of
the loaded ggml build) and the small checks rules are written with."""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field
from typing import Callable, Dict, FrozenSet, List, NoReturn, Optional, Sequence, Tuple

import numpy as np

from apir.codec.copy import RawMemory, copy_bytes
from apir.ggml.features import Feature
from apir.ggml.lib import Ggml
from apir.host.errors import Refused
from apir.host.tensors import tensor_extent


@dataclass(frozen=True)
class OpEnums:
    """Facts of the loaded ggml build the rules need: sizes of the enums some ops carry in
    op_params, which types its CPU backend converts rows of F32 into and out of, its version
    and the version-dependent kernel facts it has (`features`, apir.ggml.features; a rule
    asks `Feature.X in enums.features`)."""

    glu: Dict[str, int] = field(default_factory=dict)  # `enum ggml_glu_op`, COUNT included
    rope: Dict[str, int] = field(default_factory=dict)  # the GGML_ROPE_TYPE_* modes
    # types whose `ggml_type_traits_cpu.from_float` is set (CPY / DUP into them; without it
    # the CPU kernel aborts)
    from_float: FrozenSet[str] = frozenset()
    # quantized types whose `ggml_type_traits.to_float` is set (CPY from them into F32)
    to_float: FrozenSet[str] = frozenset()
    version: tuple = (0, 0, 0)  # ggml_version(), for kernels that changed between versions
    unary: Dict[str, int] = field(default_factory=dict)  # `enum ggml_unary_op`, COUNT included
    # types with a CPU `vec_dot` -> their `vec_dot_type` (MUL_MAT, MUL_MAT_ID)
    vec_dot: Dict[str, str] = field(default_factory=dict)
    blck_size: Dict[str, int] = field(default_factory=dict)  # ggml_blck_size of every type
    # types whose CPU `vec_dot` is set and whose `vec_dot_type` has a `from_float` (a row of
    # F32 converted to it and dotted with a row of the type) -> the row length, in elements,
    # that the blocks of both divide (FLASH_ATTN_EXT's K)
    vec_dot_row: Dict[str, int] = field(default_factory=dict)
    features: FrozenSet[Feature] = frozenset()  # apir.ggml.features.features_of(version)
    hints: Dict[str, int] = field(default_factory=dict)  # `enum ggml_op_hint` ({} before 0.20)

    @property
    def glu_count(self) -> int:
        return self.glu.get("COUNT", 0)  # 0: this build has no GLU (GLU nodes are refused)


def op_enums(g: Ggml) -> OpEnums:
    """`OpEnums` of build `g`, from its header facts (`enum ggml_unary_op`, `enum
    ggml_glu_op`, `#define GGML_ROPE_TYPE_*`, `enum ggml_op_hint`: `g.header`), `ggml_get_type_traits_cpu` (whose
    first field is `from_float`), `ggml_get_type_traits` (`to_float`), its version and
    features (`g.version_tuple`, `g.features`)."""
    from_float, to_float, vec_dot, blck_size = set(), set(), {}, {}
    for t, name in g.type_names.items():
        blck_size[name] = int(g.ggml_blck_size(t))
        traits = g.ggml_get_type_traits_cpu(t)
        if traits and ctypes.c_void_p.from_address(traits).value:
            from_float.add(name)
        if traits:
            cpu = _TypeTraitsCpu.from_address(traits)
            if cpu.vec_dot and cpu.vec_dot_type in g.type_names:
                vec_dot[name] = g.type_names[cpu.vec_dot_type]
        base = _TypeTraits.from_address(g.ggml_get_type_traits(t))
        # The mirrored layout is trusted only where it reads back what ggml reports.
        if (
            base.is_quantized
            and base.to_float
            and base.blck_size == g.ggml_blck_size(t)
            and base.type_size == g.ggml_type_size(t)
        ):
            to_float.add(name)
    vec_dot_row = {}
    for name, dot in vec_dot.items():
        if dot in from_float:
            a, b = blck_size[name], blck_size[dot]
            vec_dot_row[name] = a * b // math.gcd(a, b)
    return OpEnums(
        dict(g.header.glu_ops),
        dict(g.header.rope_types),
        frozenset(from_float),
        frozenset(to_float),
        g.version_tuple,
        unary=dict(g.header.unary_ops),
        vec_dot=vec_dot,
        blck_size=blck_size,
        vec_dot_row=vec_dot_row,
        features=g.features,
        hints=dict(g.header.op_hints),
    )


class _TypeTraitsCpu(ctypes.Structure):
    """`struct ggml_type_traits_cpu` (ggml-cpu.h, the same in ggml 0.10 and 0.20)."""

    _fields_ = [
        ("from_float", ctypes.c_void_p),
        ("vec_dot", ctypes.c_void_p),
        ("vec_dot_type", ctypes.c_int),
        ("nrows", ctypes.c_int64),
    ]


class _TypeTraits(ctypes.Structure):
    """`struct ggml_type_traits` (ggml.h, the same in ggml 0.10 and 0.20)."""

    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


@dataclass
class IdReads:
    """What the rules of one graph read of row ids. `room`: the bytes they may still copy
    (`TensorInfo.snapshot`): one graph may view the same ids through as many tensors as it
    has records, and each is copied, so without a bound a few MiB of guest buffers made the
    host copy GiB; the graph build sets it to the bytes of the buffers the graph names
    (apir.host.graph.build). `ranges`: (tensor index, flat) -> the least and greatest id of its
    copy read that way (`check_row_ids`), so that ids many nodes read are read once (N
    readers of n ids cost N * n before compute)."""

    room: int
    ranges: Dict[tuple, Tuple[int, int]] = field(default_factory=dict)

    def take(self, node: "TensorInfo", nbytes: int) -> None:
        """Takes `nbytes` for a copy of row ids `node`'s rule reads; Refused past `room`."""
        if nbytes > self.room:
            fail(node, f"row ids of {nbytes} bytes: the graph's copies of row ids would exceed its buffers' bytes")
        self.room -= nbytes


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
    # real address of its data (for GET_ROWS row ids); 0 without data; None where no data is
    # known (device_supports_op): checks of the data are then left to graph_compute
    address: Optional[int]
    # bytes from its data to the end of its buffer: how far a kernel that reads past the
    # tensor's own extent (ROPE's frequency factors) stays in mapped memory; None where not
    # known (device_supports_op): such checks are then left to graph_compute
    room: Optional[int] = None
    # the bytes of this tensor's extent, copied by a rule that read its data before compute
    # (row ids, `row_ids`): the kernel is then given this copy, so the guest cannot change the
    # ids after the check (its buffer may be guest memory); and graph_compute refuses a graph
    # in which a node writes over the original before its readers ran (the ids used would not
    # be those of ggml CPU)
    snapshot: Optional[ctypes.Array] = None
    # how to copy `n` bytes of its data when kernels do not read host memory (a GPU or a
    # remote backend, apir.host.graph.profiles: `address` is then the backend's own pointer, never
    # dereferenced): a copy through the backend (ggml_backend_tensor_get); None: read `address`
    fetch: Optional[Callable[[int], ctypes.Array]] = None
    read_by: Optional[List[int]] = None  # graph indices of the nodes whose rules read the snapshot
    # what those reads checked, one (flat, n_rows) per read (`check_row_ids`): every id in
    # [0, n_rows); lets a cached graph re-check fresh ids without its rules (apir.host.graph.cache)
    id_bounds: Optional[List[tuple]] = None
    # set by a rule whose kernel is only safe when the whole graph runs on one thread
    one_thread: bool = False
    # what its graph's rules read of row ids (one IdReads for the whole graph); None: not
    # bounded nor remembered (device_supports_op; a cached graph re-checking the copies its
    # build made)
    id_reads: Optional[IdReads] = None
    # (writer, bound): every element is one that node `writer` of the graph computes, an id in
    # [0, bound) whatever its inputs (apir.host.graph.computed_ids); None: not known so
    computed_by: Optional[Tuple[int, int]] = None
    # graph indices of the nodes whose rules took its ids as `computed_by` bounds them, unread:
    # the graph build checks that no other write reaches them between writer and reader
    read_computed_by: Optional[List[int]] = None

    def nelements(self) -> int:
        return math.prod(map(int, self.ne))  # exact (Python ints); np.prod(dtype=object) is ~20x slower

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
        return math.prod(map(int, self.ne[1:]))

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

INT_MAX = 2**31 - 1  # C `int` on every platform ggml's CPU backend runs on
# A count of rows a kernel keeps in `int` and splits among threads as `(nr + nth - 1) / nth`
# (still an `int`): the sum must not wrap either, for any thread count ggml allows
# (GGML_MAX_N_THREADS is 512; the margin leaves room for more).
INT_ROWS_MAX = INT_MAX - (1 << 16)


def int_rows(node: TensorInfo, n: int, what: str) -> None:
    """Refuses a row count `n` that the kernel keeps in an `int` and splits among threads
    (`const int nr = ...; const int dr = (nr + nth - 1)/nth;`) when it could wrap: a wrapped
    count makes a thread's row range negative, and the kernel then indexes before its
    tensors."""
    if n > INT_ROWS_MAX:
        fail(node, f"{what} ({n}) exceed the kernel's int row count")


def param_i32(node: TensorInfo, i: int) -> int:
    return int(np.asarray(node.op_params, dtype=np.int32)[i])


def param_f32(node: TensorInfo, i: int) -> float:
    return float(np.asarray(node.op_params, dtype=np.int32)[i : i + 1].view(np.float32)[0])


def need(node: TensorInfo, srcs: Sequence[Optional[TensorInfo]], n: int) -> List[TensorInfo]:
    got = [s for s in srcs[:n] if s is not None]
    if len(got) < n:  # fewer than n, or one of the first n absent
        raise Refused(
            f"node {node.index} ({node.op_name}) needs {n} sources",
            node=node.index,
            op=node.op_name,
            reason=f"needs {n} sources",
        )
    return got


def rule_name(rule: Callable) -> str:
    """`module.qualname` of a rule function (a Refused's `rule` field)."""
    return f"{rule.__module__}.{rule.__qualname__}"


def fail(node: TensorInfo, why: str, rule: Optional[Callable] = None) -> NoReturn:
    """Raises Refused for `node`: `why` the reason; `rule` the check refusing it where that
    is not the op's own rule (check_node names the op's rule otherwise)."""
    raise Refused(
        f"node {node.index} ({node.op_name}): {why}",
        node=node.index,
        op=node.op_name,
        reason=why,
        rule=None if rule is None else rule_name(rule),
    )


def same_shape(node: TensorInfo, a: TensorInfo, what: str) -> None:
    if node.ne != a.ne:
        fail(node, f"shape {node.ne} differs from {what} {a.ne}")


def dst_contiguous(node: TensorInfo) -> None:
    if not node.contiguous():
        fail(node, f"destination is not contiguous (nb {node.nb})")


def extent(t: TensorInfo) -> int:
    """Bytes from t's data its ne and nb reach (`apir.host.tensors.tensor_extent`, already
    checked to lie inside t's buffer)."""
    return tensor_extent(t.type_size, t.blck_size, t.ne, t.nb)


def span_nbytes(t: TensorInfo) -> int:
    """Bytes of `t`'s elements as if each dimension of 0 were 1: `ggml_row_size(type,
    prod(max(ne[i], 1)))`. For a tensor whose elements do not overlap this is at most its
    extent (so at most its buffer); it is what ggml's work-size planning and the kernels
    that size or loop by one dimension can be driven to by a tensor's *other* dimensions,
    even when it has no elements at all. graph.py refuses a
    tensor whose span exceeds its buffer's size (an empty one: the larger of that and the work
    budget; `check_span`)."""
    blocks0 = -(-max(int(t.ne[0]), 1) // t.blck_size)
    return blocks0 * t.type_size * math.prod(max(int(n), 1) for n in t.ne[1:])


def check_span(t: TensorInfo, limit: int, what: str) -> None:
    """Refuses `t` when `span_nbytes(t)` exceeds `limit`: the size of the buffer it lies in
    for a tensor with elements, a looser bound for an empty one (graph.py: the larger of its
    buffer and the work budget; test-backend-ops' empty tensors span a little more than their
    buffer). A tensor with elements that do not overlap never exceeds its buffer. What is
    refused: elements aliased through strides of 0 or overlapping rows by more than the buffer
    holds (work buffers and loops sized by the element count), and an empty tensor with huge
    other dimensions (a 2^63-byte work buffer planned from them). Raises Refused."""
    span = span_nbytes(t)
    if span > limit:
        why = (
            f"ne {t.ne} spans {span} bytes of {t.type_name}, more than the {limit} "
            f"bytes its buffer allows (empty or aliasing elements)"
        )
        raise Refused(f"{what}: {why}", reason=why, rule=rule_name(check_span))


# A shape rule (one per op, in a module's RULES table): raises Refused unless `node` is what
# ggml would build from its sources `srcs` (None for an absent optional source) in the build
# whose enum sizes are `enums`.
Rule = Callable[[TensorInfo, Sequence[Optional[TensorInfo]], OpEnums], None]

# Name of the attribute `empty_sources_ok` sets on a rule.
_EMPTY_SOURCES_OK = "empty_sources_ok"


def empty_sources_ok(rule: Rule) -> Rule:
    """Decorator for a rule whose kernel is known to read nothing of a source with no
    elements while still writing a result with elements; without it `check_empty_sources`
    refuses such a node before the rule runs."""
    setattr(rule, _EMPTY_SOURCES_OK, True)
    return rule


def cpu_empty_sources_ok(rule: Rule) -> Rule:
    """`empty_sources_ok` for a rule whose exemption is a fact of ggml-cpu's kernel only (read
    there, not in other backends' kernels): the CPU profile's table keeps it, the tables of
    other backends (`without_cpu_exemptions`, apir.host.graph.profiles) drop it. The rule itself
    then refuses every empty source but the one the kernel is known not to read."""
    setattr(rule, _EMPTY_SOURCES_OK, _CPU)
    return rule


_CPU = "cpu"  # the value `cpu_empty_sources_ok` marks a rule with


def allows_empty_sources(rule: Rule) -> bool:
    return bool(getattr(rule, _EMPTY_SOURCES_OK, False))


def without_cpu_exemptions(rules: Dict[str, Rule]) -> Dict[str, Rule]:
    """`rules` with each rule marked `cpu_empty_sources_ok` replaced by a wrapper without the
    mark (same name and docstring): for a backend whose kernels are not ggml-cpu's, such a
    node's empty source is refused by `check_empty_sources` again."""
    import functools

    def strict(rule: Rule) -> Rule:
        @functools.wraps(rule)
        def checked(node: TensorInfo, srcs: Sequence[Optional[TensorInfo]], enums: OpEnums) -> None:
            return rule(node, srcs, enums)

        setattr(checked, _EMPTY_SOURCES_OK, False)  # functools.wraps copied the mark
        return checked

    return {op: strict(r) if getattr(r, _EMPTY_SOURCES_OK, False) == _CPU else r for op, r in rules.items()}


def check_empty_sources(node: TensorInfo, srcs: Sequence[TensorInfo | None], allowed: bool = False) -> None:
    """Issue 13, class 1: a node whose result has elements, one of whose sources has none, is
    refused (unless `allowed`, see `empty_sources_ok`). An empty tensor's extent is 0 bytes, so
    the bounds checks place it anywhere (at the very end of its buffer); a kernel that walks
    it by another tensor's shape (ADD_ID's ids by src0's rows, a convolution's input by the
    kernel's channels) then reads or writes outside every checked extent. A node with no
    elements is not computed (ggml_compute_forward returns on ggml_is_empty), and ggml's work
    planning, which still reads its sources' dimensions, is bounded by `check_span` and the
    compute-time work-size bound (apir.host.graph.work_plan)."""
    # (ne >= 0, so "no elements" is "a 0 in ne": cheaper than the product, once per node)
    if allowed or 0 in node.ne:
        return
    for k, s in enumerate(srcs):
        if s is not None and 0 in s.ne:
            fail(
                node,
                f"src{k} {s.ne} has no elements but the result {node.ne} has: the kernel "
                f"would walk it by another tensor's shape",
                check_empty_sources,
            )


_ID_DTYPES = {"I32": np.int32, "I64": np.int64}


def row_ids(
    node: TensorInfo, ids: TensorInfo, types=("I32",), flat: bool = False, read: bool = True
) -> Optional[np.ndarray]:
    """The row ids a kernel reads, as the array [ne3, ne2, ne1, ne0] read through ids' nb (or,
    `flat`, the first nelements of ids' data as one packed array, as GET_ROWS_BACK reads them);
    None where no data is known (device_supports_op).

    Reading them before compute is sound only if the kernel reads the same values: the ids'
    bytes are copied once (`ids.snapshot`), the values read from the copy, and graph_compute
    points the kernel's tensor at the copy (a guest writing its buffer meanwhile changes
    nothing) and refuses a graph in which a node (ids themselves when computed by the graph,
    or any node whose result overlaps them) writes over the original. Ids computed by the
    graph are so refused: the CPU kernels GGML_ASSERT (abort the host) or, worse, index out of
    their tensors on an id out of range. With `read` False, everything but the values (the
    checks, the copy, `read_by`): None."""
    if ids.type_name not in types:
        fail(node, f"row ids must be {' or '.join(types)}, not {ids.type_name}")
    if ids.address == 0:
        fail(node, "row ids have no data")
    if ids.address is None:
        return None
    dtype = np.dtype(_ID_DTYPES[ids.type_name])
    n = ids.nelements()
    if n == 0:
        return np.zeros(0, dtype)
    size = extent(ids)
    if ids.snapshot is None:
        if ids.id_reads is not None:
            ids.id_reads.take(node, size)
        ids.snapshot = copy_ids(ids)
    ids.read_by = (ids.read_by or []) + [node.index]
    if flat and n * dtype.itemsize > size:
        fail(node, f"{n} packed row ids reach past ids' extent (nb {ids.nb})")
    if not flat and ids.nb[0] < dtype.itemsize and ids.ne[0] > 1:
        fail(node, f"row ids overlap (nb {ids.nb})")
    return id_values(ids, ids.snapshot, flat).copy() if read else None


def copy_ids(ids: TensorInfo) -> ctypes.Array:
    """A copy of the bytes of ids' extent: read at `address`, or through `fetch` where
    kernels do not read host memory. Only for ids with data (`row_ids` checks that)."""
    size = extent(ids)
    if ids.fetch is not None:
        return ids.fetch(size)
    assert ids.address, "row ids without data"
    out = ctypes.create_string_buffer(size)
    copy_bytes(out, RawMemory(ids.address, size))
    return out


def id_values(ids: TensorInfo, snapshot: ctypes.Array, flat: bool) -> np.ndarray:
    """The ids in `snapshot` (a copy of ids' extent) as `row_ids` reads them, a view of it:
    [ne3, ne2, ne1, ne0] at ids' nb, or (`flat`) the first nelements packed. Sizes as
    `row_ids` checked them."""
    dtype = np.dtype(_ID_DTYPES[ids.type_name])
    if flat:
        return np.frombuffer(memoryview(snapshot), dtype=dtype, count=ids.nelements())
    return np.ndarray(shape=tuple(ids.ne[::-1]), dtype=dtype, buffer=memoryview(snapshot), strides=tuple(ids.nb[::-1]))


def check_row_ids(
    node: TensorInfo, ids: TensorInfo, n_rows: int, types=("I32", "I64"), what: str = "row id", flat: bool = False
) -> None:
    """Every row id of ids in [0, n_rows): the CPU kernels GGML_ASSERT it (an id out of range
    would abort the host); see `row_ids`. The only way rules read ids: each read is recorded
    in `ids.id_bounds`, so a cached graph can re-check fresh ids against the same bounds
    (apir.host.graph.cache) without the rules. A rule that checks ids some other way must read
    them through `row_ids` (a read without a bound makes a cached graph run its rules again),
    never from `ids.snapshot` itself: a check there would be skipped on every cache hit.

    The least and greatest id of a copy, read one way, are found once per graph
    (`IdReads.ranges`), not once per reader: one tensor of ids read by N nodes would cost N
    passes over them before compute."""
    if _computed_within(node, ids, n_rows, types, flat):
        return
    reads = len(ids.read_by or ())
    ranges = ids.id_reads.ranges if ids.id_reads is not None else None
    known = ranges.get((ids.index, flat)) if ranges is not None and ids.snapshot is not None else None
    values = row_ids(node, ids, types, flat, read=known is None)
    if values is not None and values.size:
        known = (int(values.min()), int(values.max()))
        if ranges is not None:
            ranges[(ids.index, flat)] = known
    if known is not None and (known[0] < 0 or known[1] >= n_rows):
        fail(node, f"{what} out of [0, {n_rows})")
    if len(ids.read_by or ()) > reads:
        ids.id_bounds = (ids.id_bounds or []) + [(flat, n_rows)]


def _computed_within(node: TensorInfo, ids: TensorInfo, n_rows: int, types, flat: bool) -> bool:
    """Whether the graph computes ids in [0, n_rows) by construction (`ids.computed_by`, not
    yet read before compute: a tensor is either read or computed for all its readers): then
    nothing is read, and the read is recorded in `read_computed_by` for the graph's check
    that no other write reaches them before this reader (apir.host.graph.computed_ids)."""
    made = ids.computed_by
    if made is None or made[1] > n_rows or ids.snapshot is not None or ids.type_name not in types:
        return False
    if ids.address == 0:
        fail(node, "row ids have no data")
    n = ids.nelements()
    itemsize = np.dtype(_ID_DTYPES[ids.type_name]).itemsize
    if flat and n * itemsize > extent(ids):
        fail(node, f"{n} packed row ids reach past ids' extent (nb {ids.nb})")
    if not flat and ids.nb[0] < itemsize and ids.ne[0] > 1:
        fail(node, f"row ids overlap (nb {ids.nb})")
    if n:
        ids.read_computed_by = (ids.read_computed_by or []) + [node.index]
    return True


def int_counted(node: TensorInfo, srcs: Sequence[Optional[TensorInfo]]) -> None:
    """Refuses a node any of whose tensors (node or source) has an ne[i] or a row count above
    INT32_MAX (a row count above INT_ROWS_MAX: split among threads as `(nr + nth - 1)/nth`,
    it would wrap too). ggml-cpu's kernels keep these in C `int` (`const int nr =
    ggml_nrows(src0)`, `for (int i3 = 0; i3 < ne3; i3++)`, `int i = i0 + i1*nc`): past
    INT32_MAX an index wraps negative (signed overflow) and the kernel addresses memory before
    its tensor. Legitimate tensors stay far below: such a dimension is at least 2 GiB of I8.
    (Issue 13, class 3.)"""
    for t in (node, *srcs):
        if t is not None and (any(n > INT_MAX for n in t.ne) or t.nrows() > INT_ROWS_MAX):
            fail(node, f"tensor {t.index} {t.ne} is too large for the kernel's int counts", int_counted)


def int_counted_rules(rules: Dict[str, Rule]) -> Dict[str, Rule]:
    """`rules` with `int_counted` checked before each (a module's RULES table, for the op
    families whose every kernel counts in `int`); the wrapper keeps the rule's name, docstring
    and attributes (functools.wraps)."""
    import functools

    def wrap(rule: Rule) -> Rule:
        @functools.wraps(rule)
        def checked(node: TensorInfo, srcs: Sequence[Optional[TensorInfo]], enums: OpEnums) -> None:
            int_counted(node, srcs)
            return rule(node, srcs, enums)

        return checked

    return {op: wrap(rule) for op, rule in rules.items()}


# The quantized types ggml-cpu's kernels switch on where they dequantize a row:
# ggml_compute_forward_add (add_q_f32), ggml_compute_forward_get_rows and
# ggml_compute_forward_out_prod list the same `case`s in ggml 0.10 and 0.20 (Q2_0 is new in
# 0.20; a type this build lacks never matches); any other quantized type GGML_ABORTs there.
CPU_QUANTIZED_ROW_TYPES = frozenset(
    (
        "Q1_0",
        "Q2_0",
        "Q4_0",
        "Q4_1",
        "Q5_0",
        "Q5_1",
        "Q8_0",
        "MXFP4",
        "NVFP4",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "TQ1_0",
        "TQ2_0",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ3_XXS",
        "IQ1_S",
        "IQ1_M",
        "IQ4_NL",
        "IQ4_XS",
        "IQ3_S",
        "IQ2_S",
    )
)
