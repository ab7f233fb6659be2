"""Bounds-checked bulk copies between numpy arrays, shared memory and raw addresses.

Theory of operation: tensor data moves between the guest's ggml memory (raw addresses),
the shared data window (an mmap) and numpy arrays. Every endpoint is turned into an
(address, length) pair first; the offsets and size are checked against both lengths before
any byte moves, so a bad request raises ValueError and leaves both sides untouched. The bytes
move by `ctypes.memmove` (C's memmove, the GIL released); with `apir.accel.enabled()`, large
copies by its Numba twin (`llvm.memmove`, GIL released, no ctypes call to pay). Overlapping
regions are copied as memmove does.

A raw address is passed as `RawMemory(address, length)` (or any (address, length) tuple):
the caller vouches that the whole range is its own, readable (and writable as destination).
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple, Optional

import numpy as np

from apir import accel

__all__ = ["RawMemory", "copy_bytes", "KERNEL_MIN_BYTES"]

# Below this size the ctypes call is cheaper than dispatching to the kernel.
KERNEL_MIN_BYTES = 1 << 16

# The copy of KERNEL_MIN_BYTES or more: C's memmove, or its Numba twin where enabled.
_bulk_memmove = ctypes.memmove
if accel.enabled():
    from apir.codec._kernels import memmove_kernel as _bulk_memmove


class RawMemory(NamedTuple):
    """`length` bytes at `address` in this process."""

    address: int
    length: int


def _region(obj, writable: bool, role: str):
    """(address, length, keepalive) of a copy endpoint."""
    if isinstance(obj, tuple):
        address, length = (int(v) for v in obj)
        if length < 0 or (length and address <= 0):
            raise ValueError(f"{role}: bad raw region (address {address:#x}, length {length})")
        return address, length, None
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError(f"{role}: numpy array is not C-contiguous")
        arr = obj
    else:
        try:
            arr = np.frombuffer(obj, dtype=np.uint8)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{role}: not a contiguous buffer ({type(obj).__name__})") from exc
    if writable and not arr.flags.writeable:
        raise ValueError(f"{role}: buffer is read-only")
    return arr.ctypes.data, arr.nbytes, arr


def copy_bytes(dst, src, size: Optional[int] = None, *, dst_offset: int = 0, src_offset: int = 0) -> int:
    """Copies `size` bytes from ``src[src_offset:]`` to ``dst[dst_offset:]``; returns `size`.

    `dst` / `src`: a numpy array (C-contiguous; offsets in bytes), any buffer (bytearray,
    mmap, memoryview; `src` may be read-only) or `RawMemory(address, length)`. `size`
    defaults to the rest of `src`. Raises ValueError, before any byte moves, when an offset
    or the size is negative or a range runs past its endpoint's length."""
    d_addr, d_len, d_keep = _region(dst, True, "destination")
    s_addr, s_len, s_keep = _region(src, False, "source")
    if size is None:
        size = s_len - src_offset
    if size < 0 or dst_offset < 0 or src_offset < 0:
        raise ValueError(f"negative size or offset: size {size}, dst_offset {dst_offset}, src_offset {src_offset}")
    if src_offset + size > s_len:
        raise ValueError(f"source range [{src_offset}, {src_offset + size}) past its {s_len} bytes")
    if dst_offset + size > d_len:
        raise ValueError(f"destination range [{dst_offset}, {dst_offset + size}) past its {d_len} bytes")
    if size:
        if size >= KERNEL_MIN_BYTES:
            _bulk_memmove(d_addr + dst_offset, s_addr + src_offset, size)
        else:
            ctypes.memmove(d_addr + dst_offset, s_addr + src_offset, size)
    del d_keep, s_keep
    return size
