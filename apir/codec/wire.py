"""The APIR encoder and decoder: 4-byte aligned values over any buffer.

Theory of operation (mirrors `backend/shared/apir_cs.h`): a command or reply is a run of
values, each occupying a multiple of 4 bytes, little-endian. 8-byte values (u64, size_t,
uintptr, handles) take 8; u8 and bool take 4 with the value in the first byte; blobs are
padded to 4; a C string travels as its u64 array size (length + 1, the NUL included) then
the bytes padded to 4. There is no tag or length prefix beyond what the caller encodes.

Both classes work in place over a buffer the caller owns (bytearray, mmap, numpy array),
so the host decodes straight out of a guest's shared memory. No I/O happens here.

Errors: a decoder that would read past its end sets `fatal`, returns zeros and does not
move (the C `apir_decoder_peek_internal`); it never raises and never reads out of bounds,
so a handler can decode everything and check `fatal` once. An encoder that would write
past its end sets `fatal` and from then on writes nothing (the C asserts instead), so what
it wrote is always a prefix of the intended message; `check()` raises.
"""

from __future__ import annotations

import builtins
import struct
from typing import Any, Optional, Tuple

import numpy as np

from apir.errors import ApirError

__all__ = ["Decoder", "Encoder", "EncoderOverflow", "align4"]

_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_U64 = struct.Struct("<Q")
_ZERO4 = b"\0\0\0\0"
# A failed array read yields zeros, like the C; past this many bytes it yields an empty
# array instead, so a hostile count cannot make the host allocate gigabytes of zeros.
_MAX_ZERO_FILL = 1 << 16


def align4(size: int) -> int:
    """`size` rounded up to a multiple of 4 (the C `(size + 3) & ~3`)."""
    return (size + 3) & ~3


def _byte_view(buf) -> memoryview:
    view = memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


class EncoderOverflow(ApirError):
    """An encoder ran out of room: the command or reply does not fit its buffer."""


