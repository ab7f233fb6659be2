"""ApirClient against two hosts served synchronously by a test device: the C reference host
(libggml-virtgpu-backend.so over the CPU backend) and apir's own (apir.host HostContext with
its built-in dispatcher). Every backend function, chunked transfers, graphs, the Venus
capset, and 8 threads of mixed calls."""

import ctypes
import struct
import threading

import numpy as np
import pytest

from apir.codec.constants import VENUS_COMMAND_TYPE_LENGTH, VIRTGPU_DRM_CAPSET_VENUS, ApirCommandType
from apir.codec.records import RPC_TENSOR_DTYPE
from apir.guest.client import ApirClient, DeviceProps
from apir.guest.errors import BackendFunctionError, LibraryAlreadyLoaded, ReplyError
from apir.guest.remote import Remote
from tests.guest.hosts import CHostContext, SilentHost, SyncDevice, connect, shared_c_host

WINDOW = 64 * 1024  # a small data window, so transfers get chunked


@pytest.fixture(scope="module", params=["c-host", "apir-host"])
def host(request, cref_020):
    if request.param == "apir-host":
        from apir.host.component.context import HostContext

        return HostContext(7)
    return shared_c_host(cref_020)


@pytest.fixture(scope="module")
def is_c_host(host):
    """Whether the client's host is the C reference host (it cannot free from-ptr buffers)."""
    return isinstance(host, CHostContext)


@pytest.fixture(scope="module")
def client(host):
    c = connect(SyncDevice(host, owns_host=False), data_size=WINDOW, forward_timeout_s=30)
    yield c
    c.close()


@pytest.fixture(scope="module")
def g():
    import apir.ggml

    return apir.ggml.load()


def flag_compute(g):
    """GGML_TENSOR_FLAG_COMPUTE from this build's ggml.h (the CPU backend skips nodes without it)."""
    return g.tensor_flags["COMPUTE"]


def rpc(g, tid, buffer, n, data_offset, op="NONE", src=()):
    """An F32 vector tensor of `n` elements as an apir_rpc_tensor record; nodes (op not
    NONE) are flagged for computing."""
    rec = np.zeros((), RPC_TENSOR_DTYPE)
    rec["flags"] = flag_compute(g) if op != "NONE" else 0
    rec["id"], rec["type"], rec["buffer"] = tid, g.types["F32"], buffer
    rec["ne"] = [n, 1, 1, 1]
    rec["nb"] = [4, 4 * n, 4 * n, 4 * n]
    rec["op"] = g.ops[op]
    rec["src"][: len(src)] = src
    rec["data"] = data_offset
    rec["name"][:4] = [b"t", b"e", b"s", b"t"]
    return rec


@pytest.fixture(scope="module")
def buffer(client):
    buft = client.device_get_buffer_type()
    handle = client.buffer_type_alloc_buffer(buft, 4 << 20)
    assert handle
    yield handle
    client.buffer_free_buffer(handle)


def test_handshake_recorded_host_version(client):
    assert client.host_version == (0, 2)
    assert client.remote.capset_id == 10 and client.remote.command_type_offset == 0


def test_load_library_twice_is_already_loaded(client, host):
    with pytest.raises(LibraryAlreadyLoaded) as info:
        ApirClient.connect(SyncDevice(host, owns_host=False))
    assert info.value.code == 2
    assert client.device_get_count() == 1  # the first client is unharmed


def test_device_functions_match_the_cpu_backend(client, g):
    cpu = g.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    assert client.device_get_count() == 1
    assert client.device_get_device_count() == 1
    assert client.device_get_name() == g.ggml_backend_dev_name(cpu).decode()
    assert client.device_get_description() == g.ggml_backend_dev_description(cpu).decode()
    assert client.device_get_type() == g.ggml_backend_dev_type(cpu)
    free, total = client.device_get_memory()
    f, t = ctypes.c_size_t(), ctypes.c_size_t()
    g.ggml_backend_dev_memory(cpu, ctypes.byref(f), ctypes.byref(t))
    assert total == t.value and 0 < free <= total
    # ggml-cpu.cpp's caps: async false, host_buffer false, from_host_ptr true, events false, mmap true
    assert client.device_get_props() == DeviceProps(False, False, True, False, True)


