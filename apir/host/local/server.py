"""The local host: a Unix-socket server playing the virtio-gpu kernel driver and the hypervisor.

Theory of operation: each accepted connection is one guest's opened render node and, after
CONTEXT_INIT, one APIR context (`apir.host.component.context.HostContext`). A thread per
connection reads requests (apir.local.wire), answers each with one reply, and owns the context's
shared memory file (apir.host.local.memfile) through a KernelContext (apir.host.local.kernel),
which plays the driver for that guest: CREATE_BLOB places a blob in the file and registers it
with the context as a resource; EXECBUFFER runs the command with `HostContext.submit` and then
replies, so a guest waiting on the socket learns both completion and, through EOF, the host's
death. When the connection ends for any reason, the context is closed and its blobs freed.

Every guest byte is hostile: a bad request gets an errno reply, one the stream cannot survive
closes the connection, and nothing a guest sends raises out of its connection thread. What
guests can make the host hold is bounded (apir.host.config), and a guest that hangs up while
its graph computes cancels the compute (apir.host.local.hangup). After each reply a connection
thread polls its socket, or its exec ring (apir.local.exec_ring), for a short while before it
blocks, while that pays. docs/local-transport.md gives the wire, each op's rules, the bounds,
the exec ring and the polling rules, with why.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import select
import socket
import stat
import threading
import time
from typing import Callable, Hashable, Optional

from apir.codec.atomics import spins_for
from apir.local.wire import (
    HELLO_MAGIC,
    MAX_GET_CAPS,
    MAX_RING_COMMAND,
    REQUEST,
    RING_SIZE,
    WIRE_VERSION,
    ConnectionClosed,
    DeadlineExceeded,
    Op,
    WireError,
    fixed_reply,
)
from apir.codec.virtgpu import BLOB_ALIGNMENT
from apir.host.backend.budget import physical_memory
from apir.host.config import (
    CONFIG_KEY_HELLO_TIMEOUT,
    CONFIG_KEY_LOCAL_SPIN,
    CONFIG_KEY_MAX_CONNECTIONS,
    CONFIG_KEY_MAX_CONNECTIONS_PER_PEER,
    CONFIG_KEY_MAX_CONTEXT_BYTES,
    CONFIG_KEY_MAX_HOST_BYTES,
    CONFIG_KEY_MAX_PEER_BYTES,
    CONFIG_KEY_MESSAGE_TIMEOUT,
    CONFIG_KEY_PEER,
    DEFAULT_HELLO_TIMEOUT_S,
    DEFAULT_LOCAL_SPIN_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS_PER_PEER,
    DEFAULT_MAX_CONTEXT_BYTES,
    DEFAULT_MESSAGE_TIMEOUT_S,
    HOST_BYTES_SHARE,
    PEER_BYTES_SHARE,
    config_limit,
)
from apir.host.local.hangup import HangupWatch
from apir.host.local.peers import PeerLimits, PeerShare, peer_uid
from apir.host.component.seams import ContextFactory
from apir.host.local.kernel import KernelContext, KernelError, default_context_factory
from apir.host.local.memfile import HostBlob
from apir.local.exec_ring import ExecRing
from apir.local.socket_io import recv_message, send_message
from apir.local.spin_policy import spinning_pays

__all__ = ["LocalServer", "ServerStats", "DEFAULT_SOCKET_MODE"]

log = logging.getLogger(__name__)

_ACCEPT_BACKOFF_MIN_S = 0.01
_ACCEPT_BACKOFF_MAX_S = 1.0
_REFUSAL_LOG_INTERVAL_S = 5.0
DEFAULT_SOCKET_MODE = 0o600  # the socket file: only its owner's processes may connect


class ServerStats:
    """Counts of the STAT reply, over one connection or the whole host: contexts, blobs, blob
    bytes, file bytes, ggml buffers (-1 when a HostContext cannot count them)."""

    __slots__ = ("contexts", "blobs", "blob_bytes", "file_bytes", "ggml_buffers")

    def __init__(self, contexts=0, blobs=0, blob_bytes=0, file_bytes=0, ggml_buffers=0):
        self.contexts = contexts
        self.blobs = blobs
        self.blob_bytes = blob_bytes
        self.file_bytes = file_bytes
        self.ggml_buffers = ggml_buffers

    def as_tuple(self) -> tuple[int, int, int, int, int]:
        return (self.contexts, self.blobs, self.blob_bytes, self.file_bytes, self.ggml_buffers)

    def __repr__(self) -> str:
        return "ServerStats(" + ", ".join(f"{k}={getattr(self, k)}" for k in self.__slots__) + ")"


# While it polls the exec ring, a connection thread looks at its socket this often (a request
# there waits at most this long; each look is a system call).
_RING_SLICE_S = 20e-6
# Each message's op by its number: a dict lookup, where `Op(n)` is a Python-level call
_OPS = {int(op): op for op in Op}

# Longer spins never pay: a guest that takes this long to send its next request is not in a loop of
# small calls.
MAX_LOCAL_SPIN_S = 0.01


class _Connection:
    """One guest: its socket, its peer (apir.host.local.peers) and its KernelContext (created
    on a valid HELLO)."""

    def __init__(self, server: "LocalServer", sock: socket.socket, conn_id: int, peer: Hashable):
        self.server = server
        self.sock = sock
        self.conn_id = conn_id
        self.peer = peer
        self.accepted = time.monotonic()  # the HELLO deadline runs from here
        self.kernel: Optional[KernelContext] = None
        # the exec ring, once the guest asked for it (Op.RING): its page, its views, and the
        # sequence number of the newest command taken from it
        self.ring_blob: Optional[HostBlob] = None
        self.ring: Optional[ExecRing] = None
        self.ring_seq = 0
        self.thread = threading.Thread(target=self.run, name=f"apir-local-{conn_id}", daemon=True)

    def run(self) -> None:
        try:
            self._serve()
        except (ConnectionClosed, ConnectionResetError):
            # (a reset: the guest closed with a reply still unread, as after a KICK or an
            # EXECBUFFER it did not wait for; an ordinary end)
            log.info("guest %d disconnected", self.conn_id)
        except DeadlineExceeded as exc:
            log.info("guest %d: connection dropped: %s", self.conn_id, exc)
        except (WireError, OSError) as exc:
            log.warning("guest %d: connection dropped: %s", self.conn_id, exc)
        except Exception:  # a host bug must not take the whole server down
            log.exception("guest %d: internal error; dropping the connection", self.conn_id)
        finally:
            self.cleanup()

    def _serve(self) -> None:
        srv = self.server
        # deadlines, not timeouts per read: a peer trickling bytes must not hold the slot
        hello_timeout_s, rest_s = srv.hello_timeout_s, srv.message_timeout_s or None
        self.sock.setblocking(True)
        hello_deadline = self.accepted + hello_timeout_s if hello_timeout_s else None
        header, payload, fds = recv_message(self.sock, deadline=hello_deadline, rest_s=rest_s)
        _close_fds(fds)  # a guest has no business sending fds
        if header.op != Op.HELLO or len(payload) != REQUEST[Op.HELLO].size:
            raise WireError(f"expected HELLO, got op {header.op} with {len(payload)} bytes")
        magic, version = REQUEST[Op.HELLO].unpack(payload)
        if magic != HELLO_MAGIC or version != WIRE_VERSION:
            send_message(self.sock, Op.HELLO, header.seq, err=errno.EPROTONOSUPPORT, timeout_s=rest_s)
            raise WireError(f"bad HELLO (magic {magic:#x}, wire version {version})")
        try:
            kernel = self._set_up()
        except KernelError as exc:  # the host is out of something: this guest's error only
            log.warning("guest %d: refused (%s): %s", self.conn_id, errno.errorcode.get(exc.err, exc.err), exc)
            send_message(self.sock, Op.HELLO, header.seq, err=exc.err, timeout_s=rest_s)
            return
        reply = fixed_reply(Op.HELLO).pack(HELLO_MAGIC, WIRE_VERSION, BLOB_ALIGNMENT, 0)
        send_message(self.sock, Op.HELLO, header.seq, reply, fds=(kernel.memfile.fd,), timeout_s=rest_s)
        log.info("guest %d connected", self.conn_id)

        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        while True:
            if self.ring is not None:
                self._poll_ring(kernel, poller)
            else:
                self._poll_for_request(poller)
            header, payload, fds = recv_message(self.sock, rest_s=rest_s)
            _close_fds(fds)
            if self.ring is not None:
                self._run_ring(kernel)  # posted before this request was sent: runs first
            try:
                body, err = self._handle(kernel, header.op, payload), 0
            except KernelError as exc:
                log.info(
                    "guest %d: %s refused (%s): %s",
                    self.conn_id,
                    _op_name(header.op),
                    errno.errorcode.get(exc.err, exc.err),
                    exc,
                )
                body, err = b"", exc.err
            send_message(self.sock, header.op, header.seq, body, err=err, timeout_s=rest_s)

    def _set_up(self) -> KernelContext:
        """The guest's KernelContext, its socket watched for a hang-up (which cancels a compute
        in flight). KernelError with the errno when the host cannot (no descriptor for the
        shared memory file, no memory, no thread for the watch)."""
        srv = self.server
        config = dict(srv.config or {})
        config[CONFIG_KEY_PEER] = f"uid:{self.peer}"  # whose context: for bounds per peer
        try:
            self.kernel = KernelContext(
                f"guest-{self.conn_id}",
                config,
                srv.context_factory,
                srv.max_context_bytes,
                share=PeerShare(srv.limits, self.peer),
            )
            srv.hangups.watch(self.sock.fileno(), self)
        except OSError as exc:
            raise KernelError(exc.errno or errno.ENOMEM, f"setting up the connection: {exc}") from None
        except MemoryError:
            raise KernelError(errno.ENOMEM, "setting up the connection: out of memory") from None
        except RuntimeError as exc:  # threading: "can't start new thread"
            raise KernelError(errno.EAGAIN, f"setting up the connection: {exc}") from None
        return self.kernel

    def _poll_for_request(self, poller: select.poll) -> None:
        """Polls the socket (`poller`) for up to the server's `spin_s` while spinning pays
        (apir.local.spin_policy), so a request that comes soon is read without a wake-up:
        blocked in recv, this thread is woken tens of microseconds late on an idle virtual
        machine, more than the rest of a small call's round trip. Returns at the first
        readable event (a request, EOF or an error), or at the deadline; at once while another
        guest is connected (its thread would wait for this one's GIL)."""
        spin_s = self.server.spin_s
        if spin_s <= 0 or len(self.server._conns) > 1 or not spinning_pays():
            return
        end = time.perf_counter() + spin_s
        while not poller.poll(0) and time.perf_counter() < end:
            pass

    def _poll_ring(self, k: KernelContext, poller: select.poll) -> None:
        """Runs the commands posted in the exec ring, polling it (and, every _RING_SLICE_S,
        the socket) for up to `spin_s` after the last one, while spinning pays as for
        `_poll_for_request`; returns when the socket is readable or the spin ends, having
        stored `polling` 0: from then on the guest kicks. A command posted before that store
        is run here (the fenced store-then-load: see apir.local.exec_ring)."""
        ring = self.ring
        assert ring is not None
        spin_s, conns = self.server.spin_s, self.server._conns
        if spin_s > 0 and len(conns) == 1 and spinning_pays():
            ring.polling.store_release(1)
            slice_spins = spins_for(_RING_SLICE_S)
            clock = time.perf_counter
            end, look = clock() + spin_s, clock() + _RING_SLICE_S
            while True:
                seq = ring.posted.spin_while_equal(self.ring_seq, slice_spins)
                if seq != self.ring_seq:
                    self._run_ring(k, seq)
                    end = clock() + spin_s
                    if clock() < look:
                        continue
                # every slice, even while commands keep coming (a guest rewriting `posted`
                # in a loop): the socket (a request, a hang-up) and the other guests
                if poller.poll(0) or clock() >= end or len(conns) > 1:
                    break  # a request, the spin's end, or another guest (who needs the GIL)
                look = clock() + _RING_SLICE_S
        # Once: a command posted after this load finds `polling` 0 and is kicked (a loop
        # here would never end while the guest rewrites `posted`).
        if ring.polling.store_then_load(0, ring.posted) != self.ring_seq:
            self._run_ring(k)

    def _run_ring(self, k: KernelContext, seq: Optional[int] = None) -> None:
        """Runs the exec ring's posted command (`seq`: `posted` as just loaded, else loaded
        here), if it is a new one, as an EXECBUFFER message's (the same checks and errno), and
        publishes it as done."""
        ring = self.ring
        assert ring is not None
        if seq is None:
            seq = ring.posted.load_acquire()
        if seq == self.ring_seq:
            return
        self.ring_seq = seq
        flags, ring_idx, size, command = ring.take()
        err = 0
        try:
            if size > MAX_RING_COMMAND:
                raise KernelError(errno.EINVAL, f"exec ring command of {size} bytes")
            k.execbuffer(flags, ring_idx, command)
        except KernelError as exc:
            log.info(
                "guest %d: exec ring command %d refused (%s): %s",
                self.conn_id,
                seq,
                errno.errorcode.get(exc.err, exc.err),
                exc,
            )
            err = exc.err
        ring.finish(seq, err)

    def _open_ring(self, k: KernelContext) -> bytes:
        """Op.RING: a page of the connection's shared memory file for the exec ring (no
        resource: commands cannot name it); its offset and size. EEXIST for a second one,
        ENOMEM past the context's limit."""
        if self.ring_blob is not None:
            raise KernelError(errno.EEXIST, "the exec ring exists already")
        blob = k.allocate(RING_SIZE)
        self.ring_blob, self.ring, self.ring_seq = blob, ExecRing(blob.memory), 0
        return fixed_reply(Op.RING).pack(blob.offset, blob.size, 0)

    def _handle(self, k: KernelContext, wire_op: int, payload: bytes) -> bytes:
        """The reply payload of one request to kernel context `k`; KernelError for an errno
        reply."""
        op = _OPS.get(wire_op)
        if op is None:
            raise KernelError(errno.ENOSYS, f"unknown op {wire_op}")
        fmt = REQUEST[op]
        if op == Op.HELLO:
            raise KernelError(errno.EINVAL, "HELLO twice")
        size = fmt.size
        if len(payload) < size or (op != Op.EXECBUFFER and len(payload) != size):
            raise KernelError(errno.EINVAL, f"payload of {len(payload)} bytes, expected {size}")
        args = fmt.unpack_from(payload)
        if op == Op.EXECBUFFER:
            flags, cmd_size, ring_idx, _pad = args
            command = memoryview(payload)[size:]
            if cmd_size != len(command):
                raise KernelError(errno.EINVAL, f"command size {cmd_size}, {len(command)} bytes sent")
            k.execbuffer(flags, ring_idx, command)
            return b""
        if op == Op.GETPARAM:
            return fixed_reply(op).pack(k.get_param(args[0]))
        if op == Op.GET_CAPS:
            capset_id, capset_ver, caps_size, _pad = args
            return k.get_caps(capset_id, capset_ver, min(caps_size, MAX_GET_CAPS))
        if op == Op.CONTEXT_INIT:
            capset_id, num_rings, _poll_rings_mask = args
            k.context_init(capset_id, num_rings)
            return b""
        if op == Op.CREATE_BLOB:
            res_id, bo_handle, blob = k.create_blob(*args)
            return fixed_reply(op).pack(res_id, bo_handle, blob.size)
        if op == Op.MAP:
            return fixed_reply(op).pack(k.map(args[0]))
        if op == Op.GEM_CLOSE:
            k.gem_close(args[0])
            return b""
        if op == Op.RING:
            return self._open_ring(k)
        if op == Op.KICK:
            if self.ring is None:
                raise KernelError(errno.EINVAL, "KICK without an exec ring")
            return b""  # what was posted ran before this request (see _serve)
        if op == Op.STAT:
            srv = self.server
            st = srv.stats() if srv.stat_host_wide else _kernel_stats(ServerStats(), k)
            return fixed_reply(op).pack(*st.as_tuple())
        raise KernelError(errno.ENOSYS, f"unhandled op {op}")

    def on_hangup(self) -> None:
        """The guest hung up (apir.host.local.hangup, another thread): stop its compute in
        flight; this connection's thread then sees EOF and closes the context as usual."""
        kernel = self.kernel
        if kernel is not None:
            log.info("guest %d hung up: its compute, if any, is cancelled", self.conn_id)
            kernel.cancel_compute("the guest hung up")

    def cleanup(self) -> None:
        """Close the context and free its blobs; runs once, when the connection ends."""
        self.server.hangups.forget(self.sock.fileno())
        self.ring = None  # its views of the page: the page's mapping is closed with the file
        try:
            if self.kernel is not None:
                self.kernel.close()
        except Exception:
            log.exception("guest %d: cleanup failed", self.conn_id)
        finally:
            try:
                self.sock.close()
            except OSError:
                pass
            self.server._forget(self)
            log.debug("guest %d: context and blobs freed", self.conn_id)


class _RateLimitedLog:
    """Logs at most one line per `interval_s` (a flood of refused connections, or accept failing
    over and over, must not flood the log), saying how many were left out."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._next = 0.0
        self._skipped = 0

    def log(self, level: int, msg: str, *args) -> None:
        now = time.monotonic()
        if now < self._next:
            self._skipped += 1
            return
        if self._skipped:
            msg += f" ({self._skipped} more like it not logged)"
            self._skipped = 0
        self._next = now + self.interval_s
        log.log(level, msg, *args)


def _kernel_stats(st: ServerStats, k: Optional[KernelContext]) -> ServerStats:
    """Adds one connection's counts to `st` (nothing for a closed or not yet HELLOed one)."""
    if k is None or k.closed:
        return st
    if k.ctx is not None:
        st.contexts += 1
        n = k.ggml_buffers
        st.ggml_buffers = -1 if n is None or st.ggml_buffers < 0 else st.ggml_buffers + n
    blobs = list(k.blobs.values())  # the guest's blobs (not the exec ring's page), a snapshot
    st.blobs += len(blobs)
    st.blob_bytes += sum(blob.size for _, blob in blobs)
    st.file_bytes += k.memfile.file_size
    return st


def _op_name(op: int) -> str:
    try:
        return Op(op).name
    except ValueError:
        return f"op {op}"


def _close_fds(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class LocalServer:
    """Serves guests on a Unix socket at `path`, one HostContext per connection.

    `config` is the HostContext configuration (the C keys: ``ggml.library.path``,
    ``ggml.library.reg``, ...); it also holds the server's own bounds, ``apir.local.*``
    (apir.host.config: connections and shared memory per peer and in all, the HELLO and
    message deadlines). `context_factory(ctx_id, capset_id, config)` builds a context (default:
    `apir.host.component.context.HostContext`; its config names the peer: apir.host.peer).
    `max_context_bytes` bounds one context's shared memory file (default: the configuration's
    apir.local.max_context_bytes). `peer_id(sock)`: who connected (default: the user id,
    apir.host.local.peers). `socket_mode`: the socket file's permission bits (default 0600; set after
    binding, which happens under umask 0177, so the file is never more open than asked).
    `stat_host_wide`: STAT answers with counts over every connection instead of the asking
    connection's own (off by default: they tell one guest about the others; for tests and
    debugging). Raises OSError (EADDRINUSE) if another server already listens at `path`.
    """

    def __init__(
        self,
        path: str,
        config: Optional[dict] = None,
        context_factory: ContextFactory = default_context_factory,
        max_context_bytes: Optional[int] = None,
        *,
        socket_mode: int = DEFAULT_SOCKET_MODE,
        stat_host_wide: bool = False,
        peer_id: Callable[[socket.socket], Hashable] = peer_uid,
    ):
        if not 0 <= socket_mode <= 0o777:
            raise ValueError(f"socket mode {socket_mode:#o} is not a permission mode")
        self.path = os.fspath(path)
        self.config = config
        self.context_factory = context_factory
        if max_context_bytes is None:
            max_context_bytes = int(config_limit(config, CONFIG_KEY_MAX_CONTEXT_BYTES, DEFAULT_MAX_CONTEXT_BYTES))
        self.max_context_bytes = max_context_bytes
        self.peer_id = peer_id
        memory = physical_memory() or DEFAULT_MAX_CONTEXT_BYTES
        self.max_connections = int(config_limit(config, CONFIG_KEY_MAX_CONNECTIONS, DEFAULT_MAX_CONNECTIONS))
        self.limits = PeerLimits(
            self.max_connections,
            int(config_limit(config, CONFIG_KEY_MAX_CONNECTIONS_PER_PEER, DEFAULT_MAX_CONNECTIONS_PER_PEER)),
            int(config_limit(config, CONFIG_KEY_MAX_HOST_BYTES, memory * HOST_BYTES_SHARE[0] // HOST_BYTES_SHARE[1])),
            int(config_limit(config, CONFIG_KEY_MAX_PEER_BYTES, memory * PEER_BYTES_SHARE[0] // PEER_BYTES_SHARE[1])),
        )
        self.hello_timeout_s = config_limit(config, CONFIG_KEY_HELLO_TIMEOUT, DEFAULT_HELLO_TIMEOUT_S)
        self.message_timeout_s = config_limit(config, CONFIG_KEY_MESSAGE_TIMEOUT, DEFAULT_MESSAGE_TIMEOUT_S)
        self.spin_s = min(float(config_limit(config, CONFIG_KEY_LOCAL_SPIN, DEFAULT_LOCAL_SPIN_S)), MAX_LOCAL_SPIN_S)
        self._stopping = threading.Event()  # set by close(): the accept thread's back-off ends
        self.hangups = HangupWatch()
        self._refusals = _RateLimitedLog(_REFUSAL_LOG_INTERVAL_S)
        self.socket_mode = socket_mode
        self.stat_host_wide = stat_host_wide
        self._lock = threading.Lock()
        self._conns: set[_Connection] = set()
        self._conn_ids = itertools.count(1)
        self._closed = False
        self._remove_stale_socket()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # bind() creates the file with the umask's mode: keep it closed until the chmod. The
        # umask is process-wide, so this briefly narrows other threads' new files too.
        old_umask = os.umask(0o177)
        try:
            self.sock.bind(self.path)
        finally:
            os.umask(old_umask)
        os.chmod(self.path, self.socket_mode)
        self.sock.listen(16)
        self._accept_thread: Optional[threading.Thread] = None
        log.info("serving on %s", self.path)

    def _remove_stale_socket(self) -> None:
        try:
            mode = os.stat(self.path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise FileExistsError(errno.EEXIST, "exists and is not a socket", self.path)
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(self.path)
        except OSError:
            os.unlink(self.path)  # nobody listens: a leftover of a dead server
        else:
            raise OSError(errno.EADDRINUSE, "another apir host is serving", self.path)
        finally:
            probe.close()

    # --- stats ---------------------------------------------------------------------------
    def _forget(self, conn: _Connection) -> None:
        """Drops `conn` and its slot (once, whoever calls)."""
        with self._lock:
            if conn not in self._conns:
                return
            self._conns.discard(conn)
        self.limits.leave(conn.peer)

    def stats(self) -> ServerStats:
        """Counts over the live connections (a guest's blobs vanish from it once it is gone)."""
        st = ServerStats()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            _kernel_stats(st, c.kernel)
        return st

    # --- serving -------------------------------------------------------------------------
    def serve_forever(self) -> None:
        """Accept guests until close(); each gets its own thread, within the connection bounds.

        Nothing ends the loop but close(): accept() failing (out of descriptors, EMFILE or
        ENFILE, or memory) backs off (from _ACCEPT_BACKOFF_MIN_S doubling to
        _ACCEPT_BACKOFF_MAX_S) and tries again, so guests connect again once the ones holding
        the descriptors are gone; a failure in setting up one connection is that connection's
        (closed, logged)."""
        backoff_s = _ACCEPT_BACKOFF_MIN_S
        while not self._closed:
            try:
                sock, _ = self.sock.accept()
            except Exception as exc:  # noqa: BLE001 - the listener must outlive any failure
                if self._closed:
                    return
                self._refusals.log(
                    logging.ERROR,
                    "accept failed (%s, %s): retrying in %g s",
                    errno.errorcode.get(getattr(exc, "errno", None) or 0, type(exc).__name__),
                    exc,
                    backoff_s,
                )
                if self._stopping.wait(backoff_s):
                    return
                backoff_s = min(2 * backoff_s, _ACCEPT_BACKOFF_MAX_S)
                continue
            backoff_s = _ACCEPT_BACKOFF_MIN_S
            try:
                self._admit(sock)
            except Exception as exc:  # noqa: BLE001 - one connection's failure, not the listener's
                self._refusals.log(logging.ERROR, "a new connection could not be set up: %r", exc)
                sock.close()

    def _admit(self, sock: socket.socket) -> None:
        """Serves `sock` on a thread of its own, or closes it when the server, or its peer's
        share of it, is full, or the server is closed."""
        peer = self.peer_id(sock)
        with self._lock:
            if self._closed:
                sock.close()
                return
            full = self.limits.admit(peer)
            if full is None:
                try:
                    conn = _Connection(self, sock, next(self._conn_ids), peer)
                except BaseException:
                    self.limits.leave(peer)
                    raise
                self._conns.add(conn)
        if full is not None:
            sock.close()
            self._refusals.log(
                logging.WARNING,
                "a connection of peer %s closed: %s (%s, %s)",
                peer,
                full,
                CONFIG_KEY_MAX_CONNECTIONS,
                CONFIG_KEY_MAX_CONNECTIONS_PER_PEER,
            )
            return
        try:
            conn.thread.start()
        except Exception as exc:  # noqa: BLE001 - no thread to be had: the process is out of something
            self._refusals.log(logging.ERROR, "cannot start a connection thread: %r", exc)
            sock.close()
            self._forget(conn)

    def start(self) -> "LocalServer":
        """serve_forever() in a background thread."""
        self._accept_thread = threading.Thread(target=self.serve_forever, name="apir-local-accept", daemon=True)
        self._accept_thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting, drop every guest (closing their contexts) and remove the socket."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
        self._stopping.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        for c in conns:
            if c.kernel is not None:
                c.kernel.cancel_compute("the host is closing")
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for c in conns:
            c.thread.join(timeout)
        self.hangups.close()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout)
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def __enter__(self) -> "LocalServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
