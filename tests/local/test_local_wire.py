"""The socket wire's bytes, as docs/local-transport.md gives them, and fd passing."""

import os
import socket

import pytest

from apir.local.wire import (
    HEADER, MAX_PAYLOAD, REPLY, REQUEST, ConnectionClosed, Op, WireError, pack_message,
)
from apir.local.socket_io import recv_message, send_message


def test_documented_bytes():
    # header: op, err, len, seq (u32 LE each); CREATE_BLOB: blob_mem, blob_flags, size, blob_id
    msg = pack_message(Op.CREATE_BLOB, 7, REQUEST[Op.CREATE_BLOB].pack(2, 1, 0x4000, 0))
    assert msg.hex() == ("05000000" "00000000" "18000000" "07000000"
                         "02000000" "01000000" "0040000000000000" "0000000000000000")
    assert HEADER.size == 16
    sizes = {op: (REQUEST[op].size, None if REPLY[op] is None else REPLY[op].size) for op in Op}
    assert sizes == {Op.HELLO: (8, 16), Op.GETPARAM: (8, 8), Op.GET_CAPS: (16, None),
                     Op.CONTEXT_INIT: (16, 0), Op.CREATE_BLOB: (24, 16), Op.MAP: (8, 8),
                     Op.GEM_CLOSE: (8, 0), Op.EXECBUFFER: (16, 0), Op.STAT: (0, 32),
                     Op.RING: (0, 16), Op.KICK: (0, 0)}
    assert REQUEST[Op.HELLO].pack(0x52495041, 1)[:4] == b"APIR"


def test_fd_passing_and_framing():
    a, b = socket.socketpair()
    r, w = os.pipe()
    try:
        send_message(a, Op.HELLO, 1, b"x" * 16, fds=(w,))
        header, body, fds = recv_message(b)
        assert (header.op, header.seq, header.err, body, len(fds)) == (Op.HELLO, 1, 0, b"x" * 16, 1)
        os.write(fds[0], b"!")  # the received fd is the same pipe
        assert os.read(r, 1) == b"!"
        os.close(fds[0])
        a.sendall(HEADER.pack(Op.MAP, 0, MAX_PAYLOAD + 1, 2))
        with pytest.raises(WireError):
            recv_message(b)
        a.close()
        with pytest.raises(ConnectionClosed):
            recv_message(b)
    finally:
        b.close()
        os.close(r)
        os.close(w)
