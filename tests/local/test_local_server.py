"""The socket host: the wire against hostile input, shared blob memory, and what happens when
a guest or the host dies."""

import errno
import os
import signal
import stat
import struct
import subprocess
import sys
import threading
import time

import pytest

from apir.local.wire import HEADER, HELLO_MAGIC, Op
from apir.codec.virtgpu import VirtgpuParam
from apir.guest.client import ApirClient
from apir.guest.errors import IoctlError
from apir.guest.local import HostConnectionLost, LocalDevice, host_stats
from apir.host.local.server import LocalServer
from apir.local.socket_io import recv_message
from tests.local.hostproc import HostProcess
from tests.local.localkit import EchoContext, hello, raw, request, wait_for


def test_blobs_are_shared_memory_at_their_map_offsets(server):
    with LocalDevice(server.path) as dev:
        assert dev.get_param(VirtgpuParam.SUPPORTED_CAPSET_IDS) == (1 << 4) | (1 << 10)
        assert dev.get_caps(10, 24) == struct.pack("<II4I", 1, 1, 0, 0, 0, 0)
        dev.context_init(10)
        a, b = dev.create_blob(100), dev.create_blob(3 * 16384)
        assert (a.size, b.size) == (16384, 3 * 16384)
        a.memory[0:4] = b"WXYZ"
        dev.execbuffer(struct.pack("<II", a.res_id, b.res_id))
        assert bytes(b.memory[0:8]) == b"\x01\0\0\0WXYZ"  # written by the host, read here
        # the file holds the exec ring's page too (not a blob: no resource, not counted)
        assert dev.stats() == {"contexts": 1, "blobs": 2, "blob_bytes": 4 * 16384,
                               "file_bytes": 5 * 16384, "ggml_buffers": -1}
        dev.destroy_blob(a)
        c = dev.create_blob(16384)  # reuses a's range: zero-filled again
        assert bytes(c.memory[0:4]) == b"\0\0\0\0"
        assert dev.stats()["file_bytes"] == 5 * 16384


def test_hostile_requests_get_errno_replies(server):
    s = raw(server)
    fd = hello(s)
    os.close(fd)
    assert request(s, 99, b"")[0] == errno.ENOSYS
    assert request(s, Op.GETPARAM, b"\0" * 4)[0] == errno.EINVAL  # wrong length
    assert request(s, Op.GETPARAM, struct.pack("<Q", 1234))[0] == errno.EINVAL
    assert request(s, Op.CREATE_BLOB, struct.pack("<IIQQ", 2, 1, 16384, 0))[0] == errno.EINVAL  # no context
    assert request(s, Op.EXECBUFFER, struct.pack("<IIII", 4, 0, 0, 0))[0] == errno.EINVAL
    assert request(s, Op.CONTEXT_INIT, struct.pack("<IIQ", 7, 1, 0))[0] == errno.EINVAL
    assert request(s, Op.CONTEXT_INIT, struct.pack("<IIQ", 10, 0, 0))[0] == errno.EINVAL
    assert request(s, Op.CONTEXT_INIT, struct.pack("<IIQ", 10, 1, 0)) == (0, b"")
    assert request(s, Op.CONTEXT_INIT, struct.pack("<IIQ", 10, 1, 0))[0] == errno.EEXIST
    assert request(s, Op.CREATE_BLOB, struct.pack("<IIQQ", 1, 1, 16384, 0))[0] == errno.EINVAL  # GUEST mem
    assert request(s, Op.CREATE_BLOB, struct.pack("<IIQQ", 2, 0, 16384, 0))[0] == errno.EINVAL  # not mappable
    assert request(s, Op.CREATE_BLOB, struct.pack("<IIQQ", 2, 1, 0, 0))[0] == errno.EINVAL
    assert request(s, Op.CREATE_BLOB, struct.pack("<IIQQ", 2, 1, 1 << 62, 0))[0] == errno.ENOMEM
    assert request(s, Op.MAP, struct.pack("<II", 77, 0))[0] == errno.ENOENT
    assert request(s, Op.GEM_CLOSE, struct.pack("<II", 77, 0))[0] == errno.ENOENT
    assert request(s, Op.EXECBUFFER, struct.pack("<IIII", 1, 0, 0, 0))[0] == errno.EINVAL  # fence flag
    assert request(s, Op.EXECBUFFER, struct.pack("<IIII", 4, 0, 1, 0))[0] == errno.EINVAL  # ring 1 of 1
    assert request(s, Op.EXECBUFFER, struct.pack("<IIII", 4, 9, 0, 0) + b"x")[0] == errno.EINVAL  # size lies
    # A length the stream cannot survive: the host hangs up, and frees what it had.
    s.sendall(HEADER.pack(Op.EXECBUFFER, 0, 1 << 30, 3))
    assert s.recv(16) == b""
    s.close()
    assert wait_for(lambda: server.stats().contexts == 0)


