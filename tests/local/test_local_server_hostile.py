"""The socket host against hostile and unlucky peers: deadlines on every wait for a peer (a
trickled HELLO, a trickled payload, replies never read), a listener that outlives any failure
in one connection's set-up (each injected once), and bounds per peer and in all."""

import errno
import os
import socket
import struct
import threading
import time

import pytest

import apir.host.local.memfile as memfile_mod
from apir.guest.errors import IoctlError
from apir.guest.local import LocalDevice
from apir.host.config import CONFIG_KEY_PEER
from apir.host.local.peers import peer_uid
from apir.host.local.server import LocalServer
from apir.local.socket_io import recv_message
from apir.local.wire import HEADER, HELLO_MAGIC, WIRE_VERSION, Op
from tests.local.localkit import EchoContext, hello, raw, request, wait_for

HELLO = HEADER.pack(Op.HELLO, 0, 8, 1) + struct.pack("<II", HELLO_MAGIC, WIRE_VERSION)


@pytest.fixture
def make_server(tmp_path):
    servers = []

    def make(context_factory=EchoContext, peer_id=None, **config):
        kwargs = {} if peer_id is None else {"peer_id": peer_id}
        srv = LocalServer(str(tmp_path / f"s{len(servers)}.sock"), config={k: str(v) for k, v in config.items()},
                          context_factory=context_factory, **kwargs).start()
        servers.append(srv)
        return srv

    yield make
    for srv in servers:
        srv.close()


def closed_by_host(s) -> bool:
    """Whether the host closed `s` (EOF or a reset), reading and dropping anything before."""
    s.settimeout(10.0)  # liveness only: the host's deadlines in these tests are fractions of it
    try:
        while s.recv(65536):
            pass
    except (ConnectionResetError, socket.timeout):
        pass
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def trickle(s, data, pause_s=0.05) -> int:
    """Sends `data` one byte at a time; how many bytes went before the host hung up."""
    for i in range(len(data)):
        try:
            s.send(data[i : i + 1])
        except (BrokenPipeError, ConnectionResetError):
            return i
        time.sleep(pause_s)
    return len(data)


def served(srv) -> None:
    """A new guest is served: HELLO, a context, a blob."""
    with LocalDevice(srv.path, connect_timeout_s=10.0) as dev:
        dev.context_init(10)
        assert dev.create_blob(16384).size == 16384


# --- deadlines -------------------------------------------------------------------------------
def test_a_trickled_hello_is_dropped_at_the_deadline(make_server):
    """Each byte comes well within the HELLO deadline: a per-recv timeout never fires and the
    slot is held for as long as the trickle lasts (days, at one byte an hour)."""
    srv = make_server(**{"apir.local.hello_timeout_s": 0.3})
    s = raw(srv)
    sent = trickle(s, HELLO * 4)  # four HELLOs' worth: the first would complete long after 0.3 s
    assert closed_by_host(s)
    assert sent < len(HELLO)  # cut off before the HELLO was whole
    assert wait_for(lambda: len(srv._conns) == 0)
    s.close()
    served(srv)


def test_a_trickled_payload_is_dropped_at_the_message_deadline(make_server):
    srv = make_server(**{"apir.local.message_timeout_s": 0.3})
    s = raw(srv)
    os.close(hello(s))
    assert request(s, Op.CONTEXT_INIT, struct.pack("<IIQ", 10, 1, 0)) == (0, b"")
    s.sendall(HEADER.pack(Op.EXECBUFFER, 0, 16 + 48, 3))  # a header, then its payload trickled
    trickle(s, bytes(63))
    assert closed_by_host(s)
    assert wait_for(lambda: len(srv._conns) == 0)
    s.close()
    served(srv)


def test_a_guest_idle_between_messages_is_not_dropped(make_server):
    srv = make_server(**{"apir.local.message_timeout_s": 0.05})
    s = raw(srv)
    os.close(hello(s))
    time.sleep(0.3)  # idle, with no message begun: a guest may wait as long as it likes
    assert request(s, Op.CONTEXT_INIT, struct.pack("<IIQ", 10, 1, 0)) == (0, b"")
    s.close()


def test_a_guest_that_never_reads_its_replies_is_dropped_at_the_deadline(make_server):
    """GET_CAPS requests sent without reading a reply: once the socket's buffers are full the
    host's send waits on the guest, and must give up at the deadline. (Requests go in batches:
    a socket's buffer holds a few hundred messages whatever their size, each reply is one.)"""
    srv = make_server(**{"apir.local.message_timeout_s": 0.3})
    s = raw(srv)
    os.close(hello(s))
    s.setblocking(False)
    req = (HEADER.pack(Op.GET_CAPS, 0, 16, 5) + struct.pack("<IIII", 10, 0, 4096, 0)) * 2048
    pending = b""
    for _ in range(100000):  # until the host stops reading (its reply is stuck)
        try:
            pending = pending or req
            pending = pending[s.send(pending):]
        except BlockingIOError:
            break
        except (BrokenPipeError, ConnectionResetError):
            break
    assert wait_for(lambda: len(srv._conns) == 0)
    s.close()
    served(srv)


