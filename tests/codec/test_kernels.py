"""apir.codec._kernels: each jitted kernel against its plain-Python twin (`.py_func`)."""

import ctypes

import numpy as np
import pytest

from apir import accel

if not accel.enabled():
    pytest.skip("apir.accel is off: the kernels are not used", allow_module_level=True)

from apir.codec import _kernels as K
from apir.host.graph import kernels as HK
from apir.codec.graph import parse_graph, serialize_graph
from apir.codec.graph_accel import _layout, _rpc_layout
from tests.codec.graphs import build_graph


@pytest.fixture(scope="module")
def small(ggml):
    bg = build_graph(ggml, 2)
    yield bg
    bg.free(ggml)


def test_raw_loads_and_stores_jit_vs_python():
    @K.jit
    def probe(addr):  # every load/store at an unaligned address
        K.store_i64(addr + 1, -2)
        K.store_u32(addr + 9, 0x1_FFFF_FFFE)  # truncated to u32
        K.store_u8(addr + 13, 0x1AB)  # truncated to u8
        return K.load_i64(addr + 1), K.load_u32(addr + 9), K.load_i32(addr + 9), K.load_u8(addr + 13)

    for fn in (probe, probe.py_func):
        buf = ctypes.create_string_buffer(16)
        assert fn(ctypes.addressof(buf)) == (-2, 0xFFFF_FFFE, -2, 0xAB)
        assert buf.raw == b"\0" + b"\xfe" + b"\xff" * 7 + b"\xfe\xff\xff\xff" + b"\xab\0\0"


def test_word_loads_at_any_alignment_jit_vs_python():
    """load_i64_at(addr, k) is the int64 at addr + 8 k, whatever addr's alignment, and
    _bytes_diff (its words, then the bytes left over) finds a difference in any byte."""

    @K.jit
    def words(addr, n):
        total = 0
        for k in range(n):
            total = total * 31 + K.load_i64_at(addr, k)
        return total

    @K.jit
    def bytes_diff(a, b, n):
        return HK._bytes_diff(a, b, n)

    raw = np.random.default_rng(7).integers(0, 256, 64, dtype=np.uint8)
    for off in range(8):
        addr = raw.ctypes.data + off
        want = 0
        for k in range(6):
            want = want * 31 + int(np.frombuffer(raw[off + 8 * k : off + 8 * k + 8].tobytes(), "<i8")[0])
        want = (want + (1 << 63)) % (1 << 64) - (1 << 63)  # the jitted int64 wraps
        assert words(addr, 6) == want
        assert words.py_func(addr, 6) % (1 << 64) == want % (1 << 64)
    for fn in (bytes_diff, bytes_diff.py_func):
        for n in range(0, 20):
            a, b = raw[:24].copy(), raw[:24].copy()
            assert fn(a.ctypes.data + 1, b.ctypes.data + 1, n) == 0
            for i in range(n):
                b[1 + i] ^= 0x10
                assert fn(a.ctypes.data + 1, b.ctypes.data + 1, n) != 0
                b[1 + i] ^= 0x10
            b[1 + n] ^= 0x10  # the byte after the n compared: not read as a difference
            assert fn(a.ctypes.data + 1, b.ctypes.data + 1, n) == 0


def test_memmove_kernel_vs_python():
    for fn in (K.memmove_kernel, K.memmove_kernel.py_func):
        a = np.arange(100, dtype=np.uint8)
        fn(a.ctypes.data + 3, a.ctypes.data, 50)
        assert list(a[3:53]) == list(range(50)) and list(a[:3]) == [0, 1, 2]


def test_serialize_graph_kernel_vs_python(ggml, small):
    jit = serialize_graph(ggml, small.cgraph, small.buffers)
    py = serialize_graph(ggml, small.cgraph, small.buffers, _kernel=K.serialize_graph_kernel.py_func)
    assert jit.tobytes() == py.tobytes()


