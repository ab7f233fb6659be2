"""The socket host's bounds on what guests make it hold: no descriptor per
blob, a blob count per context, a connection limit, a HELLO deadline, and an accept loop that
outlives running out of descriptors."""

import errno
import os
import resource
import socket
import struct
import subprocess
import sys
import time
import types

import pytest

import apir.guest.local as guest_local
from apir.local.wire import HEADER, Op
from apir.guest.local import HostConnectionLost, LocalDevice
from apir.host.local.server import LocalServer
from tests.local.localkit import EchoContext, hello, raw, request, wait_for


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def create_blob(s, size=16384, seq=2):
    return request(s, Op.CREATE_BLOB, struct.pack("<IIQQ", 2, 1, size, 0), seq)


@pytest.fixture
def make_server(tmp_path):
    servers = []

    def make(**config):
        srv = LocalServer(str(tmp_path / f"s{len(servers)}.sock"), config={k: str(v) for k, v in config.items()},
                          context_factory=EchoContext).start()
        servers.append(srv)
        return srv

    yield make
    for srv in servers:
        srv.close()


def test_a_blob_holds_no_descriptor_on_the_host(make_server):
    srv = make_server()
    s = raw(srv)
    os.close(hello(s))
    assert request(s, Op.CONTEXT_INIT, struct.pack("<IIQ", 10, 1, 0)) == (0, b"")
    before = open_fds()
    for _ in range(300):
        assert create_blob(s)[0] == 0
    assert srv.stats().blobs == 300
    # one mapping per blob, no dup()ed descriptor: 20,000 blobs used to exhaust the host
    assert open_fds() - before < 10
    s.close()
    assert wait_for(lambda: srv.stats().blobs == 0)


def test_a_blob_holds_no_descriptor_on_the_guest_either_and_shares_memory(make_server):
    srv = make_server()
    with LocalDevice(srv.path) as dev:
        dev.context_init(10)
        before = open_fds()
        blobs = [dev.create_blob(16384) for _ in range(100)]
        assert open_fds() - before < 10  # neither the guest's mappings nor the host's keep one
        a, b = blobs[3], blobs[97]
        a.memory[0:4] = b"ABCD"
        dev.execbuffer(struct.pack("<II", a.res_id, b.res_id))  # the host copies through its mappings
        assert bytes(b.memory[0:8]) == b"\x01\0\0\0ABCD"
        for blob in blobs:
            dev.destroy_blob(blob)
        assert srv.stats().blobs == 0


def test_blobs_per_context_are_limited_and_the_host_serves_on(make_server):
    srv = make_server(**{"apir.local.max_blobs": 8})
    s = raw(srv)
    os.close(hello(s))
    assert request(s, Op.CONTEXT_INIT, struct.pack("<IIQ", 10, 1, 0)) == (0, b"")
    handles = []
    for _ in range(8):
        err, body = create_blob(s)
        assert err == 0
        handles.append(struct.unpack("<IIQ", body)[1])
    assert create_blob(s) == (errno.ENOSPC, b"")
    assert request(s, Op.GEM_CLOSE, struct.pack("<II", handles[0], 0)) == (0, b"")
    assert create_blob(s)[0] == 0  # room again
    assert srv.stats().blobs == 8
    s.close()


def test_connections_are_limited_and_a_slot_frees_when_a_guest_leaves(make_server):
    srv = make_server(**{"apir.local.max_connections": 2})
    first, second = LocalDevice(srv.path), LocalDevice(srv.path)
    try:
        with pytest.raises(HostConnectionLost, match="connection limit"):
            LocalDevice(srv.path)
        first.close()
        assert wait_for(lambda: len(srv._conns) == 1)
        with LocalDevice(srv.path) as third:
            third.context_init(10)
            assert third.create_blob(16384).size == 16384
    finally:
        first.close()
        second.close()


def test_a_connection_without_hello_is_closed_at_its_deadline(make_server):
    srv = make_server(**{"apir.local.hello_timeout_s": 0.2})
    s = raw(srv)
    s.settimeout(10.0)  # liveness bound: the deadline is 0.2 s
    assert s.recv(16) == b""  # the host hung up on the idle connection
    assert wait_for(lambda: len(srv._conns) == 0)
    s.close()
    with LocalDevice(srv.path) as dev:  # a guest that says HELLO is served as usual
        dev.context_init(10)


_LOW_FD_HOST = r"""
import os, resource, sys, time
import apir.host.component.context  # imported now: lazy imports need descriptors the test takes away
from apir.host.local.server import LocalServer

srv = LocalServer(sys.argv[1], config={"apir.local.max_connections": "1000", "apir.local.max_connections_per_peer": "1000",
                                       "apir.local.hello_timeout_s": "600"}).start()
spare = int(sys.argv[2])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + spare, hard))
print("ready", flush=True)
time.sleep(600)
"""


def test_accept_survives_running_out_of_descriptors(tmp_path):
    """A guest takes every descriptor of the host (idle connections under a low RLIMIT_NOFILE):
    the host's accept() fails with EMFILE. Once it leaves, a new guest is served."""
    path = str(tmp_path / "h.sock")
    log_path = tmp_path / "h.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    with open(log_path, "wb") as log_file:
        host = subprocess.Popen([sys.executable, "-c", _LOW_FD_HOST, path, "12"], env=env,
                                stdout=subprocess.PIPE, stderr=log_file)
    try:
        assert host.stdout.readline() == b"ready\n"
        attacker = []
        for _ in range(64):  # 12 spare descriptors, then the 16-deep listen backlog
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(2.0)
            try:
                s.connect(path)
            except OSError:  # the backlog is full: the host accepts no more
                s.close()
                break
            attacker.append(s)
        assert wait_for(lambda: b"Too many open files" in log_path.read_bytes(), 10.0), log_path.read_text()
        assert host.poll() is None
        for s in attacker:
            s.close()
        # the host accepts again: the attacker's leftovers come and go, then this guest is served
        with LocalDevice(path, connect_timeout_s=10.0) as dev:
            dev.context_init(10)
            assert dev.create_blob(16384).size == 16384
    finally:
        host.kill()
        host.wait()


def test_a_guest_connecting_while_the_backlog_is_full_waits_for_the_host(tmp_path, monkeypatch):
    """A Unix socket with a timeout (non-blocking underneath) gets EAGAIN at once from connect()
    while the host's listen backlog is full, where a blocking one waits: LocalDevice waits, up to
    connect_timeout_s, for the host to accept. (It failed at once, "no apir host is serving there":
    the guest of the test above, on a loaded machine whose host accepted as fast as the attacker
    connected, met the backlog still full of the attacker's connections.)"""
    srv = LocalServer(str(tmp_path / "s.sock"), context_factory=EchoContext)  # listening, not accepting
    fillers, waits = [], []
    try:
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(srv.path)
            except BlockingIOError:  # full
                s.close()
                break
            fillers.append(s)

        def sleep(seconds):  # the guest found the backlog full: only now does the host accept
            if not waits:
                for f in fillers:
                    f.close()
                srv.start()
            waits.append(seconds)
            time.sleep(seconds)

        monkeypatch.setattr(guest_local, "time", types.SimpleNamespace(monotonic=time.monotonic, sleep=sleep))
        with LocalDevice(srv.path, connect_timeout_s=30.0) as dev:
            assert waits  # its first connect found the backlog full
            dev.context_init(10)
            assert dev.create_blob(16384).size == 16384
    finally:
        for f in fillers:
            f.close()
        srv.close()
