"""apir.codec.wire against apir_cs.h: every typed helper, encoded by the C and by us, byte for
byte; the C and our decoder on the same (also truncated, oversized and random) bytes."""

import ctypes
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apir.codec.records import RPC_TENSOR_DTYPE
from apir.codec.wire import Decoder, Encoder
from tests.codec.masks import record_garbage

# The values codec_ref.cpp's ref_encode_all writes, in its order.
U64_ARRAY = [1, 0x8000000000000001, 0xFFFFFFFFFFFFFFFF]
I32_ARRAY = [-1, 7]
U32_ARRAY = [9, 0x80000000, 0xFFFFFFFF]
SIZE_ARRAY = [5, 0x123456789]
GGML_STATUS_FAILED = -1  # ggml.h enum ggml_status
N_VALUES = 31  # what ref_decode_all reports


def rpc_probe() -> bytes:
    """The apir_rpc_tensor codec_ref.cpp's fill_rpc_tensor builds."""
    rec = np.zeros(1, RPC_TENSOR_DTYPE)[0]
    rec["id"], rec["type"], rec["buffer"] = 0x7F0011223344, 1, 0xABCDEF0102030405
    rec["ne"] = [100, 101, 102, 103]
    rec["nb"] = [0xF0000000 + i for i in range(4)]
    rec["op"], rec["flags"] = 7, 5
    rec["op_params"] = [-i for i in range(16)]
    rec["src"] = [0x1000 + i for i in range(10)]
    rec["view_src"], rec["view_offs"], rec["data"] = 0x2000, 0x3000, 0x4000
    rec["name"] = np.frombuffer(b"rpc-probe".ljust(64, b"\0"), "S1")
    return rec.tobytes()


def encode_all(enc: Encoder) -> None:
    enc.u8(0xAB)
    enc.u64(0x0123456789ABCDEF)
    enc.u64_array(U64_ARRAY)
    enc.i32(-5)
    enc.i32_array(I32_ARRAY)
    enc.array_size(3)
    enc.simple_pointer(True)
    enc.simple_pointer(False)
    enc.u32(0xDEADBEEF)
    enc.u32_array(U32_ARRAY)
    enc.size_t(123456789012)
    enc.u64_array(SIZE_ARRAY)  # size_t array
    enc.blob(b"abcde")
    enc.char_array("hello")
    enc.bool(True)
    enc.bool(False)
    enc.handle(0xFEEDFACE12345678)  # buffer type host handle
    enc.handle(0x1122334455667788)  # buffer host handle
    enc.uintptr(0x7FFF00001234)
    enc.i32(GGML_STATUS_FAILED)
    enc.u32(42)  # shmem res_id
    enc.handle(0x0102030405060708)
    enc.string("virt")
    enc.blob(rpc_probe())


def pack8(data: bytes) -> int:
    return int.from_bytes(data[:8].ljust(8, b"\0"), "little")


def decode_all(dec: Decoder) -> list:
    """Our decoder, as codec_ref.cpp's ref_decode_all: one u64 per value."""
    m = 2**64 - 1
    out = [dec.u8(), dec.u64(), *dec.u64_array(3).tolist(), dec.i32() & m,
           *[v & m for v in dec.i32_array(2).tolist()], dec.array_size(3),
           int(dec.simple_pointer()), int(dec.simple_pointer()), dec.u32(), *dec.u32_array(3).tolist(),
           dec.size_t(), *dec.u64_array(2).tolist(), pack8(dec.blob(5)), pack8(dec.char_array(6)),
           int(dec.bool()), int(dec.bool()), dec.handle(), dec.handle(), dec.uintptr(), dec.i32() & m,
           dec.u32(), dec.handle()]
    size = dec.array_size_unchecked()
    out.append(size)
    out.append(pack8(dec.char_array(size)) if size <= 8 else 0)
    rec = dec.inplace(RPC_TENSOR_DTYPE.itemsize)
    out.append(pack8(bytes(rec)) if rec is not None else 0)
    assert len(out) == N_VALUES
    return out


def c_encode(ref, fill: int):
    buf = ctypes.create_string_buffer(bytes([fill]) * 4096, 4096)
    n = ref.ref_encode_all(buf, 4096)
    return buf.raw[:n]


def c_decode(ref, data: bytes):
    out = (ctypes.c_uint64 * 64)()
    src = ctypes.create_string_buffer(data, max(len(data), 1))
    fatal = ref.ref_decode_all(src, len(data), out)
    return list(out[:N_VALUES]), bool(fatal)


@pytest.fixture(scope="module")
def c_bytes(codec_ref):
    """The C's encoding, and a mask of the bytes it defines (the same under two fills)."""
    a, b = c_encode(codec_ref, 0x00), c_encode(codec_ref, 0xFF)
    assert len(a) == len(b)
    untouched = np.frombuffer(a, np.uint8) != np.frombuffer(b, np.uint8)
    # the rpc record is copied whole from the C's stack: its holes and name tail are garbage
    rec_at = len(a) - RPC_TENSOR_DTYPE.itemsize
    untouched[rec_at:] |= record_garbage(a[rec_at:], RPC_TENSOR_DTYPE)
    return a, untouched


def ours() -> bytes:
    buf = bytearray(4096)
    enc = Encoder(buf)
    encode_all(enc)
    enc.check()
    return bytes(buf[: enc.written])


