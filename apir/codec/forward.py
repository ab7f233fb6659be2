"""The 23 Forward functions of APIR 0.2 and the extensions': what each command and reply carries.

Theory of operation: `FORWARD` holds one `Function` per `ApirBackendCommandType` id (and per
`ApirExtensionCommandType` id, docs/protocol.md section 12), with its
arguments and its reply as named, typed `Field`s in wire order, and the first APIR version
that carries each field (all of them 0.1 but device_get_props' mmap_support, 0.2). The
names are the C's (the conformance vectors use them). Both sides read this table: the guest
client (`encode_args`, `decode_reply`), the host's handlers (`decode_args`, `encode_reply`),
the conformance runner and the call tracer. It says what travels, not what is allowed: the
host checks every value it decodes (handles, sizes, bounds) in its handlers.

Kinds (apir_cs.h, apir_cs_ggml.h): i32 and u32 take 4 bytes; u8 and bool a 4-byte slot with
the value in its first byte; size_t, uintptr and handle (a host handle from an earlier reply)
8; res_id is the u32 id of a shared-memory resource the guest made; a string is its u64
array size (NUL included) then the bytes padded to 4; rpc_tensor one `apir_rpc_tensor`
record; inline_tensor an `InlineTensor`.

Decoding never reads past the message: a message that ends early, or a reply string of
impossible size, raises `MalformedMessage` naming the first field that did not fit.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import struct
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import numpy as np

from apir.codec.constants import (
    APIR_PROTOCOL_0_1,
    APIR_PROTOCOL_0_2,
    APIR_PROTOCOL_VERSIONS,
    ApirBackendCommandType as F,
    ApirExtensionCommandType as X,
    negotiated_version,
)
from apir.codec.records import GgmlLimits, ggml_tensor_dtype, rpc_tensor_dtype
from apir.codec.wire import Decoder, Encoder
from apir.errors import ApirError

__all__ = [
    "Kind",
    "Field",
    "Function",
    "Layout",
    "FORWARD",
    "layouts_between",
    "reply_writers",
    "InlineTensor",
    "TensorLayouts",
    "MalformedMessage",
    "encode_args",
    "decode_args",
    "encode_reply",
    "decode_reply",
]

Version = Tuple[int, int]


class Kind(enum.Enum):
    I32 = "i32"
    U32 = "u32"
    U8 = "u8"
    BOOL = "bool"
    SIZE = "size_t"
    UINTPTR = "uintptr"
    HANDLE = "handle"
    RES_ID = "res_id"
    STRING = "string"
    RPC_TENSOR = "rpc_tensor"
    INLINE_TENSOR = "inline_tensor"


@dataclass(frozen=True)
class Field:
    name: str
    kind: Kind
    since: Version = APIR_PROTOCOL_0_1  # the first APIR version that carries it


I32, U32, U8, BOOL, SIZE = Kind.I32, Kind.U32, Kind.U8, Kind.BOOL, Kind.SIZE
UINTPTR, HANDLE, RES_ID, STRING = Kind.UINTPTR, Kind.HANDLE, Kind.RES_ID, Kind.STRING
RPC_TENSOR, INLINE_TENSOR = Kind.RPC_TENSOR, Kind.INLINE_TENSOR


@dataclass(frozen=True)
class InlineTensor:
    """An inline ggml_tensor as it travels (`apir_encode_ggml_tensor_inline`): the sender's
    struct; its buffer's host handle, sent only when the struct's `buffer` is set; the
    view_src struct when `view_src` is set; one struct per `src[i]` up to the first null.
    Pointers inside the structs are the sender's: they only say which parts follow."""

    tensor: bytes
    buffer: Optional[int] = None
    view_src: Optional[bytes] = None
    srcs: Tuple[bytes, ...] = ()


@dataclass(frozen=True)
class TensorLayouts:
    """The two structs that travel whole, as the ggml build both sides run lays them out."""

    rpc_tensor: np.dtype
    ggml_tensor: np.dtype

    @classmethod
    def of(cls, limits: GgmlLimits) -> "TensorLayouts":
        return cls(rpc_tensor_dtype(limits), ggml_tensor_dtype(limits))


