"""Acquire loads and release stores of a u32 in shared memory (the reply notification word).

Theory of operation: the guest zeroes the first u32 of its reply blob, sends a command, and
waits until the host stores a non-zero value there after writing the reply (the C uses
`std::atomic_thread_fence` + `std::atomic<uint32_t>` on the mapped word). The reply bytes must
be visible to the guest once it sees the word: a *release* store on the writer's side and an
*acquire* load on the reader's. Every function takes any writable buffer (mmap, bytearray,
numpy array) and a byte offset; the word must be 4-byte aligned in memory, in the machine's
byte order (guest and host share one machine; every platform apir supports is little-endian).

`Word` is one u32 checked once (bounds, alignment, writability) for hot paths; its
`store_release_then_spin` publishes a word and then waits on another. `spins_for(seconds)`
converts a spin time into a load count, measured once per process. `nonzero_u32_callback()` is
a C function ``bool f(void *word)`` for ggml's abort callback, which polls a flag Python sets.

This module is the plain path: each u32 is one aligned 4-byte load or store through ctypes,
and a spin lets the GIL go between loads (`time.sleep(0)`). With `apir.accel.enabled()` the
same functions run `apir.codec.atomics_accel`: LLVM atomics, spins without the GIL, and a
compiled abort callback that never takes the GIL (this one takes it once per ggml node).
"""

from __future__ import annotations

import ctypes
import math
import threading
import time
from typing import Optional, Tuple

import numpy as np

from apir import accel

__all__ = [
    "load_acquire_u32",
    "store_release_u32",
    "spin_until_nonzero_u32",
    "as_word_array",
    "Word",
    "spins_for",
    "nonzero_u32_callback",
]

# --- the plain path ---------------------------------------------------------------------------
# Why plain loads and stores are acquire and release on x86-64: a 4-byte aligned access is one
# mov (ctypes' c_uint32 getter and setter copy the 4 bytes with memcpy, which compilers emit as
# one mov), never torn; and x86-64's memory model (TSO) keeps loads in order with later loads
# and stores, and stores in order with earlier stores, which is what acquire and release ask.
# The compiler cannot move the reply's writes past the word's store either: each is an opaque
# call of the interpreter. What TSO does allow is a load passing an earlier store; a locked
# read-modify-write is a full fence there, and a lock's acquire is one (`_fence`).
# A weakly ordered CPU (ARM64, POWER, RISC-V) orders none of this by itself: it needs ldar/stlr
# (or a dmb ish barrier) around the word, which Python cannot emit; run the Numba twin there.

_FENCE_LOCK = threading.Lock()


def _word(arr: np.ndarray, offset: int) -> ctypes.c_uint32:
    return ctypes.c_uint32.from_buffer(arr.data, offset)


def _load_acquire_plain(arr: np.ndarray, offset: int) -> int:
    return _word(arr, offset).value


def _store_release_plain(arr: np.ndarray, offset: int, value: int) -> None:
    _word(arr, offset).value = value


def _fence() -> None:
    """A full fence on x86-64 (see above): the lock's acquire is a locked compare-exchange."""
    with _FENCE_LOCK:
        pass


def _spin_deadline(spins: int) -> float:
    """When `spins` plain loads should be over, by the rate `spins_for` measured: a
    `time.sleep(0)` naps longer on a loaded machine, and counting loads alone would then make
    a spin of microseconds last up to a tenth of a second."""
    return time.perf_counter() + spins / _loads_per_s if _loads_per_s else math.inf


def _spin_until_nonzero_plain(arr: np.ndarray, offset: int, spins: int) -> int:
    word = _word(arr, offset)
    deadline = _spin_deadline(spins)
    for _ in range(spins):
        value = word.value
        if value != 0:
            return value
        time.sleep(0)  # the GIL goes: the thread this waits for may need it
        if time.perf_counter() > deadline:
            break
    return 0