def test_serialize_tensor_kernel_vs_python(ggml, small):
    from apir.codec.graph import rpc_tensor_from_ggml

    for t in small.tensors[:12]:
        a = rpc_tensor_from_ggml(ggml, t, small.buffers)
        b = rpc_tensor_from_ggml(ggml, t, small.buffers, _kernel=K.serialize_tensor_kernel.py_func)
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("kernel", ["jit", "py"])
def test_name_copy_every_length(ggml, small, kernel):
    """The record's name is snprintf's: the bytes up to the first NUL, at most max_name - 1,
    zeros after; whatever follows the NUL in ggml's field (here 0xAA garbage) is not copied.
    Word-wise copying must agree for every length, words with and without the NUL."""
    from apir.codec.graph import rpc_tensor_from_ggml

    fn = K.serialize_tensor_kernel if kernel == "jit" else K.serialize_tensor_kernel.py_func
    t = small.tensors[0]
    max_name = ggml.limits.max_name
    field = (ctypes.c_char * max_name).from_address(t + ggml.tensor_dtype.fields["name"][1])
    saved = field.raw
    try:
        for n in range(max_name + 1):
            raw = bytes(0x41 + (i % 26) for i in range(n)) + b"\0" + b"\xaa" * max_name
            ctypes.memmove(field, raw, max_name)
            rec = rpc_tensor_from_ggml(ggml, t, small.buffers, _kernel=fn)
            want = raw[: min(n, max_name - 1)]
            assert rec["name"].tobytes() == want + b"\0" * (max_name - len(want)), n
    finally:
        ctypes.memmove(field, saved, max_name)


def test_serialize_graph_kernel_reports_small_work_arrays(ggml, small):
    tl, rl, lim, rpc = _layout(ggml.tensor_dtype, ggml.limits)
    n = ggml.ggml_graph_n_nodes(small.cgraph)
    nodes = ggml.ggml_graph_nodes(small.cgraph)
    ptrs, handles, bases = small.buffers.arrays()
    info = np.zeros(4, np.int64)
    for fn in (K.serialize_graph_kernel, K.serialize_graph_kernel.py_func):
        def run(out_size, set_cap):
            out = np.empty(out_size, np.uint8)
            return fn(nodes, n, tl, rl, lim, ptrs, handles, bases, out.ctypes.data, out_size,
                      np.zeros(set_cap, np.int64), np.empty(set_cap, np.int64), np.empty(set_cap, np.int64), info)
        assert run(8 + 8 * n + 304 * 3, 1024) == K.SER_OUT_FULL
        assert run(4, 1024) == K.SER_OUT_FULL
        assert run(1 << 20, 16) == K.SER_SET_FULL
        assert run(1 << 20, 1024) > 0


def parse_both(ggml, raw, type_valid):
    out = []
    for kernel in (None, K.parse_graph_kernel.py_func):
        try:
            p = parse_graph(raw, op_count=ggml.op_count, type_valid=type_valid, _kernel=kernel)
            out.append((p.order.tolist(), p.node_index.tolist(), p.src_index.tolist(), p.view_src_index.tolist()))
        except ValueError as exc:
            out.append(str(exc))
    return out