def test_encode_matches_c(c_bytes):
    theirs, untouched = c_bytes
    mine = ours()
    assert len(mine) == len(theirs)
    diff = np.nonzero((np.frombuffer(mine, np.uint8) != np.frombuffer(theirs, np.uint8)) & ~untouched)[0]
    assert diff.size == 0, f"bytes differ at {diff[:8]}"
    # the C leaves padding untouched (u8, bool, blob/char tails, record holes): we zero it
    assert untouched.sum() > 20
    assert not np.frombuffer(mine, np.uint8)[untouched[: len(mine)] & (np.arange(len(mine)) < len(mine) - 304)].any()


def test_decode_matches_c_on_full_input(codec_ref):
    data = ours()
    theirs, fatal = c_decode(codec_ref, data)
    assert not fatal
    dec = Decoder(data)
    assert decode_all(dec) == theirs and not dec.fatal and dec.remaining == 0
    assert theirs[0] == 0xAB and theirs[-2] == pack8(b"virt")


def test_decode_truncated_matches_c(codec_ref):
    data = ours()
    for cut in range(len(data) + 1):
        theirs, fatal = c_decode(codec_ref, data[:cut])
        buf = bytearray(data[:cut] + b"\xcc" * 64)  # bytes past `end` must never be read
        dec = Decoder(buf, 0, cut)
        assert decode_all(dec) == theirs, f"cut at {cut}"
        assert dec.fatal == fatal == (cut < len(data))
        assert dec.pos <= cut


def test_decode_oversized_input(codec_ref):
    data = ours() + b"\x11" * 100
    theirs, fatal = c_decode(codec_ref, data)
    dec = Decoder(data)
    assert decode_all(dec) == theirs and not fatal and not dec.fatal
    assert dec.remaining == 100


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=700))
def test_decode_random_bytes_matches_c(codec_ref, data):
    theirs, fatal = c_decode(codec_ref, data)
    dec = Decoder(data)
    assert decode_all(dec) == theirs
    assert dec.fatal == fatal


@settings(max_examples=100, deadline=None)
@given(size=st.integers(0, 600))
def test_encoder_overflow_sets_fatal_and_stays_in_bounds(size):
    full = ours()
    buf = bytearray(b"\xcc" * (size + 32))
    enc = Encoder(buf, 0, size)
    encode_all(enc)
    assert enc.fatal == (size < len(full))
    assert buf[size:] == b"\xcc" * 32  # nothing written past the end
    assert enc.written <= size
    # what was written is a prefix of the full encoding
    assert bytes(buf[: enc.written]) == full[: enc.written]


values = st.one_of(
    st.tuples(st.just("u8"), st.integers(0, 255)),
    st.tuples(st.just("u32"), st.integers(0, 2**32 - 1)),
    st.tuples(st.just("i32"), st.integers(-(2**31), 2**31 - 1)),
    st.tuples(st.just("u64"), st.integers(0, 2**64 - 1)),
    st.tuples(st.just("bool"), st.booleans()),
    st.tuples(st.just("blob"), st.binary(max_size=19)),
    st.tuples(st.just("string"), st.text(alphabet="abcxyz-_.", max_size=13)),
    st.tuples(st.just("u64_array"), st.lists(st.integers(0, 2**64 - 1), max_size=4)),
    st.tuples(st.just("i32_array"), st.lists(st.integers(-(2**31), 2**31 - 1), max_size=4)),
)


def _read(dec, kind, value):
    if kind == "blob":
        return dec.blob(len(value))
    if kind == "string":
        return dec.string()
    if kind == "u64_array":
        return dec.u64_array(len(value)).tolist()
    if kind == "i32_array":
        return dec.i32_array(len(value)).tolist()
    return getattr(dec, kind)()


@settings(max_examples=200, deadline=None)
@given(items=st.lists(values, max_size=12), extra=st.integers(0, 8))
def test_round_trip(items, extra):
    buf = bytearray(4096)
    enc = Encoder(buf)
    for kind, value in items:
        getattr(enc, kind)(value)
    enc.check()
    assert enc.written % 4 == 0
    dec = Decoder(buf, 0, enc.written + extra)
    for kind, value in items:
        assert _read(dec, kind, value) == value
    assert not dec.fatal and dec.remaining == extra


def test_pack_writes_what_the_scalar_calls_write():
    """Encoder.pack (Remote.call's command header) against i32/i32/u32, whose bytes
    test_encode_matches_c checks against the C encoder; and its overflow like theirs."""
    import struct

    header = struct.Struct("<iiI")
    one, many = bytearray(16), bytearray(16)
    a, b = Encoder(one), Encoder(many)
    a.pack(header, -331, 7, 0xFFFFFFFE)
    b.i32(-331), b.i32(7), b.u32(0xFFFFFFFE)
    assert (one, a.pos) == (many, b.pos) == (one, 12)
    small = bytearray(b"\xcc" * 16)
    c = Encoder(small, 0, 8)
    c.pack(header, 1, 2, 3)
    assert c.fatal and c.pos == 0 and small == b"\xcc" * 16


def test_decoder_reset_starts_over_and_clears_fatal():
    buf = bytearray(12)
    buf[4:12] = (7).to_bytes(4, "little") + (9).to_bytes(4, "little")
    dec = Decoder(buf, 4, 12)
    assert (dec.u32(), dec.u32()) == (7, 9)
    assert dec.u32() == 0 and dec.fatal  # past the end
    dec.reset()
    assert not dec.fatal and dec.pos == 4
    assert dec.u32() == 7


def test_unpack_reads_a_struct_or_sets_fatal():
    st = struct.Struct("<IQ")
    buf = struct.pack("<IQ", 7, 2**40) + b"\1\2"
    dec = Decoder(buf)
    assert dec.unpack(st) == (7, 2**40) and dec.pos == 12 and not dec.fatal
    assert dec.unpack(st) is None and dec.fatal and dec.pos == 12  # two bytes left: nothing read
