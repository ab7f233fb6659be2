"""apir.codec.atomics: values, bounds and cross-thread use on the plain path and on its Numba
twin (apir.codec.atomics_accel), and the LLVM orderings the twin emits."""

import ctypes
import mmap
import threading
import time

import numpy as np
import pytest

from apir import accel
from apir.codec import atomics

_TWINS = ("load_acquire", "store_release", "spin_until_nonzero", "spin_while_equal", "store_two",
          "store_fence_load", "store_then_spin")


@pytest.fixture(params=["plain", "accel"], autouse=True)
def path(request, monkeypatch):
    """Every test below runs on both paths: the module's functions call whichever twins are
    bound to its `_load_acquire`, ... names (the Numba ones only where apir.accel is on)."""
    if request.param == "accel":
        if not accel.enabled():
            pytest.skip("apir.accel is off: the plain path only")
        from apir.codec import atomics_accel as impl

        twins = {name: getattr(impl, name) for name in _TWINS}
        callback = impl.nonzero_u32_callback
    else:
        twins = {name: getattr(atomics, f"_{name}_plain") for name in _TWINS}
        callback = atomics._nonzero_u32_callback_plain
    for name, fn in twins.items():
        monkeypatch.setattr(atomics, f"_{name}", fn)
    monkeypatch.setattr(atomics, "nonzero_u32_callback", callback)
    monkeypatch.setattr(atomics, "_loads_per_s", 0.0)
    return request.param


def plain_load(buf, offset):
    """The word's bytes read without atomics, to check what the paths stored."""
    return int.from_bytes(bytes(memoryview(buf).cast("B")[offset : offset + 4]), "little")

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
    assert plain_load(buf, 8) == value
    # machine byte order, neighbours untouched
    raw = bytes(memoryview(buf).cast("B")[4:16])
    assert raw == bytes(4) + value.to_bytes(4, "little") + bytes(4)


def test_spin_returns_first_nonzero_or_zero():
    buf = bytearray(16)
    assert atomics.spin_until_nonzero_u32(buf, 4, 100) == 0
    atomics.store_release_u32(buf, 4, 0xAB1E)
    assert atomics.spin_until_nonzero_u32(buf, 4, 100) == 0xAB1E


def test_bad_offsets_and_readonly_rejected():
    fn = atomics.load_acquire_u32
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
    assert plain_load(buf, 8) == 0xCAFE
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
    fn = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p)(atomics.nonzero_u32_callback())
    words = np.zeros(4, dtype=np.uint32)
    base = words.ctypes.data
    for value in (0, 1, 0x80000000, 0xFFFFFFFF, 0):
        words[1] = value
        words[0] = words[2] = 0xFFFFFFFF  # neighbours must not leak into the load
        expected = value != 0
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


def test_a_plain_spin_ends_at_its_time_not_its_count(monkeypatch):
    # each time.sleep(0) naps 1 ms (a loaded machine) on a fake clock: a spin of 1,000 loads at
    # a measured 10**6 loads/s is 1 ms, so it ends after a nap or two, not after 1,000 naps
    from apir.codec import atomics

    clock = [0.0]

    class LoadedTime:
        @staticmethod
        def perf_counter():
            return clock[0]

        @staticmethod
        def sleep(_seconds):
            clock[0] += 0.001

    monkeypatch.setattr(atomics, "time", LoadedTime)
    monkeypatch.setattr(atomics, "_loads_per_s", 1e6)
    arr = np.zeros(8, np.uint8)
    assert atomics._spin_until_nonzero_plain(arr, 0, 1000) == 0
    assert clock[0] <= 0.002
    clock[0] = 0.0
    assert atomics._spin_while_equal_plain(arr, 0, 0, 1000) == 0
    assert clock[0] <= 0.002
