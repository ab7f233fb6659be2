"""One local-wire message over a Unix stream socket, with file descriptors (SCM_RIGHTS).

Theory of operation: the local transport's messages (apir.local.wire: a 16-byte header
and a payload) travel on a Unix stream socket; the HELLO reply also carries the context's shared
memory file as SCM_RIGHTS, attached to the message's first byte. `send_message` sends one whole
message, `recv_message` reads one whole message and the descriptors that came with it. The
socket host (apir.host.local.server) and `LocalDevice` (apir.guest.local) both use these two.
"""

from __future__ import annotations

import array
import os
import socket

from apir.local.wire import HEADER, MAX_PAYLOAD, ConnectionClosed, Header, pack_message, unpack_header

__all__ = ["send_message", "recv_message"]


def send_message(
    sock: socket.socket, op: int, seq: int, payload: bytes = b"", err: int = 0, fds: tuple[int, ...] = ()
) -> None:
    """Send one message; `fds` ride with it as SCM_RIGHTS (attached to its first byte)."""
    data = pack_message(op, seq, payload, err)
    if fds:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        sent = sock.sendmsg([data], anc)
        if sent < len(data):
            sock.sendall(data[sent:])
    else:
        sock.sendall(data)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    if size == 0:
        return b""
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionClosed(f"peer closed the connection ({got} of {size} bytes read)")
        got += n
    return bytes(buf)


_FD_SPACE = socket.CMSG_SPACE(4 * 4)  # room for up to 4 fds; more are closed and rejected


def recv_message(sock: socket.socket, max_payload: int = MAX_PAYLOAD) -> tuple[Header, bytes, list[int]]:
    """Receive one message: (header, payload, received fds).

    Raises ConnectionClosed on EOF, WireError when the header announces more than
    `max_payload` bytes (the stream cannot be trusted after that). The caller owns the fds.
    """
    data, anc, _flags, _addr = sock.recvmsg(HEADER.size, _FD_SPACE)
    fds: list[int] = []
    for level, kind, cdata in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(cdata[: len(cdata) - len(cdata) % arr.itemsize])
            fds.extend(arr)
    try:
        if len(data) == 0:
            raise ConnectionClosed("peer closed the connection")
        if len(data) < HEADER.size:
            data += _recv_exact(sock, HEADER.size - len(data))
        header = unpack_header(data, max_payload)
        payload = _recv_exact(sock, header.length)
    except BaseException:
        for fd in fds:
            _close_quietly(fd)
        raise
    return header, payload, fds


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
