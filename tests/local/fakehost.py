"""A scripted socket host for guest-side tests: answers HELLO with a 16 KiB memfd and every
later request with `answers[op]` (payload, err[, fd, ...]: descriptors to attach), or errno 0
and an empty payload."""

import os
import socket
import threading

from apir.local.wire import HELLO_MAGIC, WIRE_VERSION, ConnectionClosed, Op, fixed_reply
from apir.codec.virtgpu import BLOB_ALIGNMENT
from apir.local.socket_io import recv_message, send_message


class FakeHost:
    def __init__(self, path, answers, file_size=16384):
        self.answers = answers
        self.file_size = file_size
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(1)
        self.path = str(path)
        self.conn = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        conn, _ = self.sock.accept()
        self.conn = conn
        fd = os.memfd_create("fake-host")
        os.ftruncate(fd, self.file_size)
        try:
            header, _, _ = recv_message(conn)
            reply = fixed_reply(Op.HELLO).pack(HELLO_MAGIC, WIRE_VERSION, BLOB_ALIGNMENT, 0)
            send_message(conn, Op.HELLO, header.seq, reply, fds=(fd,))
            while True:
                header, _, _ = recv_message(conn)
                body, err, *fds = self.answers.get(header.op, (b"", 0))  # (+ fds to attach)
                if body is None:
                    continue  # never answered
                send_message(conn, header.op, header.seq, body, err=err, fds=tuple(fds))
        except (ConnectionClosed, OSError):
            pass
        finally:
            os.close(fd)

    def close(self):
        self.sock.close()
        if self.conn is not None:
            self.conn.close()
