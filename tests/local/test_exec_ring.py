"""The exec ring (apir.local.exec_ring): EXECBUFFERs through shared memory, with a KICK when
the host is not polling; its layout as docs/local-transport.md gives it; order with the
socket's requests; a hostile guest writing the page."""

import errno
import os
import mmap
import struct
import threading
import time

import pytest

from apir.host.config import CONFIG_KEY_LOCAL_SPIN
from apir.local.wire import MAX_RING_COMMAND, REPLY, RING_SIZE, Op
from apir.guest.errors import IoctlError
from apir.guest.local import HostConnectionLost, LocalDevice
from apir.host.local import server as local_server
from apir.host.local.kernel import KernelError
from apir.host.local.server import LocalServer
from apir.local.exec_ring import ExecRing
from tests.local.fakehost import FakeHost
from tests.local.localkit import EchoContext, hello, raw, request, wait_for


class _CountingDevice(LocalDevice):
    """A LocalDevice that counts the requests it sends, by op."""

    def __init__(self, *args, **kwargs):
        self.sent = {}
        super().__init__(*args, **kwargs)

    def _send(self, op, payload):
        self.sent[op] = self.sent.get(op, 0) + 1
        return super()._send(op, payload)


def _server(tmp_path, spin_s=None, context_factory=EchoContext):
    config = None if spin_s is None else {CONFIG_KEY_LOCAL_SPIN: str(spin_s)}
    return LocalServer(str(tmp_path / "s.sock"), config=config, context_factory=context_factory).start()


def _echo(dev, src, dst, value: bytes, **kwargs):
    src.memory[0:4] = value
    dst.memory[0:8] = bytes(8)
    dev.execbuffer(struct.pack("<II", src.res_id, dst.res_id), **kwargs)
    return bytes(dst.memory[0:8])


def _read_owed(dev):
    """Reads every answer `dev` is still owed: a KICK's comes after the ring's `done` word, so
    a command waited for to its end may leave one (LocalDevice reads it later, by design)."""
    while dev._exec_seqs:
        dev.watch(1.0)


def test_layout_is_the_documented_one():
    page = bytearray(RING_SIZE)
    ring = ExecRing(page)
    assert ring.post(4, 1, b"\xaa\xbb\xcc", 7) is False  # nobody polls a fresh page
    # posted (0) = 7; EXECBUFFER header at 192: flags 4, size 3, ring_idx 1, pad; command at 256
    assert page[0:4] == struct.pack("<I", 7)
    assert page[192:208] == struct.pack("<IIII", 4, 3, 1, 0)
    assert page[256:259] == b"\xaa\xbb\xcc"
    assert ring.take() == (4, 1, 3, b"\xaa\xbb\xcc")
    ring.finish(7, errno.EINVAL)  # done (64) = 7, err (68) = EINVAL
    assert page[64:72] == struct.pack("<II", 7, errno.EINVAL)
    page[128:132] = struct.pack("<I", 1)  # polling (128): the host polls
    assert ring.post(4, 0, b"", 8) is True
    assert MAX_RING_COMMAND == RING_SIZE - 256 and REPLY[Op.RING].size == 16


def test_post_refuses_what_the_page_cannot_hold():
    ring = ExecRing(bytearray(RING_SIZE))
    with pytest.raises(ValueError):
        ring.post(4, 0, bytes(MAX_RING_COMMAND + 1), 1)
    with pytest.raises(ValueError):
        ring.post(4, 0, b"", 0)
    with pytest.raises(ValueError):
        ExecRing(bytearray(RING_SIZE - 4))