def test_bad_hello_is_refused(server):
    s = raw(server)
    s.sendall(HEADER.pack(Op.HELLO, 0, 8, 1) + struct.pack("<II", HELLO_MAGIC, 999))
    header, _, fds = recv_message(s)
    assert (header.err, fds) == (errno.EPROTONOSUPPORT, [])
    assert s.recv(16) == b""
    s2 = raw(server)
    s2.sendall(HEADER.pack(Op.GETPARAM, 0, 8, 1) + bytes(8))  # no HELLO first
    assert s2.recv(16) == b""


def test_several_guests_each_their_own_context(server):
    devs = [LocalDevice(server.path) for _ in range(3)]
    try:
        for i, d in enumerate(devs):
            d.context_init(10)
            for _ in range(i + 1):
                d.create_blob(16384)
        st = server.stats()
        assert (st.contexts, st.blobs) == (3, 6)
        devs[1].close()
        assert wait_for(lambda: server.stats().blobs == 4)
        assert server.stats().contexts == 2
    finally:
        for d in devs:
            d.close()


_GUEST = r"""
import sys, time
from apir.guest.client import ApirClient
from apir.guest.local import LocalDevice
c = ApirClient.connect(LocalDevice(sys.argv[1]), data_size=65536)
buft = c.device_get_buffer_type()
handles = [c.buffer_type_alloc_buffer(buft, 1 << 20) for _ in range(3)]
print("ready", flush=True)
time.sleep(600)
"""


def test_stat_gives_a_guest_its_own_counts_only(server):
    """Issue 13 class 11: STAT, even before CONTEXT_INIT, told any client how many contexts,
    blobs and bytes the other guests of the host had."""
    other = LocalDevice(server.path)
    try:
        other.context_init(10)
        other.create_blob(3 * 16384)
        with LocalDevice(server.path) as dev:
            assert dev.stats() == {"contexts": 0, "blobs": 0, "blob_bytes": 0, "file_bytes": 0,
                                   "ggml_buffers": 0}
            dev.context_init(10)
            dev.create_blob(16384)
            assert dev.stats() == {"contexts": 1, "blobs": 1, "blob_bytes": 16384,
                                   "file_bytes": 16384, "ggml_buffers": -1}
        assert other.stats()["blob_bytes"] == 3 * 16384
        # the host's own view, once its connection thread has seen `dev` hang up
        assert wait_for(lambda: (server.stats().contexts, server.stats().blobs) == (1, 1)), server.stats()
    finally:
        other.close()


def test_stat_host_wide_when_the_host_says_so(tmp_path):
    with LocalServer(str(tmp_path / "s.sock"), context_factory=EchoContext, stat_host_wide=True).start() as srv:
        with LocalDevice(srv.path) as other:
            other.context_init(10)
            other.create_blob(16384)
            assert host_stats(srv.path)["blobs"] == 1


@pytest.mark.parametrize("umask", [0o000, 0o022])
def test_socket_file_mode_is_0600_whatever_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        srv = LocalServer(str(tmp_path / "s.sock"), context_factory=EchoContext)
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.stat(srv.path).st_mode) == 0o600
    finally:
        srv.close()
    srv = LocalServer(str(tmp_path / "t.sock"), context_factory=EchoContext, socket_mode=0o660)
    try:
        assert stat.S_IMODE(os.stat(srv.path).st_mode) == 0o660
    finally:
        srv.close()


def test_host_serve_socket_mode_option(tmp_path):
    h = HostProcess(tmp_path / "apir.sock", "--socket-mode", "0640")
    try:
        assert stat.S_IMODE(os.stat(h.path).st_mode) == 0o640
    finally:
        h.stop()


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    h = HostProcess(tmp_path_factory.mktemp("kill") / "apir.sock", "--stat-host-wide")
    yield h
    h.stop()


def test_killing_a_guest_frees_its_buffers_on_the_host(host):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    guest = subprocess.Popen([sys.executable, "-c", _GUEST, host.path], stdout=subprocess.PIPE, env=env)
    try:
        assert guest.stdout.readline() == b"ready\n"
        before = host_stats(host.path)
        # its reply blob + data window, and the three ggml buffers it allocated
        assert (before["contexts"], before["blobs"], before["ggml_buffers"]) == (1, 2, 3)
        guest.send_signal(signal.SIGKILL)
        guest.wait()
        assert wait_for(lambda: host_stats(host.path)["contexts"] == 0)
        assert host_stats(host.path) == {"contexts": 0, "blobs": 0, "blob_bytes": 0,
                                         "file_bytes": 0, "ggml_buffers": 0}
    finally:
        if guest.poll() is None:
            guest.kill()
            guest.wait()


