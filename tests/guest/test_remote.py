"""Remote: capset choice, header bytes, waiting on a host in another thread, and timeouts
from a silent host for every client call."""

import struct
import threading
import time

import numpy as np
import pytest

from apir.codec.atomics import store_release_u32
from apir.codec.constants import APIR_HANDSHAKE_MAGIC, ApirBackendCommandType, ApirCommandType
from apir.codec.records import RPC_TENSOR_DTYPE
from apir.guest.client import ApirClient
from apir.guest.errors import ApirTimeout, MissingCapability
from apir.guest.remote import Remote, select_capset
from tests.guest.hosts import SilentHost, SyncDevice

LIMIT = 0.15  # seconds: the short limit the silent-host tests use
SLACK = 1.0  # scheduling slack on a loaded 2-core machine


class ThreadedHost(SilentHost):
    """Answers every command from another thread after `delay_s`: HandShake with the magic,
    anything else with `value` as a u32 after Forward success."""

    def __init__(self, delay_s):
        super().__init__()
        self.delay_s = delay_s
        self.memories = {}

    def add_resource(self, res_id, memory):
        self.memories[res_id] = memory

    def submit(self, command):
        cmd_type, flags, reply_id = struct.unpack_from("<iiI", command)
        memory = self.memories[reply_id]

        def answer():
            time.sleep(self.delay_s)  # pure Python: runs only if the waiter released the GIL
            if cmd_type == ApirCommandType.HANDSHAKE:
                struct.pack_into("<II", memory, 4, 0, 2)
                store_release_u32(memory, 0, APIR_HANDSHAKE_MAGIC + 1)
            else:
                struct.pack_into("<i", memory, 4, 1234)
                store_release_u32(memory, 0, 4 + 1)

        threading.Thread(target=answer, daemon=True).start()


@pytest.mark.parametrize("delay_s", [0.0, 0.002, 0.05])
def test_waits_for_a_host_in_another_thread(delay_s):
    with Remote(SyncDevice(ThreadedHost(delay_s))) as remote:
        client = ApirClient(remote)
        assert client.handshake() == (0, 2)
        for _ in range(3):
            assert client.device_get_count() == 1234


def test_header_bytes_and_zeroed_word():
    host = SilentHost()
    with Remote(SyncDevice(host), forward_timeout_s=0.01) as remote:
        remote.reply.memory[:4] = b"\xff\xff\xff\xff"  # stale word from an earlier reply
        with pytest.raises(ApirTimeout):
            remote.call(ApirCommandType.FORWARD, 17, lambda enc: enc.u64(0x1122334455667788))
        assert host.commands == [struct.pack("<iiIQ", 2, 17, remote.reply.res_id, 0x1122334455667788)]
        assert remote.reply.memory[:4] == bytes(4)


def test_capset_choice(monkeypatch):
    monkeypatch.delenv("GGML_REMOTING_USE_APIR_CAPSET", raising=False)
    host = SilentHost()
    assert select_capset(SyncDevice(host, capsets_mask=(1 << 4) | (1 << 10))) == 10
    assert select_capset(SyncDevice(host, capsets_mask=1 << 4)) == 4
    assert select_capset(SyncDevice(host, capsets_mask=0)) == 4  # kernel without the query
    with pytest.raises(MissingCapability, match="capset 10"):
        select_capset(SyncDevice(host, capsets_mask=1 << 2))
    monkeypatch.setenv("GGML_REMOTING_USE_APIR_CAPSET", "1")
    assert select_capset(SyncDevice(host, capsets_mask=1 << 4)) == 10  # forced, like the C
    # forced but not offered: GET_CAPS fails and the Remote says so, closing the device
    dev = SyncDevice(host, capsets_mask=1 << 4)
    with pytest.raises(MissingCapability, match="capset 10"):
        Remote(dev)
    assert dev.blobs == {}


def test_blob_sizes_and_default_limits():
    with Remote(SyncDevice(SilentHost()), data_size=100_000) as remote:
        assert remote.reply.size == 16384 and remote.data_size == 114688
        assert remote.default_timeout(ApirCommandType.HANDSHAKE) == 2.0
        assert remote.default_timeout(ApirCommandType.LOADLIBRARY) == 60.0
    with Remote(SyncDevice(SilentHost())) as remote:
        assert remote.data_size == 0x1830000  # the C's SHMEM_DATA_SIZE


def _silent_client():
    return ApirClient(Remote(SyncDevice(SilentHost()), forward_timeout_s=LIMIT, data_size=16384))