def test_device_props_from_an_apir_0_1_host(client):
    saved = client.host_version
    client.host_version = (0, 1)
    try:
        assert client.device_get_props() == DeviceProps(False, False, True, False, None)
    finally:
        client.host_version = saved


@pytest.fixture(scope="module")
def guest_0_1(host, is_c_host):
    """An APIR 0.1 client (the C guest of ggml 0.10 speaks it). Of the apir host, on a context of
    its own (the HandShake sets the context's guest version); of the C host, on the session's
    one, whose library the module's client loaded already."""
    if is_c_host:
        c = ApirClient(Remote(SyncDevice(host, owns_host=False), data_size=WINDOW), protocol=(0, 1))
        c.handshake()
    else:
        from apir.host.component.context import HostContext

        c = ApirClient.connect(SyncDevice(HostContext(8)), data_size=WINDOW, protocol=(0, 1))
    yield c
    c.close()


def test_device_props_of_an_apir_0_1_guest(client, guest_0_1, is_c_host):
    """A 0.1 guest of a 0.2 host reads the 4 booleans of 0.1, not a 5th from whatever the
    reply resource held: here what a longer earlier reply (a device description of a few
    dozen bytes, a string of the apir host) would leave in the 5th slot."""
    assert guest_0_1.host_version == (0, 2) and guest_0_1.negotiated_version == (0, 1)
    want = client.device_get_props()
    assert want.mmap_support is not None  # the 0.2 client reads 5
    guest_0_1.device_get_name()
    guest_0_1.remote.reply.memory[4:64] = b"Intel(R) Xeon(R) Platinum 8480+ CPU".ljust(60, b"\0")
    got = guest_0_1.device_get_props()
    assert got == DeviceProps(want.async_, want.host_buffer, want.buffer_from_host_ptr, want.events, None)


def test_device_props_layout_is_the_lower_version(client):
    saved = client.host_version
    try:
        for host, negotiated in (((0, 1), (0, 1)), ((0, 2), (0, 2)), ((0, 3), (0, 2))):
            client.host_version = host
            assert client.negotiated_version == negotiated
    finally:
        client.host_version = saved


def test_buffer_type_functions(client, g):
    buft = client.device_get_buffer_type()
    cpu_buft = g.ggml_backend_cpu_buffer_type()
    assert buft != 0
    assert client.buffer_type_get_name(buft) == g.ggml_backend_buft_name(cpu_buft).decode()
    assert client.buffer_type_get_alignment(buft) == g.ggml_backend_buft_get_alignment(cpu_buft)
    assert client.buffer_type_get_max_size(buft) == g.ggml_backend_buft_get_max_size(cpu_buft)
    assert client.buffer_type_is_host(buft) is False  # the C host always answers false


def test_inline_tensors_supports_op_and_alloc_size(client, g):
    from apir.ggml.lib import InitParams

    ctx = g.ggml_init(InitParams(g.ggml_tensor_overhead() * 8, None, True))
    try:
        a = g.ggml_new_tensor_2d(ctx, g.types["F32"], 33, 7)
        b = g.ggml_new_tensor_2d(ctx, g.types["F32"], 33, 7)
        c = g.ggml_add(ctx, a, b)
        view = g.ggml_view_1d(ctx, c, 10, 8)
        assert client.device_supports_op(c) is True
        assert client.device_supports_op(view) is True  # carries view_src and src[0]
        buft = client.device_get_buffer_type()
        assert client.buffer_type_get_alloc_size(buft, a) == g.ggml_nbytes(a) == 33 * 7 * 4
    finally:
        g.ggml_free(ctx)


def test_set_get_chunked_roundtrip_and_base(client, g, buffer):
    assert client.buffer_get_base(buffer) != 0
    n = 100_000  # 400 KB: seven chunks of the 64 KiB window
    values = np.arange(n, dtype=np.float32) * 0.5
    t = rpc(g, 0x1000, buffer, n, 0)
    client.buffer_set_tensor(buffer, t, 0, values)
    out = np.empty(n, np.float32)
    client.buffer_get_tensor(buffer, t, 0, out)
    assert np.array_equal(out, values)
    part = bytearray(12)
    client.buffer_get_tensor(buffer, t, 4 * 70_000, part)
    assert np.frombuffer(part, np.float32).tolist() == values[70_000:70_003].tolist()
    client.buffer_set_tensor(buffer, t.tobytes(), 8, np.float32([-1, -2]).tobytes())
    client.buffer_get_tensor(buffer, t, 0, out)
    assert out[:4].tolist() == [0, 0.5, -1, -2]


