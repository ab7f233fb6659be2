"""Acquire loads and release stores of a u32 in shared memory (the reply notification word).

Theory of operation: the guest zeroes the first u32 of its reply blob, sends a command, and
waits until the host stores a non-zero value there after writing the reply (the C uses
`std::atomic_thread_fence` + `std::atomic<uint32_t>` on the mapped word, virtgpu.cpp /
`apir_backend_...` reply notification). The reply bytes must be visible to the guest once it
sees the word, which needs a *release* store on the writer's side and an *acquire* load on
the reader's. On x86-64 a plain aligned load/store already has these semantics, but on ARM64
it does not: a plain read may see the word before the reply bytes. So these are real atomics:
a Numba intrinsic emits LLVM `load atomic i32 ... acquire, align 4` and
`store atomic i32 ... release, align 4` (ldar/stlr on ARM64).

Every function takes any writable buffer (mmap, bytearray, numpy array) and a byte offset;
the word must be 4-byte aligned in memory. Values are in the machine's byte order (guest and
host share one machine; every platform apir supports is little-endian, as the wire is).
The jitted functions run with the GIL released, so an embedded host serving from another
thread of the same process keeps running while the guest spins.

`spin_until_nonzero_u32` does a bounded number of acquire loads in one call, so a waiter
spins without returning to Python for every load. `spins_for(seconds)` converts a spin time
into a load count (measured once per process), so a waiter can spin a whole time budget in one
call: a waiter that comes back for the GIL between short chunks would take it from the thread
it waits for, which then sleeps on the GIL (a wake-up of several microseconds).

`Word` is one u32 checked once (bounds, alignment, writability) for callers on a hot path;
its `store_release_then_spin` publishes a word and then waits on another without taking the
GIL in between (an embedded host publishing a reply and going back to its doorbell).

`nonzero_u32_callback()` is a C function ``bool f(void *word)`` (an acquire load of the u32 at
`word`, non-zero or not) for C code that polls a flag Python sets: ggml's abort callback
(`ggml_abort_callback`), which ggml calls from its compute thread after every node. Compiled
code, so it runs without the GIL: a ctypes callback would take the GIL once per node, and wait
for it whenever another thread runs Python.

Each public function has a plain-Python twin (`*_py`) that tests compare against; the twins
are not atomic and are not used for real waits.
"""

from __future__ import annotations

import platform
import struct
import time
from typing import Optional, Tuple

import numpy as np
from llvmlite import ir
from numba import carray, cfunc, njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from apir import numba_cache

__all__ = [
    "load_acquire_u32",
    "store_release_u32",
    "spin_until_nonzero_u32",
    "as_word_array",
    "Word",
    "spins_for",
    "nonzero_u32_callback",
    "load_acquire_u32_py",
    "store_release_u32_py",
    "spin_until_nonzero_u32_py",
]

_U32 = struct.Struct("=I")

# Intrinsics and the functions using them live in one file: Numba's on-disk cache of a
# function is invalidated only by changes to its own file (docs/numba-notes.md).
# (in the machine-wide cache folder of apir.numba_cache)
numba_cache.install()
_jit = njit(cache=True, nogil=True)


def _word_pointer(context, builder, arrty, arr, offset):
    """An `i32*` to byte `offset` of a 1-d uint8 array's data."""
    ary = context.make_array(arrty)(context, builder, arr)
    byte_ptr = builder.gep(builder.bitcast(ary.data, ir.IntType(8).as_pointer()), [offset])
    return builder.bitcast(byte_ptr, ir.IntType(32).as_pointer())


@intrinsic
def _load_acquire_intrinsic(typingctx, arr, offset):
    sig = types.uint32(arr, types.intp)

    def codegen(context, builder, signature, args):
        offset = context.cast(builder, args[1], signature.args[1], types.intp)
        ptr = _word_pointer(context, builder, signature.args[0], args[0], offset)
        return builder.load_atomic(ptr, "acquire", 4)

    return sig, codegen