class MalformedMessage(ApirError, ValueError):
    """A command's arguments or a reply that end before their last field, or a reply string
    whose size is 0 or too large."""


def _write_inline(enc: Encoder, value: InlineTensor) -> None:
    enc.blob(value.tensor)
    if value.buffer is not None:
        enc.u64(value.buffer)
    if value.view_src is not None:
        enc.blob(value.view_src)
    for src in value.srcs:
        enc.blob(src)


def _read_rpc_tensor(dec: Decoder, layouts: TensorLayouts) -> Optional[memoryview]:
    return dec.inplace(layouts.rpc_tensor.itemsize)  # a view: read it before the buffer changes


def _read_inline(dec: Decoder, layouts: TensorLayouts) -> Optional[InlineTensor]:
    """The parts the struct's pointers announce; None when the message ends first."""
    size = layouts.ggml_tensor.itemsize
    head = dec.inplace(size)
    if head is None:
        return None
    tensor = bytes(head)
    rec = np.frombuffer(tensor, dtype=layouts.ggml_tensor, count=1)[0]
    buffer = dec.u64() if int(rec["buffer"]) else None
    view_src = dec.inplace(size) if int(rec["view_src"]) else None
    srcs = []
    for pointer in rec["src"]:
        if not int(pointer):
            break
        src = dec.inplace(size)
        if src is None:
            return None
        srcs.append(bytes(src))
    if dec.fatal:
        return None
    return InlineTensor(tensor, buffer, bytes(view_src) if view_src is not None else None, tuple(srcs))


# How each kind is written and read: Encoder and Decoder methods for the kinds that are one
# value; the tensor readers also take the TensorLayouts of the ggml build.
_WRITE: Dict[Kind, Callable[[Encoder, Any], None]] = {
    I32: Encoder.i32,
    U32: Encoder.u32,
    RES_ID: Encoder.u32,
    U8: Encoder.u8,
    BOOL: Encoder.bool,
    SIZE: Encoder.u64,
    UINTPTR: Encoder.u64,
    HANDLE: Encoder.u64,
    STRING: Encoder.string,
    RPC_TENSOR: Encoder.blob,
    INLINE_TENSOR: _write_inline,
}
_READ: Dict[Kind, Callable[[Decoder], Any]] = {
    I32: Decoder.i32,
    U32: Decoder.u32,
    RES_ID: Decoder.u32,
    U8: Decoder.u8,
    BOOL: Decoder.bool,
    SIZE: Decoder.u64,
    UINTPTR: Decoder.u64,
    HANDLE: Decoder.u64,
    STRING: Decoder.string,
}
_READ_TENSOR: Dict[Kind, Callable[[Decoder, TensorLayouts], Any]] = {
    RPC_TENSOR: _read_rpc_tensor,
    INLINE_TENSOR: _read_inline,
}


# The kinds of a fixed size, as `struct` formats of their bytes on the wire (u8 and bool: the
# value in the first byte of a 4-byte slot; the C reads that byte alone).
_FIXED: Dict[Kind, str] = {
    I32: "i",
    U32: "I",
    RES_ID: "I",
    U8: "B3x",
    BOOL: "?3x",
    SIZE: "Q",
    UINTPTR: "Q",
    HANDLE: "Q",
}


