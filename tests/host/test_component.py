"""HostContext: HandShake, LoadLibrary, Forward, the reply word, malformed commands, config."""

import mmap
import struct

import pytest

from apir.codec.constants import (
    APIR_BACKEND_FORWARD_INDEX_INVALID,
    APIR_HANDSHAKE_MAGIC,
    VENUS_COMMAND_TYPE_LENGTH,
    VIRTGPU_DRM_CAPSET_VENUS,
    ApirBackendCommandType as Cmd,
    ApirCommandType as T,
)
from apir.host import COMMAND_MALFORMED, HostContext, LibraryLoadError
from apir.host.component.context import may_run_long
from tests.host.hostkit import DATA_RES, REPLY_RES, Guest


def test_handshake_answers_host_version_and_magic(ggml):
    g = Guest(load=False, version=None)
    rc, d = g.command(T.HANDSHAKE, 0, lambda e: (e.u32(0), e.u32(1)))
    assert rc == APIR_HANDSHAKE_MAGIC
    assert (d.u32(), d.u32()) == (0, 2)
    assert g.ctx.guest_version == (0, 1)
    g.close()


@pytest.mark.parametrize("version,n_bools", [((0, 1), 4), ((0, 2), 5)])
def test_device_get_props_matches_guest_version(ggml, version, n_bools):
    g = Guest(version=version)
    g.reply[4:64] = b"\xee" * 60
    rc, d = g.forward(Cmd.DEVICE_GET_PROPS)
    assert rc == 0
    # exactly n_bools 4-byte slots written: the next slot is untouched
    values = [d.u32() for _ in range(n_bools)]
    assert all(v in (0, 1) for v in values)
    assert d.u32() == 0xEEEEEEEE
    g.close()


def test_unknown_guest_version_still_handshakes_as_host(ggml):
    g = Guest(load=False, version=None)
    rc, d = g.command(T.HANDSHAKE, 0, lambda e: (e.u32(7), e.u32(9)))
    assert rc == APIR_HANDSHAKE_MAGIC and (d.u32(), d.u32()) == (0, 2)
    assert g.ctx.guest_version == (0, 2)
    g.close()


def test_load_library_codes(ggml, tmp_path):
    g = Guest(load=False)
    rc, _ = g.command(T.FORWARD, int(Cmd.DEVICE_GET_COUNT))
    assert rc == 1  # APIR_FORWARD_NO_DISPATCH_FCT before LoadLibrary
    assert g.command(T.LOADLIBRARY, 0)[0] == 0
    assert g.command(T.LOADLIBRARY, 0)[0] == 2  # ALREADY_LOADED
    g.close()


def test_load_library_configured_path_uses_factory(ggml):
    seen = []

    def factory(path):
        seen.append(path)
        raise LibraryLoadError(5, "no symbol")

    ctx = HostContext(3, {"apir.load_library.path": "/x/libggml-virtgpu-backend.so"}, library_factory=factory)
    g = Guest(ctx, load=False)
    assert g.command(T.LOADLIBRARY, 0)[0] == 5
    assert seen == ["/x/libggml-virtgpu-backend.so"]
    g.close()


def test_load_library_default_factory_cannot_open(ggml, monkeypatch):
    monkeypatch.setenv("VIRGL_APIR_BACKEND_LIBRARY", "/nonexistent/lib.so")
    g = Guest(load=False)
    assert g.ctx.get_config("apir.load_library.path") == "/nonexistent/lib.so"
    assert g.command(T.LOADLIBRARY, 0)[0] == 4  # CANNOT_OPEN
    g.close()


def test_load_library_ggml_path_and_symbol(ggml):
    cpu = str(ggml.lib_dir / "libggml-cpu.so")
    # a ggml library that cannot be opened: 6 + CANNOT_OPEN(4)
    g = Guest(HostContext(4, {"ggml.library.path": "/nonexistent/libggml-x.so"}), load=False)
    assert g.command(T.LOADLIBRARY, 0)[0] == 6 + 4
    g.close()
    # the default symbol ggml_backend_init is not in libggml-cpu: 6 + SYMBOL_MISSING(5)
    g = Guest(HostContext(5, {"ggml.library.path": cpu}), load=False)
    assert g.command(T.LOADLIBRARY, 0)[0] == 6 + 5
    g.close()
    g = Guest(HostContext(6, {"ggml.library.path": cpu, "ggml.library.reg": "ggml_backend_cpu_reg"}))
    rc, d = g.forward(Cmd.DEVICE_GET_NAME)
    assert rc == 0 and d.string() == "CPU"
    g.close()


def test_forward_invalid_function_id(guest):
    rc, _ = guest.command(T.FORWARD, 23)
    assert rc == 4 + APIR_BACKEND_FORWARD_INDEX_INVALID
    assert guest.forward(Cmd.DEVICE_GET_COUNT)[0] == 0


