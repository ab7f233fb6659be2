"""apir.codec.atomics: values, bounds, the emitted LLVM orderings, and cross-thread use."""

import mmap
import threading
import time

import numba
import numpy as np
import pytest

from apir.codec import atomics

BUFFERS = {
    "bytearray": lambda: bytearray(64),
    "mmap": lambda: mmap.mmap(-1, 16384),
    "numpy": lambda: np.zeros(64, np.uint8),
    "numpy-u32": lambda: np.zeros(16, np.uint32),
}


@pytest.mark.parametrize("kind", sorted(BUFFERS))
@pytest.mark.parametrize("value", [1, 0x12345678, 0xFFFFFFFF, 0])
def test_store_then_load_matches_twin(kind, value):
    buf = BUFFERS[kind]()
    atomics.store_release_u32(buf, 8, value)
    assert atomics.load_acquire_u32(buf, 8) == value
    assert atomics.load_acquire_u32_py(buf, 8) == value
    # machine byte order, neighbours untouched
    raw = bytes(memoryview(buf).cast("B")[4:16])
    assert raw == bytes(4) + value.to_bytes(4, "little") + bytes(4)
    other = BUFFERS[kind]()
    atomics.store_release_u32_py(other, 8, value)
    assert bytes(memoryview(other).cast("B")) == bytes(memoryview(buf).cast("B"))


def test_spin_returns_first_nonzero_or_zero():
    buf = bytearray(16)
    assert atomics.spin_until_nonzero_u32(buf, 4, 100) == 0
    assert atomics.spin_until_nonzero_u32_py(buf, 4, 100) == 0
    atomics.store_release_u32(buf, 4, 0xAB1E)
    assert atomics.spin_until_nonzero_u32(buf, 4, 100) == 0xAB1E
    assert atomics.spin_until_nonzero_u32_py(buf, 4, 100) == 0xAB1E


@pytest.mark.parametrize("fn", [atomics.load_acquire_u32, atomics.load_acquire_u32_py])
def test_bad_offsets_and_readonly_rejected(fn):
    buf = bytearray(16)
    for offset in (-4, 13, 16, 2):
        with pytest.raises(ValueError):
            fn(buf, offset)
    with pytest.raises(ValueError):
        fn(b"\0" * 16, 0)
    with pytest.raises(ValueError):
        atomics.store_release_u32(buf, 0, 1 << 32)
    with pytest.raises(ValueError):
        atomics.store_release_u32(buf, 0, -1)


def _ir(dispatcher, *args):
    """LLVM IR of a fresh, uncached compile (cached code cannot be inspected)."""
    fresh = numba.njit(dispatcher.py_func)
    fresh(*args)
    return "\n".join(fresh.inspect_llvm().values())


def test_llvm_orderings_are_acquire_and_release():
    """ARM64 correctness rests on these orderings (LLVM lowers them to ldar / stlr)."""
    arr = np.zeros(16, np.uint8)
    load_lines = [l for l in _ir(atomics._load_acquire, arr, 0).splitlines() if "load atomic" in l]
    assert load_lines and all("acquire, align 4" in l and "i32" in l for l in load_lines)
    spin_lines = [l for l in _ir(atomics._spin_until_nonzero, arr, 0, 1).splitlines() if "load atomic" in l]
    assert spin_lines and all("acquire" in l for l in spin_lines)
    store_lines = [l for l in _ir(atomics._store_release, arr, 0, 1).splitlines() if "store atomic" in l]
    assert store_lines and all("release, align 4" in l and "i32" in l for l in store_lines)


def test_spin_releases_the_gil_and_sees_payload():
    """A spinner in one thread sees the word (and the payload written before it) stored by a
    pure-Python thread; that thread can only run if the spin released the GIL."""
    buf = mmap.mmap(-1, 16384)
    payload = bytes(range(256)) * 16

    def writer():
        time.sleep(0.05)
        buf[64 : 64 + len(payload)] = payload
        atomics.store_release_u32(buf, 0, 7)

    t = threading.Thread(target=writer)
    t.start()
    start = time.monotonic()
    # 2**34 loads would take many seconds: returning early proves the writer ran meanwhile
    value = atomics.spin_until_nonzero_u32(buf, 0, 1 << 34)
    t.join()
    assert value == 7
    assert buf[64 : 64 + len(payload)] == payload
    assert time.monotonic() - start < 5
