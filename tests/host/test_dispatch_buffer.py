"""Buffer functions: virtual base, tensor set/get/copy, clear, free."""

import numpy as np

from apir.codec.constants import ApirBackendCommandType as Cmd
from tests.host.hostkit import GgmlScratch, rpc_bytes, rpc_record


def test_get_base_is_virtual_and_aligned(guest, ggml):
    b1, b2 = guest.alloc(10000), guest.alloc(100)
    lib = guest.ctx._library
    base1, base2 = guest.base(b1), guest.base(b2)
    real1 = lib.buffers.get(b1).base
    align = ggml.ggml_backend_buft_get_alignment(ggml.ggml_backend_dev_buffer_type(ggml.ggml_backend_dev_by_type(0)))
    assert base1 != real1 and base1 % align == 0 and base2 % align == 0
    assert base2 >= base1 + 10000  # ranges do not overlap


def test_set_get_roundtrip_and_offset(guest, ggml):
    s = GgmlScratch(ggml)
    t = ggml.ggml_new_tensor_2d(s.ctx, ggml.types["F32"], 16, 4)
    buf = guest.alloc(4096)
    rpc = rpc_bytes(rpc_record(ggml, t, buf, data=256))
    values = np.arange(64, dtype=np.float32)
    assert guest.set_tensor(buf, rpc, values.tobytes()) == 0
    rc, got = guest.get_tensor(buf, rpc, 256)
    assert rc == 0 and got == values.tobytes()
    # the bytes are at base + 256 of the real buffer
    real = guest.ctx._library.buffers.get(buf).base
    import ctypes
    assert ctypes.string_at(real + 256, 256) == values.tobytes()
    # partial write with an offset
    assert guest.set_tensor(buf, rpc, np.float32([-1, -2]).tobytes(), offset=8) == 0
    rc, got = guest.get_tensor(buf, rpc, 16)
    assert np.frombuffer(got, np.float32).tolist() == [0, 1, -1, -2]
    s.close()


def test_cpy_tensor(guest, ggml):
    s = GgmlScratch(ggml)
    a = ggml.ggml_new_tensor_1d(s.ctx, ggml.types["F32"], 32)
    b = ggml.ggml_new_tensor_1d(s.ctx, ggml.types["F32"], 32)
    buf = guest.alloc(1024)
    ra, rb = rpc_bytes(rpc_record(ggml, a, buf, 0)), rpc_bytes(rpc_record(ggml, b, buf, 512))
    data = np.linspace(0, 1, 32, dtype=np.float32).tobytes()
    assert guest.set_tensor(buf, ra, data) == 0
    rc, d = guest.forward(Cmd.BUFFER_CPY_TENSOR, lambda e: (e.handle(buf), e.blob(ra), e.blob(rb)))
    assert rc == 0 and d.bool() is True
    assert guest.get_tensor(buf, rb, 128) == (0, data)
    s.close()


def test_clear_and_free(guest, ggml):
    s = GgmlScratch(ggml)
    t = ggml.ggml_new_tensor_1d(s.ctx, ggml.types["I8"], 100)
    buf = guest.alloc(100)
    rpc = rpc_bytes(rpc_record(ggml, t, buf, 0))
    assert guest.forward(Cmd.BUFFER_CLEAR, lambda e: (e.handle(buf), e.u8(0xA5)))[0] == 0
    assert guest.get_tensor(buf, rpc, 100) == (0, b"\xa5" * 100)
    assert guest.forward(Cmd.BUFFER_FREE_BUFFER, lambda e: e.handle(buf))[0] == 0
    assert guest.forward(Cmd.BUFFER_GET_BASE, lambda e: e.handle(buf))[0] == 1  # gone
    assert guest.forward(Cmd.BUFFER_FREE_BUFFER, lambda e: e.handle(buf))[0] == 1  # no double free
    s.close()


def test_loose_twin_has_the_fields_ggml_gives_the_same_tensor(ggml):
    """The transfer functions' tensor, written in one struct.pack_into outside any
    ggml_context, against the tensor ggml itself makes with those fields (ggml_new_tensor,
    ggml_set_name, data and buffer set): every field equal, a too-long name cut alike."""
    import ctypes

    from apir.ggml.layout import tensor_record
    from apir.host.handles import HostBuffer
    from apir.host.tensors import TensorChecker

    chk = TensorChecker(ggml)
    s = GgmlScratch(ggml)
    try:
        t = ggml.ggml_new_tensor_3d(s.ctx, ggml.types["F16"], 8, 3, 2)
        name = bytes(range(65, 65 + 26)) * 4  # 104 bytes: over GGML_MAX_NAME
        ggml.ggml_set_name(t, name)
        ref = tensor_record(t, ggml.tensor_dtype)
        ref["op_params"][:3] = [7, -1, 1 << 30]
        ref["flags"] = 4
        buf = HostBuffer(ptr=0x5000, base=0x100000, size=1 << 20, virtual_base=1 << 40, buft_handle=1)
        ref["buffer"], ref["data"] = buf.ptr, buf.base + 512
        raw = rpc_bytes(rpc_record(ggml, t, 1, data=512))
        rec = chk.rpc_tensor(raw)
        assert rec.name.split(b"\0")[0] == name[:63]
        params = tuple(int(x) for x in ref["op_params"])
        twin = chk.loose_twin(rec._replace(op_params=params, flags=4, name=name), buf)  # name uncut, no NUL
        got = tensor_record(ctypes.addressof(twin), ggml.tensor_dtype)
        for field in ggml.tensor_dtype.names:
            if field != "padding":
                assert np.array_equal(got[field], ref[field]), field
    finally:
        s.close()