# --- a listener that never stops serving -------------------------------------------------------
def fail_once(monkeypatch, obj, name, exc, when=lambda *a, **k: True):
    """Makes `obj.name` raise `exc` at its first call for which `when(*args)` holds."""
    real = getattr(obj, name)
    fired = []

    def wrapper(*args, **kwargs):
        if not fired and when(*args, **kwargs):
            fired.append(1)
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapper)
    return fired


@pytest.mark.parametrize("exc", [RuntimeError("can't start new thread"), MemoryError()])
def test_a_connection_thread_that_cannot_start_leaves_the_listener_serving(make_server, monkeypatch, exc):
    srv = make_server()
    fired = fail_once(monkeypatch, threading.Thread, "start", exc,
                      when=lambda t: t.name.startswith("apir-local-") and t.name != "apir-local-hangup")
    s = raw(srv)
    assert closed_by_host(s)  # that connection's error: closed
    s.close()
    assert fired
    assert wait_for(lambda: len(srv._conns) == 0)
    served(srv)


@pytest.mark.parametrize("exc", [OSError(errno.EMFILE, "Too many open files"), MemoryError()])
def test_accept_failing_leaves_the_listener_serving(make_server, monkeypatch, exc):
    srv = make_server()
    fired = fail_once(monkeypatch, socket.socket, "accept", exc)
    s = raw(srv)  # the failure is on the listener: this guest waits in the backlog
    try:
        assert wait_for(lambda: fired)
        served(srv)
    finally:
        s.close()


@pytest.mark.parametrize("exc, err", [(OSError(errno.EMFILE, "Too many open files"), errno.EMFILE),
                                      (OSError(errno.ENFILE, "File table overflow"), errno.ENFILE),
                                      (MemoryError(), errno.ENOMEM)])
def test_no_shared_memory_file_is_an_errno_to_that_guest_only(make_server, monkeypatch, exc, err):
    srv = make_server()
    fail_once(monkeypatch, memfile_mod.os, "memfd_create", exc)
    s = raw(srv)
    s.sendall(HELLO)
    header, body, fds = recv_message(s)
    assert (header.op, header.seq, header.err, fds) == (Op.HELLO, 1, err, [])
    assert closed_by_host(s)
    s.close()
    assert wait_for(lambda: len(srv._conns) == 0)
    served(srv)


def test_a_guest_refused_for_want_of_descriptors_gets_a_clear_error(make_server, monkeypatch):
    srv = make_server()
    fail_once(monkeypatch, memfile_mod.os, "memfd_create", OSError(errno.EMFILE, "Too many open files"))
    with pytest.raises(IoctlError, match="Too many open files") as info:
        LocalDevice(srv.path)
    assert info.value.errno == errno.EMFILE
    served(srv)


class _BlockingContext(EchoContext):
    """submit blocks until its compute is cancelled (a guest's long graph)."""

    instances: list = []

    def __init__(self, *args):
        super().__init__(*args)
        self.cancelled = threading.Event()
        self.submitted = threading.Event()
        _BlockingContext.instances.append(self)

    def submit(self, command):
        self.submitted.set()
        self.cancelled.wait(30.0)

    def cancel_compute(self, reason):
        self.cancelled.set()


def test_a_hangup_watch_that_cannot_start_is_one_guests_error_and_later_guests_are_watched(
        make_server, monkeypatch):
    _BlockingContext.instances = []
    srv = make_server(context_factory=_BlockingContext)
    fail_once(monkeypatch, threading.Thread, "start", RuntimeError("can't start new thread"),
              when=lambda t: t.name == "apir-local-hangup")
    s = raw(srv)
    s.sendall(HELLO)
    header, _, fds = recv_message(s)
    assert (header.op, header.err, fds) == (Op.HELLO, errno.EAGAIN, [])
    s.close()
    # the next guest's hang-up mid-compute cancels its compute: the watch runs
    s = raw(srv)
    os.close(hello(s))
    assert request(s, Op.CONTEXT_INIT, struct.pack("<IIQ", 10, 1, 0)) == (0, b"")
    s.sendall(HEADER.pack(Op.EXECBUFFER, 0, 16 + 8, 3) + struct.pack("<IIII", 0, 8, 0, 0) + bytes(8))
    ctx = _BlockingContext.instances[-1]
    assert ctx.submitted.wait(10.0)
    s.close()
    assert ctx.cancelled.wait(10.0)
    assert wait_for(lambda: len(srv._conns) == 0)


