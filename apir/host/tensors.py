"""Guest tensors made safe: validation of wire tensors and host ggml tensors built from them.

Theory of operation: the guest describes tensors two ways. `apir_rpc_tensor` records (set /
get / cpy tensor, graphs) carry a buffer handle and a data offset from that buffer's virtual
base; inline tensors (device_supports_op, buffer_type_get_alloc_size) are the sender's raw
`ggml_tensor` structs, pointers and all. Neither is ever used in place: every field the host
needs is read into Python, checked, and written into a fresh tensor of a host `ggml_context`
(`Scratch`, no_alloc, freed after the command: the C leaks one context per tensor). Guest
pointers are never followed: an inline tensor's buffer, data, view_src and src pointers only
say which structs follow it on the wire, and its host twin has no buffer and no data.

Checks, each raising `Refused`: type is one this ggml build has; op is below GGML_OP_COUNT
and not a custom op (their op_params hold function pointers); quantized `ne[0]` is a
multiple of the block size; ne >= 0; the name is NUL-terminated; an rpc tensor's buffer is
this context's and its data (offset + extent) lies inside that buffer; `buffer == 0` with
non-zero data is refused. The extent is an upper bound of what any kernel touches: ggml's
own `ggml_nbytes`, or a contiguous first row when `nb[0]` is smaller than an element.
"""

from __future__ import annotations

import ctypes
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from apir.codec.forward import InlineTensor, TensorLayouts
from apir.codec.records import RecordStruct, rpc_tensor_dtype
from apir.ggml.layout import tensor_record
from apir.ggml.lib import InitParams
from apir.host.errors import Refused
from apir.host.handles import HostBuffer

__all__ = ["Scratch", "TensorChecker", "RpcTensor", "inline_twin", "CUSTOM_OPS"]

CUSTOM_OPS = ("CUSTOM", "MAP_CUSTOM1", "MAP_CUSTOM2", "MAP_CUSTOM3")
_NE_MAX = 1 << 62  # ne fits int64 with room for products of two


class RpcTensor(NamedTuple):
    """The fields of one `apir_rpc_tensor` that the host reads, as Python values, each read
    once from the guest's bytes (`TensorChecker.rpc_tensor`): later checks and the host twin
    see these values, whatever the guest writes into its memory meanwhile."""

    type: int
    buffer: int  # the host handle
    ne: Tuple[int, ...]
    nb: Tuple[int, ...]
    op: int
    op_params: Tuple[int, ...]
    flags: int
    data: int  # offset from the buffer's virtual base
    name: bytes  # the whole field, NUL included (check_common)