class _SendWatchingDevice(LocalDevice):
    """A LocalDevice that tells when an EXECBUFFER has left for the host: as a request, or
    about to be posted in the exec ring (within microseconds, with no message when the host
    polls the ring)."""

    def __init__(self, *args, **kwargs):
        self.exec_sent = threading.Event()
        super().__init__(*args, **kwargs)

    def _send(self, op, payload):
        seq = super()._send(op, payload)
        if op == Op.EXECBUFFER:
            self.exec_sent.set()
        return seq

    def _ring_execbuffer(self, *args, **kwargs):
        self.exec_sent.set()
        return super()._ring_execbuffer(*args, **kwargs)


@pytest.mark.parametrize("exec_ring", [True, False])
def test_killing_the_host_mid_call_is_a_clear_error_at_once(tmp_path, exec_ring):
    h = HostProcess(tmp_path / "apir.sock")
    try:
        # exec_wait_s far above the few seconds a loaded machine may take here: the error must
        # come from the host's end of the socket, not from a wait running out
        dev = _SendWatchingDevice(h.path, exec_wait_s=60.0, exec_ring=exec_ring)
        client = ApirClient.connect(dev, data_size=65536)
        assert client.device_get_type() == 0  # GGML_BACKEND_DEVICE_TYPE_CPU (the CPU backend)
        h.pause()  # stopped for real: the next call stays in flight
        dev.exec_sent.clear()
        outcome = {}

        def call():
            try:
                outcome["value"] = client.device_get_type()
            except Exception as exc:
                outcome["error"] = exc
            outcome["done"] = time.monotonic()

        t = threading.Thread(target=call)
        t.start()
        assert dev.exec_sent.wait(10)  # the command is with the host
        time.sleep(0.2)
        assert t.is_alive() and outcome == {}  # a stopped host cannot have answered
        killed = time.monotonic()
        h.signal(signal.SIGKILL)
        t.join(10)
        assert not t.is_alive()
        assert isinstance(outcome.get("error"), HostConnectionLost), outcome
        assert "closed the connection" in str(outcome["error"])
        assert outcome["done"] - killed < 2.0  # at once: far inside exec_wait_s and the 300 s limit
        with pytest.raises(HostConnectionLost):
            client.device_get_name()
    finally:
        h.stop()


def test_refused_ioctl_is_an_ioctl_error(server):
    with LocalDevice(server.path) as dev:
        with pytest.raises(IoctlError) as info:
            dev.create_blob(16384)
        assert info.value.errno == errno.EINVAL
        assert info.value.request == "DRM_IOCTL_VIRTGPU_RESOURCE_CREATE_BLOB"