def test_parse_graph_kernel_vs_python(ggml, small):
    valid = np.zeros(ggml.type_count, bool)
    valid[list(ggml.type_names)] = True
    raw = serialize_graph(ggml, small.cgraph, small.buffers).tobytes()
    n = int.from_bytes(raw[:4], "little")
    rpc = _rpc_layout(ggml.limits)[2]
    rng = np.random.default_rng(7)
    cases = [raw]
    for _ in range(12):  # ids, types, ops, names, src slots of random tensors scribbled on
        data = bytearray(raw)
        k = int(rng.integers(0, (len(raw) - 8 - 8 * n) // rpc.itemsize))
        field = ["id", "type", "op", "name", "src", "view_src"][int(rng.integers(0, 6))]
        off = 8 + 8 * n + rpc.itemsize * k + rpc.fields[field][1] + int(rng.integers(0, 4))
        data[off] ^= 1 << int(rng.integers(0, 8))
        cases.append(bytes(data))
    results = [parse_both(ggml, c, valid) for c in cases]
    assert all(a == b for a, b in results)
    assert isinstance(results[0][0], tuple)  # the unmutated graph parses
    assert any(isinstance(r[0], str) for r in results)  # and some mutations are caught


def test_record_key_kernel_vs_python():
    """Masked bytes kept, the rest zero; each name cut after its first NUL, a name without
    one kept whole; the same from the jitted kernel and its twin."""
    rng = np.random.default_rng(7)
    rows = rng.integers(1, 256, (4, 12), dtype=np.uint8)  # names at [4, 10): no NUL yet
    rows[0, 6] = 0  # name "xy\0..." : bytes 7..9 cut
    rows[1, 4] = 0  # empty name: 5..9 cut
    rows[2, 9] = 0  # NUL in the last byte: nothing after it
    mask = np.array([0xFF, 0, 0xFF, 0xFF] + [0xFF] * 6 + [0, 0xFF], np.uint8)
    want = rows & mask
    want[0, 7:10] = 0
    want[1, 5:10] = 0
    for fn in (HK.record_key_kernel, HK.record_key_kernel.py_func):
        out = np.full(rows.size, 0xEE, np.uint8)
        assert fn(rows, mask, 4, 6, out) == 0
        assert out.tobytes() == want.tobytes()


def test_names_cut_at_their_first_nul_in_any_byte_of_a_word():
    """The first NUL of a 64-byte name (found 8 bytes at a time, `_first_nul`) at each of its
    positions, with bytes of every value around it (0x80 and 0x01 ones next to it, which the
    word test must not take for a zero), and a name without one: record_key_kernel cuts the
    name just after it, the jitted kernel as its twin."""
    rng = np.random.default_rng(9)
    rows = rng.integers(1, 256, (65, 72), dtype=np.uint8)  # names at [8, 72)
    rows[::2, 8:72] = np.where(rng.random((33, 64)) < 0.5, 0x80, 0x01).astype(np.uint8)
    for p in range(64):
        rows[p, 8 + p] = 0
        rows[p, 8 + p + 1 : 72] |= (rows[p, 8 + p + 1 : 72] == 0).astype(np.uint8)  # (the first NUL)
    mask = np.full(72, 0xFF, np.uint8)
    want = rows.copy()
    for p in range(64):
        want[p, 8 + p + 1 :] = 0  # row 64: no NUL, kept whole
    for fn in (HK.record_key_kernel, HK.record_key_kernel.py_func):
        out = np.full(rows.size, 0xEE, np.uint8)
        assert fn(rows, mask, 8, 64, out) == 0
        assert out.reshape(rows.shape).tolist() == want.tolist()
    # name_lens_kernel (GraphWire's compared name bytes): the NUL's position, 63 without one
    for fn in (HK.name_lens_kernel, HK.name_lens_kernel.py_func):
        lens = np.full(65, -5, np.int64)
        assert fn(rows, 8, 64, lens) == 0
        assert lens.tolist() == list(range(64)) + [63]


def test_record_match_kernel_vs_python():
    """A header, then records compared 8 bytes at a time under the word mask and each name up
    to its NUL; the first difference that counts is a mismatch, in the jitted kernel and its
    twin, whatever the new bytes' alignment."""
    rng = np.random.default_rng(8)
    rows = rng.integers(1, 256, (3, 24), dtype=np.uint8)  # names at [8, 20)
    rows[0, 10] = 0  # record 0's name ends at byte 10
    rows[1, 8] = 0  # record 1's is empty
    rows[2, 19] = 0  # record 2's NUL is its name's last byte
    mask = np.array([0xFF, 0, 0xFF, 0xFF] + [0xFF] * 4 + [0xFF] * 12 + [0, 0xFF, 0xFF, 0], np.uint8)
    head = np.arange(7, 15, dtype=np.uint8)
    old = np.empty(8 + rows.size, np.uint8)
    old[:8] = head
    HK.record_key_kernel(rows, mask, 8, 12, old[8:])
    words = mask.copy()
    words[8:20] = 0
    words = words.view(np.int64)
    name_lens = np.array([2, 0, 11], np.int64)
    for offset in (0, 3):  # the guest's bytes at an aligned and an unaligned address
        buf = np.zeros(offset + 8 + rows.size + 2, np.uint8)
        new = buf[offset:]
        new[:8] = head
        new[8 : 8 + rows.size] = rows.reshape(-1)
        new[-2:] = [1, 2]  # trailing bytes
        for fn in (HK.record_match_kernel, HK.record_match_kernel.py_func):
            def match(b, size=None):
                size = b.size if size is None else size
                return fn(b.ctypes.data, size, old.ctypes.data, old.size, 8, 24, words, 8, name_lens)

            assert match(new)
            # (offset, compared): header bytes; record 0's masked-out bytes 1 and 20; record
            # 1's byte 0 and its name's NUL (8) but not the byte after it; record 0's name:
            # its NUL (10) compared, the bytes after it (11..19) not; record 2's last name byte
            for at, counts in ((0, True), (7, True), (8 + 1, False), (8 + 20, False), (8 + 21, True),
                               (8 + 24, True), (8 + 24 + 8, True), (8 + 24 + 9, False), (8 + 10, True),
                               (8 + 11, False), (8 + 19, False), (8 + 48 + 19, True), (8 + 48 + 18, True)):
                changed = new.copy()
                changed[at] ^= 0x40
                assert match(changed) is (not counts), (offset, at)
            assert not match(new, old.size - 1)
