"""The vhost-user wire: request numbers, feature bits, the message header and its payloads.

Theory of operation: a vhost-user front-end (QEMU) and back-end (this device) exchange messages
over a Unix stream socket: a 12-byte header (u32 request, u32 flags, u32 payload size), the
payload, and file descriptors as SCM_RIGHTS ancillary data of the header's first byte (QEMU's
`vhost_user_write`, docs/interop/vhost-user.rst). The back-end channel (SET_BACKEND_REQ_FD)
uses the same framing with the back-end's own request numbers. `recv_message` reads one
message and refuses what no well-behaved front-end sends (a wrong version, a payload larger
than MAX_PAYLOAD, more than MAX_FDS descriptors), closing any descriptors it took. Its waits
have deadlines, not per-recv timeouts: a message begun must be complete within
`message_timeout_s` of its first byte, and a whole read can be bounded by `deadline` (a reply
awaited), so a peer trickling bytes holds nothing longer than that; `set_send_timeout` bounds
a send to a peer that does not read.

Numbers: QEMU 11.1.3's (the SHMEM protocol feature is bit 22 there; docs/vm.md).
Pure codec: sockets in, tuples out; no device state.
"""

from __future__ import annotations

import enum
import os
import select
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from apir.errors import ApirError

__all__ = [
    "Request",
    "BackendRequest",
    "ProtocolFeature",
    "F_PROTOCOL_FEATURES",
    "F_VERSION_1",
    "FLAG_VERSION",
    "FLAG_REPLY",
    "FLAG_NEED_REPLY",
    "HEADER",
    "MAX_PAYLOAD",
    "MAX_FDS",
    "MAX_SHMEM_REGIONS",
    "VRING_INDEX_MASK",
    "VRING_NOFD",
    "Message",
    "ProtocolError",
    "PeerClosed",
    "recv_message",
    "send_message",
    "close_quietly",
    "set_send_timeout",
    "MEMORY_REGION",
    "VRING_STATE",
    "VRING_ADDR",
    "CONFIG_HEADER",
    "SHMEM_MAP",
    "U64",
]


class Request(enum.IntEnum):
    """`VHOST_USER_*` front-end requests (the ones this back-end knows)."""

    GET_FEATURES = 1
    SET_FEATURES = 2
    SET_OWNER = 3
    RESET_OWNER = 4
    SET_MEM_TABLE = 5
    SET_LOG_BASE = 6
    SET_LOG_FD = 7
    SET_VRING_NUM = 8
    SET_VRING_ADDR = 9
    SET_VRING_BASE = 10
    GET_VRING_BASE = 11
    SET_VRING_KICK = 12
    SET_VRING_CALL = 13
    SET_VRING_ERR = 14
    GET_PROTOCOL_FEATURES = 15
    SET_PROTOCOL_FEATURES = 16
    GET_QUEUE_NUM = 17
    SET_VRING_ENABLE = 18
    SET_BACKEND_REQ_FD = 21
    GET_CONFIG = 24
    SET_CONFIG = 25
    RESET_DEVICE = 34
    GET_MAX_MEM_SLOTS = 36
    ADD_MEM_REG = 37
    REM_MEM_REG = 38
    SET_STATUS = 39
    GET_STATUS = 40
    GET_SHMEM_CONFIG = 44


class BackendRequest(enum.IntEnum):
    """`VHOST_USER_BACKEND_*` requests the back-end sends on the back-end channel."""

    SHMEM_MAP = 9
    SHMEM_UNMAP = 10


class ProtocolFeature(enum.IntEnum):
    """`VHOST_USER_PROTOCOL_F_*` bits this back-end offers."""

    MQ = 0
    REPLY_ACK = 3
    BACKEND_REQ = 5
    CONFIG = 9
    CONFIGURE_MEM_SLOTS = 15
    SHMEM = 22  # QEMU 11.1.3 (mailing-list drafts said 20; probed: only 22 works)


F_PROTOCOL_FEATURES = 30  # VHOST_USER_F_PROTOCOL_FEATURES, in GET_FEATURES' device features
F_VERSION_1 = 32  # VIRTIO_F_VERSION_1

FLAG_VERSION = 0x1  # the protocol version (1) in bits 0..1 of every header
FLAG_REPLY = 0x4
FLAG_NEED_REPLY = 0x8
_VERSION_MASK = 0x3

HEADER = struct.Struct("<III")  # request, flags, payload size
U64 = struct.Struct("<Q")
MEMORY_REGION = struct.Struct("<QQQQ")  # guest_phys_addr, memory_size, userspace_addr, mmap_offset
VRING_STATE = struct.Struct("<II")  # index, num
VRING_ADDR = struct.Struct("<IIQQQQ")  # index, flags, desc, used, avail, log (QEMU addresses)
CONFIG_HEADER = struct.Struct("<III")  # offset, size, flags (then `size` bytes)
SHMEM_MAP = struct.Struct("<B7xQQQQ")  # shmid, fd_offset, shm_offset, len, flags
MAX_SHMEM_REGIONS = 256  # VHOST_MEMORY_BASELINE_NREGIONS' cousin: GET_SHMEM_CONFIG's array

