"""Fixed-size records of the wire: `apir_rpc_tensor` and the raw `ggml_tensor`.

Theory of operation: both are C structs copied byte for byte, so each is a numpy structured
dtype with the C offsets spelled out (padding holes included), built from ggml's four size
constants. The defaults are ggml 0.20.2's; `apir.ggml.layout` checks them against the loaded
libggml at start-up, and callers pass `GgmlLimits` read from another build where it differs.

`apir_rpc_tensor` (backend/shared/apir_cs_rpc.h) is 304 bytes with the defaults; `ggml_tensor`
(ggml.h) 336, the same fields at their own offsets with ne/nb 64-bit, pointers for
buffer/src/view_src/data, then `extra` and 8 bytes of padding. docs/protocol.md section 6 gives
both layouts field by field, holes included.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from typing import Dict, Mapping, Union

import numpy as np

__all__ = [
    "field_offset",
    "GgmlLimits",
    "GGML_0_20_LIMITS",
    "rpc_tensor_dtype",
    "ggml_tensor_dtype",
    "RPC_TENSOR_DTYPE",
    "GGML_TENSOR_DTYPE",
    "rpc_tensor_undefined_mask",
    "RecordStruct",
]


@dataclass(frozen=True)
class GgmlLimits:
    """ggml's compile-time sizes that shape the records (ggml.h GGML_MAX_*)."""

    max_dims: int = 4
    max_src: int = 10
    max_op_params: int = 64  # bytes
    max_name: int = 64


GGML_0_20_LIMITS = GgmlLimits()


def _align(off: int, a: int) -> int:
    return (off + a - 1) & ~(a - 1)


def _build(fields, total_align: int = 8) -> np.dtype:
    """A dtype from (name, format, count, alignment) in C order, inserting C's holes."""
    names, formats, offsets = [], [], []
    off = 0
    for name, fmt, count, align in fields:
        off = _align(off, align)
        names.append(name)
        formats.append(fmt if count == 1 else (fmt, (count,)))
        offsets.append(off)
        off += np.dtype(fmt).itemsize * count
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": _align(off, total_align)})


@functools.lru_cache(maxsize=8)
def rpc_tensor_dtype(limits: GgmlLimits = GGML_0_20_LIMITS) -> np.dtype:
    """`struct apir_rpc_tensor` for ggml built with `limits` (304 bytes for 0.20.2). One
    dtype per `limits`, cached: every parse_graph asks for it."""
    return _build(
        [
            ("id", "<u8", 1, 8),
            ("type", "<u4", 1, 4),
            ("buffer", "<u8", 1, 8),
            ("ne", "<u4", limits.max_dims, 4),
            ("nb", "<u4", limits.max_dims, 4),
            ("op", "<u4", 1, 4),
            ("op_params", "<i4", limits.max_op_params // 4, 4),
            ("flags", "<i4", 1, 4),
            ("src", "<u8", limits.max_src, 8),
            ("view_src", "<u8", 1, 8),
            ("view_offs", "<u8", 1, 8),
            ("data", "<u8", 1, 8),
            ("name", "S1", limits.max_name, 1),
            ("padding", "S1", 4, 1),
        ]
    )


@functools.lru_cache(maxsize=8)
def ggml_tensor_dtype(limits: GgmlLimits = GGML_0_20_LIMITS) -> np.dtype:
    """`struct ggml_tensor` on a 64-bit little-endian host (336 bytes for 0.20.2).
    Pointers are u8 addresses. One dtype per `limits` (cached)."""
    return _build(
        [
            ("type", "<u4", 1, 4),
            ("buffer", "<u8", 1, 8),
            ("ne", "<i8", limits.max_dims, 8),
            ("nb", "<u8", limits.max_dims, 8),
            ("op", "<u4", 1, 4),
            ("op_params", "<i4", limits.max_op_params // 4, 4),
            ("flags", "<i4", 1, 4),
            ("src", "<u8", limits.max_src, 8),
            ("view_src", "<u8", 1, 8),
            ("view_offs", "<u8", 1, 8),
            ("data", "<u8", 1, 8),
            ("name", "S1", limits.max_name, 1),
            ("extra", "<u8", 1, 8),
            ("padding", "S1", 8, 1),
        ]
    )


RPC_TENSOR_DTYPE = rpc_tensor_dtype()
GGML_TENSOR_DTYPE = ggml_tensor_dtype()
assert RPC_TENSOR_DTYPE.itemsize == 304 and GGML_TENSOR_DTYPE.itemsize == 336


def field_offset(dtype: np.dtype, name: str) -> int:
    """The byte offset of field `name` in the structured `dtype`. Raises KeyError when it has
    no such field (or no fields at all)."""
    fields = dtype.fields
    if fields is None or name not in fields:
        raise KeyError(f"{dtype} has no field {name!r}")
    return int(fields[name][1])


def rpc_tensor_undefined_mask(dtype: np.dtype = RPC_TENSOR_DTYPE) -> np.ndarray:
    """Bool array over one record's bytes: True where the C sender leaves stack garbage
    (holes, `padding`). Name bytes after the NUL are garbage too; callers mask those per
    record, since they depend on the name's length."""
    mask = np.ones(dtype.itemsize, dtype=bool)
    for name in dtype.names or ():
        if name == "padding":
            continue
        off = field_offset(dtype, name)
        mask[off : off + dtype[name].itemsize] = False
    return mask


_STRUCT_CODES = {"<u4": "I", "<i4": "i", "<u8": "Q", "<i8": "q"}


class RecordStruct:
    """A `struct.Struct` laid out like the structured `dtype` (one of the two above), for a
    record read or written whole by Python code, where a numpy record's field access is the
    slower (docs/design.md, Measurements): `unpack_from` gives a flat tuple, `pack_into` takes one.

    `slots[name]` is the field's place in that tuple: an index (a scalar; a name's bytes, one
    `bytes` of the whole array) or a slice (an array field, one item an element). Holes and
    the tail are pad bytes (zero when packed). Raises KeyError for a field format outside
    u32/i32/u64/i64/bytes."""

    def __init__(self, dtype: np.dtype):
        fields: Mapping[str, tuple] = dtype.fields or {}
        parts, pos, index = ["<"], 0, 0
        self.slots: Dict[str, Union[int, slice]] = {}
        for name in sorted(fields, key=lambda n: fields[n][1]):
            sub, off = fields[name][0], int(fields[name][1])
            if off > pos:
                parts.append(f"{off - pos}x")
            base, count = sub.base, int(np.prod(sub.shape)) if sub.shape else 1
            if base.kind == "S":
                parts.append(f"{count * base.itemsize}s")
                self.slots[name] = index
                index += 1
            else:
                parts.append(f"{count}{_STRUCT_CODES[base.str]}")
                self.slots[name] = slice(index, index + count) if sub.shape else index
                index += count
            pos = off + sub.itemsize
        if dtype.itemsize > pos:
            parts.append(f"{dtype.itemsize - pos}x")
        self.struct = struct.Struct("".join(parts))
        self.size = self.struct.size
        self.items = index  # the length of the flat tuple
        assert self.size == dtype.itemsize, (self.size, dtype.itemsize)