class Decoder:
    """Reads APIR values from ``buf[start:end]`` (`struct apir_decoder`).

    `pos` is the absolute offset of the next value; `fatal` is set, never cleared, by any
    read past `end` or any array size that does not match what the caller expects.
    """

    __slots__ = ("buf", "start", "pos", "end", "fatal")

    def __init__(self, buf, start: int = 0, end: Optional[int] = None):
        self.buf = _byte_view(buf)
        size = len(self.buf)
        if end is None:
            end = size
        if not 0 <= start <= end <= size:
            raise ValueError(f"decoder window [{start}, {end}) outside a {size}-byte buffer")
        self.start = start
        self.pos = start
        self.end = end
        self.fatal = False

    def reset(self) -> None:
        """Starts over at `start` (`fatal` is cleared), to reuse this decoder for the next
        reply in the same buffer."""
        self.pos = self.start
        self.fatal = False

    @property
    def remaining(self) -> int:
        return self.end - self.pos

    def _take(self, size: int) -> int:
        """Offset of `size` bytes to consume, or -1 (fatal set) when they are not there."""
        pos = self.pos
        if size < 0 or size > self.end - pos:
            self.fatal = True
            return -1
        self.pos = pos + size
        return pos

    # --- scalars -------------------------------------------------------------------------
    def u32(self) -> int:
        off = self._take(4)
        return 0 if off < 0 else _U32.unpack_from(self.buf, off)[0]

    def i32(self) -> int:
        off = self._take(4)
        return 0 if off < 0 else _I32.unpack_from(self.buf, off)[0]

    def u8(self) -> int:
        off = self._take(4)
        return 0 if off < 0 else self.buf[off]

    def bool(self) -> bool:
        # C reads sizeof(bool) = 1 byte; any non-zero byte is true.
        off = self._take(4)
        return False if off < 0 else self.buf[off] != 0

    def u64(self) -> int:
        off = self._take(8)
        return 0 if off < 0 else _U64.unpack_from(self.buf, off)[0]

    size_t = u64
    uintptr = u64
    handle = u64  # apir_buffer_type_host_handle_t, apir_buffer_host_handle_t

    # --- arrays ------------------------------------------------------------------------
    def _array(self, dtype, count: int) -> np.ndarray:
        """`count` values copied out; zeros (at most _MAX_ZERO_FILL bytes of them) on overrun."""
        dt = np.dtype(dtype)
        off = self._take(dt.itemsize * count) if count >= 0 else self._take(-1)
        if off < 0:
            return np.zeros(count if 0 <= count * dt.itemsize <= _MAX_ZERO_FILL else 0, dt)
        return np.frombuffer(self.buf, dtype=dt, count=count, offset=off).copy()

    def u64_array(self, count: int) -> np.ndarray:
        return self._array("<u8", count)

    def u32_array(self, count: int) -> np.ndarray:
        return self._array("<u4", count)

    def i32_array(self, count: int) -> np.ndarray:
        return self._array("<i4", count)

    def unpack(self, st: struct.Struct) -> Optional[Tuple[Any, ...]]:
        """Several values at once in the layout `st` (what as many scalar reads would return,
        in one step: `Encoder.pack`'s twin); None, `fatal` set, when they are not all there."""
        off = self._take(st.size)
        return None if off < 0 else st.unpack_from(self.buf, off)

    def inplace(self, size: int) -> Optional[memoryview]:
        """The next `size` bytes as a view (`apir_decoder_use_inplace`), None on overrun.
        `size` is not padded: callers pass the C sizes, which are multiples of 4."""
        off = self._take(size)
        return None if off < 0 else self.buf[off : off + size]

    def blob(self, size: int) -> bytes:
        """`size` bytes, the read advancing by `size` padded to 4 (`apir_decode_blob_array`)."""
        off = self._take(align4(size)) if size >= 0 else self._take(-1)
        if off < 0:
            return bytes(size if 0 <= size <= _MAX_ZERO_FILL else 0)
        return bytes(self.buf[off : off + size])

    # --- sizes, pointers, strings -------------------------------------------------------
    def array_size(self, expected: int) -> int:
        """A u64 array size that must equal `expected`; otherwise fatal and 0."""
        size = self.u64()
        if size != expected:
            self.fatal = True
            return 0
        return size

    def array_size_unchecked(self) -> int:
        return self.u64()

    def simple_pointer(self) -> builtins.bool:  # builtins: `bool` here is the method above
        """Whether the sender's pointer was non-null (`apir_decode_simple_pointer`)."""
        return self.u64() != 0

    def char_array(self, size: int) -> bytes:
        """`size` bytes whose last is forced to NUL (`apir_decode_char_array`); returns the
        bytes up to the first NUL. A size of 0 is fatal."""
        if size <= 0:
            self.fatal = True
            return b""
        raw = self.blob(size)
        return raw[: size - 1].split(b"\0", 1)[0]

    def string(self, max_size: int = 1 << 20) -> str:
        """A C string as the C replies carry it: u64 size (NUL included) then the bytes.
        A size of 0 or above `max_size` is fatal (the sender is hostile or confused)."""
        size = self.array_size_unchecked()
        if size == 0 or size > max_size:
            self.fatal = True
            return ""
        return self.char_array(size).decode("utf-8", "replace")


