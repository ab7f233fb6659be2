"""The vhost-user socket: QEMU connects, one front-end at a time, for as long as the host runs.

Theory of operation: `VhostUserServer(path, ...)` listens on a Unix socket (mode `socket_mode`,
default 0600, whatever the umask). Its thread accepts a front-end and serves it with a
`FrontendSession` until it goes away (the VM stopped, was killed, or QEMU reconnects), then
accepts the next: one VM per socket, as vhost-user has it. Everything that VM held is freed
when its session ends. Several servers (one socket each) can share a process: one host for
paired VMs; what they hold together is bounded (apir.host.vhost_user.process_limits), and each
VM is a peer of its own (apir.host.peer: the socket's path) for the host's per-peer bounds.
Whatever fails in accepting or setting up one front-end (EMFILE, a thread that cannot start)
is logged and that connection closed; the listener goes on.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import threading
import time
from typing import Optional, Tuple

from apir.codec.virtgpu import VIRTGPU_DRM_CAPSET_APIR
from apir.host.component.seams import ContextFactory
from apir.host.local.kernel import default_context_factory
from apir.host.vhost_user.gpu_device import DeviceCounts, GpuDevice
from apir.host.vhost_user.memory import GuestMemory
from apir.host.vhost_user.session import FrontendSession

__all__ = ["VhostUserServer", "DEFAULT_SHM_SIZE"]

log = logging.getLogger(__name__)

DEFAULT_SHM_SIZE = 1 << 30
_ACCEPT_BACKOFF_S = 0.5  # the host-visible region: every mapped blob of the VM fits in it


class VhostUserServer:
    """A virtio-gpu vhost-user back-end on `path`. `config`: HostContext configuration keys
    (and apir.vhost.* bounds); `capsets`: capset ids offered (APIR, and Venus where asked);
    `shm_size`: bytes of the host-visible region (a multiple of the page size)."""

    def __init__(
        self,
        path: str,
        *,
        config: Optional[dict] = None,
        context_factory: ContextFactory = default_context_factory,
        capsets: Tuple[int, ...] = (VIRTGPU_DRM_CAPSET_APIR,),
        shm_size: int = DEFAULT_SHM_SIZE,
        socket_mode: int = 0o600,
    ):
        if shm_size <= 0 or shm_size % os.sysconf("SC_PAGE_SIZE"):
            raise ValueError(f"host-visible region size {shm_size} is not a positive multiple of the page size")
        self.path = path
        self.config = config
        self.context_factory = context_factory
        self.capsets = capsets
        self.shm_size = shm_size
        self.sessions_served = 0
        self.session: Optional[FrontendSession] = None
        self._closed = False
        self._lock = threading.Lock()
        _remove_stale_socket(path)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self._listener.bind(path)
            os.chmod(path, socket_mode)
            self._listener.listen(1)
        except BaseException:
            self._listener.close()
            raise
        self._thread = threading.Thread(
            target=self.serve_forever, name=f"apir-vhost-{os.path.basename(path)}", daemon=True
        )

    def make_device(self, memory: GuestMemory) -> GpuDevice:
        return GpuDevice(
            memory, self.context_factory, self.config, self.capsets, self.shm_size, peer=f"vhost-user:{self.path}"
        )

    def serve_forever(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError as exc:
                if self._closed:
                    return
                # EMFILE, ENOMEM...: the listener stays; the next QEMU is taken once there is room
                log.error("%s: accept failed: %s", self.path, exc)
                time.sleep(_ACCEPT_BACKOFF_S)
                continue
            try:
                self._serve(sock)
            except Exception:  # noqa: BLE001 - one front-end's set-up failing must not end the listener
                log.exception("%s: front-end dropped: its session could not be set up", self.path)
                _close_socket(sock)
                with self._lock:
                    self.session = None
                time.sleep(_ACCEPT_BACKOFF_S)

    def _serve(self, sock: socket.socket) -> None:
        """Serves one front-end until it goes away. Raises when its session cannot be made
        (the socket is then the caller's to close)."""
        session = FrontendSession(sock, self.make_device, self.config, name=f"vhost-user {self.path}")
        with self._lock:
            if self._closed:
                session.close()
                return
            self.session = session
        log.info("%s: front-end connected", self.path)
        try:
            session.run()
        finally:
            with self._lock:
                self.session = None
                self.sessions_served += 1

    def start(self) -> "VhostUserServer":
        self._thread.start()
        return self

    def counts(self) -> DeviceCounts:
        """What the current front-end's device holds (zeros when none is connected)."""
        with self._lock:
            session = self.session
        return session.device.counts() if session is not None else DeviceCounts()

    def close(self, timeout: float = 10.0) -> None:
        """Stops accepting, ends the current session (freeing its VM's state), removes the
        socket file."""
        with self._lock:
            self._closed = True
            session = self.session
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        if session is not None:
            session.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def __enter__(self) -> "VhostUserServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def _close_socket(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass


def _remove_stale_socket(path: str) -> None:
    """Removes a socket file nothing listens on; refuses to replace anything else."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise FileExistsError(f"{path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # stale: its server is gone
        return
    finally:
        probe.close()
    raise FileExistsError(f"{path}: another server is listening there")
