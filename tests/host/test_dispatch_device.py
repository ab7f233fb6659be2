"""Device functions, each reply field checked against what ggml CPU reports directly."""

import ctypes

import pytest

from apir.codec.constants import ApirBackendCommandType as Cmd
from apir.ggml.backend_props import get_dev_props
from tests.host.hostkit import DATA_RES, GgmlScratch, inline_tensor


def _cpu(ggml):
    return ggml.ggml_backend_dev_by_type(0)


def test_counts_name_description_type(guest, ggml):
    dev = _cpu(ggml)
    count = ggml.ggml_backend_reg_dev_count(ggml.ggml_backend_dev_backend_reg(dev))
    for cmd in (Cmd.DEVICE_GET_DEVICE_COUNT, Cmd.DEVICE_GET_COUNT):
        rc, d = guest.forward(cmd)
        assert rc == 0 and d.i32() == count
    rc, d = guest.forward(Cmd.DEVICE_GET_NAME)
    assert rc == 0 and d.string() == ggml.ggml_backend_dev_name(dev).decode()
    rc, d = guest.forward(Cmd.DEVICE_GET_DESCRIPTION)
    assert rc == 0 and d.string() == ggml.ggml_backend_dev_description(dev).decode()
    rc, d = guest.forward(Cmd.DEVICE_GET_TYPE)
    assert rc == 0 and d.u32() == ggml.ggml_backend_dev_type(dev)


def test_memory(guest, ggml):
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    ggml.ggml_backend_dev_memory(_cpu(ggml), ctypes.byref(free), ctypes.byref(total))
    rc, d = guest.forward(Cmd.DEVICE_GET_MEMORY)
    assert rc == 0
    got_free, got_total = d.size_t(), d.size_t()
    assert got_total == total.value
    assert abs(got_free - free.value) < total.value // 10  # free memory moves between calls


def test_props(guest, ggml):
    caps = get_dev_props(ggml, _cpu(ggml))
    rc, d = guest.forward(Cmd.DEVICE_GET_PROPS)
    assert rc == 0
    got = [d.bool() for _ in range(5)]
    assert got == [caps[k] for k in ("async", "host_buffer", "buffer_from_host_ptr", "events", "mmap_support")]


def test_buffer_type_handle_is_opaque(guest, ggml):
    buft = guest.buffer_type()
    real = ggml.ggml_backend_dev_buffer_type(_cpu(ggml))
    assert buft != real and 0 < buft < 1 << 32
    assert guest.buffer_type() == buft  # the same buffer type keeps its id


def test_supports_op_matches_ggml(guest, ggml):
    s = GgmlScratch(ggml)
    f32, f16 = ggml.types["F32"], ggml.types["F16"]
    a = ggml.ggml_new_tensor_2d(s.ctx, f16, 64, 8)
    b = ggml.ggml_new_tensor_2d(s.ctx, f32, 64, 4)
    mm = ggml.ggml_mul_mat(s.ctx, a, b)
    add = ggml.ggml_add(s.ctx, mm, ggml.ggml_new_tensor_2d(s.ctx, f32, 8, 4))
    view = ggml.ggml_view_1d(s.ctx, b, 16, 0)
    cpy = ggml.ggml_cpy(s.ctx, ggml.ggml_new_tensor_1d(s.ctx, f32, 256),
                        ggml.ggml_new_tensor_1d(s.ctx, ggml.types["IQ2_XXS"], 256))
    for t in (mm, add, view, cpy):
        rc, d = guest.forward(Cmd.DEVICE_SUPPORTS_OP, lambda e, t=t: e.blob(inline_tensor(ggml, t)))
        assert rc == 0
        assert d.bool() == ggml.ggml_backend_dev_supports_op(_cpu(ggml), t)
    # cpy to IQ2_XXS is the one ggml CPU declines: the test can tell the answers apart
    assert not ggml.ggml_backend_dev_supports_op(_cpu(ggml), cpy)
    s.close()


def _supports(guest, ggml, t) -> bool:
    rc, d = guest.forward(Cmd.DEVICE_SUPPORTS_OP, lambda e: e.blob(inline_tensor(ggml, t)))
    assert rc == 0
    return d.bool()