class Layout:
    """One function's arguments or its reply in one APIR version: the fields in wire order,
    with the Encoder/Decoder step of each looked up once, when the table is made. When every
    field has a fixed size (most functions), they are also read as one `struct.Struct`, in one
    step: the same values as field by field (tests/codec/test_forward.py holds them equal).
    Writing stays field by field: the Encoder cuts each value to its field as the C's cast
    does, where a struct would refuse it. `write(enc, *values)` is `encode` in one call: for
    one field (most replies) the field's Encoder step itself, no frame of its own."""

    __slots__ = ("function", "fields", "write", "_what", "_ends", "_writes", "_reads", "_struct", "_offsets")

    def __init__(self, function: str, fields: Tuple[Field, ...], what: str, ends: str):
        self.function = function
        self.fields = fields
        self._what = what  # "arguments", "reply values": for a wrong count
        self._ends = ends  # "arguments end", "reply ends": for a short message
        self._writes = tuple(_WRITE[f.kind] for f in fields)
        self.write: Callable[..., None] = self._writes[0] if len(self._writes) == 1 else self._write_all
        # (field, reader, whether the reader takes the TensorLayouts)
        self._reads: Tuple[Tuple[Field, Callable[..., Any], bool], ...] = tuple(
            (f, _READ_TENSOR[f.kind], True) if f.kind in _READ_TENSOR else (f, _READ[f.kind], False) for f in fields
        )
        self._struct: Optional[struct.Struct] = None
        self._offsets: Tuple[int, ...] = ()  # where each field of the struct ends
        if all(f.kind in _FIXED for f in fields):
            formats = [_FIXED[f.kind] for f in fields]
            self._struct = struct.Struct("<" + "".join(formats))
            self._offsets = tuple(struct.calcsize("<" + "".join(formats[: i + 1])) for i in range(len(formats)))

    def encode(self, enc: Encoder, values: Sequence[Any]) -> None:
        """Appends `values`, one per field, in order."""
        if len(values) != len(self._writes):
            names = ", ".join(f.name for f in self.fields) or "none"
            raise TypeError(
                f"{self.function}: {len(values)} {self._what} given, the table has {len(self.fields)} ({names})"
            )
        i = 0  # (an index, not zip or enumerate: their iterator costs more than a small call)
        for write in self._writes:
            write(enc, values[i])
            i += 1

    def _write_all(self, enc: Encoder, *values: Any) -> None:
        self.encode(enc, values)

    def decode(self, dec: Decoder, layouts: Optional[TensorLayouts] = None) -> Tuple[Any, ...]:
        """One value per field: ints, bools, str, a memoryview over an rpc_tensor's bytes, an
        InlineTensor. Raises MalformedMessage naming the first field that did not fit."""
        if self._struct is not None:
            values = dec.unpack(self._struct)
            if values is None:
                short = next(f for f, end in zip(self.fields, self._offsets) if end > dec.remaining)
                raise MalformedMessage(f"{self.function}: {self._ends} before {short.name!r}")
            return values
        decoded = []
        for field, read, takes_layouts in self._reads:
            if not takes_layouts:
                decoded.append(read(dec))
            elif layouts is None:
                raise TypeError("decoding a tensor needs the TensorLayouts of the ggml build")
            else:
                decoded.append(read(dec, layouts))
            if dec.fatal:
                raise MalformedMessage(f"{self.function}: {self._ends} before {field.name!r}")
        return tuple(decoded)


@dataclass(frozen=True)
class Function:
    id: Union[F, X]
    args: Tuple[Field, ...] = ()
    reply: Tuple[Field, ...] = ()
    # (args, reply) Layouts in each known version, worked out once: every call looks them up
    _known: Dict[Version, Tuple[Layout, Layout]] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_known", {v: self._layouts(v) for v in APIR_PROTOCOL_VERSIONS})

    @property
    def name(self) -> str:
        """The C's name, e.g. "buffer_get_tensor"."""
        return self.id.c_name

    def layouts(self, version: Version) -> Tuple[Layout, Layout]:
        """(arguments, reply) of this function in APIR `version`."""
        known = self._known.get(version)
        return known if known is not None else self._layouts(version)

    def args_in(self, version: Version) -> Tuple[Field, ...]:
        return self.layouts(version)[0].fields

    def reply_in(self, version: Version) -> Tuple[Field, ...]:
        return self.layouts(version)[1].fields

    def _layouts(self, version: Version) -> Tuple[Layout, Layout]:
        return (
            Layout(self.name, _in_version(self.args, version), "arguments", "arguments end"),
            Layout(self.name, _in_version(self.reply, version), "reply values", "reply ends"),
        )


def _in_version(fields: Tuple[Field, ...], version: Version) -> Tuple[Field, ...]:
    return tuple(f for f in fields if f.since <= tuple(version))


_TRANSFER = (
    Field("buffer", HANDLE),
    Field("tensor", RPC_TENSOR),
    Field("shmem_res_id", RES_ID),  # the bytes are [0, size) of this resource
    Field("offset", SIZE),  # byte offset within the tensor
    Field("size", SIZE),
)

