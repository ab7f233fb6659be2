"""The APIR component: one `HostContext` per guest context (virglrenderer's `apir_context`).

Theory of operation: the hypervisor creates a context for a guest (`HostContext(ctx_id,
config, capset_id=...)`), registers each blob the guest creates (`add_resource`), and hands
every EXECBUFFER payload to `submit`. A payload starts with three u32 (command type, flags,
reply resource id). The context looks the reply resource up, runs the command, writes the
reply payload 4 bytes into that resource, and then stores `return_code + 1` in its first 4
bytes: the notification word the guest polls.

    HandShake   (0)  guest major, minor -> host major, minor; returns APIR_HANDSHAKE_MAGIC.
                     The guest's version is kept so replies match it (device_get_props).
    LoadLibrary (1)  loads the backend library (see `apir.host.library`); the C codes.
    Forward     (2)  flags = backend function id; returns 4 + the function's return code,
                     or 1 (APIR_FORWARD_NO_DISPATCH_FCT) when no library is loaded. With
                     ASYNC agreed, an id with APIR_FORWARD_POSTED is posted: run, no reply;
                     the third header word is then its length, and several posted commands
                     (and one other command after them) may share a payload.

Over the Venus capset (4) the guest adds 331 to the command type; it is subtracted here.
Unlike the C component, every command gets a reply whenever a reply resource is known, a
malformed one `COMMAND_MALFORMED`, and `submit` never raises for guest input. docs/protocol.md
(sections 3-5 and 9) gives each case; docs/design.md ("Host seam") the configuration lookup.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from typing import TYPE_CHECKING, Callable, Dict, Mapping, Optional, Tuple, cast

from apir.codec.atomics import Word
from apir.codec.forward import layouts_between, reply_writers
from apir.codec.constants import (
    APIR_FORWARD_POSTED,
    APIR_HANDSHAKE_MAGIC,
    APIR_PROTOCOL_MAJOR,
    APIR_PROTOCOL_MINOR,
    APIR_PROTOCOL_VERSIONS,
    VENUS_COMMAND_TYPE_LENGTH,
    ApirBackendCommandType,
    ApirCommandType,
    ApirExtensionCommandType,
    ApirForwardReturnCode,
    ApirLoadLibraryReturnCode,
    ApirBackendInitializeReturnCode,
)
from apir.host.config import CONFIG_KEY_LOAD_LIBRARY_PATH, ENV_FALLBACKS
from apir.codec.virtgpu import VIRTGPU_DRM_CAPSET_APIR, VIRTGPU_DRM_CAPSET_VENUS
from apir.codec.wire import Decoder, Encoder
from apir.host.errors import log
from apir.host.backend.c_library import c_library_factory
from apir.host.component.seams import conforms
from apir.host.library import BackendLibrary, LibraryLoadError, PostingLibrary
from apir.host.resources import NOTIFICATION_SIZE, Resource

if TYPE_CHECKING:  # annotations only
    from typing_extensions import Buffer  # any bytes-like object (collections.abc.Buffer in 3.12)

    from apir.host.component.trace import CommandTrace

__all__ = ["HostContext", "COMMAND_MALFORMED", "NOTIFICATION_SIZE", "may_run_long"]

# The return code of a command the host could not even decode. 1 is a failure for each of
# the three commands (HandShake expects the magic, LoadLibrary 0, Forward >= 4), and is
# what the C component answers when it cannot sync its reply encoder.
COMMAND_MALFORMED = 1
_HEADER = struct.Struct("<III")  # command type, flags, reply resource id
_FORWARD = int(ApirCommandType.FORWARD)  # plain ints: no enum lookups on the hot path
_HANDSHAKE = int(ApirCommandType.HANDSHAKE)
_FORWARD_BASE = int(ApirForwardReturnCode.BASE_INDEX)
# The Forward functions whose host run time the command itself bounds: all but graph_compute,
# and of the extensions (docs/protocol.md section 12) all but the graph functions. A posted
# command (APIR_FORWARD_POSTED) is bounded as its function is.
_BOUNDED_FORWARD = frozenset(
    [int(f) for f in ApirBackendCommandType if f is not ApirBackendCommandType.BACKEND_GRAPH_COMPUTE]
    + [
        int(f)
        for f in ApirExtensionCommandType
        if f not in (ApirExtensionCommandType.GRAPH_COMPUTE_KEEP, ApirExtensionCommandType.GRAPH_RECOMPUTE)
    ]
)


def _apir_command_type(cmd_type: int, capset_id: int) -> int:
    """The APIR command type of header word `cmd_type` on capset `capset_id`: over Venus the
    guest adds VENUS_COMMAND_TYPE_LENGTH (virglrenderer's Venus-to-APIR transition)."""
    if capset_id == VIRTGPU_DRM_CAPSET_VENUS and cmd_type >= VENUS_COMMAND_TYPE_LENGTH:
        return cmd_type - VENUS_COMMAND_TYPE_LENGTH
    return cmd_type


def may_run_long(command: Buffer, capset_id: int) -> bool:
    """Whether serving the EXECBUFFER payload `command` of a context on capset `capset_id` may
    take unbounded time, read from its header only (command type u32 at byte 0, less
    VENUS_COMMAND_TYPE_LENGTH over the Venus capset, as `HostContext.submit` reads it; flags u32
    at byte 4, the backend function id of a Forward).

    False for HandShake and every Forward function but backend_graph_compute: their host run
    time is bounded by what the command names (a few bytes, a transfer of at most the blob it
    names, one buffer). True for LoadLibrary (dlopen and backend init), Forward
    backend_graph_compute (a graph may run for minutes, or hang in a broken backend), and any
    header this cannot read: shorter than 12 bytes, an unknown command type or function id.
    A caller that runs bounded commands at once and the others where they can be waited for
    with a timeout and cancelled (apir.local.embedded) thus sends whatever `submit` would
    refuse the slow way. Posted commands at the head of the payload (ASYNC: each bounded as
    its function is) are stepped over by their lengths, and the command after them decides.
    Never raises for guest bytes."""
    if type(command) is not bytes:  # (bytes, as the embedded device has it: no view needed)
        command = memoryview(command).cast("B")
    pos = 0
    while True:
        if len(command) - pos < _HEADER.size:
            return pos == 0 or pos != len(command)  # (posted commands alone: bounded)
        cmd_type, flags, length = _HEADER.unpack_from(command, pos)
        cmd_type = _apir_command_type(cmd_type, capset_id)
        if cmd_type != _FORWARD:
            return cmd_type != _HANDSHAKE
        if not flags & APIR_FORWARD_POSTED:
            return flags not in _BOUNDED_FORWARD
        if flags & ~APIR_FORWARD_POSTED not in _BOUNDED_FORWARD or length < _HEADER.size:
            return True
        pos += length


def _builtin_library() -> BackendLibrary:
    # on first use: it imports the dispatcher, the shape rules and the codec's Numba kernels
    from apir.host.backend.extensions import ExtendedLibrary

    return ExtendedLibrary()


class HostContext:
    """One guest context of the APIR component.

    `config`: the C's key/value configuration (`apir.load_library.path`, `ggml.library.path`,
    `ggml.library.reg`), falling back to the environment. `capset_id`: 10 (APIR) or 4 (Venus).
    `library_factory(path)`: opens a configured backend library (a `BackendLibrary`, or raises
    `LibraryLoadError`); the built-in Python dispatcher serves when no path is configured.
    """

    def __init__(
        self,
        ctx_id: int,
        config: Optional[Mapping[str, str]] = None,
        *,
        capset_id: int = VIRTGPU_DRM_CAPSET_APIR,
        library_factory: Callable[[str], BackendLibrary] = c_library_factory,
    ):
        if capset_id not in (VIRTGPU_DRM_CAPSET_APIR, VIRTGPU_DRM_CAPSET_VENUS):
            raise ValueError(
                f"APIR context with capset {capset_id}: expected "
                f"{VIRTGPU_DRM_CAPSET_APIR} (APIR) or {VIRTGPU_DRM_CAPSET_VENUS} (Venus)"
            )
        self.ctx_id = ctx_id
        self.capset_id = capset_id
        self.config: Dict[str, str] = dict(config or {})
        self.host_version: Tuple[int, int] = (APIR_PROTOCOL_MAJOR, APIR_PROTOCOL_MINOR)
        self.guest_version = self.host_version  # until the HandShake
        self._library_factory = library_factory
        self._library: Optional[BackendLibrary] = None
        self._resources: Dict[int, Resource] = {}
        self._last_reply_res_id: Optional[int] = None
        self._lock = threading.RLock()
        self._closed = False
        # An embedded host sets `defer_notification` to store the word itself, from its wait
        # for the next command (apir.local.embedded); `take_notification` hands it over.
        self.defer_notification = False
        self._pending_notification: Optional[Tuple[Word, int]] = None
        # Whether the commands `may_run_long` calls bounded also end in bounded time on this
        # context's backend (an embedded host runs them in the guest's thread, with no timeout
        # on the guest's side): before LoadLibrary, and on a backend whose kernels work in host
        # memory (a profile's host_addressable: ggml-cpu); not on a GPU's or ggml-rpc's, whose
        # copies wait on a device or a server that may never answer, nor on a library of
        # unknown kind.
        self.commands_bounded_in_time = True
        # An apir.host.component.trace.CommandTrace: its describe(self, command) before each command,
        # finish(record, (rc, reply_bytes) or None, host_seconds) after. None: no tracing.
        self.tracer: Optional[CommandTrace] = None

    # --- configuration and resources (hypervisor side) ------------------------------------
    def set_config(self, key: str, value: str) -> None:
        """`virgl_apir_configure_kv`: sets one configuration key of this context."""
        self.config[key] = value

    def get_config(self, key: str) -> Optional[str]:
        """The value of `key`: this context's configuration, else its environment fallback."""
        value = self.config.get(key)
        if value is None and key in ENV_FALLBACKS:
            value = os.environ.get(ENV_FALLBACKS[key])
        return value

    def add_resource(self, res_id: int, memory: Buffer) -> None:
        """Registers a blob: `memory` is any writable contiguous buffer (an mmap); its length
        is the resource's size. Raises ValueError for a duplicate id or an unusable buffer."""
        with self._lock:
            if res_id in self._resources:
                raise ValueError(f"resource {res_id} already exists in context {self.ctx_id}")
            self._resources[res_id] = Resource.wrap(res_id, memory)

    def remove_resource(self, res_id: int) -> None:
        """Forgets a blob. Buffers that wrap it (buffer_from_ptr) are freed first, so no ggml
        buffer outlives the memory it points into. Unknown ids are ignored, like the C."""
        with self._lock:
            res = self._resources.pop(res_id, None)
            if res is None:
                return
            if self._library is not None:
                self._library.forget_resource(res_id)
            if self._last_reply_res_id == res_id:
                self._last_reply_res_id = None
            res.release()

    def get_shmem(self, res_id: int) -> Optional[Resource]:
        """The blob `res_id` of this context, or None (`get_shmem_ptr`, plus the size)."""
        return self._resources.get(res_id)

    def cancel_compute(self, reason: str) -> None:
        """Stops the graph compute in flight, if any, and every later one (the guest gets
        GGML_STATUS_ABORTED): this context's guest is gone. Any thread, without the context's
        lock, which the compute holds; a C backend library's compute cannot be stopped."""
        library = self._library
        if library is not None:
            library.cancel_compute(reason)

    def buffer_count(self) -> Optional[int]:
        """The ggml buffers this context's backend library holds (0 before LoadLibrary), or
        None when the library cannot tell."""
        library = self._library
        return 0 if library is None else library.buffer_count()

    def close(self) -> None:
        """Deinitializes the backend library, freeing exactly this context's buffers, and
        drops the resources. Idempotent. A compute in flight on another thread is cancelled
        first (`cancel_compute`), so closing does not wait for the graph to finish."""
        self.cancel_compute("the context is closed")
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._library is not None:
                self._library.deinit()
                self._library = None
            for res in self._resources.values():
                res.release()
            self._resources.clear()

    def __enter__(self) -> "HostContext":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def guest_version(self) -> Tuple[int, int]:
        """(major, minor) the guest sent in HandShake; ours before."""
        return self._guest_version

    @guest_version.setter
    def guest_version(self, version: Tuple[int, int]) -> None:
        self._guest_version = version
        # what every Forward handler encodes and decodes by, looked up once per HandShake
        self.forward_layouts = layouts_between(version, self.host_version)
        self.forward_replies = reply_writers(version, self.host_version)

    # --- commands ---------------------------------------------------------------------------
    def submit(self, command: Buffer) -> None:
        """Runs one EXECBUFFER payload and writes its reply. Never raises for guest input."""
        with self._lock:
            if self._closed:
                log.error("ctx %d: command on a closed context dropped", self.ctx_id)
                return
            cmd = memoryview(command).cast("B")
            tracer = self.tracer
            record = tracer.describe(self, cmd) if tracer is not None else None
            t0 = time.perf_counter() if tracer is not None else 0.0
            result = None
            try:
                result = self._submit(cmd)
            except Exception:  # noqa: BLE001 - a host bug must not take the hypervisor down
                log.exception("ctx %d: internal error while serving a command", self.ctx_id)
            if tracer is not None and record is not None:
                tracer.finish(record, result, time.perf_counter() - t0)

    def _submit(self, cmd: memoryview) -> Optional[Tuple[int, int]]:
        """Serves one command; (return code, reply payload bytes) as sent, None when no reply
        resource could carry one."""
        if len(cmd) < _HEADER.size:
            log.error("ctx %d: truncated command header (%d bytes)", self.ctx_id, len(cmd))
            return self._reply_malformed()
        cmd_type, flags, reply_res_id = _HEADER.unpack_from(cmd, 0)
        cmd_type = _apir_command_type(cmd_type, self.capset_id)
        if cmd_type == _FORWARD and flags & APIR_FORWARD_POSTED and self._posts():
            rest = self._run_posted(cmd)
            if rest is None:
                return None  # posted commands alone: no reply
            cmd = rest
            cmd_type, flags, reply_res_id = _HEADER.unpack_from(cmd, 0)
            cmd_type = _apir_command_type(cmd_type, self.capset_id)
        reply = self._reply_resource(reply_res_id)
        if reply is None:
            return self._reply_malformed()
        if cmd_type not in ApirCommandType._value2member_map_:
            log.error("ctx %d: invalid command type %d", self.ctx_id, cmd_type)
            self._send(reply, COMMAND_MALFORMED)
            return COMMAND_MALFORMED, 0
        dec = Decoder(cmd, _HEADER.size)
        enc = reply.reply_encoder()
        if cmd_type == _FORWARD:
            rc = self._forward(flags, dec, enc)
        elif cmd_type == _HANDSHAKE:
            rc = self._handshake(dec, enc)
        else:
            rc = self._load_library()
        if enc.fatal:
            log.error(
                "ctx %d: %s reply does not fit reply resource %d (%d bytes)",
                self.ctx_id,
                ApirCommandType(cmd_type).c_name,
                reply.res_id,
                reply.size,
            )
            rc = COMMAND_MALFORMED
        self._send(reply, rc)
        return rc, 0 if enc.fatal else enc.pos - NOTIFICATION_SIZE

    def _run_posted(self, cmd: memoryview) -> Optional[memoryview]:
        """Runs the posted commands at the head of `cmd` (ASYNC: a posted command's third
        header word is its length, header included); the command after them, or None when
        nothing follows or a length is wrong (its command is then the pending error, and the
        rest of the payload is dropped: no command there can be found)."""
        library = cast(PostingLibrary, self._library)
        pos, end = 0, len(cmd)
        while end - pos >= _HEADER.size:
            cmd_type, flags, length = _HEADER.unpack_from(cmd, pos)
            if _apir_command_type(cmd_type, self.capset_id) != _FORWARD or not flags & APIR_FORWARD_POSTED:
                return cmd[pos:]
            if not _HEADER.size <= length <= end - pos:
                log.error("ctx %d: posted command of length %d at byte %d of %d", self.ctx_id, length, pos, end)
                library.post(flags & ~APIR_FORWARD_POSTED, Decoder(cmd, end, end))  # (no arguments: refused)
                return None
            library.post(flags & ~APIR_FORWARD_POSTED, Decoder(cmd, pos + _HEADER.size, pos + length))
            pos += length
        if pos != end:
            log.error("ctx %d: %d bytes after the posted commands", self.ctx_id, end - pos)
        return None

    def _posts(self) -> bool:
        library = self._library
        return conforms(library, PostingLibrary) and cast(PostingLibrary, library).accepts_posted()

    def _reply_resource(self, res_id: int) -> Optional[Resource]:
        res = self._resources.get(res_id)
        if res is None or res.size < NOTIFICATION_SIZE:
            log.error(
                "ctx %d: reply resource %d %s",
                self.ctx_id,
                res_id,
                "unknown" if res is None else f"too small ({res.size} bytes)",
            )
            return None
        self._last_reply_res_id = res_id
        return res

    def _reply_malformed(self) -> Optional[Tuple[int, int]]:
        """Replies COMMAND_MALFORMED through the last reply resource, if one is known;
        (COMMAND_MALFORMED, 0) then, else None."""
        res = self._resources.get(self._last_reply_res_id) if self._last_reply_res_id else None
        if res is None:
            log.error("ctx %d: no reply resource known: the command gets no reply", self.ctx_id)
            return None
        self._send(res, COMMAND_MALFORMED)
        return COMMAND_MALFORMED, 0

    def _send(self, reply: Resource, rc: int) -> None:
        """`send_response`: the payload is already in place; publish `rc + 1` in the reply
        notification word with release ordering (a guest that sees the word with an acquire
        load sees the whole payload), or keep it for `take_notification`."""
        word, value = reply.notification_word(), (rc + 1) & 0xFFFFFFFF
        if self.defer_notification:
            self._pending_notification = (word, value)
        else:
            word.store_release(value)

    def take_notification(self) -> Optional[Tuple[Word, int]]:
        """With `defer_notification` set: the (word, value) the last `submit` did not store
        yet, or None (no reply, or taken already). The caller stores it with release
        ordering, on the thread that ran `submit`, before that thread runs anything else."""
        pending, self._pending_notification = self._pending_notification, None
        return pending

    def _handshake(self, dec: Decoder, enc: Encoder) -> int:
        major, minor = dec.u32(), dec.u32()
        if dec.fatal:
            log.error("ctx %d: HandShake without a guest version", self.ctx_id)
            return COMMAND_MALFORMED
        enc.u32(self.host_version[0])
        enc.u32(self.host_version[1])
        if (major, minor) in APIR_PROTOCOL_VERSIONS:
            self.guest_version = (major, minor)
        else:
            # The C only logs a mismatch; apir does too, and keeps speaking its own version.
            log.error(
                "ctx %d: guest APIR %d.%d is not one of %s; replying as %d.%d",
                self.ctx_id,
                major,
                minor,
                APIR_PROTOCOL_VERSIONS,
                *self.host_version,
            )
            self.guest_version = self.host_version
        log.info("ctx %d: HandShake: guest %d.%d, host %d.%d", self.ctx_id, major, minor, *self.host_version)
        return APIR_HANDSHAKE_MAGIC

    def _load_library(self) -> int:
        if self._library is not None:
            log.info("ctx %d: backend library already loaded", self.ctx_id)
            return ApirLoadLibraryReturnCode.ALREADY_LOADED
        path = self.get_config(CONFIG_KEY_LOAD_LIBRARY_PATH)
        try:
            library = _builtin_library() if path is None else self._library_factory(path)
        except LibraryLoadError as exc:
            log.error("ctx %d: LoadLibrary: %s", self.ctx_id, exc)
            return exc.code
        init_rc = library.initialize(self)
        base = ApirLoadLibraryReturnCode.INIT_BASE_INDEX
        if init_rc not in (ApirLoadLibraryReturnCode.SUCCESS, base + ApirBackendInitializeReturnCode.SUCCESS):
            log.error("ctx %d: LoadLibrary: backend library initialization returned %d", self.ctx_id, init_rc)
            library.deinit()
            return base + init_rc  # the C component's encoding of a backend init failure
        self._library = library
        self.commands_bounded_in_time = library.commands_bounded_in_time
        log.info("ctx %d: LoadLibrary: backend library loaded (%s)", self.ctx_id, path or "built-in")
        return ApirLoadLibraryReturnCode.SUCCESS

    def _forward(self, function_id: int, dec: Decoder, enc: Encoder) -> int:
        if self._library is None:
            log.error("ctx %d: Forward before LoadLibrary", self.ctx_id)
            return ApirForwardReturnCode.NO_DISPATCH_FCT
        return _FORWARD_BASE + self._library.dispatch(function_id, dec, enc)
