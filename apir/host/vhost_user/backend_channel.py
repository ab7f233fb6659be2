"""The back-end channel: requests this device sends to QEMU (SHMEM_MAP, SHMEM_UNMAP).

Theory of operation: the front-end hands over one end of a socket pair with SET_BACKEND_REQ_FD
(protocol feature BACKEND_REQ). The device sends VHOST_USER_BACKEND_SHMEM_MAP with a blob's
memfd to map it into the VIRTIO shared memory region at the offset the guest chose, and
SHMEM_UNMAP to take it out again; both ask for QEMU's ack (NEED_REPLY, REPLY_ACK): a u64, 0 for
success. Requests go one at a time (a lock), and the wait for the ack has a deadline
(`timeout_s` for the whole answer, however it is trickled): QEMU acks from its main loop, and a
front-end that never answers fails the request rather than the device. The front-end channel
is served on another thread meanwhile, so QEMU may send its memory table changes
(ADD_MEM_REG) before it acks.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Optional

from apir.errors import ApirError
from apir.host.vhost_user.protocol import (
    FLAG_NEED_REPLY,
    FLAG_REPLY,
    SHMEM_MAP,
    U64,
    BackendRequest,
    PeerClosed,
    ProtocolError,
    recv_message,
    send_message,
    set_send_timeout,
)

__all__ = ["BackendChannel", "BackendError", "SHMEM_MAP_RW"]

log = logging.getLogger(__name__)

SHMEM_MAP_RW = 1  # VHOST_USER_FLAG_MAP_RW: the guest may read and write the mapping


class BackendError(ApirError):
    """A back-end request that failed: no channel, no ack in time, a refusal, a closed peer.
    `peer_gone`: the front-end closed the channel (it is going away: what it mapped goes with
    it), rather than misbehaving."""

    def __init__(self, message: str, peer_gone: bool = False):
        super().__init__(message)
        self.peer_gone = peer_gone


class BackendChannel:
    """The channel socket (owned: `close` closes it)."""

    def __init__(self, sock: socket.socket, timeout_s: float):
        set_send_timeout(sock, timeout_s)  # QEMU not reading the channel fails the request too
        self.sock = sock
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._broken = False
        self._peer_gone = False

    def shmem_map(self, shmid: int, fd: int, fd_offset: int, shm_offset: int, length: int) -> None:
        """Maps `length` bytes at `fd_offset` of `fd` at `shm_offset` of region `shmid`,
        read-write. Raises BackendError."""
        payload = SHMEM_MAP.pack(shmid, fd_offset, shm_offset, length, SHMEM_MAP_RW)
        self._request(BackendRequest.SHMEM_MAP, payload, fd)

    def shmem_unmap(self, shmid: int, shm_offset: int, length: int) -> None:
        """Unmaps [shm_offset, shm_offset + length) of region `shmid`. Raises BackendError."""
        self._request(BackendRequest.SHMEM_UNMAP, SHMEM_MAP.pack(shmid, 0, shm_offset, length, 0), None)

    def _request(self, request: int, payload: bytes, fd: Optional[int]) -> None:
        with self._lock:
            if self._broken:
                raise BackendError("the back-end channel failed earlier", peer_gone=self._peer_gone)
            try:
                send_message(self.sock, request, FLAG_NEED_REPLY, payload, () if fd is None else (fd,))
                reply = recv_message(self.sock, deadline=time.monotonic() + self.timeout_s)
                reply.close_fds()
            except (OSError, ProtocolError) as exc:
                # A late ack would be taken for the next request's: the channel is done.
                self._broken = True
                self._peer_gone = isinstance(exc, (ConnectionResetError, BrokenPipeError, PeerClosed))
                raise BackendError(f"back-end request {request}: {exc}", peer_gone=self._peer_gone) from None
            if reply.request != request or not reply.flags & FLAG_REPLY or len(reply.payload) < U64.size:
                self._broken = True
                raise BackendError(f"back-end request {request}: unexpected answer (request {reply.request})")
            status = U64.unpack_from(reply.payload)[0]
            if status != 0:
                raise BackendError(f"back-end request {request} refused by the front-end (status {status})")

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
