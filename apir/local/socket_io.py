"""One local-wire message over a Unix stream socket, with file descriptors (SCM_RIGHTS).

Theory of operation: the local transport's messages (apir.local.wire: a 16-byte header
and a payload) travel on a Unix stream socket; the HELLO reply also carries the context's shared
memory file as SCM_RIGHTS, attached to the message's first byte. `send_message` sends one whole
message, `recv_message` reads one whole message and the descriptors that came with it. The
socket host (apir.host.local.server) and `LocalDevice` (apir.guest.local) both use these two.

A host waits on a peer only until a deadline, never per system call (a peer sending one byte
per timeout would hold it for ever): `recv_message`'s `deadline` bounds the whole message,
`rest_s` the rest of it once its first bytes are in (a guest may idle between messages, not
inside one), and `send_message`'s `timeout_s` a reply the peer does not take. On a blocking
socket these cost no system call while the peer keeps up: each call is made with MSG_DONTWAIT,
and only one that would block waits, in poll, for what is left of the deadline.
"""

from __future__ import annotations

import array
import os
import select
import socket
import time
from typing import Optional

from apir.local.wire import (
    HEADER,
    MAX_PAYLOAD,
    ConnectionClosed,
    DeadlineExceeded,
    Header,
    pack_message,
    unpack_header,
)

__all__ = ["send_message", "recv_message"]


def send_message(
    sock: socket.socket,
    op: int,
    seq: int,
    payload: bytes = b"",
    err: int = 0,
    fds: tuple[int, ...] = (),
    timeout_s: Optional[float] = None,
) -> None:
    """Send one message; `fds` ride with it as SCM_RIGHTS (attached to its first byte).
    `timeout_s` (a blocking socket): DeadlineExceeded if the peer has not taken the whole
    message that long after the send first found its buffer full."""
    data = pack_message(op, seq, payload, err)
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    if timeout_s is not None:
        try:
            sent = sock.sendmsg([data], anc, socket.MSG_DONTWAIT) if anc else sock.send(data, socket.MSG_DONTWAIT)
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            _send_rest(sock, memoryview(data)[sent:], [] if sent else anc, timeout_s)
        return
    if anc:
        sent = sock.sendmsg([data], anc)
        if sent < len(data):
            sock.sendall(data[sent:])
    else:
        sock.sendall(data)


def _send_rest(sock: socket.socket, view: memoryview, anc: list, timeout_s: float) -> None:
    """Sends what is left of a message (`anc` with its first byte, if none went yet), waiting
    for the peer to take it until `timeout_s` from now."""
    deadline = time.monotonic() + timeout_s
    while view:
        try:
            sent = sock.sendmsg([view], anc, socket.MSG_DONTWAIT) if anc else sock.send(view, socket.MSG_DONTWAIT)
        except BlockingIOError:
            _wait(sock, select.POLLOUT, deadline, "take a reply")
            continue
        anc = []  # gone with the first byte sent
        view = view[sent:]


def _wait(sock: socket.socket, events: int, deadline: float, what: str) -> None:
    """Returns once `sock` is ready for `events` (or hung up); DeadlineExceeded at `deadline`."""
    remaining = deadline - time.monotonic()
    if remaining > 0:
        poller = select.poll()
        poller.register(sock, events)
        if poller.poll(max(1, int(remaining * 1000 + 0.999))):
            return
    raise DeadlineExceeded(f"the peer did not {what} by its deadline")


def _recv_exact(sock: socket.socket, size: int, deadline: Optional[float] = None) -> bytes:
    if size == 0:
        return b""
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        if deadline is None:
            n = sock.recv_into(view[got:])
        else:
            try:
                n = sock.recv_into(view[got:], 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                _wait(sock, select.POLLIN, deadline, "send a whole message")
                continue
        if n == 0:
            raise ConnectionClosed(f"peer closed the connection ({got} of {size} bytes read)")
        got += n
    return bytes(buf)


_FD_SPACE = socket.CMSG_SPACE(4 * 4)  # room for up to 4 fds; more are closed and rejected


def recv_message(
    sock: socket.socket,
    max_payload: int = MAX_PAYLOAD,
    *,
    deadline: Optional[float] = None,
    rest_s: Optional[float] = None,
) -> tuple[Header, bytes, list[int]]:
    """Receive one message: (header, payload, received fds).

    Raises ConnectionClosed on EOF, WireError when the header announces more than
    `max_payload` bytes (the stream cannot be trusted after that). The caller owns the fds.
    On a blocking socket, `deadline` (time.monotonic()) bounds the whole message, its first
    byte included, and `rest_s` the rest once its first bytes are in: DeadlineExceeded.
    """
    if deadline is not None:
        _wait(sock, select.POLLIN, deadline, "send a whole message")
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
        if rest_s is not None:
            rest_end = time.monotonic() + rest_s
            deadline = rest_end if deadline is None else min(deadline, rest_end)
        if len(data) < HEADER.size:
            data += _recv_exact(sock, HEADER.size - len(data), deadline)
        header = unpack_header(data, max_payload)
        payload = _recv_exact(sock, header.length, deadline)
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
