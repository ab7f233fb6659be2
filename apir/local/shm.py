"""Mapping a range of the shared memory file without holding a descriptor per mapping.

Theory of operation: the local transport puts every blob of a context in one memfd and each side
maps a blob's range on its own (apir.host.local.memfile on the host, `LocalDevice` on the guest).
Python's `mmap.mmap(fd, ...)` keeps a dup() of `fd` for as long as the mapping lives (for its
`size()` and `resize()`), so every blob cost a file descriptor: a guest that made about 20,000
16 KiB blobs used up the host process's descriptors, and then no guest could connect, make a blob
or even import a module. A mapping needs no descriptor once it exists, so `map_shared` makes one
that keeps none: on Python 3.13+ with `trackfd=False`; before that, an anonymous `mmap.mmap` (no
descriptor) reserves the address range and libc's `mmap(MAP_FIXED)` then puts the file's range in
its place. The `mmap` object keeps its usual behaviour for slicing, buffer exports, `madvise` and
`close` (munmap); only `size()` and `resize()` are not available (apir calls neither).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys

__all__ = ["map_shared"]

_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FIXED = 0x10  # asm-generic/mman-common.h (the Python 3.11 mmap module does not export it)
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc_mmap = None


def _mmap_fn():
    global _libc_mmap
    if _libc_mmap is None:
        fn = ctypes.CDLL(None, use_errno=True).mmap
        fn.restype = ctypes.c_void_p
        fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
        _libc_mmap = fn
    return _libc_mmap


def map_shared(fd: int, size: int, offset: int) -> mmap.mmap:
    """A shared read-write mapping of bytes [offset, offset + size) of `fd` that holds no
    descriptor (closing `fd` later leaves it valid). `offset` must be page aligned.
    Raises OSError (the errno of mmap) or ValueError, like `mmap.mmap`."""
    if sys.version_info >= (3, 13):
        return mmap.mmap(fd, size, mmap.MAP_SHARED, _PROT_RW, offset=offset, trackfd=False)
    memory = mmap.mmap(-1, size, mmap.MAP_SHARED, _PROT_RW)  # reserves the range, keeps no fd
    anchor = ctypes.c_char.from_buffer(memory)
    address = ctypes.addressof(anchor)
    del anchor  # the buffer export: close() refuses while one is alive
    got = _mmap_fn()(address, size, _PROT_RW, mmap.MAP_SHARED | _MAP_FIXED, fd, offset)
    if got != address:
        err = ctypes.get_errno()
        memory.close()
        if got != _MAP_FAILED:  # the kernel never moves a MAP_FIXED mapping; be sure anyway
            raise OSError(f"mmap(MAP_FIXED) placed the mapping at {got:#x}, not {address:#x}")
        raise OSError(err, f"mmap of {size} bytes at offset {offset}: {os.strerror(err)}")
    return memory
