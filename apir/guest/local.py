"""`LocalDevice`: the virtgpu device interface over the local transport's Unix socket.

Theory of operation: connecting to an apir host process (`apir host serve --socket PATH`) is
opening a render node: the HELLO reply brings the context's shared memory file (SCM_RIGHTS),
and every device call is one request and one reply (apir.local.wire's messages, sent and
received by apir.local.socket_io; docs/local-transport.md). `create_blob` is CREATE_BLOB + MAP
+ ``mmap(fd, size, offset)``, as a DRM guest maps a blob: no bulk data crosses the socket.

`execbuffer` waits up to `exec_wait_s` for the host's EXECBUFFER reply, sent once the command
has run, so the notification word is then set and a host that dies mid-call is
`HostConnectionLost` at once, not a timeout. A longer command is left to the caller's wait on
the word (apir.guest.remote), which calls `watch` between looks: it polls the socket, so a host
that dies later is still seen at once and a late reply is read when it comes. Every other
socket read is bounded by `io_timeout_s`: the guest never hangs.

From the first EXECBUFFER on, a command that fits goes through the exec ring (Op.RING;
apir.local.exec_ring) with no message while the host polls (a KICK when it does not), and
execbuffer waits on the ring's `done` word, spinning and then sleeping in `watch`. A host
without the ring (ENOSYS), a longer command or `exec_ring=False` keeps the EXECBUFFER message.
"""

from __future__ import annotations

import errno as errno_mod
import logging
import mmap
import os
import select
import socket
import threading
import time
from typing import Optional

from apir.codec.atomics import spins_for
from apir.local.wire import (
    HELLO_MAGIC,
    MAX_RING_COMMAND,
    REPLY,
    RING_SIZE,
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
from apir.local.exec_ring import ExecRing
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
    Op.RING: "RING",
    Op.KICK: IoctlName.EXECBUFFER,
}
# An EXECBUFFER through the exec ring spins this long (at most) on its `done` word, then waits
# on the socket in growing sleeps (a host that dies is seen there; a long one ends at the wake
# request's reply, see `watch`).
_RING_SPIN_S = 500e-6
_RING_SLEEP_MIN_S = 10e-6
_RING_SLEEP_MAX_S = 50e-3
# `watch` asks for a wake (a KICK) when told to wait this long or longer for a ring command: a
# wait that has lasted about as long already, where a message costs little next to it.
_WAKE_REQUEST_MIN_S = 1e-3
# A connect that finds the host's listen backlog full is tried again this often (see _connect).
_CONNECT_RETRY_S = 5e-3