_TABLE = (
    # device (virtgpu-forward-device.cpp, backend-dispatched-device.cpp)
    Function(F.DEVICE_GET_DEVICE_COUNT, reply=(Field("count", I32),)),
    Function(F.DEVICE_GET_COUNT, reply=(Field("count", I32),)),
    Function(F.DEVICE_GET_NAME, reply=(Field("name", STRING),)),
    Function(F.DEVICE_GET_DESCRIPTION, reply=(Field("description", STRING),)),
    Function(F.DEVICE_GET_TYPE, reply=(Field("type", U32),)),  # enum ggml_backend_dev_type
    Function(F.DEVICE_GET_MEMORY, reply=(Field("free", SIZE), Field("total", SIZE))),
    Function(F.DEVICE_SUPPORTS_OP, args=(Field("op", INLINE_TENSOR),), reply=(Field("supported", BOOL),)),
    Function(F.DEVICE_GET_BUFFER_TYPE, reply=(Field("buft", HANDLE),)),
    Function(
        F.DEVICE_GET_PROPS,  # ggml_backend_dev_caps
        reply=(
            Field("async", BOOL),
            Field("host_buffer", BOOL),
            Field("buffer_from_host_ptr", BOOL),
            Field("events", BOOL),
            Field("mmap_support", BOOL, since=APIR_PROTOCOL_0_2),
        ),
    ),
    Function(
        F.DEVICE_BUFFER_FROM_PTR,
        args=(Field("shmem_res_id", RES_ID), Field("size", SIZE), Field("max_tensor_size", SIZE)),
        reply=(Field("buffer", HANDLE), Field("buft", HANDLE)),
    ),
    # buffer type (virtgpu-forward-buffer-type.cpp); is_host: the C host reads no argument
    Function(F.BUFFER_TYPE_GET_NAME, args=(Field("buft", HANDLE),), reply=(Field("name", STRING),)),
    Function(F.BUFFER_TYPE_GET_ALIGNMENT, args=(Field("buft", HANDLE),), reply=(Field("alignment", SIZE),)),
    Function(F.BUFFER_TYPE_GET_MAX_SIZE, args=(Field("buft", HANDLE),), reply=(Field("max_size", SIZE),)),
    Function(F.BUFFER_TYPE_IS_HOST, args=(Field("buft", HANDLE),), reply=(Field("is_host", BOOL),)),
    Function(
        F.BUFFER_TYPE_ALLOC_BUFFER,
        args=(Field("buft", HANDLE), Field("size", SIZE)),
        reply=(Field("buffer", HANDLE),),
    ),
    Function(
        F.BUFFER_TYPE_GET_ALLOC_SIZE,
        args=(Field("buft", HANDLE), Field("op", INLINE_TENSOR)),
        reply=(Field("alloc_size", SIZE),),
    ),
    # buffer (virtgpu-forward-buffer.cpp)
    Function(F.BUFFER_GET_BASE, args=(Field("buffer", HANDLE),), reply=(Field("base", UINTPTR),)),
    Function(F.BUFFER_SET_TENSOR, args=_TRANSFER),
    Function(F.BUFFER_GET_TENSOR, args=_TRANSFER),
    Function(
        F.BUFFER_CPY_TENSOR,
        args=(Field("buffer", HANDLE), Field("src", RPC_TENSOR), Field("dst", RPC_TENSOR)),
        reply=(Field("copied", BOOL),),
    ),
    Function(F.BUFFER_CLEAR, args=(Field("buffer", HANDLE), Field("value", U8))),
    Function(F.BUFFER_FREE_BUFFER, args=(Field("buffer", HANDLE),)),
    # backend (virtgpu-forward-backend.cpp): the serialized graph is [0, size) of the resource
    Function(
        F.BACKEND_GRAPH_COMPUTE,
        args=(Field("shmem_res_id", RES_ID), Field("size", SIZE)),
        reply=(Field("status", I32),),  # enum ggml_status
    ),
)