@intrinsic
def _store_release_intrinsic(typingctx, arr, offset, value):
    sig = types.void(arr, types.intp, types.uint32)

    def codegen(context, builder, signature, args):
        offset = context.cast(builder, args[1], signature.args[1], types.intp)
        value = context.cast(builder, args[2], signature.args[2], types.uint32)
        ptr = _word_pointer(context, builder, signature.args[0], args[0], offset)
        builder.store_atomic(value, ptr, "release", 4)
        return context.get_dummy_value()

    return sig, codegen


# The spin-wait hint between loads: it keeps a spinning core from flooding the memory system
# and from starving a sibling hardware thread (which may run the thread being waited for).
# (LLVM intrinsics, not inline asm: Numba's JIT has no asm parser.)
_MACHINE = platform.machine().lower()
_RELAX = {
    "x86_64": ("llvm.x86.sse2.pause", None),
    "amd64": ("llvm.x86.sse2.pause", None),
    "aarch64": ("llvm.aarch64.hint", 1),
    "arm64": ("llvm.aarch64.hint", 1),
}.get(_MACHINE)  # 1: YIELD


@intrinsic
def _fence_seq_cst_intrinsic(typingctx):
    sig = types.void()

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _cpu_relax_intrinsic(typingctx):
    sig = types.void()

    def codegen(context, builder, signature, args):
        if _RELAX is not None:
            name, hint = _RELAX
            argtys = [] if hint is None else [ir.IntType(32)]
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), argtys), name)
            builder.call(fn, [] if hint is None else [ir.Constant(ir.IntType(32), hint)])
        return context.get_dummy_value()

    return sig, codegen


@_jit
def _load_acquire(arr, offset):
    return _load_acquire_intrinsic(arr, offset)  # type: ignore[call-arg]  # typingctx: numba passes it


@_jit
def _store_release(arr, offset, value):
    _store_release_intrinsic(arr, offset, np.uint32(value))  # type: ignore[call-arg]  # typingctx: numba passes it


@_jit
def _spin_until_nonzero(arr, offset, spins):
    value = np.uint32(0)
    for _ in range(spins):
        value = _load_acquire_intrinsic(arr, offset)  # type: ignore[call-arg]  # typingctx: numba passes it
        if value != 0:
            break
        _cpu_relax_intrinsic()
    return value


@_jit
def _store_then_spin(arr, offset, value, arr2, offset2, value2, wait_arr, wait_offset, spins, clear, settle):
    _store_release_intrinsic(arr, offset, np.uint32(value))  # type: ignore[call-arg]  # typingctx: numba passes it
    _store_release_intrinsic(arr2, offset2, np.uint32(value2))
    seen = np.uint32(0)
    for _ in range(spins):
        seen = _load_acquire_intrinsic(wait_arr, wait_offset)
        if seen != 0:
            break
        _cpu_relax_intrinsic()
    if clear and seen != 0:
        _store_release_intrinsic(wait_arr, wait_offset, np.uint32(0))
    if seen == 2:
        for _ in range(settle):
            _cpu_relax_intrinsic()
    return seen


@_jit
def _store_fence_load(arr, offset, value, load_arr, load_offset):
    _store_release_intrinsic(arr, offset, np.uint32(value))  # type: ignore[call-arg]  # typingctx: numba passes it
    _fence_seq_cst_intrinsic()
    return _load_acquire_intrinsic(load_arr, load_offset)


@_jit
def _store_two(arr, offset, value, arr2, offset2, value2):
    _store_release_intrinsic(arr, offset, np.uint32(value))  # type: ignore[call-arg]  # typingctx: numba passes it
    _store_release_intrinsic(arr2, offset2, np.uint32(value2))


@_jit
def _spin_while_equal(arr, offset, old, spins):
    value = np.uint32(old)
    for _ in range(spins):
        value = _load_acquire_intrinsic(arr, offset)  # type: ignore[call-arg]  # typingctx: numba passes it
        if value != old:
            break
        _cpu_relax_intrinsic()
    return value