@pytest.mark.parametrize("spin_s", [60.0, 0])  # the host polls the ring (past each post) / never (KICKs)
def test_commands_go_through_the_ring(tmp_path, monkeypatch, spin_s):
    # spinning as on an idle machine, whatever else this one runs (apir.local.spin_policy), and
    # for as long as the test needs: within MAX_LOCAL_SPIN_S a loaded machine may run the
    # guest's next post after the host has stopped polling, and the test counts KICKs
    monkeypatch.setattr(local_server, "spinning_pays", lambda: True)
    monkeypatch.setattr(local_server, "MAX_LOCAL_SPIN_S", 60.0)
    found_polling = []  # what each post found: one that found the host not polling kicks
    post = ExecRing.post

    def watched_post(ring, *args):
        found_polling.append(post(ring, *args))
        return found_polling[-1]

    monkeypatch.setattr(ExecRing, "post", watched_post)
    with _server(tmp_path, spin_s) as srv, _CountingDevice(srv.path) as dev:
        dev.context_init(10)
        src, dst = dev.create_blob(16384), dev.create_blob(16384)
        assert _echo(dev, src, dst, b"OPEN") == b"\x01\0\0\0OPEN"  # (the ring opens: the host may poll later)
        for i in range(50):
            if spin_s:  # polling again, with no request to answer (a long wait's wake-up KICK)
                _read_owed(dev)
                assert wait_for(lambda: dev._ring.polling.load_acquire() == 1, 60.0)
            value = struct.pack("<I", 0x1000 + i)
            assert _echo(dev, src, dst, value) == b"\x01\0\0\0" + value
        assert dev._ring is not None and dev._ring_seq == 51
        assert dev.sent.get(Op.EXECBUFFER, 0) == 0
        if spin_s == 0:
            assert found_polling[1:] == [False] * 50 and dev.sent[Op.KICK] == 51  # the host blocked in recv
        else:
            assert found_polling[1:] == [True] * 50  # none kicked (a long wait may still ask to be woken)


def test_a_refused_ring_command_is_an_ioctl_error_and_the_ring_goes_on(tmp_path):
    with _server(tmp_path) as srv, LocalDevice(srv.path) as dev:
        dev.context_init(10, num_rings=1)
        src, dst = dev.create_blob(16384), dev.create_blob(16384)
        assert _echo(dev, src, dst, b"ABCD") == b"\x01\0\0\0ABCD"
        with pytest.raises(IoctlError) as info:
            dev.execbuffer(struct.pack("<II", src.res_id, dst.res_id), ring_idx=3)  # 1 ring only
        assert info.value.errno == errno.EINVAL
        assert info.value.request == "DRM_IOCTL_VIRTGPU_EXECBUFFER"
        assert dev._ring_seq == 2  # it went through the ring
        assert _echo(dev, src, dst, b"EFGH") == b"\x01\0\0\0EFGH"


def test_a_command_longer_than_the_ring_goes_as_a_message(tmp_path):
    with _server(tmp_path) as srv, _CountingDevice(srv.path) as dev:
        dev.context_init(10)
        src, dst = dev.create_blob(16384), dev.create_blob(16384)
        command = struct.pack("<II", src.res_id, dst.res_id) + bytes(MAX_RING_COMMAND)
        src.memory[0:4] = b"LONG"
        dev.execbuffer(command)
        assert bytes(dst.memory[0:8]) == b"\x01\0\0\0LONG"
        assert dev.sent[Op.EXECBUFFER] == 1
        assert _echo(dev, src, dst, b"SHRT") == b"\x01\0\0\0SHRT"  # the next one: the ring
        assert dev.sent[Op.EXECBUFFER] == 1


class _SlowEchoContext(EchoContext):
    delay_s = 0.2

    def submit(self, command):
        time.sleep(self.delay_s)
        super().submit(command)


@pytest.mark.parametrize("spin_s", [None, 0])
def test_a_ring_command_runs_before_a_later_request(tmp_path, spin_s):
    """A command posted in the ring, still running, and then a GEM_CLOSE of the blob it
    reads: the host runs what the ring holds before any request, as the message order was."""
    with _server(tmp_path, spin_s, _SlowEchoContext) as srv, LocalDevice(srv.path) as dev:
        dev.context_init(10)
        src, dst = dev.create_blob(16384), dev.create_blob(16384)
        src.memory[0:4] = b"ORDR"
        dev.execbuffer_nowait(struct.pack("<II", src.res_id, dst.res_id))
        dev.destroy_blob(src)  # GEM_CLOSE: had it run first, the command would find no src
        assert bytes(dst.memory[0:8]) == b"\x01\0\0\0ORDR"
        assert dev._ring.err.load_acquire() == 0
        src2 = dev.create_blob(16384)  # the next command: through the ring again
        assert _echo(dev, src2, dst, b"NEXT") == b"\x01\0\0\0NEXT"
        assert dev._ring_seq == 2


