"""The socket host's shared memory file (apir.host.local.memfile) and descriptors in the hands
of a hostile guest, who holds the file's fd from HELLO on.
- Seals the guest adds (the host seals only against shrinking, not F_SEAL_SEAL): F_SEAL_GROW,
  F_SEAL_FUTURE_WRITE and F_SEAL_WRITE (before the host maps anything) each make CREATE_BLOB
  and RING answer EPERM (the host's ftruncate or writable mmap fails) and the connection serves
  on (STAT); F_SEAL_SEAL changes nothing. F_SEAL_FUTURE_WRITE after a blob exists: GEM_CLOSE
  still answers 0 (the host's MADV_REMOVE fails quietly), a new blob EPERM.
- The guest growing the file to 1 GiB: the host's next append (an ftruncate that would now
  shrink it) answers EPERM, the guest's own shrink is refused by the seal.
- The guest punching holes (fallocate PUNCH_HOLE) over the exec ring's page and every blob:
  the host reads zeros where it mapped, nothing faults; blobs and STAT go on.
- Descriptors riding on requests: 20 requests with 40 fds each (over the 4 recv_message has
  room for: the kernel drops the rest), answered, and the host process holds no more fds after.
- Another guest connected meanwhile serves normally throughout (its own file, unsealed).
"""

import array
import ctypes
import errno
import fcntl
import mmap
import os
import socket
import struct

import pytest

from apir.local.wire import HEADER, Op, fixed_reply
from apir.local.socket_io import recv_message
from tests.fdkit import fds_on
from tests.local.localkit import hello, raw, request, wait_for

F_SEAL_FUTURE_WRITE = 0x10  # (Linux 5.1; not in Python's fcntl)
PUNCH = 3  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE


def _guest(server):
    s = raw(server)
    fd = hello(s)
    assert request(s, Op.CONTEXT_INIT, struct.pack("<IIQ", 10, 1, 0)) == (0, b"")
    return s, fd


def _blob(s, size=16384):
    err, body = request(s, Op.CREATE_BLOB, struct.pack("<IIQQ", 2, 1, size, 0))
    return err, (struct.unpack("<IIQ", body) if not err else None)


def _serves(s):
    err, body = request(s, Op.STAT, b"")
    assert err == 0 and len(body) == fixed_reply(Op.STAT).size


def _echo(s, fd):
    """A round trip through two new blobs (EchoContext copies 4 bytes of one into the other,
    after a notification word): the host serves this guest."""
    (ea, (ra, bo_a, _)), (eb, (rb, bo_b, _)) = _blob(s), _blob(s)
    assert ea == eb == 0
    maps = []
    for bo in (bo_a, bo_b):
        err, body = request(s, Op.MAP, struct.pack("<II", bo, 0))
        assert err == 0
        maps.append(mmap.mmap(fd, 16384, offset=struct.unpack("<Q", body)[0]))
    maps[0][0:4] = b"ping"
    assert request(s, Op.EXECBUFFER, struct.pack("<IIII", 4, 8, 0, 0) + struct.pack("<II", ra, rb)) == (0, b"")
    assert bytes(maps[1][0:8]) == b"\x01\0\0\0ping"
    for m in maps:
        m.close()


@pytest.mark.parametrize(
    "seal,refused",
    [
        (fcntl.F_SEAL_GROW, True),
        (F_SEAL_FUTURE_WRITE, True),
        (fcntl.F_SEAL_WRITE, True),
        (fcntl.F_SEAL_SEAL, False),
    ],
)
def test_seals_the_guest_adds_get_errnos(server, seal, refused):
    s, fd = _guest(server)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seal)
    assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & seal
    err, got = _blob(s)
    assert err == (errno.EPERM if refused else 0), (err, got)
    assert request(s, Op.RING, b"")[0] == (errno.EPERM if refused else 0)
    _serves(s)
    n, nfd = _guest(server)  # a neighbour, unaffected
    _echo(n, nfd)
    for x in (s, n):
        x.close()
    for f in (fd, nfd):
        os.close(f)
    assert wait_for(lambda: server.stats().contexts == 0)


def test_future_write_seal_after_a_blob(server):
    s, fd = _guest(server)
    err, (_, bo, size) = _blob(s)
    assert (err, size) == (0, 16384)
    m = mmap.mmap(fd, 16384, offset=0)
    m[0:6] = b"secret"
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE)
    assert request(s, Op.GEM_CLOSE, struct.pack("<II", bo, 0)) == (0, b"")
    assert _blob(s)[0] == errno.EPERM
    _serves(s)
    m.close()
    s.close()
    os.close(fd)


def test_the_guest_growing_the_file(server):
    s, fd = _guest(server)
    os.ftruncate(fd, 1 << 30)
    assert _blob(s)[0] == errno.EPERM  # the host's ftruncate would shrink the file now
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 0)
    _serves(s)
    s.close()
    os.close(fd)


def test_holes_punched_under_the_host(server):
    libc = ctypes.CDLL(None, use_errno=True)
    s, fd = _guest(server)
    err, body = request(s, Op.RING, b"")
    assert err == 0
    assert _blob(s)[0] == 0
    assert libc.fallocate(fd, PUNCH, ctypes.c_long(0), ctypes.c_long(1 << 20)) == 0
    _echo(s, fd)  # blobs placed over the holes work
    assert libc.fallocate(fd, PUNCH, ctypes.c_long(0), ctypes.c_long(1 << 20)) == 0
    _serves(s)
    s.close()
    os.close(fd)


def test_descriptors_on_requests_are_dropped(server, tmp_path):
    s, fd = _guest(server)
    sent = tmp_path / "sent"  # a file of its own, so that a copy left open is ours to find
    sent.write_bytes(b"")
    for seq in range(20):
        fds = [os.open(sent, os.O_RDONLY) for _ in range(40)]
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        s.sendmsg([HEADER.pack(Op.STAT, 0, 0, seq)], anc)
        for f in fds:
            os.close(f)
        header, body, got = recv_message(s)
        assert (header.op, header.seq, header.err, got) == (Op.STAT, seq, 0, [])
    assert fds_on([str(sent)]) == []  # the host closed each copy it received
    s.close()
    os.close(fd)


def test_a_refused_append_keeps_the_trailing_hole():
    """An append past the limit absorbed the free range at the file's end before it was
    refused: that range was lost for good (here the next fitting blob was refused too)."""
    from apir.host.local.memfile import MemFile, MemFileFull

    k = 16384
    mf = MemFile("t", limit=3 * k)
    try:
        mf.allocate(k)
        mf.free(mf.allocate(k))  # a hole at [k, 2k), the file's end
        with pytest.raises(MemFileFull):
            mf.allocate(3 * k)
        assert mf.allocate(2 * k).offset == k
    finally:
        mf.close()