def test_cpy_clear_and_graph_compute(client, g, buffer):
    n = 1000
    a, b, c = (rpc(g, 0x2000, buffer, n, 1 << 20), rpc(g, 0x3000, buffer, n, (1 << 20) + 4096),
               rpc(g, 0x4000, buffer, n, (1 << 20) + 8192, op="ADD", src=(0x2000, 0x3000)))
    va = np.linspace(-3, 3, n, dtype=np.float32)
    vb = np.linspace(10, 0, n, dtype=np.float32)
    client.buffer_set_tensor(buffer, a, 0, va)
    client.buffer_set_tensor(buffer, b, 0, vb)
    graph = (struct.pack("<I", 1) + struct.pack("<Q", 0x4000) + struct.pack("<I", 3)
             + a.tobytes() + b.tobytes() + c.tobytes())
    assert client.backend_graph_compute(graph) == 0  # GGML_STATUS_SUCCESS
    out = np.empty(n, np.float32)
    client.buffer_get_tensor(buffer, c, 0, out)
    assert np.array_equal(out, va + vb)
    assert client.buffer_cpy_tensor(buffer, a, c) is True
    client.buffer_get_tensor(buffer, c, 0, out)
    assert np.array_equal(out, va)


def test_graph_larger_than_the_window_uses_a_temporary_blob(client, g, buffer):
    n = 1000
    base = 2 << 20
    tensors = [rpc(g, 0x10000, buffer, n, base)]
    for i in range(1, 300):  # 300 x 304 bytes > 64 KiB
        tensors.append(rpc(g, 0x10000 + i, buffer, n, base, op="SCALE", src=(0x10000 + i - 1,)))
        tensors[-1]["op_params"][0] = np.float32(1.0).view(np.int32)
        tensors[-1]["data"] = base + 4096 * (i % 2 + 1)
    client.buffer_set_tensor(buffer, tensors[0], 0, np.full(n, 3, np.float32))
    ids = [int(t["id"]) for t in tensors[1:]]
    graph = (struct.pack("<I", len(ids)) + np.array(ids, "<u8").tobytes() + struct.pack("<I", len(tensors))
             + b"".join(t.tobytes() for t in tensors))
    assert len(graph) > WINDOW
    blobs_before = dict(client.remote.device.blobs)
    assert client.backend_graph_compute(graph) == 0
    assert client.remote.device.blobs.keys() == blobs_before.keys()  # the temporary blob is gone
    out = np.empty(n, np.float32)
    client.buffer_get_tensor(buffer, tensors[-1], 0, out)
    assert np.array_equal(out, np.full(n, 3, np.float32))


def test_buffer_clear(client, g):
    buft = client.device_get_buffer_type()
    handle = client.buffer_type_alloc_buffer(buft, 8192)
    client.buffer_clear(handle, 0x5A)
    out = bytearray(8192)
    client.buffer_get_tensor(handle, rpc(g, 1, handle, 2048, 0), 0, out)
    assert out == b"\x5a" * 8192
    client.buffer_free_buffer(handle)
    with pytest.raises(BackendFunctionError) as info:  # the host no longer knows the handle
        client.buffer_get_tensor(handle, rpc(g, 1, handle, 2048, 0), 0, out)
    assert info.value.function == "buffer_get_tensor" and info.value.function_code == 1  # both hosts