class Encoder:
    """Writes APIR values into ``buf[start:end]`` (`struct apir_encoder`).

    `pos` is the absolute offset of the next value; `written` the bytes since `start`.
    Padding bytes of u8/bool/blobs are zeroed (the C leaves them as they were).
    """

    __slots__ = ("buf", "start", "pos", "end", "fatal")

    def __init__(self, buf, start: int = 0, end: Optional[int] = None):
        self.buf = _byte_view(buf)
        if self.buf.readonly:
            raise ValueError("encoder needs a writable buffer")
        size = len(self.buf)
        if end is None:
            end = size
        if not 0 <= start <= end <= size:
            raise ValueError(f"encoder window [{start}, {end}) outside a {size}-byte buffer")
        self.start = start
        self.pos = start
        self.end = end
        self.fatal = False

    def reset(self) -> None:
        """Starts over at `start` (the bytes stay; `fatal` is cleared), to reuse this encoder
        for the next command over the same buffer."""
        self.pos = self.start
        self.fatal = False

    @property
    def written(self) -> int:
        return self.pos - self.start

    @property
    def remaining(self) -> int:
        return self.end - self.pos

    def check(self) -> None:
        """Raises EncoderOverflow if any write did not fit."""
        if self.fatal:
            raise EncoderOverflow(f"encoder overflow: {self.end - self.start}-byte buffer too small")

    def reserve(self, size: int) -> int:
        """Claims `size` bytes (padded to 4) and returns their absolute offset, or -1 with
        `fatal` set. For values the caller fills in place (tensor data, graphs)."""
        padded = align4(size)
        pos = self.pos
        if self.fatal or size < 0 or padded > self.end - pos:
            self.fatal = True
            return -1
        self.pos = pos + padded
        if padded != size:
            self.buf[pos + size : pos + padded] = _ZERO4[: padded - size]
        return pos

    # --- scalars -------------------------------------------------------------------------
    def _pack(self, st: struct.Struct, value) -> None:
        # `pack` for one value: the scalars' path, where `pack`'s *values took twice the time
        pos = self.pos
        if self.fatal or st.size > self.end - pos:
            self.fatal = True
            return
        st.pack_into(self.buf, pos, value)
        self.pos = pos + st.size

    def pack(self, st: struct.Struct, *values) -> None:
        """Several values at once in the layout `st` (little-endian, 4-byte fields: what as
        many `i32`/`u32` calls would write, in one step), e.g. a command header."""
        pos = self.pos
        if self.fatal or st.size > self.end - pos:
            self.fatal = True
            return
        st.pack_into(self.buf, pos, *values)
        self.pos = pos + st.size

    def u32(self, value: int) -> None:
        self._pack(_U32, value & 0xFFFFFFFF)

    def i32(self, value: int) -> None:
        self._pack(_I32, value)

    def u8(self, value: int) -> None:
        self._pack(_U32, value & 0xFF)

    def bool(self, value: bool) -> None:
        self._pack(_U32, 1 if value else 0)

    def u64(self, value: int) -> None:
        self._pack(_U64, value & 0xFFFFFFFFFFFFFFFF)

    size_t = u64
    uintptr = u64
    handle = u64

    # --- arrays, blobs, strings ----------------------------------------------------------
    def blob(self, data) -> None:
        """Raw bytes padded to 4 (`apir_encode_blob_array`)."""
        src = _byte_view(data)
        off = self.reserve(len(src))
        if off >= 0:
            self.buf[off : off + len(src)] = src

    def array(self, values, dtype) -> None:
        """A typed array with no size prefix (`apir_encode_*_array`)."""
        self.blob(np.ascontiguousarray(values, dtype=dtype))

    def u64_array(self, values) -> None:
        self.array(values, "<u8")

    def u32_array(self, values) -> None:
        self.array(values, "<u4")

    def i32_array(self, values) -> None:
        self.array(values, "<i4")

    def array_size(self, size: int) -> None:
        self.u64(size)

    def simple_pointer(self, present: builtins.bool) -> None:  # builtins: `bool` is a method here
        self.u64(1 if present else 0)

    def char_array(self, text) -> None:
        """`text` plus its NUL, padded to 4, with no size prefix (`apir_encode_char_array`)."""
        data = text.encode() if isinstance(text, str) else bytes(text)
        self.blob(data + b"\0")

    def string(self, text) -> None:
        """A C string as the C replies carry it: u64 size (NUL included), then the bytes."""
        data = text.encode() if isinstance(text, str) else bytes(text)
        self.array_size(len(data) + 1)
        self.blob(data + b"\0")