# --- bounds per peer and in all ----------------------------------------------------------------
def peers(*names):
    """A peer_id that names the connections, in the order they are accepted, `names`."""
    order = list(names)
    return lambda sock: order.pop(0)


def context_init(s):
    assert request(s, Op.CONTEXT_INIT, struct.pack("<IIQ", 10, 1, 0)) == (0, b"")


def create_blob(s, size, seq=3):
    return request(s, Op.CREATE_BLOB, struct.pack("<IIQQ", 2, 1, size, 0), seq)[0]


def test_one_peers_idle_connections_cannot_take_every_slot(make_server):
    srv = make_server(peer_id=peers("a", "a", "a", "b", "b"),
                      **{"apir.local.max_connections": 4, "apir.local.max_connections_per_peer": 2})
    idle = [raw(srv), raw(srv)]  # peer a: its two slots, held without a HELLO
    assert wait_for(lambda: len(srv._conns) == 2)
    third = raw(srv)
    assert closed_by_host(third)  # a's third: closed at once
    third.close()
    for _ in range(2):  # peer b is served
        s = raw(srv)
        os.close(hello(s))
        context_init(s)
        s.close()
    for s in idle:
        s.close()
    assert wait_for(lambda: len(srv._conns) == 0 and srv.limits.connections == 0)


def test_shared_memory_is_bounded_per_peer_and_in_all(make_server):
    k = 16384
    srv = make_server(peer_id=peers("a", "a", "b"),
                      **{"apir.local.max_peer_bytes": 4 * k, "apir.local.max_host_bytes": 6 * k})
    a1, a2, b = raw(srv), raw(srv), raw(srv)
    for s in (a1, a2, b):
        os.close(hello(s))
        context_init(s)
    assert create_blob(a1, 3 * k) == 0
    assert create_blob(a2, 2 * k) == errno.ENOMEM  # a's two contexts: 5 of a's 4
    assert create_blob(a2, 1 * k) == 0
    assert create_blob(b, 2 * k) == 0
    assert create_blob(b, 1 * k) == errno.ENOMEM  # 7 of the host's 6
    assert srv.limits.held("a")[1] == 4 * k
    a1.close()  # a's file goes, and its bytes with it
    assert wait_for(lambda: srv.limits.held("a")[1] == k)
    assert create_blob(b, 2 * k) == 0
    for s in (a2, b):
        s.close()
    assert wait_for(lambda: srv.limits.bytes == 0 and srv.limits.connections == 0)


def test_a_peer_is_its_user_id_and_its_contexts_know_it(make_server):
    seen = []

    class Ctx(EchoContext):
        def __init__(self, ctx_id, capset_id, config):
            super().__init__(ctx_id, capset_id, config)
            seen.append(config[CONFIG_KEY_PEER])

    srv = make_server(context_factory=Ctx)
    s = raw(srv)
    os.close(hello(s))
    context_init(s)
    assert peer_uid(s) == os.getuid()
    assert seen == [f"uid:{os.getuid()}"]
    assert srv.limits.held(os.getuid())[0] == 1
    s.close()


_OTHER_USER_GUEST = r"""
import os, socket, struct, sys
os.setgid(65534); os.setuid(65534)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10.0)
s.connect(sys.argv[1])
s.sendall(struct.pack("<IIII", 1, 0, 8, 1) + struct.pack("<II", 0x52495041, 1))
print(struct.unpack("<IIII", s.recv(16))[1])
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another user")
def test_another_user_is_served_while_one_user_holds_its_slots(tmp_path):
    """Real peers (SO_PEERCRED): root holds its one slot idle; nobody's guest is served."""
    import subprocess
    import sys
    import tempfile

    d = tempfile.mkdtemp(prefix="apir-peers-")
    os.chmod(d, 0o755)
    srv = LocalServer(os.path.join(d, "s.sock"), context_factory=EchoContext, socket_mode=0o666,
                      config={"apir.local.max_connections_per_peer": "1"}).start()
    try:
        mine = raw(srv)
        assert wait_for(lambda: len(srv._conns) == 1)
        second = raw(srv)
        assert closed_by_host(second)
        second.close()
        out = subprocess.run([sys.executable, "-c", _OTHER_USER_GUEST, srv.path], capture_output=True,
                             text=True, timeout=60)
        assert out.stdout.strip() == "0", out.stderr  # HELLO answered, err 0
        mine.close()
    finally:
        srv.close()
        os.rmdir(d)
