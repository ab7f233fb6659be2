"""Memory fenced by unreadable pages, so that any out-of-bounds access by the host crashes.

Theory of operation: a `Fenced` region is one anonymous mapping of GUARD bytes of PROT_NONE
pages, the usable pages, and GUARD bytes of PROT_NONE pages again. A blob placed in it ends
exactly where the trailing guard starts (`tail(n)`), so a read one byte past its end faults
(SIGSEGV), as does a read before its first page. The guards are large (1 MiB by default) so
that a kernel striding far past a tensor still lands in them rather than in other memory.

`FencedBuffers` does the same for the host's ggml buffers: it replaces the loaded `Ggml`
object's `ggml_backend_buft_alloc_buffer` (the one call apir's host allocates buffers with)
by a fenced mapping wrapped with `ggml_backend_cpu_buffer_from_ptr`, the buffer ending at the
trailing guard. Freed buffers stay PROT_NONE for a while (a quarantine) so that a use after
free faults too. The only difference the host can see is the buffer's type: ggml's
CPU_Mapped type instead of the device's CPU type (a second buffer-type handle).

Linux only (mmap / mprotect through libc).
"""

from __future__ import annotations

import ctypes
import mmap
from collections import deque
from typing import Deque, Dict, Optional

__all__ = ["Fenced", "FencedBuffers", "GUARD", "PAGE"]

PAGE = mmap.PAGESIZE
GUARD = 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_PROT_NONE = 0


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


class Fenced:
    """`size` usable bytes (rounded up to pages) between two PROT_NONE guards of `guard`
    bytes. `address` is the first usable byte, `end` one past the last."""

    def __init__(self, size: int, guard: int = GUARD):
        self.usable = _round_up(max(size, 1), PAGE)
        self.guard = guard
        self.total = guard + self.usable + guard
        base = _libc.mmap(None, self.total, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        if base in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap of {self.total} bytes failed")
        self.base = base
        self.address = base + guard
        self.end = self.address + self.usable
        if _libc.mprotect(self.address, self.usable, mmap.PROT_READ | mmap.PROT_WRITE) != 0:
            self.close()
            raise OSError(ctypes.get_errno(), "mprotect failed")

    def tail(self, n: int, align: int = 64) -> memoryview:
        """A writable view of `n` bytes ending at the trailing guard (rounded up to `align`
        so the start stays aligned; then at most align-1 bytes of slack before the guard)."""
        n = _round_up(max(n, 1), align)
        if n > self.usable:
            raise ValueError(f"{n} bytes do not fit a {self.usable}-byte fenced region")
        return memoryview((ctypes.c_char * n).from_address(self.end - n)).cast("B")

    def zero(self) -> None:
        ctypes.memset(self.address, 0, self.usable)

    def protect_all(self) -> None:
        """Makes the whole region unreadable (quarantine of a freed buffer)."""
        _libc.mprotect(self.address, self.usable, _PROT_NONE)

    def close(self) -> None:
        if self.base:
            _libc.munmap(self.base, self.total)
            self.base = 0


class FencedBuffers:
    """Fenced ggml CPU buffers for the host's `alloc_buffer` (see the module docstring).
    Sizes up to `max_size` are fenced; larger ones go to ggml's own allocation (a fenced
    mapping of them would only be reserved, not committed, and hide the host's limits)."""

    def __init__(self, g, max_size: int = 256 << 20, quarantine: int = 32, guard: int = 64 << 10):
        self.g = g
        self.max_size = max_size
        self.guard = guard
        self._orig_alloc = g.ggml_backend_buft_alloc_buffer
        self._orig_free = g.ggml_backend_buffer_free
        self._live: Dict[int, Fenced] = {}
        self._quarantine: Deque[Fenced] = deque()
        self._quarantine_len = quarantine
        self.fenced_allocs = 0  # how many host buffers were fenced (the harness checks it)
        self.align = g.ggml_backend_buft_get_alignment(g.ggml_backend_cpu_buffer_type())

    def install(self) -> "FencedBuffers":
        self.g.ggml_backend_buft_alloc_buffer = self._alloc
        self.g.ggml_backend_buffer_free = self._free
        return self

    def uninstall(self) -> None:
        self.g.ggml_backend_buft_alloc_buffer = self._orig_alloc
        self.g.ggml_backend_buffer_free = self._orig_free

    def _alloc(self, buft, size) -> Optional[int]:
        if size == 0 or size > self.max_size:
            return self._orig_alloc(buft, size)
        region = Fenced(_round_up(size, self.align), self.guard)
        ptr = self.g.ggml_backend_cpu_buffer_from_ptr(region.end - _round_up(size, self.align), size)
        if not ptr:
            region.close()
            return None
        self._live[ptr] = region
        self.fenced_allocs += 1
        return ptr

    def _free(self, buffer) -> None:
        self._orig_free(buffer)
        region = self._live.pop(buffer, None)
        if region is None:
            return
        region.protect_all()
        self._quarantine.append(region)
        while len(self._quarantine) > self._quarantine_len:
            self._quarantine.popleft().close()
