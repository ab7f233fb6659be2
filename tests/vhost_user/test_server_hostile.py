"""The vhost-user listener never stops serving: whatever fails in setting up one front-end's
session (EMFILE, a thread that cannot start) is logged and that connection closed, and the next
front-end is served. Failures are injected."""

import errno
import socket
import threading

from apir.codec.virtgpu import VirtioGpuCtrlType as T
from apir.host.vhost_user import session as session_mod

from .conftest import wait_for
from .frontend import FakeFrontend, hdr, resp_type


def _dropped(path: str) -> None:
    """Connects and waits for the device to close the connection."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        sock.settimeout(20)
        assert sock.recv(1) == b""
    finally:
        sock.close()


def _served(path: str) -> None:
    fe = FakeFrontend.connect(path)
    try:
        assert resp_type(fe.command(hdr(T.CMD_GET_DISPLAY_INFO), 24 + 16 * 24)) == T.RESP_OK_DISPLAY_INFO
    finally:
        fe.close()


def test_emfile_in_a_sessions_set_up_leaves_the_listener_serving(server, monkeypatch):
    real = session_mod.os.pipe2
    calls = []

    def pipe2(flags):
        calls.append(flags)
        if len(calls) == 1:
            raise OSError(errno.EMFILE, "Too many open files")
        return real(flags)

    monkeypatch.setattr(session_mod.os, "pipe2", pipe2)
    _dropped(server.path)
    _served(server.path)
    assert len(calls) == 2


def test_a_queue_thread_that_cannot_start_leaves_the_listener_serving(server, monkeypatch):
    started = []

    class Thread(threading.Thread):
        def start(self):
            started.append(self.name)
            if len(started) == 1:
                raise RuntimeError("can't start new thread")
            super().start()

    monkeypatch.setattr(session_mod.threading, "Thread", Thread)
    _dropped(server.path)
    wait_for(lambda: server.sessions_served == 1, what="the failed session counted")
    monkeypatch.undo()
    _served(server.path)