def test_buffer_from_ptr_is_zero_copy(client, g, is_c_host):
    blob, handle, buft = client.device_buffer_from_ptr(40_000, 40_000)
    assert handle and buft and blob.size == 49152
    assert client.buffer_get_base(handle) != 0
    np.frombuffer(blob.memory, np.float32, 100)[:] = np.arange(100)  # the guest writes the blob
    out = np.empty(100, np.float32)
    client.buffer_get_tensor(handle, rpc(g, 1, handle, 100, 0), 0, out)  # the host reads it
    assert np.array_equal(out, np.arange(100, dtype=np.float32))
    client.buffer_set_tensor(handle, rpc(g, 1, handle, 100, 0), 0, np.full(100, 7, np.float32))
    assert np.frombuffer(blob.memory, np.float32, 100).tolist() == [7.0] * 100
    if not is_c_host:
        client.buffer_free_buffer(handle)
        client.destroy_blob(blob)
    # Not freed on the C host: it calls the CPU from-ptr buffer's free_buffer, which is NULL, and
    # crashes (backend_buffer_free_buffer). The blob stays for the session for the same reason.


def test_eight_threads_of_mixed_calls(client, g, buffer):
    n_threads, n_calls, n = 8, 1000, 64
    name = client.device_get_name()
    buft = client.device_get_buffer_type()
    alignment = client.buffer_type_get_alignment(buft)
    base = client.buffer_get_base(buffer)
    errors = []

    def worker(k):
        try:
            t = rpc(g, 0x9000 + k, buffer, n, (3 << 20) + k * 4096)
            out = np.empty(n, np.float32)
            for i in range(n_calls):
                kind = i % 5
                if kind == 0:
                    client.buffer_set_tensor(buffer, t, 0, np.full(n, k * 10000 + i, np.float32))
                elif kind == 1:
                    client.buffer_get_tensor(buffer, t, 0, out)
                    assert (out == k * 10000 + i - 1).all(), (k, i, out[:4])
                elif kind == 2:
                    assert client.device_get_name() == name
                elif kind == 3:
                    assert client.buffer_type_get_alignment(buft) == alignment
                else:
                    assert client.buffer_get_base(buffer) == base
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(n_threads)]
    remote = client.remote
    before, commands, execbuffers = remote.device.submitted, remote.waited + remote.posted, remote.execbuffers
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    # one command per call, waited for or posted (ASYNC: posted ones share EXECBUFFERs)
    assert remote.waited + remote.posted - commands == n_threads * n_calls
    assert remote.device.submitted - before == remote.execbuffers - execbuffers


def test_venus_capset_offsets_command_types():
    """Without the APIR capset the command types travel + 331 (and the host is told so)."""
    host = SilentHost()
    host.capset_id = VIRTGPU_DRM_CAPSET_VENUS
    dev = SyncDevice(host, capsets_mask=1 << VIRTGPU_DRM_CAPSET_VENUS)

    def submit(command):
        host.commands.append(command)
        reply = dev.blobs[struct.unpack_from("<I", command, 8)[0]].memory
        struct.pack_into("<III", reply, 0, 0xAB1E + 1, 0, 1)

    host.submit = submit
    client = ApirClient(Remote(dev))
    assert client.handshake() == (0, 1)
    assert dev.contexts == [(VIRTGPU_DRM_CAPSET_VENUS, 1)]
    cmd_type, flags, reply_id, major, minor = struct.unpack("<iiIII", host.commands[0])
    assert cmd_type == ApirCommandType.HANDSHAKE + VENUS_COMMAND_TYPE_LENGTH
    assert (flags, major, minor) == (0, 0, 2) and reply_id == client.remote.reply.res_id
    client.close()


def test_short_reply_is_a_reply_error():
    host = SilentHost()
    dev = SyncDevice(host)
    client = ApirClient(Remote(dev))

    def submit(command):  # Forward success, then a string size far past the blob
        reply = dev.blobs[struct.unpack_from("<I", command, 8)[0]].memory
        struct.pack_into("<IQ", reply, 0, 4 + 1, 1 << 40)

    host.submit = submit
    with pytest.raises(ReplyError, match="device_get_name"):
        client.device_get_name()

    def submit_ok(command):  # the next reply is whole: the Remote's reused Decoder starts over
        reply = dev.blobs[struct.unpack_from("<I", command, 8)[0]].memory
        struct.pack_into("<IQ4s", reply, 0, 4 + 1, 3, b"ab\0\0")

    host.submit = submit_ok
    assert client.device_get_name() == "ab"
    client.close()