def as_word_array(buf) -> np.ndarray:
    """A writable 1-d uint8 numpy view of `buf` (mmap, bytearray, numpy array, memoryview).

    Callers that touch the same word many times make this view once and pass it instead of
    the buffer, to skip the per-call conversion. The view holds a buffer export: an mmap
    cannot be closed while it lives. Raises ValueError for a read-only buffer.
    """
    if isinstance(buf, np.ndarray) and buf.dtype == np.uint8 and buf.ndim == 1:
        arr = buf
    else:
        arr = np.frombuffer(buf, dtype=np.uint8)
    if not arr.flags.writeable:
        raise ValueError("atomic u32 access needs a writable buffer")
    if not arr.flags.c_contiguous:
        raise ValueError("atomic u32 access needs a contiguous buffer")
    return arr


def _checked(buf, offset: int) -> np.ndarray:
    arr = as_word_array(buf)
    if offset < 0 or offset + 4 > arr.size:
        raise ValueError(f"u32 at offset {offset} outside a {arr.size}-byte buffer")
    if (arr.ctypes.data + offset) % 4:
        raise ValueError(f"u32 at offset {offset} is not 4-byte aligned in memory")
    return arr


def load_acquire_u32(buf, offset: int) -> int:
    """The u32 at byte `offset` of `buf`, loaded with acquire ordering.

    Raises ValueError when the word is out of bounds, misaligned or `buf` is read-only."""
    return int(_load_acquire(_checked(buf, offset), offset))


def store_release_u32(buf, offset: int, value: int) -> None:
    """Stores `value` (0 .. 2**32-1) as the u32 at byte `offset` of `buf` with release
    ordering: every earlier write of this thread is visible to an acquire load that sees it.

    Raises ValueError like `load_acquire_u32`, or when `value` does not fit in a u32."""
    if not 0 <= value <= 0xFFFFFFFF:
        raise ValueError(f"{value} does not fit in a u32")
    _store_release(_checked(buf, offset), offset, value)


def spin_until_nonzero_u32(buf, offset: int, spins: int) -> int:
    """Up to `spins` acquire loads of the u32 at `offset`; the first non-zero value, or 0.

    Runs without the GIL. Raises ValueError like `load_acquire_u32`."""
    return int(_spin_until_nonzero(_checked(buf, offset), offset, max(int(spins), 1)))


_loads_per_s: float = 0.0


def spins_for(seconds: float) -> int:
    """About how many acquire loads `spin_until_nonzero_u32` makes in `seconds` (at least
    1). The rate is measured on first use (the fastest of three spins of 2**15 loads on a zero
    word, about 1 ms each on x86-64 with its pause hint)."""
    global _loads_per_s
    if not _loads_per_s:
        probe = np.zeros(8, dtype=np.uint8)
        _spin_until_nonzero(probe, 0, 1024)  # compiled/loaded before timing
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            _spin_until_nonzero(probe, 0, 1 << 15)
            best = min(best, time.perf_counter() - t0)
        _loads_per_s = (1 << 15) / max(best, 1e-9)
    return max(1, int(seconds * _loads_per_s))


