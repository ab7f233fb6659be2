"""`LocalDevice`: the virtgpu device interface over the local transport's Unix socket.

Theory of operation: connecting to an apir host process (`apir host serve --socket PATH`) is
opening a render node: the HELLO reply brings the context's shared memory file (SCM_RIGHTS), and
every device call is one request and one reply (apir.codec.local_wire's messages, sent and received
by apir.local.socket_io; docs/local-transport.md).
`create_blob` is CREATE_BLOB + MAP + ``mmap(fd, size, offset)``, exactly as a DRM guest maps a
blob, so the host and the guest share the blob's pages and no bulk data crosses the socket.

`execbuffer` sends the command and then waits, up to `exec_wait_s`, for the host's EXECBUFFER reply,
which the host sends once the command has run: the reply notification word is then already set,
and a host that dies mid-call shows up at once as `HostConnectionLost` instead of as a timeout.
When the command runs longer, execbuffer returns and the caller's wait on the notification word
(apir.guest.remote) takes over with its own timeout; that wait calls `watch` between its looks at
the word, which polls the socket, so a host that dies later in the call is still seen at once
(EOF or a hang-up), and a late reply is read as soon as it comes. Every other socket read is
bounded by `io_timeout_s`, so the guest never hangs forever.
"""

from __future__ import annotations

import errno as errno_mod
import logging
import os
import select
import socket
import threading
import time
from typing import Optional

from apir.codec.local_wire import (
    HELLO_MAGIC,
    REPLY,
    REQUEST,
    WIRE_VERSION,
    ConnectionClosed,
    Op,
    WireError,
    fixed_reply,
)
from apir.codec.virtgpu import (
    VIRTGPU_BLOB_FLAG_USE_MAPPABLE,
    VIRTGPU_BLOB_MEM_HOST3D,
    VIRTGPU_EXECBUF_RING_IDX,
    IoctlName,
)
from apir.guest.device import Blob
from apir.guest.errors import DeviceError, IoctlError
from apir.local.shm import map_shared
from apir.local.socket_io import recv_message, send_message

__all__ = ["LocalDevice", "HostConnectionLost", "host_stats"]

log = logging.getLogger(__name__)

_HOST_GONE = "the apir host closed the connection (it exited or crashed)"
_POLL_EVENTS = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR
_IOCTL_NAMES: dict[Op, str] = {
    Op.GETPARAM: IoctlName.GETPARAM,
    Op.GET_CAPS: IoctlName.GET_CAPS,
    Op.CONTEXT_INIT: IoctlName.CONTEXT_INIT,
    Op.CREATE_BLOB: IoctlName.RESOURCE_CREATE_BLOB,
    Op.MAP: IoctlName.MAP,
    Op.GEM_CLOSE: IoctlName.GEM_CLOSE,
    Op.EXECBUFFER: IoctlName.EXECBUFFER,
    Op.STAT: "STAT",
}


class HostConnectionLost(DeviceError):
    """The apir host closed the connection or broke the wire (it exited, crashed or was
    killed); the context and its buffers are gone with it."""