# The extensions (docs/protocol.md, "Extensions"): sent only once EXT_QUERY agreed on them,
# EXT_QUERY itself only by a guest that has them.
_EXTENSIONS = (
    Function(
        X.EXT_QUERY,
        args=(Field("guest_extensions", U32),),  # ApirExtension bits the guest has
        reply=(Field("extensions", U32), Field("device_count", U32)),  # both have; devices served
    ),
    Function(X.DEVICE_SELECT, args=(Field("device", U32),)),
    Function(
        X.GRAPH_COMPUTE_KEEP,
        args=(Field("graph_id", SIZE), Field("shmem_res_id", RES_ID), Field("size", SIZE)),
        reply=(Field("status", I32),),
    ),
    Function(X.GRAPH_RECOMPUTE, args=(Field("graph_id", SIZE),), reply=(Field("status", I32),)),
    # ASYNC: the posted commands since the last waited-for one, and the first that failed
    # (`code` 0: none; else the Forward return code it would have had, waited for)
    Function(
        X.SYNCHRONIZE,
        reply=(Field("posted", U32), Field("failed_index", U32), Field("function", U32), Field("code", U32)),
    ),
    Function(X.EVENT_NEW, reply=(Field("event", HANDLE),)),
    Function(X.EVENT_RECORD, args=(Field("event", HANDLE),)),
    Function(X.EVENT_WAIT, args=(Field("event", HANDLE),)),
    Function(X.EVENT_SYNCHRONIZE, args=(Field("event", HANDLE),)),
    Function(X.EVENT_FREE, args=(Field("event", HANDLE),)),
    Function(  # buffer_set_tensor from bytes [shmem_offset, + size) of the resource
        X.BUFFER_SET_TENSOR_AT,
        args=(
            Field("buffer", HANDLE),
            Field("tensor", RPC_TENSOR),
            Field("shmem_res_id", RES_ID),
            Field("shmem_offset", SIZE),
            Field("offset", SIZE),
            Field("size", SIZE),
        ),
    ),
)

# By function id (an ApirBackendCommandType or ApirExtensionCommandType, or the int of one).
FORWARD: Dict[int, Function] = {int(f.id): f for f in _TABLE + _EXTENSIONS}


@functools.lru_cache(maxsize=64)
def layouts_between(guest: Version, host: Version) -> Dict[int, Tuple[Layout, Layout]]:
    """Every function's (arguments, reply) Layouts, by function id, in the version a guest
    speaking `guest` and a host speaking `host` negotiate (`negotiated_version`). Both sides
    ask once per HandShake and keep the answer (the host context's `forward_layouts`, the
    client's `ForwardCaller`); it is kept here too, per pair of versions."""
    version = negotiated_version(guest, host)
    return {fid: f.layouts(version) for fid, f in FORWARD.items()}


@functools.lru_cache(maxsize=64)
def reply_writers(guest: Version, host: Version) -> Dict[str, Callable[..., None]]:
    """Each function's reply writer (`Layout.write`) by the C name, in the version of
    `layouts_between(guest, host)`: `writers["device_get_type"](enc, type)`. The host asks
    once per HandShake (its context's `forward_replies`)."""
    return {FORWARD[fid].name: reply.write for fid, (_, reply) in layouts_between(guest, host).items()}


def encode_args(enc: Encoder, function: Function, version: Version, args: Sequence[Any]) -> None:
    """Appends `args`, one value per argument of `function` in APIR `version`, in order."""
    function.layouts(version)[0].encode(enc, args)


def decode_args(
    dec: Decoder, function: Function, version: Version, layouts: Optional[TensorLayouts] = None
) -> Tuple[Any, ...]:
    """The arguments of `function` in APIR `version`, one value per field (`Layout.decode`).
    `layouts` is needed by the functions that carry tensors. Raises MalformedMessage."""
    return function.layouts(version)[0].decode(dec, layouts)


def encode_reply(enc: Encoder, function: Function, version: Version, values: Sequence[Any]) -> None:
    """Appends the reply of `function` in APIR `version`: one value per field, in order."""
    function.layouts(version)[1].encode(enc, values)


def decode_reply(dec: Decoder, function: Function, version: Version) -> Tuple[Any, ...]:
    """The reply of `function` in APIR `version`, one value per field. Raises MalformedMessage."""
    return function.layouts(version)[1].decode(dec)