def test_venus_capset_subtracts_331(ggml):
    g = Guest(HostContext(8, capset_id=VIRTGPU_DRM_CAPSET_VENUS), version=None, load=False)
    rc, d = g.command(T.HANDSHAKE + VENUS_COMMAND_TYPE_LENGTH, 0, lambda e: (e.u32(0), e.u32(2)))
    assert rc == APIR_HANDSHAKE_MAGIC
    assert g.command(T.LOADLIBRARY + VENUS_COMMAND_TYPE_LENGTH, 0)[0] == 0
    rc, d = g.command(T.FORWARD + VENUS_COMMAND_TYPE_LENGTH, int(Cmd.DEVICE_GET_COUNT))
    assert rc == 4 and d.i32() >= 1
    g.close()
    with pytest.raises(ValueError):
        HostContext(9, capset_id=3)


def test_unknown_command_type_gets_a_reply(guest):
    assert guest.command(3, 0)[0] == COMMAND_MALFORMED
    assert guest.command(0xFFFFFFFF, 0)[0] == COMMAND_MALFORMED
    assert guest.forward(Cmd.DEVICE_GET_COUNT)[0] == 0


def test_truncated_header_replies_through_last_reply_resource(guest):
    assert guest.raw(b"\x02\0\0\0\x01\0") == COMMAND_MALFORMED
    assert guest.raw(b"") == COMMAND_MALFORMED
    assert guest.forward(Cmd.DEVICE_GET_COUNT)[0] == 0


def test_unknown_or_tiny_reply_resource(guest):
    rc, _ = guest.command(T.FORWARD, int(Cmd.DEVICE_GET_COUNT), reply_res=999)
    assert rc == COMMAND_MALFORMED  # through the last valid reply resource
    tiny = bytearray(3)
    guest.ctx.add_resource(50, tiny)
    rc, _ = guest.command(T.FORWARD, int(Cmd.DEVICE_GET_COUNT), reply_res=50)
    assert rc == COMMAND_MALFORMED and tiny == bytearray(3)
    assert guest.forward(Cmd.DEVICE_GET_COUNT)[0] == 0


def test_no_reply_resource_ever_known_means_no_reply(ggml):
    ctx = HostContext(11)
    ctx.submit(struct.pack("<III", 2, 0, 5))  # nothing to write into: must simply not crash
    ctx.close()


def test_reply_too_small_for_payload(guest):
    tiny = bytearray(8)  # word + 4 payload bytes: device_get_name needs more
    guest.ctx.add_resource(61, tiny)
    rc, _ = guest.command(T.FORWARD, int(Cmd.DEVICE_GET_NAME), reply_res=61)
    # the reply went to resource 61, not to the guest's usual reply blob
    assert struct.unpack_from("<I", tiny, 0)[0] - 1 == COMMAND_MALFORMED


def test_reply_resource_encoder_starts_over_for_each_command(guest):
    """The reply Encoder a resource keeps (Resource.reply_encoder) is reset for every command:
    a reply that did not fit leaves nothing behind for the next one, and removing the resource
    leaves no view of its memory (the mapping can be closed)."""
    tiny = mmap.mmap(-1, 8)  # word + 4 payload bytes
    guest.ctx.add_resource(61, tiny)
    rc, _ = guest.command(T.FORWARD, int(Cmd.DEVICE_GET_NAME), reply_res=61)
    assert struct.unpack_from("<I", tiny, 0)[0] - 1 == COMMAND_MALFORMED
    for _ in range(2):
        tiny[:] = bytes(8)
        guest.command(T.FORWARD, int(Cmd.DEVICE_GET_TYPE), reply_res=61)
        word, dev_type = struct.unpack_from("<II", tiny, 0)
        assert word - 1 == 4  # the Forward's base index + BACKEND_RC_OK
        assert dev_type == guest.forward(Cmd.DEVICE_GET_TYPE)[1].u32()
    guest.ctx.remove_resource(61)
    tiny.close()  # BufferError if a view of it were still alive


def test_config_env_fallback(monkeypatch, ggml):
    monkeypatch.setenv("APIR_LLAMA_CPP_GGML_LIBRARY_REG", "from_env")
    ctx = HostContext(12, {"ggml.library.path": "/p"})
    assert ctx.get_config("ggml.library.path") == "/p"
    assert ctx.get_config("ggml.library.reg") == "from_env"
    ctx.set_config("ggml.library.reg", "from_kv")
    assert ctx.get_config("ggml.library.reg") == "from_kv"
    assert ctx.get_config("unknown.key") is None
    ctx.close()