def test_a_new_guest_cannot_read_a_departed_guests_buffer(tmp_path):
    """Issue 13 class 5 over the socket host: a guest writes a secret into a buffer and
    disconnects without freeing it; the next guest's fresh buffers read as zeros."""
    import numpy as np

    import apir.ggml
    from apir.codec.records import RPC_TENSOR_DTYPE

    g = apir.ggml.load()
    size = 64 << 10

    def rpc(buffer):
        rec = np.zeros((), RPC_TENSOR_DTYPE)
        rec["id"], rec["type"], rec["buffer"] = 1, g.types["F32"], buffer
        rec["ne"] = [size // 4, 1, 1, 1]
        rec["nb"] = [4, size, size, size]
        return rec

    with LocalServer(str(tmp_path / "s.sock")).start() as srv:
        a = ApirClient.connect(LocalDevice(srv.path), data_size=size)
        buf = a.buffer_type_alloc_buffer(a.device_get_buffer_type(), size)
        a.buffer_set_tensor(buf, rpc(buf), 0, b"secret!\0" * (size // 8))
        a.close()
        assert wait_for(lambda: srv.stats().contexts == 0)
        b = ApirClient.connect(LocalDevice(srv.path), data_size=size)
        try:
            buft = b.device_get_buffer_type()
            for _ in range(4):
                buf = b.buffer_type_alloc_buffer(buft, size)
                out = bytearray(b"\xa5" * size)
                b.buffer_get_tensor(buf, rpc(buf), 0, out)
                assert out == bytes(size)
        finally:
            b.close()


def test_spin_after_a_reply_is_configured_and_bounded(tmp_path):
    """`apir.local.spin_s`: the default, a value, and a value past MAX_LOCAL_SPIN_S (capped)."""
    from apir.host.local import server as ls
    from apir.host.config import DEFAULT_LOCAL_SPIN_S

    for config, want in ((None, DEFAULT_LOCAL_SPIN_S), ({"apir.local.spin_s": "0"}, 0.0),
                         ({"apir.local.spin_s": "0.002"}, 0.002), ({"apir.local.spin_s": "5"}, ls.MAX_LOCAL_SPIN_S)):
        srv = LocalServer(str(tmp_path / "spin.sock"), config=config, context_factory=EchoContext)
        try:
            assert srv.spin_s == want, config
        finally:
            srv.close()


def test_poll_for_request_returns_on_data_at_its_deadline_or_when_spinning_does_not_pay(monkeypatch):
    """A connection thread polls for the next request only while spinning pays, and for no
    longer than spin_s; a request (or EOF) waiting ends the poll at once."""
    import select
    import socket
    import types

    from apir.host.local import server as ls

    a, b = socket.socketpair()
    poller = select.poll()
    poller.register(a, select.POLLIN)
    conn = types.SimpleNamespace(server=types.SimpleNamespace(spin_s=0.05, _conns={"this one"}))
    try:
        monkeypatch.setattr(ls, "spinning_pays", lambda: True)
        t = time.perf_counter()
        ls._Connection._poll_for_request(conn, poller)  # nothing comes: polls to the deadline
        assert time.perf_counter() - t >= 0.05
        conn.server.spin_s = 5.0  # (past the cap only here, to show what ends the poll)
        b.send(b"x")
        t = time.perf_counter()
        ls._Connection._poll_for_request(conn, poller)
        assert time.perf_counter() - t < 4.0  # the byte waiting ended it
        assert a.recv(1) == b"x"
        monkeypatch.setattr(ls, "spinning_pays", lambda: False)
        t = time.perf_counter()
        ls._Connection._poll_for_request(conn, poller)  # the machine is busy: no poll
        assert time.perf_counter() - t < 4.0
    finally:
        a.close()
        b.close()


def _cpu_ticks(thread) -> int:
    """utime + stime of `thread` (clock ticks, /proc/self/task/<tid>/stat)."""
    with open(f"/proc/self/task/{thread.native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # (stat fields 14, 15; fields[0] is field 3)


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="per-thread CPU times from /proc")
def test_an_idle_connection_stops_spinning(tmp_path, monkeypatch):
    """After a reply a connection thread polls for the next request for at most spin_s, then
    blocks in recv: a guest connected and idle (the only one, spin_s at its cap, spinning made
    to pay), its thread uses no CPU. Spinning past the deadline would use a core."""
    from apir.codec.virtgpu import VirtgpuParam
    from apir.host.local import server as ls

    monkeypatch.setattr(ls, "spinning_pays", lambda: True)
    srv = LocalServer(str(tmp_path / "spin.sock"), config={"apir.local.spin_s": "1"}, context_factory=EchoContext)
    srv.start()
    socks = []
    try:
        assert srv.spin_s == ls.MAX_LOCAL_SPIN_S
        socks.append(raw(srv))
        os.close(hello(socks[-1]))
        for _ in range(3):
            assert request(socks[-1], Op.GETPARAM, struct.pack("<Q", VirtgpuParam.SUPPORTED_CAPSET_IDS))[0] == 0
        threads = [t for t in threading.enumerate() if t.name.startswith("apir-local-")]
        assert threads
        time.sleep(20 * ls.MAX_LOCAL_SPIN_S)  # every spin over
        before = sum(_cpu_ticks(t) for t in threads)
        time.sleep(0.5)
        assert sum(_cpu_ticks(t) for t in threads) - before <= 1  # (a tick: 10 ms at most)
    finally:
        for s in socks:
            s.close()
        srv.close()


def test_a_connection_spins_only_while_it_is_the_only_one(tmp_path, monkeypatch):
    """Polling holds the GIL between polls, so another guest's thread, woken by its request,
    waits for the spin to end. So a connection polls for its next request only while it is
    the server's only connection."""
    from apir.host.local import server as ls

    class Poller:
        def __init__(self):
            self.polls = 0

        def poll(self, timeout):
            self.polls += 1
            return []

    def polls(conn):
        p = Poller()
        conn._poll_for_request(p)
        return p.polls

    monkeypatch.setattr(ls, "spinning_pays", lambda: True)
    srv = LocalServer(str(tmp_path / "spin.sock"), config={"apir.local.spin_s": "0.005"}, context_factory=EchoContext)
    srv.start()
    a = raw(srv)
    try:
        os.close(hello(a))
        (conn,) = list(srv._conns)
        assert polls(conn) > 1  # alone: it polls until spin_s has passed
        b = raw(srv)
        os.close(hello(b))
        assert wait_for(lambda: len(srv._conns) == 2)
        assert polls(conn) == 0
        b.close()
        assert wait_for(lambda: len(srv._conns) == 1)
        assert polls(conn) > 1
    finally:
        a.close()
        srv.close()