def _timed(fn):
    start = time.monotonic()
    with pytest.raises(ApirTimeout) as info:
        fn()
    return time.monotonic() - start, info.value


def test_silent_host_handshake_and_load_library_time_out():
    client = _silent_client()
    elapsed, exc = _timed(lambda: client.handshake(LIMIT))
    assert LIMIT <= elapsed < LIMIT + SLACK and exc.command == "HandShake" and exc.limit_s == LIMIT
    elapsed, exc = _timed(lambda: client.load_library(LIMIT))
    assert LIMIT <= elapsed < LIMIT + SLACK and exc.command == "LoadLibrary"
    client.close()


def test_silent_host_every_backend_function_times_out():
    client = _silent_client()
    client.host_version = (0, 2)
    tensor = np.zeros((), RPC_TENSOR_DTYPE)
    tensor_struct = np.zeros(1, client.tensor_dtype)  # a ggml_tensor with no srcs, in memory
    addr = tensor_struct.ctypes.data
    calls = {
        "device_get_device_count": lambda: client.device_get_device_count(),
        "device_get_count": lambda: client.device_get_count(),
        "device_get_name": lambda: client.device_get_name(),
        "device_get_description": lambda: client.device_get_description(),
        "device_get_type": lambda: client.device_get_type(),
        "device_get_memory": lambda: client.device_get_memory(),
        "device_supports_op": lambda: client.device_supports_op(addr),
        "device_get_buffer_type": lambda: client.device_get_buffer_type(),
        "device_get_props": lambda: client.device_get_props(),
        "device_buffer_from_ptr": lambda: client.device_buffer_from_ptr(1000, 1000),
        "buffer_type_get_name": lambda: client.buffer_type_get_name(1),
        "buffer_type_get_alignment": lambda: client.buffer_type_get_alignment(1),
        "buffer_type_get_max_size": lambda: client.buffer_type_get_max_size(1),
        "buffer_type_is_host": lambda: client.buffer_type_is_host(1),
        "buffer_type_alloc_buffer": lambda: client.buffer_type_alloc_buffer(1, 10),
        "buffer_type_get_alloc_size": lambda: client.buffer_type_get_alloc_size(1, addr),
        "buffer_get_base": lambda: client.buffer_get_base(1),
        "buffer_set_tensor": lambda: client.buffer_set_tensor(1, tensor, 0, b"abcd"),
        "buffer_get_tensor": lambda: client.buffer_get_tensor(1, tensor, 0, bytearray(4)),
        "buffer_cpy_tensor": lambda: client.buffer_cpy_tensor(1, tensor, tensor),
        "buffer_clear": lambda: client.buffer_clear(1, 0),
        "buffer_free_buffer": lambda: client.buffer_free_buffer(1),
        "backend_graph_compute": lambda: client.backend_graph_compute(b"\0" * 8),
    }
    assert set(calls) == {f.c_name for f in ApirBackendCommandType}
    blobs = set(client.remote.device.blobs)
    for name, call in calls.items():
        elapsed, exc = _timed(call)
        assert exc.command == f"Forward {name}" and LIMIT <= elapsed < LIMIT + SLACK, (name, elapsed)
    assert set(client.remote.device.blobs) == blobs  # buffer_from_ptr's blob was released
    client.close()


class _WatchedSyncDevice(SyncDevice):
    """A SyncDevice with `watch` (it sleeps the time asked, and records it)."""

    def __init__(self, ctx, wakes):
        super().__init__(ctx)
        self.watch_wakes = wakes
        self.asked = []

    def watch(self, timeout_s):
        self.asked.append(timeout_s)
        time.sleep(timeout_s)


@pytest.mark.parametrize("wakes", [False, True])
def test_the_wait_looks_every_millisecond_unless_the_device_wakes_it(wakes):
    """A 0.3 s call: on a device whose watch returns once the host is done (`watch_wakes`)
    the looks grow past 1 ms (to tens of them, not hundreds); on any other, 1 ms at most."""
    dev = _WatchedSyncDevice(ThreadedHost(0.0), wakes)
    with Remote(dev) as remote:
        client = ApirClient(remote)
        assert client.handshake() == (0, 2)
        dev.ctx.delay_s, dev.asked[:] = 0.3, []
        assert client.device_get_count() == 1234
    if wakes:
        assert max(dev.asked) > 0.01 and len(dev.asked) < 60  # (about 20: 10 us doubling to 50 ms)
    else:
        assert max(dev.asked) <= 1e-3
