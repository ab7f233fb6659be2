"""The 23 Forward functions: what each command carries and what its reply carries.

Theory of operation: `FORWARD` holds one `Function` per `ApirBackendCommandType` id, with its
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
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import numpy as np

from apir.codec.constants import (
    APIR_PROTOCOL_0_1,
    APIR_PROTOCOL_0_2,
    APIR_PROTOCOL_VERSIONS,
    ApirBackendCommandType as F,
)
from apir.codec.records import GgmlLimits, ggml_tensor_dtype, rpc_tensor_dtype
from apir.codec.wire import Decoder, Encoder
from apir.errors import ApirError

__all__ = [
    "Kind",
    "Field",
    "Function",
    "FORWARD",
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


@dataclass(frozen=True)
class Function:
    id: F
    args: Tuple[Field, ...] = ()
    reply: Tuple[Field, ...] = ()
    # (args, reply) in each known version, worked out once: every call looks them up
    _known: Dict[Version, Tuple[Tuple[Field, ...], Tuple[Field, ...]]] = dataclasses.field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        known = {v: (_in_version(self.args, v), _in_version(self.reply, v)) for v in APIR_PROTOCOL_VERSIONS}
        object.__setattr__(self, "_known", known)

    @property
    def name(self) -> str:
        """The C's name, e.g. "buffer_get_tensor"."""
        return self.id.c_name

    def args_in(self, version: Version) -> Tuple[Field, ...]:
        known = self._known.get(version)
        return known[0] if known is not None else _in_version(self.args, version)

    def reply_in(self, version: Version) -> Tuple[Field, ...]:
        known = self._known.get(version)
        return known[1] if known is not None else _in_version(self.reply, version)


def _in_version(fields: Tuple[Field, ...], version: Version) -> Tuple[Field, ...]:
    return tuple(f for f in fields if f.since <= tuple(version))


I32, U32, U8, BOOL, SIZE = Kind.I32, Kind.U32, Kind.U8, Kind.BOOL, Kind.SIZE
UINTPTR, HANDLE, RES_ID, STRING = Kind.UINTPTR, Kind.HANDLE, Kind.RES_ID, Kind.STRING
RPC_TENSOR, INLINE_TENSOR = Kind.RPC_TENSOR, Kind.INLINE_TENSOR

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

# By function id (an ApirBackendCommandType, or the int of one).
FORWARD: Dict[int, Function] = {int(f.id): f for f in _TABLE}


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


def _check_count(function: Function, fields: Sequence[Field], values: Sequence[Any], what: str) -> None:
    if len(values) != len(fields):
        names = ", ".join(f.name for f in fields) or "none"
        raise TypeError(f"{function.name}: {len(values)} {what} given, the table has {len(fields)} ({names})")


# The Encoder and Decoder methods of the kinds that are one value.
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


def _encode(enc: Encoder, kind: Kind, value: Any) -> None:
    write = _WRITE.get(kind)
    if write is not None:
        write(enc, value)
        return
    # INLINE_TENSOR
    enc.blob(value.tensor)
    if value.buffer is not None:
        enc.u64(value.buffer)
    if value.view_src is not None:
        enc.blob(value.view_src)
    for src in value.srcs:
        enc.blob(src)


def _decode_inline(dec: Decoder, dtype: np.dtype) -> Optional[InlineTensor]:
    """The parts the struct's pointers announce; None when the message ends first."""
    size = dtype.itemsize
    head = dec.inplace(size)
    if head is None:
        return None
    tensor = bytes(head)
    rec = np.frombuffer(tensor, dtype=dtype, count=1)[0]
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


def _decode(dec: Decoder, kind: Kind, layouts: Optional[TensorLayouts]) -> Any:
    read = _READ.get(kind)
    if read is not None:
        return read(dec)
    if layouts is None:
        raise TypeError("decoding a tensor needs the TensorLayouts of the ggml build")
    if kind is RPC_TENSOR:
        return dec.inplace(layouts.rpc_tensor.itemsize)  # a view: read it before the buffer changes
    return _decode_inline(dec, layouts.ggml_tensor)


def _decode_fields(dec: Decoder, function: Function, fields: Sequence[Field], layouts, what: str) -> Tuple[Any, ...]:
    values = []
    for field in fields:
        values.append(_decode(dec, field.kind, layouts))
        if dec.fatal:
            raise MalformedMessage(f"{function.name}: {what} before {field.name!r}")
    return tuple(values)


def encode_args(enc: Encoder, function: Function, version: Version, args: Sequence[Any]) -> None:
    """Appends `args`, one value per argument of `function` in APIR `version`, in order."""
    fields = function.args_in(version)
    _check_count(function, fields, args, "arguments")
    for field, value in zip(fields, args):
        _encode(enc, field.kind, value)


def decode_args(
    dec: Decoder, function: Function, version: Version, layouts: Optional[TensorLayouts] = None
) -> Tuple[Any, ...]:
    """The arguments of `function` in APIR `version`, one value per field: ints, bools, a
    memoryview over the rpc_tensor's bytes, an InlineTensor. `layouts` is needed by the
    functions that carry tensors. Raises MalformedMessage."""
    return _decode_fields(dec, function, function.args_in(version), layouts, "arguments end")


def encode_reply(enc: Encoder, function: Function, version: Version, values: Sequence[Any]) -> None:
    """Appends the reply of `function` in APIR `version`: one value per field, in order."""
    fields = function.reply_in(version)
    _check_count(function, fields, values, "reply values")
    for field, value in zip(fields, values):
        _encode(enc, field.kind, value)


def decode_reply(dec: Decoder, function: Function, version: Version) -> Tuple[Any, ...]:
    """The reply of `function` in APIR `version`, one value per field. Raises MalformedMessage."""
    return _decode_fields(dec, function, function.reply_in(version), None, "reply ends")