def test_supports_op_says_no_where_compute_would_refuse(guest, ggml):
    """ggml CPU says yes to all of these; the host's shape rules accept the first two and
    refuse the others at graph_compute, so device_supports_op says no to those."""
    from apir.ggml.layout import tensor_record

    s = GgmlScratch(ggml)
    f32, q8 = ggml.types["F32"], ggml.types["Q8_0"]
    # ADD with a permuted src1 (computed: binary kernels read src1 at any stride)
    add = ggml.ggml_add(s.ctx, ggml.ggml_new_tensor_3d(s.ctx, f32, 2, 8, 3),
                        ggml.ggml_permute(s.ctx, ggml.ggml_new_tensor_3d(s.ctx, f32, 8, 3, 2), 1, 2, 0, 3))
    cpy_ok = ggml.ggml_cpy(s.ctx, ggml.ggml_new_tensor_2d(s.ctx, f32, 64, 2), ggml.ggml_new_tensor_2d(s.ctx, q8, 64, 2))
    # rows of 64 into Q8_0 rows of 32: the rule refuses (the CPU work buffer is sized by 32)
    cpy_bad = ggml.ggml_cpy(s.ctx, ggml.ggml_new_tensor_2d(s.ctx, f32, 64, 2), ggml.ggml_new_tensor_2d(s.ctx, q8, 32, 4))
    # an op with no rule on this host: an ADD relabelled so (ggml CPU's default is yes for these)
    from apir.host.graph.shapes import CHECKED_OPS

    no_rule = [op for op in ("WIN_PART", "WIN_UNPART", "POOL_1D", "POOL_2D", "GET_REL_POS")
               if op in ggml.ops and op not in CHECKED_OPS]
    if not no_rule:
        pytest.skip("every candidate op has a shape rule now")
    acc = ggml.ggml_add(s.ctx, ggml.ggml_new_tensor_1d(s.ctx, f32, 8), ggml.ggml_new_tensor_1d(s.ctx, f32, 8))
    tensor_record(acc, ggml.tensor_dtype)["op"] = ggml.ops[no_rule[0]]
    dev = _cpu(ggml)
    for t in (add, cpy_ok, cpy_bad, acc):
        assert ggml.ggml_backend_dev_supports_op(dev, t)
    assert [_supports(guest, ggml, t) for t in (add, cpy_ok, cpy_bad, acc)] == [True, True, False, False]
    s.close()


def test_buffer_from_ptr(guest, ggml):
    rc, d = guest.forward(Cmd.DEVICE_BUFFER_FROM_PTR,
                          lambda e: (e.u32(DATA_RES), e.size_t(65536), e.size_t(65536)))
    assert rc == 0
    buffer, buft = d.handle(), d.handle()
    assert buffer and buft and buft != guest.buffer_type()
    rc, d = guest.forward(Cmd.BUFFER_TYPE_GET_NAME, lambda e: e.handle(buft))
    assert rc == 0 and d.string() == "CPU_Mapped"
    # the buffer is the guest's memory: clearing it writes the resource
    guest.data[0:4] = b"\0\0\0\0"
    assert guest.forward(Cmd.BUFFER_CLEAR, lambda e: (e.handle(buffer), e.u8(0x5A)))[0] == 0
    assert bytes(guest.data[0:4]) == b"\x5a" * 4 and guest.data[65536] == 0
    # removing the resource frees the buffer that wraps it
    guest.ctx.remove_resource(DATA_RES)
    assert guest.forward(Cmd.BUFFER_GET_BASE, lambda e: e.handle(buffer))[0] == 1


def test_import_host_memory_off_offers_no_buffer_from_ptr(ggml):
    """apir.host.import_host_memory=0: props say no buffer_from_host_ptr although ggml CPU's
    do, and device_buffer_from_ptr is refused (5): the guest allocates device buffers."""
    from apir.host import HostContext
    from tests.host.hostkit import Guest

    assert get_dev_props(ggml, _cpu(ggml))["buffer_from_host_ptr"]
    g = Guest(HostContext(7, {"apir.host.import_host_memory": "0"}))
    try:
        rc, d = g.forward(Cmd.DEVICE_GET_PROPS)
        assert rc == 0 and [d.bool() for _ in range(3)][2] is False
        rc, _ = g.forward(Cmd.DEVICE_BUFFER_FROM_PTR, lambda e: (e.u32(DATA_RES), e.size_t(65536), e.size_t(65536)))
        assert rc == 1
    finally:
        g.close()


@pytest.mark.parametrize("name", ["gpu", "ACCEL"])
def test_configured_device_type(ggml, name):
    """apir.host.device_type: device_get_type reports that `enum ggml_backend_dev_type` value
    (read from ggml-backend.h) instead of the CPU device's own; the rest is unchanged."""
    from apir.host import HostContext
    from apir.host.backend.library import device_types
    from tests.host.hostkit import Guest

    g = Guest(HostContext(7, {"apir.host.device_type": name}))
    try:
        rc, d = g.forward(Cmd.DEVICE_GET_TYPE)
        assert rc == 0 and d.u32() == device_types(ggml)[name.upper()] != ggml.ggml_backend_dev_type(_cpu(ggml))
        rc, d = g.forward(Cmd.DEVICE_GET_NAME)
        assert rc == 0 and d.string() == ggml.ggml_backend_dev_name(_cpu(ggml)).decode()
    finally:
        g.close()


def test_unknown_device_type_fails_load_library(ggml):
    """An apir.host.device_type that names no type fails the backend's initialization (6 +
    APIR_BACKEND_INITIALIZE_BACKEND_INIT_FAILED, which LoadLibrary answers as 6 + that, the C
    component's encoding) instead of being ignored."""
    from apir.codec.constants import ApirBackendInitializeReturnCode as InitRc
    from apir.codec.constants import ApirCommandType, ApirLoadLibraryReturnCode as LoadRc
    from apir.host import HostContext
    from tests.host.hostkit import Guest

    g = Guest(HostContext(7, {"apir.host.device_type": "tpu"}), load=False)
    try:
        rc, _ = g.command(ApirCommandType.LOADLIBRARY, 0)
        base = LoadRc.INIT_BASE_INDEX
        assert rc == base + base + InitRc.BACKEND_INIT_FAILED
    finally:
        g.close()