def test_resource_sizes_are_real(guest):
    assert guest.ctx.get_shmem(REPLY_RES).size == 16384
    assert guest.ctx.get_shmem(DATA_RES).size == len(guest.data)
    with pytest.raises(ValueError):
        guest.ctx.add_resource(REPLY_RES, bytearray(8))
    with pytest.raises(ValueError):
        guest.ctx.add_resource(70, bytes(8))
    guest.ctx.remove_resource(DATA_RES)
    assert guest.ctx.get_shmem(DATA_RES) is None
    guest.ctx.remove_resource(12345)  # unknown: ignored


def test_close_frees_exactly_this_contexts_buffers(ggml, monkeypatch):
    a, b = Guest(HostContext(20)), Guest(HostContext(21))
    a_bufs = {a.ctx._library.buffers.get(a.alloc(n)).ptr for n in (64, 128)}
    b_buf = b.alloc(64)
    freed = []
    real_free = ggml.ggml_backend_buffer_free
    monkeypatch.setattr(ggml, "ggml_backend_buffer_free", lambda p: (freed.append(p), real_free(p)))
    a.close()
    assert set(freed) == a_bufs
    assert b.base(b_buf)  # the other context's buffer is untouched and still served
    a.ctx.submit(struct.pack("<III", 2, 0, REPLY_RES))  # dropped, no crash
    b.close()
    assert len(freed) == 3


def test_deferred_notification_is_handed_over_not_stored(guest):
    """An embedded host defers the reply word: submit writes the payload, not the word."""
    guest.ctx.defer_notification = True
    try:
        rc = guest.raw(struct.pack("<III", T.FORWARD, int(Cmd.DEVICE_GET_COUNT), REPLY_RES))
        assert rc is None  # the word is still 0
        word, value = guest.ctx.take_notification()
        assert value == 4 + 1  # Forward success: 4 + BACKEND_RC_OK, plus one
        assert guest.ctx.take_notification() is None
        word.store_release(value)
        assert struct.unpack_from("<I", guest.reply, 0)[0] == 5
        assert struct.unpack_from("<i", guest.reply, 4)[0] >= 1  # the device count
    finally:
        guest.ctx.defer_notification = False
    assert guest.forward(Cmd.DEVICE_GET_COUNT)[0] == 0  # stored by submit again


def _header(cmd_type, flags=0, reply_res=REPLY_RES):
    return struct.pack("<III", cmd_type, flags, reply_res)


@pytest.mark.parametrize("capset_id,offset", [(10, 0), (VIRTGPU_DRM_CAPSET_VENUS, VENUS_COMMAND_TYPE_LENGTH)])
def test_may_run_long_names_load_library_and_graph_compute(capset_id, offset):
    """Only LoadLibrary and Forward backend_graph_compute may run unbounded; HandShake and the
    other 22 Forward functions are bounded by what they name (arguments after the header do
    not change the answer)."""
    assert may_run_long(_header(T.HANDSHAKE + offset) + bytes(8), capset_id) is False
    assert may_run_long(_header(T.LOADLIBRARY + offset), capset_id) is True
    long_ones = [f for f in Cmd if may_run_long(_header(T.FORWARD + offset, f) + bytes(16), capset_id)]
    assert long_ones == [Cmd.BACKEND_GRAPH_COMPUTE]
    # any buffer the ioctl may hand over
    assert may_run_long(bytearray(_header(T.FORWARD + offset, Cmd.DEVICE_GET_TYPE)), capset_id) is False
    assert may_run_long(memoryview(_header(T.FORWARD + offset, Cmd.BACKEND_GRAPH_COMPUTE)), capset_id) is True


def test_may_run_long_for_every_header_it_cannot_read():
    """Short, unknown command type, unknown function id: may run long (the slow path refuses
    them); the Venus offset is subtracted only over the Venus capset, as `submit` does."""
    forward_get_type = _header(T.FORWARD, Cmd.DEVICE_GET_TYPE)
    for short in (b"", forward_get_type[:4], forward_get_type[:11]):
        assert may_run_long(short, 10) is True
    assert may_run_long(_header(3), 10) is True
    assert may_run_long(_header(0xFFFFFFFF, 0xFFFFFFFF), 10) is True
    assert may_run_long(_header(T.FORWARD, len(Cmd)), 10) is True
    # Forward + 331 is an unknown type over APIR; plain Forward still passes over Venus
    assert may_run_long(_header(T.FORWARD + VENUS_COMMAND_TYPE_LENGTH, Cmd.DEVICE_GET_TYPE), 10) is True
    assert may_run_long(forward_get_type, VIRTGPU_DRM_CAPSET_VENUS) is False
    assert may_run_long(_header(T.HANDSHAKE + VENUS_COMMAND_TYPE_LENGTH - 1), VIRTGPU_DRM_CAPSET_VENUS) is True