def test_a_host_without_the_ring_gets_messages(tmp_path, monkeypatch):
    def no_ring(self, k):
        raise KernelError(errno.ENOSYS, "unknown op 10")

    monkeypatch.setattr(local_server._Connection, "_open_ring", no_ring)
    with _server(tmp_path) as srv, _CountingDevice(srv.path) as dev:
        dev.context_init(10)
        src, dst = dev.create_blob(16384), dev.create_blob(16384)
        assert _echo(dev, src, dst, b"OLD!") == b"\x01\0\0\0OLD!"
        assert dev._ring is None and dev.sent[Op.EXECBUFFER] == 1 and dev.sent[Op.RING] == 1


def test_hostile_ring_input_gets_errnos_and_the_host_goes_on(tmp_path):
    with _server(tmp_path) as srv:
        s = raw(srv)
        fd = hello(s)
        try:
            assert request(s, Op.KICK, b"")[0] == errno.EINVAL  # no ring yet
            assert request(s, Op.RING, b"\0")[0] == errno.EINVAL  # wrong length
            err, body = request(s, Op.RING, b"")
            assert err == 0
            offset, size, _ = REPLY[Op.RING].unpack(body)
            assert size == RING_SIZE and offset % 16384 == 0
            assert request(s, Op.RING, b"")[0] == errno.EEXIST
            page = mmap.mmap(fd, size, offset=offset)
            ring = ExecRing(page)
            # before CONTEXT_INIT; then a size word past the page; then bad flags
            cases = [(4, 0, 8, errno.EINVAL), (4, 0, 0xFFFFFFFF, errno.EINVAL), (0xFF, 0, 8, errno.EINVAL)]
            for seq, (flags, ring_idx, size_word, want) in enumerate(cases, start=1):
                struct.pack_into("<IIII", page, 192, flags, size_word, ring_idx, 0)
                page[0:4] = struct.pack("<I", seq)  # posted, by hand
                assert request(s, Op.KICK, b"")[0] == 0
                assert (ring.done.load_acquire(), ring.err.load_acquire()) == (seq, want)
            # a guest rewriting `posted` faster than the host looks: each value seen runs once
            stop = threading.Event()

            def scribble():
                n = 100
                while not stop.is_set():
                    page[0:4] = struct.pack("<I", n)
                    n += 1

            t = threading.Thread(target=scribble)
            t.start()
            time.sleep(0.2)
            stop.set()
            t.join()
            assert request(s, Op.GETPARAM, struct.pack("<Q", 1)) == (0, struct.pack("<Q", 1))
            del ring
            page.close()
        finally:
            s.close()
        # the host still serves others
        with LocalDevice(srv.path) as dev:
            dev.context_init(10)
            src, dst = dev.create_blob(16384), dev.create_blob(16384)
            assert _echo(dev, src, dst, b"LIVE") == b"\x01\0\0\0LIVE"
        assert wait_for(lambda: len(srv._conns) == 0)


class _RepostingContext(EchoContext):
    """A guest that posts a new command in the ring while each one runs (as a guest process
    rewriting `posted` in a loop on a core of its own would): every submit bumps `posted` of
    the page in `page` (the test's mapping), while it is set."""

    page = None

    def submit(self, command):
        page = type(self).page
        if page is not None:
            seq = struct.unpack_from("<I", page, 0)[0]
            struct.pack_into("<I", page, 0, seq % 0xFFFFFFFF + 1)