VRING_INDEX_MASK = 0xFF  # SET_VRING_KICK/CALL/ERR: u64 with the ring index in bits 0..7
VRING_NOFD = 0x100  # ... and bit 8 set when no descriptor comes with it

# The largest payload a front-end sends: SET_MEM_TABLE with 8 regions (8 + 8 * 32 bytes) and
# GET_CONFIG (12 + 256) are the big ones; anything beyond this is not vhost-user.
MAX_PAYLOAD = 4096
MAX_FDS = 8  # VHOST_MEMORY_BASELINE_NREGIONS: the most descriptors one message carries


class ProtocolError(ApirError):
    """The peer broke the framing (the session cannot continue)."""


class PeerClosed(ProtocolError):
    """The peer closed the socket (EOF)."""


@dataclass
class Message:
    """One message: `request` number, `flags`, `payload` bytes and the descriptors it carried
    (owned by the receiver: close the ones not kept)."""

    request: int
    flags: int
    payload: bytes
    fds: List[int] = field(default_factory=list)

    @property
    def need_reply(self) -> bool:
        return bool(self.flags & FLAG_NEED_REPLY)

    def take_fd(self) -> Optional[int]:
        """The first descriptor, now the caller's (None when there was none)."""
        return self.fds.pop(0) if self.fds else None

    def close_fds(self) -> None:
        while self.fds:
            close_quietly(self.fds.pop())


def close_quietly(fd: Optional[int]) -> None:
    if fd is None:
        return
    try:
        os.close(fd)
    except OSError:
        pass


def set_send_timeout(sock: socket.socket, seconds: float) -> None:
    """A send that cannot go on for `seconds` (the peer reads nothing) fails with an OSError
    instead of blocking for good (SO_SNDTIMEO; receives are left as they are)."""
    whole = int(seconds)
    tv = struct.pack("@ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _wait_readable(sock: socket.socket, deadline: Optional[float]) -> None:
    """Returns once `sock` has bytes (or EOF) to read; ProtocolError past `deadline`."""
    if deadline is None:
        return
    poller = select.poll()  # not select: the socket may be numbered past FD_SETSIZE
    poller.register(sock, select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ProtocolError("the peer did not complete its message in time")
        if poller.poll(left * 1000):
            return


def _recv_exact(sock: socket.socket, n: int, deadline: Optional[float] = None) -> bytes:
    data = bytearray()
    while len(data) < n:
        _wait_readable(sock, deadline)
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise PeerClosed("peer closed the socket mid-message")
        data += chunk
    return bytes(data)


def recv_message(
    sock: socket.socket, message_timeout_s: Optional[float] = None, deadline: Optional[float] = None
) -> Message:
    """Reads one message. Raises PeerClosed at EOF, ProtocolError for a bad header (wrong
    version bits, payload over MAX_PAYLOAD, more than MAX_FDS descriptors, truncated
    ancillary data) or a deadline passed: the whole read's `deadline` (time.monotonic), or
    `message_timeout_s` after the message's first byte. Descriptors of a refused message are
    closed."""
    fds: List[int] = []
    _wait_readable(sock, deadline)
    data, anc, msg_flags, _ = sock.recvmsg(HEADER.size, socket.CMSG_SPACE(MAX_FDS * 4))
    if message_timeout_s is not None:
        rest = time.monotonic() + message_timeout_s
        deadline = rest if deadline is None else min(deadline, rest)
    for level, kind, cdata in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(cdata) - len(cdata) % 4
            fds += struct.unpack(f"{usable // 4}i", cdata[:usable])
    try:
        if not data:
            raise PeerClosed("peer closed the socket")
        if msg_flags & socket.MSG_CTRUNC:
            raise ProtocolError(f"more than {MAX_FDS} descriptors in one message")
        if len(data) < HEADER.size:
            data += _recv_exact(sock, HEADER.size - len(data), deadline)
        request, flags, size = HEADER.unpack(data)
        if flags & _VERSION_MASK != FLAG_VERSION:
            raise ProtocolError(f"request {request}: protocol version {flags & _VERSION_MASK}, expected 1")
        if size > MAX_PAYLOAD:
            raise ProtocolError(f"request {request}: payload of {size} bytes (at most {MAX_PAYLOAD})")
        payload = _recv_exact(sock, size, deadline) if size else b""
    except BaseException:
        for fd in fds:
            close_quietly(fd)
        raise
    return Message(request, flags, payload, fds)


def send_message(sock: socket.socket, request: int, flags: int, payload: bytes = b"", fds: Sequence[int] = ()) -> None:
    """Writes one message (`flags` gets the version bits), with `fds` as SCM_RIGHTS."""
    data = HEADER.pack(request, flags | FLAG_VERSION, len(payload)) + payload
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))] if fds else []
    sent = sock.sendmsg([data], anc)
    if sent < len(data):
        sock.sendall(data[sent:])