class LocalDevice:
    """A virtgpu device served by an apir host process over the Unix socket `path`.

    `connect_timeout_s` bounds the connection and HELLO; `io_timeout_s` every later read but
    EXECBUFFER's; `exec_wait_s` how long execbuffer waits for the command to complete before
    leaving the wait to the caller. Raises `DeviceError` when nothing serves `path`,
    `HostConnectionLost` when the host goes away, `IoctlError` for a refused request.
    """

    def __init__(self, path: str, connect_timeout_s: float = 5.0, io_timeout_s: float = 60.0, exec_wait_s: float = 2.0):
        self.path = os.fspath(path)
        self.node = self.name = f"local:{self.path}"
        self.io_timeout_s = io_timeout_s
        self.exec_wait_s = exec_wait_s
        self._lock = threading.Lock()
        self._seq = 0
        self._exec_seqs: list[int] = []  # seqs of EXECBUFFER replies not read yet (still running)
        self._blobs: dict[int, Blob] = {}
        self._broken: Optional[str] = None
        self.fd = -1
        self.sock: Optional[socket.socket] = None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(connect_timeout_s)
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            raise DeviceError(f"{self.node}: no apir host is serving there ({exc.strerror or exc})") from None
        self.sock = sock
        try:
            body, fds = self._request(Op.HELLO, REQUEST[Op.HELLO].pack(HELLO_MAGIC, WIRE_VERSION))
            magic, version, self.blob_alignment, _ = fixed_reply(Op.HELLO).unpack(body)
            if magic != HELLO_MAGIC or version != WIRE_VERSION or len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                raise HostConnectionLost(
                    f"{self.node}: not an apir host (magic {magic:#x}, wire version {version}, {len(fds)} fds)"
                )
            self.fd = fds[0]
        except HostConnectionLost as exc:
            sock.close()
            if self._broken != _HOST_GONE:
                raise
            raise HostConnectionLost(
                f"{self.node}: the apir host closed the connection before "
                "answering HELLO (it may be at its connection limit, "
                "apir.local.max_connections: see its log)"
            ) from exc
        except BaseException:
            sock.close()
            raise
        sock.settimeout(io_timeout_s)
        self._poller = select.poll()  # made once: execbuffer and watch poll on every call
        self._poller.register(sock, _POLL_EVENTS)

    # --- the exchange --------------------------------------------------------------------
    def _fail(self, why: str) -> HostConnectionLost:
        self._broken = why
        return HostConnectionLost(f"{self.node}: {why}")

    def _read_reply(self, op: Op, seq: int) -> tuple[bytes, list[int]]:
        sock = self.sock
        if sock is None:
            raise DeviceError(f"{self.node}: device is closed")
        try:
            header, body, fds = recv_message(sock)
        except (ConnectionClosed, ConnectionResetError):
            raise self._fail(_HOST_GONE) from None
        except socket.timeout:
            raise self._fail(f"no answer from the apir host within {sock.gettimeout():g} s") from None
        except (WireError, OSError) as exc:
            raise self._fail(f"connection to the apir host failed: {exc}") from None
        if header.op != op or header.seq != seq:
            for fd in fds:
                os.close(fd)
            raise self._fail(f"reply {header.op}/{header.seq} to request {op}/{seq}")
        if header.err:
            for fd in fds:
                os.close(fd)
            name = _IOCTL_NAMES.get(op, op.name)
            raise IoctlError(self.node, name, header.err, os.strerror(header.err))
        return body, fds

    def _drain_pending(self) -> None:
        """Read the EXECBUFFER replies of commands that outlived execbuffer's wait."""
        while self._exec_seqs:
            self._read_reply(Op.EXECBUFFER, self._exec_seqs.pop(0))

    def _send(self, op: Op, payload: bytes) -> int:
        if self._broken is not None:
            raise HostConnectionLost(f"{self.node}: {self._broken}")
        if self.sock is None:
            raise DeviceError(f"{self.node}: device is closed")
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        try:
            send_message(self.sock, op, self._seq, payload)
        except (BrokenPipeError, ConnectionResetError):
            raise self._fail(_HOST_GONE) from None
        except OSError as exc:
            raise self._fail(f"sending to the apir host failed: {exc.strerror or exc}") from None
        return self._seq

    def _request(self, op: Op, payload: bytes) -> tuple[bytes, list[int]]:
        with self._lock:
            self._drain_pending()
            seq = self._send(op, payload)
            return self._read_reply(op, seq)

    def _call(self, op: Op, *args: int) -> tuple:
        body, _ = self._request(op, REQUEST[op].pack(*args))
        fmt = REPLY[op]
        if fmt is not None and len(body) != fmt.size:
            raise self._fail(f"{op.name} reply of {len(body)} bytes, expected {fmt.size}")
        return fmt.unpack(body) if fmt is not None else (body,)

    # --- VirtgpuDevice -------------------------------------------------------------------
    def get_param(self, param: int) -> int:
        """DRM_IOCTL_VIRTGPU_GETPARAM; 0 for a param the host does not know."""
        try:
            return self._call(Op.GETPARAM, param)[0]
        except IoctlError as exc:
            if exc.errno == errno_mod.EINVAL:
                return 0
            raise

    def get_caps(self, capset_id: int, size: int) -> bytes:
        """DRM_IOCTL_VIRTGPU_GET_CAPS, version 0: up to `size` bytes."""
        return self._call(Op.GET_CAPS, capset_id, 0, size, 0)[0]

    def context_init(self, capset_id: int, num_rings: int = 1) -> None:
        """DRM_IOCTL_VIRTGPU_CONTEXT_INIT (POLL_RINGS_MASK 0)."""
        self._call(Op.CONTEXT_INIT, capset_id, num_rings, 0)

    def create_blob(self, size: int) -> Blob:
        """RESOURCE_CREATE_BLOB (HOST3D, MAPPABLE) + MAP + mmap of the shared file at the
        returned offset. The Blob's size is the host's (rounded to 16 KiB)."""
        res_id, bo_handle, real_size = self._call(
            Op.CREATE_BLOB, VIRTGPU_BLOB_MEM_HOST3D, VIRTGPU_BLOB_FLAG_USE_MAPPABLE, size, 0
        )
        try:
            (offset,) = self._call(Op.MAP, bo_handle, 0)
            memory = map_shared(self.fd, real_size, offset)  # no descriptor per blob
        except BaseException:
            try:
                self._call(Op.GEM_CLOSE, bo_handle, 0)
            except DeviceError:
                pass
            raise
        blob = Blob(res_id=res_id, bo_handle=bo_handle, size=real_size, memory=memory)
        self._blobs[bo_handle] = blob
        return blob

    def destroy_blob(self, blob: Blob) -> None:
        """munmap + DRM_IOCTL_GEM_CLOSE. If a view of the mapping is still alive (numpy array,
        memoryview), the mapping stays until that view is dropped (a warning is logged); the
        host frees the blob either way. Destroying twice is a no-op."""
        if self._blobs.pop(blob.bo_handle, None) is None:
            return
        try:
            blob.memory.close()
        except BufferError:
            log.warning(
                "%s: blob %d destroyed while a view of its memory is alive; unmapped when the view goes",
                self.node,
                blob.res_id,
            )
        self._call(Op.GEM_CLOSE, blob.bo_handle, 0)

    def execbuffer(self, payload, ring_idx: int = 0) -> None:
        """DRM_IOCTL_VIRTGPU_EXECBUFFER; returns when the host has run the command or after
        `exec_wait_s` (the reply notification word says which)."""
        command = bytes(payload)
        header = REQUEST[Op.EXECBUFFER].pack(VIRTGPU_EXECBUF_RING_IDX, len(command), ring_idx, 0)
        with self._lock:
            self._drain_pending()
            seq = self._send(Op.EXECBUFFER, header + command)
            if self._readable(self.exec_wait_s):
                self._read_reply(Op.EXECBUFFER, seq)
            else:
                self._exec_seqs.append(seq)

    def execbuffer_nowait(self, payload, ring_idx: int = 0) -> None:
        """DRM_IOCTL_VIRTGPU_EXECBUFFER that returns once the command is sent, for a caller
        with work of its own before it waits on the reply word (apir.guest.remote's
        `meanwhile`); the host's EXECBUFFER reply is read by the next request or `watch`."""
        command = bytes(payload)
        header = REQUEST[Op.EXECBUFFER].pack(VIRTGPU_EXECBUF_RING_IDX, len(command), ring_idx, 0)
        with self._lock:
            self._drain_pending()
            self._exec_seqs.append(self._send(Op.EXECBUFFER, header + command))

    def _readable(self, timeout_s: float) -> bool:
        """Whether the socket has data or a hang-up within `timeout_s` (poll: no FD_SETSIZE
        limit, unlike select, in a process with many descriptors)."""
        try:
            return bool(self._poller.poll(max(0.0, timeout_s) * 1000.0))
        except OSError:
            return True  # let the read report it

    def watch(self, timeout_s: float) -> None:
        """Waits up to `timeout_s` for the host's side of the socket, for a caller waiting on
        a reply notification word (apir.guest.remote): returns early when something arrived
        (a late EXECBUFFER reply, read here), raises `HostConnectionLost` at once when the
        host closed the connection, exited or was killed. Waits under 1 ms sleep and then
        poll without blocking (poll's unit is the millisecond)."""
        with self._lock:
            if self._broken is not None:
                raise HostConnectionLost(f"{self.node}: {self._broken}")
            if self.sock is None:
                raise DeviceError(f"{self.node}: device is closed")
            if timeout_s < 1e-3:
                time.sleep(max(0.0, timeout_s))
                timeout_s = 0.0
            if not self._readable(timeout_s):
                return
            if self._exec_seqs:
                self._drain_pending()  # the late reply, or HostConnectionLost on EOF
                return
            # nothing is owed to us: only a hang-up (EOF) or a host breaking the wire
            try:
                data = self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                raise self._fail(f"connection to the apir host failed: {exc}") from None
            if not data:
                raise self._fail(_HOST_GONE)
            raise self._fail("the apir host sent a message nobody asked for")

    # --- debug and teardown --------------------------------------------------------------
    @property
    def blobs(self) -> dict[int, Blob]:
        """The live blobs this device created and has not destroyed, by res_id (a snapshot)."""
        return {blob.res_id: blob for blob in list(self._blobs.values())}

    def stats(self) -> dict:
        """The host's STAT: this connection's counts of contexts, blobs, blob bytes, shared
        file bytes and ggml buffers (-1 when the host cannot count them); counts over every
        connection when the host serves with `stat_host_wide` (--stat-host-wide)."""
        return host_stats_from_tuple(self._call(Op.STAT))

    def close(self) -> None:
        """Unmap every blob and disconnect; the host then closes the context and frees it all."""
        with self._lock:
            for blob in list(self._blobs.values()):
                try:
                    blob.memory.close()
                except BufferError:
                    log.warning("%s: blob %d still referenced at close", self.node, blob.res_id)
            self._blobs.clear()
            if self.sock is not None:
                self.sock.close()
                self.sock = None
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1

    def __enter__(self) -> "LocalDevice":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def host_stats_from_tuple(values: tuple) -> dict:
    keys = ("contexts", "blobs", "blob_bytes", "file_bytes", "ggml_buffers")
    return dict(zip(keys, values))


def host_stats(path: str, timeout_s: float = 5.0) -> dict:
    """Host-wide counts from the apir host at `path`, over a short-lived connection of its own
    (which creates no context and no blob). Only a host serving with --stat-host-wide gives
    them; any other answers this connection's own counts, all 0."""
    with LocalDevice(path, connect_timeout_s=timeout_s, io_timeout_s=timeout_s) as dev:
        return dev.stats()
