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


def test_word_checks_once_and_stores_loads():
    buf = bytearray(64)
    word = atomics.Word(buf, 8)
    word.store_release(0xCAFE)
    assert word.load_acquire() == 0xCAFE
    assert atomics.load_acquire_u32_py(buf, 8) == 0xCAFE  # the same bytes as the plain twin
    assert word.spin_until_nonzero(3) == 0xCAFE
    with pytest.raises(ValueError):
        word.store_release(1 << 32)
    for offset in (-4, 62, 64):
        with pytest.raises(ValueError):
            atomics.Word(buf, offset)
    with pytest.raises(ValueError):
        atomics.Word(bytes(64), 0)


def test_store_then_spin_stores_in_order_and_clears_the_ring():
    first, second, bell = (atomics.Word(np.zeros(16, np.uint8), 4) for _ in range(3))
    # nothing rung: both stores made, 0 back, the bell untouched
    assert second.store_release_then_spin(7, bell, 50, before=(first, 3), clear=True) == 0
    assert (first.load_acquire(), second.load_acquire(), bell.load_acquire()) == (3, 7, 0)
    bell.store_release(5)
    assert second.store_release_then_spin(9, bell, 50) == 5
    assert (second.load_acquire(), bell.load_acquire()) == (9, 5)  # not cleared
    assert second.store_release_then_spin(11, bell, 50, clear=True) == 5
    assert (second.load_acquire(), bell.load_acquire()) == (11, 0)
    with pytest.raises(ValueError):
        second.store_release_then_spin(1, bell, 1, before=(first, -1))


def test_store_then_spin_without_before_stores_its_word_once(monkeypatch):
    """Without `before`, the word is stored once, not twice: a reader woken by the first store
    may zero the word for its next use before a second store would put the old value back."""
    word, bell = atomics.Word(np.zeros(8, np.uint8), 0), atomics.Word(np.zeros(8, np.uint8), 4)
    calls = []
    real = atomics._store_then_spin

    def spy(arr, offset, value, arr2, offset2, value2, *rest):
        calls.append((arr is word.array, value, arr2 is word.array, value2))
        return real(arr, offset, value, arr2, offset2, value2, *rest)

    monkeypatch.setattr(atomics, "_store_then_spin", spy)
    assert word.store_release_then_spin(7, bell, 10) == 0
    assert calls == [(False, 0, True, 7)]  # the first store goes into another word
    assert word.load_acquire() == 7


def test_store_then_spin_orderings():
    arr = np.zeros(16, np.uint8)
    ir = _ir(atomics._store_then_spin, arr, 0, 1, arr, 4, 2, arr, 8, 1, True, 0).splitlines()
    stores = [l for l in ir if "store atomic" in l]
    loads = [l for l in ir if "load atomic" in l]
    assert len(stores) >= 3 and all("release, align 4" in l for l in stores)
    assert loads and all("acquire, align 4" in l for l in loads)


def test_spins_for_scales_with_time():
    short, long = atomics.spins_for(10e-6), atomics.spins_for(10e-3)
    assert 1 <= short < long
    assert atomics.spins_for(0) == 1
    # the spin really spins on a zero word: spins_for(2 ms) does not return at once. No upper
    # bound: a loaded machine may stall us for any time (speed belongs to benchmarks/).
    probe = atomics.Word(np.zeros(8, np.uint8), 0)
    t0 = time.perf_counter()
    probe.spin_until_nonzero(atomics.spins_for(2e-3))
    assert time.perf_counter() - t0 > 0.2e-3


def test_nonzero_u32_callback_reads_the_word_like_its_twin():
    """The C callback ggml's abort check calls (`bool f(void *word)`): true exactly when the
    word is non-zero, whatever its other bytes' neighbours hold."""
    import ctypes

    fn = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p)(atomics.nonzero_u32_callback())
    words = np.zeros(4, dtype=np.uint32)
    base = words.ctypes.data
    for value in (0, 1, 0x80000000, 0xFFFFFFFF, 0):
        words[1] = value
        words[0] = words[2] = 0xFFFFFFFF  # neighbours must not leak into the load
        expected = atomics.load_acquire_u32_py(words.view(np.uint8), 4) != 0
        assert fn(base + 4) is expected
    assert atomics.nonzero_u32_callback() == atomics.nonzero_u32_callback()  # made once


def test_spin_while_equal_returns_the_first_other_value():
    word = atomics.Word(np.zeros(16, np.uint8), 4)
    assert word.spin_while_equal(0, 50) == 0  # spins out: the old value
    word.store_release(3)
    assert word.spin_while_equal(0, 50) == 3
    assert word.spin_while_equal(3, 50) == 3  # unchanged: spun out on 3


def test_store_then_load_and_store_release_both():
    arr = np.zeros(16, np.uint8)
    a, b = atomics.Word(arr, 0), atomics.Word(arr, 8)
    b.store_release(5)
    assert a.store_then_load(9, b) == 5 and a.load_acquire() == 9
    a.store_release_both(1, b, 2)
    assert (a.load_acquire(), b.load_acquire()) == (1, 2)
    for bad in (-1, 1 << 32):
        with pytest.raises(ValueError):
            a.store_then_load(bad, b)
        with pytest.raises(ValueError):
            a.store_release_both(1, b, bad)


def test_store_then_load_has_a_full_fence_between():
    """The exec ring's notification suppression rests on this: store (release), a seq_cst
    fence (mfence on x86-64, dmb ish on ARM64), then the load (acquire); without the fence x86
    may let the load pass the store."""
    arr = np.zeros(16, np.uint8)
    ir = [l.strip() for l in _ir(atomics._store_fence_load, arr, 0, 1, arr, 8).splitlines()]
    ops = [l for l in ir if l.startswith(("store atomic", "fence ")) or "= load atomic" in l]
    kinds = ["store" if "store atomic" in l else "fence" if l.startswith("fence") else "load" for l in ops]
    # the function's own body comes first (later fences are the wrapper's reference counting)
    assert kinds[:3] == ["store", "fence", "load"], ops
    assert "release" in ops[0] and ops[1] == "fence seq_cst" and "acquire" in ops[2]
    two = [l for l in _ir(atomics._store_two, arr, 0, 1, arr, 8, 2).splitlines() if "store atomic" in l]
    assert len(two) == 2 and all("release, align 4" in l for l in two)
    spin = [l for l in _ir(atomics._spin_while_equal, arr, 0, np.uint32(0), 1).splitlines() if "load atomic" in l]
    assert spin and all("acquire" in l for l in spin)