class Scratch:
    """A host `ggml_context` with room for `n_tensors` tensor headers (no data) and, if
    `graph_size`, one graph of that many nodes. Use as a context manager."""

    def __init__(self, g, n_tensors: int, graph_size: int = 0):
        self.g = g
        self.pinned: list[ctypes.Array] = []  # memory the context's tensors point into, kept until close
        self._tensors: Optional[np.ndarray] = None  # tensor_block's memory, kept until close
        self.buffers: list[int] = []  # ggml buffers made for this scratch's tensors, freed on close
        size = g.ggml_tensor_overhead() * (n_tensors + 1) + 1024
        if graph_size:
            size += g.ggml_graph_overhead_custom(graph_size, False)
        self.size = size  # bytes of the context's memory pool
        self.ctx = g.ggml_init(InitParams(size, None, True))
        if not self.ctx:
            raise MemoryError(f"ggml_init of a {size}-byte context failed")

    def check_room(self, n_tensors: int, graph_size: int = 0) -> None:
        """Raises MemoryError unless the context's pool has room for `n_tensors` more tensor
        headers and, if `graph_size`, a graph of that many nodes: ggml_new_object's own test,
        made before ggml is called, since ggml GGML_ASSERTs a full context in ggml_new_tensor
        (an abort of the host) and dereferences the NULL of ggml_new_graph_custom."""
        g = self.g
        need = n_tensors * g.ggml_tensor_overhead()
        if graph_size:
            need += g.ggml_graph_overhead_custom(graph_size, False)
        room = g.ggml_get_mem_size(self.ctx) - g.ggml_used_mem(self.ctx) if self.ctx else 0
        if need > room:
            raise MemoryError(f"scratch ggml_context full: {need} bytes needed, {room} free")

    def tensor_block(self, n_tensors: int, tensor_size: int) -> int:
        """The address of room for `n_tensors` structs ggml_tensor of `tensor_size` bytes
        (sizeof, as apir.ggml.layout checked it) side by side, 64-byte aligned, not zeroed:
        for a caller that writes whole tensors itself (apir.host.graph.build), where 10,000 calls
        of ggml_new_tensor would cost more than writing them. ggml only reads a graph's
        tensors through their pointers, never through the context that holds them. The
        memory lives until `close` (one block per Scratch) and counts in `size`."""
        if self._tensors is not None:
            raise RuntimeError("Scratch.tensor_block: this scratch has its block already")
        nbytes = n_tensors * tensor_size
        self._tensors = np.empty(nbytes + 64, np.uint8)
        self.size += nbytes + 64
        return -(-self._tensors.ctypes.data // 64) * 64

    @property
    def closed(self) -> bool:
        return self.ctx is None

    def close(self) -> None:
        """Frees the context, its tensor block and buffers."""
        for buf in self.buffers:
            self.g.ggml_backend_buffer_free(buf)
        self.buffers = []
        if self.ctx:
            self.g.ggml_free(self.ctx)
            self.ctx = None
        self.pinned = []
        self._tensors = None

    def __enter__(self) -> "Scratch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def tensor_extent(type_size: int, blck_size: int, ne: Sequence[int], nb: Sequence[int]) -> int:
    """Bytes from a tensor's data that a kernel may touch (>= ggml_nbytes), the one definition
    of a tensor's extent: 0 when an ne is 0, else the last byte of the last row + 1, where a
    row of `ne[0] / blck_size` blocks of `type_size` bytes spans whichever is longer of its
    packed size and its nb[0] stride (and, for block types, ggml_nbytes' own `ne[0] / blck *
    nb[0]`). Exact (Python ints); apir.host.graph.build has its whole-graph numpy twin."""
    if any(n <= 0 for n in ne):
        return 0
    blocks0 = ne[0] // blck_size
    row = max(blocks0 * type_size, (blocks0 - 1) * nb[0] + type_size)
    if blck_size > 1:
        row = max(row, blocks0 * nb[0])  # ggml_nbytes' own formula for block types
    return row + sum((ne[i] - 1) * nb[i] for i in range(1, len(ne)))


class TensorChecker:
    """The checks and the host-tensor builder of one loaded ggml build."""

    def __init__(self, g):
        self.g = g
        self.limits = g.limits
        self.rpc_dtype = rpc_tensor_dtype(g.limits)
        self.tensor_dtype = g.tensor_dtype
        self.layouts = TensorLayouts(self.rpc_dtype, self.tensor_dtype)  # what the Forward table reads
        self.type_size = {t: g.ggml_type_size(t) for t in g.type_names}
        self.blck_size = {t: g.ggml_blck_size(t) for t in g.type_names}
        self.custom_ops = {g.ops[name] for name in CUSTOM_OPS if name in g.ops}
        self.valid_types = g.valid_types  # apir.ggml.lib.Ggml.valid_types
        # The same facts as arrays indexed by type / op, for checks of a whole graph at once
        # (apir.host.graph.build); 1 where a type is not valid, so no division by zero.
        self.type_size_arr = np.ones(len(self.valid_types), dtype=np.int64)
        self.blck_size_arr = np.ones(len(self.valid_types), dtype=np.int64)
        for t in np.flatnonzero(self.valid_types).tolist():
            self.type_size_arr[t], self.blck_size_arr[t] = self.type_size[t], self.blck_size[t]
        self.custom_op_mask = np.zeros(max(g.op_count, 1), dtype=bool)
        self.custom_op_mask[list(self.custom_ops)] = True
        # Single records go through struct, not numpy, whose field access is far slower
        # (RecordStruct; docs/design.md, Measurements).
        self._rpc = RecordStruct(self.rpc_dtype)
        self._rpc_fields = tuple(self._rpc.slots[f] for f in RpcTensor._fields)
        self._tensor = RecordStruct(self.tensor_dtype)
        ts = self._tensor.slots
        self._t_slots: Tuple[Any, ...] = tuple(
            ts[f] for f in ("type", "ne", "nb", "op", "op_params", "flags", "buffer", "data", "name")
        )
        self._t_zero = self._tensor.struct.unpack(bytes(self._tensor.size))  # a fresh tensor's fields
        self._no_params = (0,) * (self.limits.max_op_params // 4)

    # --- field checks ---------------------------------------------------------------------
    def type_ok(self, type_: int) -> bool:
        return self.g.valid_type(type_)

    def check_common(self, what: str, type_: int, op: int, ne: Sequence[int], name: bytes) -> None:
        """Type, op, ne and name checks shared by rpc and inline tensors."""
        if not self.type_ok(type_):
            raise Refused(f"{what}: tensor type {type_} is not a type of this ggml")
        if not 0 <= op < self.g.op_count:
            raise Refused(f"{what}: op {op} out of range (GGML_OP_COUNT {self.g.op_count})")
        if op in self.custom_ops:
            raise Refused(f"{what}: custom op {self.g.op_names[op]} refused (op_params hold host pointers)")
        for n in ne:
            if not 0 <= n < _NE_MAX:
                raise Refused(f"{what}: ne {list(ne)} out of range")
        blck = self.blck_size[type_]
        if ne[0] % blck:
            raise Refused(
                f"{what}: ne[0] = {ne[0]} is not a multiple of the block size {blck} of {self.g.type_names[type_]}"
            )
        if b"\0" not in name:
            raise Refused(f"{what}: name is not NUL-terminated")

    def extent(self, type_: int, ne: Sequence[int], nb: Sequence[int]) -> int:
        """`tensor_extent` of a tensor of valid type `type_`."""
        return tensor_extent(self.type_size[type_], self.blck_size[type_], ne, nb)

    # --- rpc tensors ----------------------------------------------------------------------
    def rpc_tensor(self, raw) -> RpcTensor:
        """The RpcTensor of the `apir_rpc_tensor` at the start of the bytes-like `raw` (each
        byte read once)."""
        v = self._rpc.struct.unpack_from(raw)
        return RpcTensor._make([v[i] for i in self._rpc_fields])

    def check_rpc(self, rec: RpcTensor, buffers, what: str) -> Tuple[Optional[HostBuffer], int]:
        """Checks one rpc record; returns (its buffer or None, its extent in bytes).
        `buffers` is the context's buffer table."""
        self.check_common(what, rec.type, rec.op, rec.ne, rec.name)
        handle, data = rec.buffer, rec.data
        extent = self.extent(rec.type, rec.ne, rec.nb)
        if handle == 0:
            if data != 0:
                raise Refused(f"{what}: tensor without a buffer has data 0x{data:x}")
            return None, extent
        buf = buffers.get(handle)
        if buf is None:
            raise Refused(f"{what}: unknown buffer handle 0x{handle:x}")
        if data + extent > buf.size:
            raise Refused(f"{what}: data [{data}, {data + extent}) outside its {buf.size}-byte buffer")
        return buf, extent

    def host_tensor(
        self,
        scratch: Scratch,
        type_: int,
        ne,
        nb,
        op: int,
        op_params,
        flags: int,
        name: bytes,
        buffer: int = 0,
        data: int = 0,
    ) -> int:
        """A tensor header in `scratch` with these (already checked) fields; no src.
        `op_params`: its int32 words, or empty for all zero."""
        scratch.check_room(1)
        t = self.g.ggml_new_tensor_1d(scratch.ctx, type_, self.blck_size[type_])
        self.write_tensor(
            (ctypes.c_char * self._tensor.size).from_address(t), type_, ne, nb, op, op_params, flags, name, buffer, data
        )
        return t

    def write_tensor(
        self, mem, type_: int, ne, nb, op: int, op_params, flags: int, name: bytes, buffer: int, data: int
    ) -> None:
        """Writes a whole `ggml_tensor` with these fields into the writable buffer `mem`, in one
        `struct.pack_into`; every other field as a fresh tensor has it (zero: no src, view or
        extra). The name is cut at its NUL and at GGML_MAX_NAME - 1 bytes, as ggml_set_name."""
        v = list(self._t_zero)
        s_type, s_ne, s_nb, s_op, s_params, s_flags, s_buffer, s_data, s_name = self._t_slots
        v[s_type], v[s_ne], v[s_nb], v[s_op] = type_, ne, nb, op
        v[s_params] = op_params if len(op_params) else self._no_params
        v[s_flags], v[s_buffer], v[s_data] = flags, buffer, data
        v[s_name] = name.split(b"\0", 1)[0][: self.limits.max_name - 1]
        self._tensor.struct.pack_into(mem, 0, *v)

    def host_from_rpc(self, scratch: Scratch, rec: RpcTensor, buf: Optional[HostBuffer]) -> int:
        """The host twin of a checked rpc record: data = real base + offset; no src/view."""
        return self.host_tensor(scratch, *self._twin_fields(rec, buf))

    def loose_twin(self, rec: RpcTensor, buf: HostBuffer) -> ctypes.Array:
        """`host_from_rpc` in memory of its own (the returned array; its address is the
        tensor), in no ggml_context: for a backend call that only reads the tensor
        (ggml_backend_tensor_set / _get, buffer_copy_tensor), where a Scratch per call costs
        more than the call. Keep the array alive while ggml may read the tensor."""
        mem = ctypes.create_string_buffer(self._tensor.size)
        self.write_tensor(mem, *self._twin_fields(rec, buf))
        return mem

    @staticmethod
    def _twin_fields(rec: RpcTensor, buf: Optional[HostBuffer]) -> tuple:
        # host_tensor's / write_tensor's fields (after scratch or mem) of the twin of `rec`
        return (
            rec.type,
            rec.ne,
            rec.nb,
            rec.op,
            rec.op_params,
            rec.flags,
            rec.name,
            buf.ptr if buf else 0,
            buf.base + rec.data if buf else 0,
        )


def inline_twin(chk: TensorChecker, inline: InlineTensor, scratch: Scratch, what: str) -> int:
    """The host twin of an inline tensor (`apir_encode_ggml_tensor_inline`, decoded by the
    Forward table): its buffer handle is ignored (the C guest sends garbage there, and apir
    never needs the buffer); the twin and its view_src/src twins have no buffer and no data."""
    dtype = chk.tensor_dtype

    def struct_(raw: bytes) -> np.void:
        return np.frombuffer(raw, dtype=dtype, count=1)[0]

    head = struct_(inline.tensor)
    view = struct_(inline.view_src) if inline.view_src is not None else None
    srcs: List[np.void] = [struct_(raw) for raw in inline.srcs]

    def twin(rec, label: str) -> int:
        ne = [int(x) for x in rec["ne"]]
        nb = [int(x) for x in rec["nb"]]
        if any(x < 0 for x in nb):
            raise Refused(f"{label}: nb out of range")
        chk.check_common(label, int(rec["type"]), int(rec["op"]), ne, bytes(rec["name"]))
        return chk.host_tensor(
            scratch, int(rec["type"]), ne, nb, int(rec["op"]), rec["op_params"], int(rec["flags"]), bytes(rec["name"])
        )

    t = twin(head, what)
    rec = tensor_record(t, chk.tensor_dtype)
    if view is not None:
        rec["view_src"] = twin(view, f"{what} view_src")
        rec["view_offs"] = int(head["view_offs"])
    for i, s in enumerate(srcs):
        rec["src"][i] = twin(s, f"{what} src[{i}]")
    return t
