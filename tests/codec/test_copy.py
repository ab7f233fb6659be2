"""apir.codec.copy: every kind of endpoint, bounds checked before any byte moves, on the plain
path (ctypes.memmove) and with the Numba bulk copy."""

import ctypes
import mmap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from apir import accel
from apir.codec import copy as codec_copy
from apir.codec.copy import KERNEL_MIN_BYTES, RawMemory, copy_bytes


@pytest.fixture(params=["plain", "accel"], autouse=True)
def path(request, monkeypatch):
    """Each test on both bulk copies (the Numba one only where apir.accel is on)."""
    if request.param == "accel":
        if not accel.enabled():
            pytest.skip("apir.accel is off: the plain path only")
        from apir.codec._kernels import memmove_kernel

        monkeypatch.setattr(codec_copy, "_bulk_memmove", memmove_kernel)
    else:
        monkeypatch.setattr(codec_copy, "_bulk_memmove", ctypes.memmove)
    return request.param


def pattern(n, seed=1):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("size", [0, 1, 4095, KERNEL_MIN_BYTES, 3 * KERNEL_MIN_BYTES + 7])
def test_numpy_mmap_raw(size):
    src = pattern(size + 16)
    mm = mmap.mmap(-1, size + 64)
    try:
        assert copy_bytes(mm, src, size, dst_offset=32, src_offset=16) == size
        assert mm[32 : 32 + size] == src[16:].tobytes()
        assert mm[:32] == bytes(32)
        raw = ctypes.create_string_buffer(size + 8)
        copy_bytes(RawMemory(ctypes.addressof(raw), size + 8), mm, size, dst_offset=8, src_offset=32)
        assert raw.raw[8:] == src[16:].tobytes()
        out = np.zeros(size // 4 + 2, dtype=np.float32)  # offsets are bytes, whatever the dtype
        copy_bytes(out, (ctypes.addressof(raw), size + 8), size, src_offset=8)
        assert out.view(np.uint8)[:size].tobytes() == src[16:].tobytes()
    finally:
        mm.close()


def test_defaults_and_readonly_source():
    dst = bytearray(10)
    assert copy_bytes(dst, b"abcdef", src_offset=2) == 4
    assert dst == b"cdef" + bytes(6)


def test_overlap_is_memmove():
    buf = np.arange(2 * KERNEL_MIN_BYTES, dtype=np.uint8)
    expected = buf.copy()
    expected[5:] = buf[:-5]
    copy_bytes(buf, buf, len(buf) - 5, dst_offset=5)
    assert (buf == expected).all()


@settings(max_examples=200, deadline=None)
@given(d_len=st.integers(0, 64), s_len=st.integers(0, 64), size=st.integers(-2, 80),
       d_off=st.integers(-2, 80), s_off=st.integers(-2, 80))
def test_bounds_checked_before_any_byte_moves(d_len, s_len, size, d_off, s_off):
    dst = bytearray(b"\xcc" * d_len)
    src = bytes(range(s_len))
    ok = size >= 0 and d_off >= 0 and s_off >= 0 and s_off + size <= s_len and d_off + size <= d_len
    if ok:
        copy_bytes(dst, src, size, dst_offset=d_off, src_offset=s_off)
        assert dst[d_off : d_off + size] == src[s_off : s_off + size]
    else:
        with pytest.raises(ValueError, match=r"size|offset|range"):
            copy_bytes(dst, src, size, dst_offset=d_off, src_offset=s_off)
        assert dst == b"\xcc" * d_len


def test_bad_endpoints():
    with pytest.raises(ValueError, match="read-only"):
        copy_bytes(b"immutable", b"abc")
    with pytest.raises(ValueError, match="C-contiguous"):
        copy_bytes(np.zeros((4, 4), np.uint8)[:, 1], b"ab")
    with pytest.raises(ValueError, match="raw region"):
        copy_bytes(RawMemory(0, 16), b"ab")
    with pytest.raises(ValueError, match="not a contiguous buffer"):
        copy_bytes(bytearray(4), 1234)
    with pytest.raises(ValueError, match=r"destination range \[6, 9\) past its 8 bytes"):
        copy_bytes(bytearray(8), b"abc", dst_offset=6)
