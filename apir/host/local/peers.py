"""Who is at the other end of a socket host's connection, and what each peer holds.

Theory of operation: a peer is the user id of the process that connected (SO_PEERCRED, read
once when the connection is accepted): processes of one user can do what each other can
(signal, ptrace, open each other's sockets), so bounding a process or a connection alone would
bound nothing. `PeerLimits` counts, per peer and in all, the connections the host serves and
the bytes of shared memory files they hold (apir.host.local.memfile), and refuses what would
pass a bound: one peer's idle connections or blobs cannot take every slot or all the memory,
so other users' guests are still served. The bounds are apir.host.config's
``apir.local.max_connections*`` and ``apir.local.max_*_bytes``; docs/security.md has the table.
"""

from __future__ import annotations

import socket
import struct
import threading
from typing import Dict, Hashable, Optional

__all__ = ["peer_uid", "PeerLimits", "PeerShare"]

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_uid(sock: socket.socket) -> int:
    """The user id of the process that connected `sock` (a Unix socket), as of connect()."""
    _pid, uid, _gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return uid


class PeerLimits:
    """Connections and shared memory bytes per peer and in all, each under its bound.
    Thread-safe (connection threads take and give bytes; the accept thread admits)."""

    def __init__(self, max_connections: int, max_peer_connections: int, max_bytes: int, max_peer_bytes: int):
        self.max_connections = max_connections
        self.max_peer_connections = max_peer_connections
        self.max_bytes = max_bytes
        self.max_peer_bytes = max_peer_bytes
        self._lock = threading.Lock()
        self._conns: Dict[Hashable, int] = {}
        self._bytes: Dict[Hashable, int] = {}
        self.connections = 0
        self.bytes = 0

    def admit(self, peer: Hashable) -> Optional[str]:
        """Counts a new connection of `peer`; None, or why not (what is full) and nothing counted."""
        with self._lock:
            if self.connections >= self.max_connections:
                return f"{self.connections} connections, the limit"
            held = self._conns.get(peer, 0)
            if held >= self.max_peer_connections:
                return f"{held} connections of this peer, its limit"
            self._conns[peer] = held + 1
            self.connections += 1
            return None

    def leave(self, peer: Hashable) -> None:
        with self._lock:
            held = self._conns.pop(peer, 0) - 1
            if held > 0:
                self._conns[peer] = held
            self.connections -= 1

    def take(self, peer: Hashable, nbytes: int) -> Optional[str]:
        """Counts `nbytes` more of `peer`'s; None, or why not and nothing counted."""
        with self._lock:
            held = self._bytes.get(peer, 0)
            if held + nbytes > self.max_peer_bytes:
                return f"this peer's shared memory would exceed its {self.max_peer_bytes}-byte limit"
            if self.bytes + nbytes > self.max_bytes:
                return f"the host's shared memory would exceed its {self.max_bytes}-byte limit"
            self._bytes[peer] = held + nbytes
            self.bytes += nbytes
            return None

    def give(self, peer: Hashable, nbytes: int) -> None:
        with self._lock:
            held = self._bytes.pop(peer, 0) - nbytes
            if held > 0:
                self._bytes[peer] = held
            self.bytes -= nbytes

    def held(self, peer: Hashable) -> tuple[int, int]:
        """(connections, bytes) of `peer` now."""
        with self._lock:
            return self._conns.get(peer, 0), self._bytes.get(peer, 0)


class PeerShare:
    """One peer's side of a PeerLimits: what a shared memory file charges its growth to."""

    def __init__(self, limits: PeerLimits, peer: Hashable):
        self.limits, self.peer = limits, peer

    def take(self, nbytes: int) -> Optional[str]:
        return self.limits.take(self.peer, nbytes)

    def give(self, nbytes: int) -> None:
        self.limits.give(self.peer, nbytes)