def _spin_while_equal_plain(arr: np.ndarray, offset: int, old: int, spins: int) -> int:
    word = _word(arr, offset)
    deadline = _spin_deadline(spins)
    value = old
    for _ in range(spins):
        value = word.value
        if value != old:
            break
        time.sleep(0)
        if time.perf_counter() > deadline:
            break
    return value


def _store_two_plain(arr, offset, value, arr2, offset2, value2) -> None:
    _store_release_plain(arr, offset, value)
    _store_release_plain(arr2, offset2, value2)


def _store_fence_load_plain(arr, offset, value, load_arr, load_offset) -> int:
    _store_release_plain(arr, offset, value)
    _fence()
    return _load_acquire_plain(load_arr, load_offset)


def _store_then_spin_plain(
    arr, offset, value, arr2, offset2, value2, wait_arr, wait_offset, spins, clear, settle
) -> int:
    # (`settle` is for a spinner that holds no GIL; this one lets it go between loads anyway)
    _store_two_plain(arr, offset, value, arr2, offset2, value2)
    seen = _spin_until_nonzero_plain(wait_arr, wait_offset, spins)
    if clear and seen != 0:
        _store_release_plain(wait_arr, wait_offset, 0)
    return seen


_NONZERO_U32 = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p)
_nonzero_u32_plain_callback = _NONZERO_U32(lambda word: ctypes.c_uint32.from_address(word).value != 0)


def _nonzero_u32_callback_plain() -> int:
    address = ctypes.cast(_nonzero_u32_plain_callback, ctypes.c_void_p).value
    assert address is not None
    return address


# The functions below call these names; the Numba twins replace them when enabled.
_load_acquire = _load_acquire_plain
_store_release = _store_release_plain
_spin_until_nonzero = _spin_until_nonzero_plain
_spin_while_equal = _spin_while_equal_plain
_store_two = _store_two_plain
_store_fence_load = _store_fence_load_plain
_store_then_spin = _store_then_spin_plain
nonzero_u32_callback = _nonzero_u32_callback_plain
if accel.enabled():
    from apir.codec import atomics_accel

    _load_acquire = atomics_accel.load_acquire
    _store_release = atomics_accel.store_release
    _spin_until_nonzero = atomics_accel.spin_until_nonzero
    _spin_while_equal = atomics_accel.spin_while_equal
    _store_two = atomics_accel.store_two
    _store_fence_load = atomics_accel.store_fence_load
    _store_then_spin = atomics_accel.store_then_spin
    nonzero_u32_callback = atomics_accel.nonzero_u32_callback


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

    Lets other threads run (the Numba twin without the GIL; the plain path between loads).
    Raises ValueError like `load_acquire_u32`."""
    return int(_spin_until_nonzero(_checked(buf, offset), offset, max(int(spins), 1)))


_loads_per_s: float = 0.0


def spins_for(seconds: float) -> int:
    """About how many acquire loads `spin_until_nonzero_u32` makes in `seconds` (at least
    1). The rate is measured on first use: the fastest of three spins on a zero word, each of
    2**15 loads with the x86-64 pause hint, or on the plain path of 64 loads, few because
    each follows a `time.sleep(0)`, which on Linux may nap for the timer slack."""
    global _loads_per_s
    if not _loads_per_s:
        loads = 1 << 15 if accel.enabled() else 1 << 6
        probe = np.zeros(8, dtype=np.uint8)
        _spin_until_nonzero(probe, 0, 64)  # compiled/loaded before timing
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            _spin_until_nonzero(probe, 0, loads)
            best = min(best, time.perf_counter() - t0)
        _loads_per_s = loads / max(best, 1e-9)
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
        """As `spin_until_nonzero_u32`."""
        return int(_spin_until_nonzero(self.array, self.offset, max(int(spins), 1)))

    def spin_while_equal(self, old: int, spins: int) -> int:
        """Up to `spins` acquire loads while the word holds `old`; the first other value, or
        `old` when the spins ran out. Lets other threads run as `spin_until_nonzero_u32`."""
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
        The Numba twin releases the GIL before the stores and takes it back when the spin ends,
        so a thread woken by a store finds the GIL free. ValueError when a value is not a u32."""
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