class Word:
    """The u32 at byte `offset` of `buf`, checked once like `load_acquire_u32` (ValueError).

    Holds a numpy view of `buf` (a buffer export: an mmap cannot be closed while it lives)."""

    __slots__ = ("array", "offset")

    def __init__(self, buf, offset: int = 0):
        self.array = _checked(buf, offset)
        self.offset = offset

    def load_acquire(self) -> int:
        return int(_load_acquire(self.array, self.offset))

    def store_release(self, value: int) -> None:
        """As `store_release_u32`; ValueError when `value` does not fit in a u32."""
        if not 0 <= value <= 0xFFFFFFFF:
            raise ValueError(f"{value} does not fit in a u32")
        _store_release(self.array, self.offset, value)

    def spin_until_nonzero(self, spins: int) -> int:
        """As `spin_until_nonzero_u32` (no GIL held while spinning)."""
        return int(_spin_until_nonzero(self.array, self.offset, max(int(spins), 1)))

    def spin_while_equal(self, old: int, spins: int) -> int:
        """Up to `spins` acquire loads while the word holds `old`; the first other value, or
        `old` when the spins ran out. No GIL held while spinning."""
        return int(_spin_while_equal(self.array, self.offset, np.uint32(old), max(int(spins), 1)))

    def store_release_both(self, value: int, then: "Word", then_value: int) -> None:
        """Stores `value` here, then `then_value` in `then`, both release, in one call: a reader
        that sees the second store (acquire) sees the first. ValueError when a value is not a
        u32."""
        for v in (value, then_value):
            if not 0 <= v <= 0xFFFFFFFF:
                raise ValueError(f"{v} does not fit in a u32")
        _store_two(self.array, self.offset, value, then.array, then.offset, then_value)

    def store_then_load(self, value: int, other: "Word") -> int:
        """Stores `value` here (release), then a sequentially consistent fence, then an
        acquire load of `other`, returned. The fence orders the store before the load, which
        release and acquire alone do not (x86 lets a load pass an earlier store): when two
        sides each store their word and then load the other's, at least one of them sees the
        other's store (notification suppression, as virtio's VRING_USED_F_NO_NOTIFY with its
        re-check). ValueError when `value` is not a u32."""
        if not 0 <= value <= 0xFFFFFFFF:
            raise ValueError(f"{value} does not fit in a u32")
        return int(_store_fence_load(self.array, self.offset, value, other.array, other.offset))

    def store_release_then_spin(
        self,
        value: int,
        other: "Word",
        spins: int,
        *,
        before: "Optional[Tuple[Word, int]]" = None,
        clear: bool = False,
        settle: int = 0,
    ) -> int:
        """Stores `value` here (release; `before` = (word, value) is stored first), then up
        to `spins` acquire loads of `other`; its first non-zero value, or 0 (`clear`: a
        non-zero value seen is then reset to 0, a plain release store, not an exchange;
        `settle`: after seeing 2, that many more spin-wait hints before the GIL is taken,
        for a waker that still comes back for the GIL itself).
        The GIL is released before the stores and not taken back until the spin ends, so a
        thread woken by a store finds the GIL free. ValueError when a value is not a u32."""
        # without `before`, a word of nobody's is stored first; not this one twice: its reader,
        # woken by the first store, may have stored into it again before the second
        first, first_value = (_scratch_word(), 0) if before is None else before
        for v in (value, first_value):
            if not 0 <= v <= 0xFFFFFFFF:
                raise ValueError(f"{v} does not fit in a u32")
        return int(
            _store_then_spin(
                first.array,
                first.offset,
                first_value,
                self.array,
                self.offset,
                value,
                other.array,
                other.offset,
                max(int(spins), 1),
                clear,
                max(int(settle), 0),
            )
        )


_scratch: Optional[Word] = None


def _scratch_word() -> Word:
    """A word no one reads (`store_release_then_spin`'s first store when it has only one)."""
    global _scratch
    if _scratch is None:
        _scratch = Word(np.zeros(4, dtype=np.uint8))
    return _scratch


_nonzero_u32_cfunc = None


def nonzero_u32_callback() -> int:
    """The address of a C function ``bool f(void *word)``: whether the u32 at `word` (4-byte
    aligned) is non-zero, by an acquire load; it never takes the GIL. Compiled, or loaded from
    Numba's cache, on the first call (defined here, beside the intrinsic it uses: see the note on
    Numba's cache above)."""
    global _nonzero_u32_cfunc
    if _nonzero_u32_cfunc is None:

        @cfunc(types.boolean(types.voidptr), cache=True)
        def nonzero_u32(word):
            return _load_acquire_intrinsic(carray(word, 4, np.uint8), 0) != 0  # type: ignore[call-arg]  # typingctx: numba passes it

        _nonzero_u32_cfunc = nonzero_u32
    address = _nonzero_u32_cfunc.address
    assert address is not None  # a compiled cfunc always has one
    return address


# --- plain-Python twins (not atomic; for tests) -------------------------------------------
def load_acquire_u32_py(buf, offset: int) -> int:
    return _U32.unpack_from(_checked(buf, offset).data, offset)[0]


def store_release_u32_py(buf, offset: int, value: int) -> None:
    if not 0 <= value <= 0xFFFFFFFF:
        raise ValueError(f"{value} does not fit in a u32")
    _U32.pack_into(_checked(buf, offset).data, offset, value)


def spin_until_nonzero_u32_py(buf, offset: int, spins: int) -> int:
    for _ in range(max(int(spins), 1)):
        value = load_acquire_u32_py(buf, offset)
        if value:
            return value
    return 0
