"""Noticing that a socket host's guest hung up while its connection thread is busy computing.

Theory of operation: a connection thread runs each EXECBUFFER to its end before it reads the
socket again, so on its own it learns that its guest left (closed the socket, exited, was
killed) only once the command is done: a guest could leave a long graph computing for nobody,
holding its context. `HangupWatch` is one thread per server blocked in `epoll_wait` on every
connection's socket for EPOLLRDHUP / EPOLLHUP (one-shot): when one fires it calls that
connection's `on_hangup`, which cancels its compute in flight (apir.host.backend.compute_abort). The
connection thread still does the rest (EOF, closing the context) as before. Registering costs
one `epoll_ctl` per connection, nothing per command.
"""

from __future__ import annotations

import logging
import os
import select
import threading
from typing import Dict, Optional, Protocol

__all__ = ["HangupWatch"]

log = logging.getLogger(__name__)

_EVENTS = select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLONESHOT


class _Watched(Protocol):
    def on_hangup(self) -> None: ...


class HangupWatch:
    """Calls `conn.on_hangup()` once the peer of a watched socket hangs up. Thread-safe."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC)  # close() wakes the thread with it
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._lock = threading.Lock()
        self._watched: Dict[int, _Watched] = {}  # socket fd -> connection
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    def watch(self, fd: int, conn: _Watched) -> None:
        """Watches socket `fd` of `conn` until `forget(fd)` (before the socket is closed).
        Raises (RuntimeError: no thread; OSError: epoll_ctl) with nothing watched, and the
        next call tries again."""
        with self._lock:
            if self._closed:
                return
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="apir-local-hangup", daemon=True)
                thread.start()
                self._thread = thread  # only once it runs: a thread that never started watches nothing
            self._epoll.register(fd, _EVENTS)
            self._watched[fd] = conn

    def forget(self, fd: int) -> None:
        with self._lock:
            if self._watched.pop(fd, None) is not None and not self._closed:
                try:
                    self._epoll.unregister(fd)
                except OSError:
                    pass

    def _run(self) -> None:
        while True:
            try:
                events = self._epoll.poll()
            except InterruptedError:
                continue
            except (OSError, ValueError):  # closed under us
                return
            for fd, _ in events:
                if fd == self._wake_r:
                    return
                with self._lock:
                    conn = self._watched.get(fd)
                if conn is not None:
                    try:
                        conn.on_hangup()
                    except Exception:  # noqa: BLE001 - the watch must outlive one connection's bug
                        log.exception("hang-up of socket %d: cancelling its compute failed", fd)

    def close(self, timeout: float = 5.0) -> None:
        """Stops the thread and releases the epoll and pipe descriptors. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        os.write(self._wake_w, b"x")
        if thread is not None:
            thread.join(timeout)
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        self._epoll.close()