@pytest.mark.parametrize("spin", [True, False])  # the host polls the ring / stops at once
def test_a_guest_posting_without_end_does_not_keep_the_host_from_its_socket(tmp_path, monkeypatch, spin):
    """`posted` that never stays put must not hold the connection thread in its ring loop:
    it still answers requests and sees the guest hang up (its context freed), and a second
    guest is served. The guest posts to the end, so a host held in the loop answers nothing:
    the bounds are liveness bounds, far over what the two requests take."""
    monkeypatch.setattr(local_server, "spinning_pays", lambda: spin)
    with _server(tmp_path, None, _RepostingContext) as srv:
        s = raw(srv)
        fd = hello(s)
        page = None
        try:
            assert request(s, Op.CONTEXT_INIT, struct.pack("<IIQ", 10, 1, 0))[0] == 0
            err, body = request(s, Op.RING, b"")
            offset, size, _ = REPLY[Op.RING].unpack(body)
            page = mmap.mmap(fd, size, offset=offset)
            struct.pack_into("<IIII", page, 192, 4, 8, 0, 0)  # RING_IDX, 8 bytes, ring 0
            monkeypatch.setattr(_RepostingContext, "page", page)  # (None again once the host is closed)
            page[0:4] = struct.pack("<I", 1)
            s.settimeout(60.0)
            assert request(s, Op.KICK, b"", seq=3)[0] == 0
            assert request(s, Op.GETPARAM, struct.pack("<Q", 1), seq=4) == (0, struct.pack("<Q", 1))
            with LocalDevice(srv.path, connect_timeout_s=60.0) as dev:  # another guest meanwhile
                assert dev.get_param(1) == 1
        finally:
            s.close()
            os.close(fd)
        # the hang-up seen, the context freed, while the guest's commands still came
        assert wait_for(lambda: len(srv._conns) == 0, 60.0)
        _RepostingContext.page = None
        page.close()


@pytest.mark.parametrize("offset", [1 << 20, 8192])  # past the 16 KiB file / across its end
def test_a_ring_past_the_shared_file_is_refused_not_a_bus_error(tmp_path, offset):
    """A host's RING reply naming a page beyond the file's end: mapped as it was, the guest's
    first post faulted (SIGBUS, the whole process gone); now a clear HostConnectionLost."""
    host = FakeHost(tmp_path / "s.sock", {Op.RING: (REPLY[Op.RING].pack(offset, RING_SIZE, 0), 0)})
    try:
        with LocalDevice(host.path, io_timeout_s=2.0, exec_wait_s=0.2) as dev:
            with pytest.raises(HostConnectionLost, match="past the 16384-byte shared file"):
                dev.execbuffer(b"12345678")
            assert dev._ring is None
    finally:
        host.close()


class _LongEchoContext(EchoContext):
    delay_s = 0.0  # (set by the test once the ring is open)

    def submit(self, command):
        time.sleep(self.delay_s)
        super().submit(command)


def test_a_long_wait_asks_to_be_woken_and_ends_with_the_command(tmp_path, monkeypatch):
    """A guest waiting long on a ring command, with no reply owed to it (no KICK went with
    the command: the host's `polling` said it was polling), sends one KICK, which the host
    answers once what was posted has run: `watch` returns then, with the command's result in
    place, not at its timeout. (The post is made to read `polling` 1 here: the host, which
    never polls, is blocked in recv, so without that KICK nothing would run the command.)"""
    with _server(tmp_path, 0, _LongEchoContext) as srv, _CountingDevice(srv.path) as dev:
        assert LocalDevice.watch_wakes is True
        dev.context_init(10)
        src, dst = dev.create_blob(16384), dev.create_blob(16384)
        assert _echo(dev, src, dst, b"WARM") == b"\x01\0\0\0WARM"  # the ring open
        _read_owed(dev)  # the answer to WARM's KICK
        monkeypatch.setattr(_LongEchoContext, "delay_s", 0.5)
        src.memory[0:4] = b"LONG"
        dst.memory[0:8] = bytes(8)
        kicks = dev.sent[Op.KICK]
        post = dev._ring.post
        monkeypatch.setattr(dev._ring, "post", lambda *args: post(*args) or True)  # "the host polls"
        dev.execbuffer_nowait(struct.pack("<II", src.res_id, dst.res_id))  # posted, not waited for
        assert dev.sent[Op.KICK] == kicks and not dev._exec_seqs
        dev.watch(0.5e-3)  # a short look asks for nothing
        assert dev.sent[Op.KICK] == kicks and bytes(dst.memory[0:8]) == bytes(8)
        dev.watch(20.0)
        assert dev.sent[Op.KICK] == kicks + 1 and not dev._exec_seqs
        assert bytes(dst.memory[0:8]) == b"\x01\0\0\0LONG" and dev._ring.done.load_acquire() == dev._ring_seq
        monkeypatch.setattr(_LongEchoContext, "delay_s", 0.0)
        monkeypatch.setattr(dev._ring, "post", post)
        assert _echo(dev, src, dst, b"NEXT") == b"\x01\0\0\0NEXT"