def _connect(sock: socket.socket, path: str, timeout_s: float) -> None:
    """`sock.connect(path)`, waiting up to `timeout_s` while the host's listen backlog is full
    (guests connecting faster than the host accepts them, or a host out of descriptors for a
    moment): a Unix socket with a timeout, non-blocking underneath, gets EAGAIN there at once,
    where a blocking connect waits for the host to accept. BlockingIOError once `timeout_s`
    has passed; any other OSError at once (nothing listens there: ENOENT, ECONNREFUSED)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(_CONNECT_RETRY_S)


class HostConnectionLost(DeviceError):
    """The apir host closed the connection or broke the wire (it exited, crashed or was
    killed); the context and its buffers are gone with it."""


class LocalDevice:
    """A virtgpu device served by an apir host process over the Unix socket `path`.

    `connect_timeout_s` bounds the connection and HELLO; `io_timeout_s` every later read but
    EXECBUFFER's; `exec_wait_s` how long execbuffer waits for the command to complete before
    leaving the wait to the caller; `exec_ring` whether commands go through the exec ring when
    the host offers it. Raises `DeviceError` when nothing serves `path`,
    `HostConnectionLost` when the host goes away, `IoctlError` for a refused request.
    """

    def __init__(
        self,
        path: str,
        connect_timeout_s: float = 5.0,
        io_timeout_s: float = 60.0,
        exec_wait_s: float = 2.0,
        exec_ring: bool = True,
    ):
        self.path = os.fspath(path)
        self.node = self.name = f"local:{self.path}"
        self.io_timeout_s = io_timeout_s
        self.exec_wait_s = exec_wait_s
        self._lock = threading.Lock()
        self._seq = 0
        # (op, seq) of the EXECBUFFER and KICK replies not read yet (their commands still running)
        self._exec_seqs: list[tuple[Op, int]] = []
        self._ring: Optional[ExecRing] = None  # the exec ring, when the host offers one
        self._ring_memory: Optional[mmap.mmap] = None
        self._ring_seq = 0  # the newest command posted in the ring
        self._ring_reported = 0  # the newest ring command whose errno was looked at
        self._ring_spins = 0
        self._blobs: dict[int, Blob] = {}
        self._broken: Optional[str] = None
        self.fd = -1
        self.sock: Optional[socket.socket] = None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(connect_timeout_s)
        try:
            _connect(sock, self.path, connect_timeout_s)
        except BlockingIOError:
            sock.close()
            raise DeviceError(
                f"{self.node}: the apir host accepted no connection within {connect_timeout_s:g} s "
                "(its queue of connections not accepted yet stayed full)"
            ) from None
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
                f"{self.node}: the host closed the connection before answering HELLO: either no "
                "`apir host serve` socket (a `host vhost-user` socket is for QEMU: inside its VM, "
                "use --drm) or a host at its connection limit (apir.local.max_connections, or "
                "apir.local.max_connections_per_peer for this user: see its log)"
            ) from exc
        except BaseException:
            sock.close()
            raise
        sock.settimeout(io_timeout_s)
        self._poller = select.poll()  # made once: execbuffer and watch poll on every call
        self._poller.register(sock, _POLL_EVENTS)
        self._ring_wanted = exec_ring  # asked for at the first EXECBUFFER

    def _open_ring(self) -> Optional[ExecRing]:
        """RING, and the mapping of the page it names (apir.local.exec_ring), once: at the
        first EXECBUFFER (a connection that runs no command, such as `host_stats`'s, costs the
        host no page). A host that predates the exec ring answers ENOSYS (or one whose context
        is at its memory limit ENOMEM), and EXECBUFFERs then go as messages."""
        with self._lock:
            if not self._ring_wanted:
                return self._ring
            self._ring_wanted = False
            self._drain_pending()
            try:
                body, _ = self._read_reply(Op.RING, self._send(Op.RING, b""))
            except IoctlError as exc:  # ENOSYS: a host from before the ring; ENOMEM: a full file
                log.info("%s: no exec ring (%s); EXECBUFFERs go over the socket", self.node, exc)
                return None
            fmt = fixed_reply(Op.RING)
            if len(body) != fmt.size:
                raise self._fail(f"RING reply of {len(body)} bytes, expected {fmt.size}")
            offset, size, _pad = fmt.unpack(body)
            if size < RING_SIZE:
                raise self._fail(f"an exec ring of {size} bytes, expected {RING_SIZE}")
            self._ring_memory = self._map(offset, RING_SIZE, "the exec ring")  # (the page it uses)
            self._ring = ExecRing(self._ring_memory)
            self._ring_spins = spins_for(_RING_SPIN_S)
            return self._ring

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
        if header.op != op or header.seq != seq or header.err or op != Op.HELLO:
            for fd in fds:  # only HELLO's reply carries one (the shared file): a host's others go
                os.close(fd)
            fds = []
        if header.op != op or header.seq != seq:
            raise self._fail(f"reply {header.op}/{header.seq} to request {op}/{seq}")
        if header.err:
            name = _IOCTL_NAMES.get(op, op.name)
            raise IoctlError(self.node, name, header.err, os.strerror(header.err))
        return body, fds

    def _drain_pending(self, kicks_later: bool = False) -> None:
        """Read the EXECBUFFER replies of commands that outlived execbuffer's wait. With
        `kicks_later`, when only KICK replies are owed and none has arrived, they stay owed
        (read by the next request or `watch`): a KICK carries no command, so nothing posted
        next can overtake it, and a host stopped before it answered a wake request must not
        keep the next ring command from being posted."""
        while self._exec_seqs:
            if kicks_later and all(op == Op.KICK for op, _ in self._exec_seqs) and not self._readable(0.0):
                return
            self._read_reply(*self._exec_seqs.pop(0))

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
            memory = self._map(offset, real_size, f"blob {res_id}")
        except BaseException:
            try:
                self._call(Op.GEM_CLOSE, bo_handle, 0)
            except DeviceError:
                pass
            raise
        blob = Blob(res_id=res_id, bo_handle=bo_handle, size=real_size, memory=memory)
        self._blobs[bo_handle] = blob
        return blob

    def _map(self, offset: int, size: int, what: str) -> mmap.mmap:
        """`size` bytes of the shared file at `offset`, mapped (no descriptor per mapping). A
        range past the file's end, as a broken host may name, would map and then fault
        (SIGBUS, the whole process gone) at the first access: HostConnectionLost instead;
        DeviceError when mmap fails."""
        try:
            file_size = os.fstat(self.fd).st_size
            if offset + size > file_size:
                raise self._fail(f"{what} at offset {offset} ({size} bytes), past the {file_size}-byte shared file")
            return map_shared(self.fd, size, offset)
        except (OSError, ValueError) as exc:
            raise DeviceError(f"{self.node}: mapping {what} failed: {exc}") from None

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
        `exec_wait_s` (the reply notification word says which). Through the exec ring when
        the host offers one, the command fits and the ring's previous command is done, else
        as an EXECBUFFER message. IoctlError for a command the host refused."""
        if self._through_ring(payload, ring_idx, self.exec_wait_s):
            return
        command = bytes(payload)
        header = REQUEST[Op.EXECBUFFER].pack(VIRTGPU_EXECBUF_RING_IDX, len(command), ring_idx, 0)
        with self._lock:
            self._drain_pending()
            seq = self._send(Op.EXECBUFFER, header + command)
            if self._readable(self.exec_wait_s):
                self._read_reply(Op.EXECBUFFER, seq)
            else:
                self._exec_seqs.append((Op.EXECBUFFER, seq))

    def execbuffer_nowait(self, payload, ring_idx: int = 0) -> None:
        """DRM_IOCTL_VIRTGPU_EXECBUFFER that returns once the command is posted or sent, for
        a caller with work of its own before it waits on the reply word (apir.guest.remote's
        `meanwhile`); the host's EXECBUFFER reply (or a refusal through the ring) is read by
        the next request or `watch`."""
        if self._through_ring(payload, ring_idx, 0.0):
            return
        command = bytes(payload)
        header = REQUEST[Op.EXECBUFFER].pack(VIRTGPU_EXECBUF_RING_IDX, len(command), ring_idx, 0)
        with self._lock:
            self._drain_pending()
            self._exec_seqs.append((Op.EXECBUFFER, self._send(Op.EXECBUFFER, header + command)))

    def _through_ring(self, payload, ring_idx: int, wait_s: float) -> bool:
        """`_ring_execbuffer` when the host offers the exec ring (asked for on first use) and
        the command fits it; False, with nothing sent, otherwise."""
        ring = self._ring if not self._ring_wanted else self._open_ring()
        return (
            ring is not None
            and len(payload) <= MAX_RING_COMMAND
            and self._ring_execbuffer(ring, payload, ring_idx, wait_s)
        )

    def _ring_execbuffer(self, ring: ExecRing, payload, ring_idx: int, wait_s: float) -> bool:
        """Posts the command in the exec ring (and KICKs a host that is not polling it), then
        waits for it up to `wait_s`: a spin on the ring's `done` word, then `watch` in growing
        sleeps. False, with nothing sent, when the ring's previous command is not done yet
        (the caller sends this one as a message: the host runs what the ring holds before any
        request, so the order holds)."""
        with self._lock:
            if self._broken is not None:
                raise HostConnectionLost(f"{self.node}: {self._broken}")
            self._drain_pending(kicks_later=True)
            previous = self._ring_seq
            if previous != self._ring_reported and ring.done.load_acquire() != previous:
                return False  # (a command waited for to the end needs no look)
            seq = previous % 0xFFFFFFFF + 1  # 1 .. 2**32-1: 0 is "none yet"
            polling = ring.post(VIRTGPU_EXECBUF_RING_IDX, ring_idx, payload, seq)
            self._ring_seq = seq
            if not polling:
                self._exec_seqs.append((Op.KICK, self._send(Op.KICK, b"")))
        if wait_s <= 0:
            return True
        deadline = time.monotonic() + wait_s
        spins = self._ring_spins if wait_s >= _RING_SPIN_S else spins_for(wait_s)
        done = ring.done.spin_while_equal(previous, spins)
        sleep_s = _RING_SLEEP_MIN_S
        while done != seq:
            left = deadline - time.monotonic()
            if left <= 0:
                return True  # still running: the caller's wait on the reply word goes on
            self.watch(min(sleep_s, left))  # HostConnectionLost when the host is gone
            sleep_s = min(sleep_s * 2, _RING_SLEEP_MAX_S)
            done = ring.done.load_acquire()
        self._raise_ring_error(seq)
        return True

    def _raise_ring_error(self, seq: int) -> None:
        """IoctlError when the host refused ring command `seq`, which is done (the host stores
        `err` before `done`); either way its errno counts as looked at."""
        self._ring_reported = seq
        ring = self._ring
        err = ring.err.load_acquire() if ring is not None else 0
        del ring  # a kept traceback must not pin the page's mapping
        if err:
            raise IoctlError(self.node, IoctlName.EXECBUFFER, err, os.strerror(err))

    def _readable(self, timeout_s: float) -> bool:
        """Whether the socket has data or a hang-up within `timeout_s` (poll: no FD_SETSIZE
        limit, unlike select, in a process with many descriptors)."""
        try:
            return bool(self._poller.poll(max(0.0, timeout_s) * 1000.0))
        except OSError:
            return True  # let the read report it

    # watch returns once the host has run what was posted or sent (see watch)
    watch_wakes = True

    def watch(self, timeout_s: float) -> None:
        """Waits up to `timeout_s` for the host's side of the socket, for a caller waiting on
        a reply notification word (apir.guest.remote): returns early when something arrived
        (a late EXECBUFFER or KICK reply, read here), raises `HostConnectionLost` at once when
        the host closed the connection, exited or was killed. Waits under 1 ms sleep and then
        poll without blocking (poll's unit is the millisecond).

        A wait of `_WAKE_REQUEST_MIN_S` or more for an exec ring command the host is running
        (nothing else owed: a host not polling the ring was kicked already) first sends a KICK:
        the host answers it once the ring's command has run (local_server reads its socket
        between commands), so the wait ends there, where a host busy on a long graph would
        otherwise be looked at every millisecond until it ends."""
        with self._lock:
            if self._broken is not None:
                raise HostConnectionLost(f"{self.node}: {self._broken}")
            if self.sock is None:
                raise DeviceError(f"{self.node}: device is closed")
            # a ring command refused after execbuffer's wait (no local: a kept traceback must
            # not pin the page's mapping)
            if (
                self._ring is not None
                and self._ring_seq != self._ring_reported
                and self._ring.done.load_acquire() == self._ring_seq
            ):
                self._raise_ring_error(self._ring_seq)
            if timeout_s < 1e-3:
                time.sleep(max(0.0, timeout_s))
                timeout_s = 0.0
            elif (
                timeout_s >= _WAKE_REQUEST_MIN_S
                and not self._exec_seqs
                and self._ring is not None
                and self._ring.done.load_acquire() != self._ring_seq
            ):
                self._exec_seqs.append((Op.KICK, self._send(Op.KICK, b"")))
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
            self._ring = None  # its views of the page, before the page is unmapped
            if self._ring_memory is not None:
                try:
                    self._ring_memory.close()
                except BufferError:  # a view of the page is still alive (a kept traceback?)
                    log.warning("%s: the exec ring is still referenced at close; unmapped later", self.node)
                self._ring_memory = None
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
