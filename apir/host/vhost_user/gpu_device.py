"""The virtio-gpu device: contexts, resources and blobs of one VM, and its control commands.

Theory of operation: `GpuDevice.handle(request, send)` serves one control-queue command (the
bytes of its readable buffers) and calls `send(response)` once, now or later. Each guest
context (CTX_CREATE with context_init = capset 10 APIR, or 4 Venus where configured) is one
`HostContext` (through `context_factory`) with its own worker thread (apir.host.vhost_user.
context_worker): SUBMIT_3D, and registering or dropping a blob with that HostContext, run
there in order, so a long graph compute stalls neither the queue nor another context.
Fenced responses leave in fence order (apir.host.vhost_user.completion).

Blobs: a HOST3D blob is a memfd of its own, registered with the HostContexts of the contexts
that hold it; RESOURCE_MAP_BLOB maps it into the host-visible shared memory region at the
offset the guest kernel chose (SHMEM_MAP on the back-end channel). A GUEST blob is guest
pages, checked against the memory table. CTX_DESTROY cancels the context's compute, closes its
HostContext and frees the blobs it created, leaving tombstones; `close` does the same for every
context: the front-end is gone. Every field of a command is the guest's: a bad one gets a
VIRTIO_GPU_RESP_ERR_* response, and the next command is served. What one VM may hold is
bounded, and so is what all VMs of the process hold together (apir.host.vhost_user.
process_limits: descriptors, blob bytes; apir.host.config: apir.vhost.*); a blob keeps only the
descriptors it needs (its memfd while it can be mapped). Contexts of one device are one peer
(`peer`: apir.host.peer), sharing the host's per-peer bounds. docs/vm.md ("What the device
does") has the details.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Set, Tuple

from apir.codec.constants import CapsetApir
from apir.local.wire import MAX_EXEC_COMMAND
from apir.codec.virtgpu import (
    VIRTGPU_BLOB_FLAG_USE_MAPPABLE,
    VIRTGPU_BLOB_MEM_HOST3D,
    VIRTGPU_DRM_CAPSET_APIR,
    VIRTIO_GPU_BLOB_FLAG_USE_CROSS_DEVICE,
    VIRTIO_GPU_BLOB_FLAG_USE_SHAREABLE,
    VIRTIO_GPU_BLOB_MEM_GUEST,
    VIRTIO_GPU_CONTEXT_INIT_CAPSET_ID_MASK,
    VIRTIO_GPU_MAP_CACHE_CACHED,
    VIRTIO_GPU_MAX_SCANOUTS,
    VIRTIO_GPU_SHM_ID_HOST_VISIBLE,
    VirtioGpuCtrlType as T,
)
from apir.host.config import (
    CONFIG_KEY_PEER,
    CONFIG_KEY_VHOST_MAX_CONTEXTS,
    CONFIG_KEY_VHOST_MAX_RESOURCES,
    DEFAULT_VHOST_MAX_CONTEXTS,
    DEFAULT_VHOST_MAX_RESOURCES,
    config_limit,
)
from apir.host.component.seams import ApirContext, Cancellable, ContextFactory
from apir.host.local.kernel import CAPSET_APIR_VERSION, ggml_buffer_count
from apir.host.vhost_user.backend_channel import BackendChannel, BackendError
from apir.host.vhost_user.completion import FenceOrder, Ticket
from apir.host.vhost_user.context_worker import ContextWorker
from apir.host.vhost_user.gpu_wire import (
    CAPSET_INFO_REQ,
    CAPSET_INFO_RESP,
    CREATE_BLOB_REQ,
    CTX_CREATE_REQ,
    CTX_NAME_SIZE,
    DISPLAY_ONE,
    GET_CAPSET_REQ,
    MAP_BLOB_REQ,
    MAP_INFO_RESP,
    MEM_ENTRY,
    NO_HEADER,
    RESOURCE_ID_REQ,
    SUBMIT_3D_REQ,
    GpuError,
    Header,
    parse_header,
    response,
    unpack_body,
)
from apir.host.vhost_user.memory import GuestMemory
from apir.host.vhost_user.process_limits import BLOB_BYTES, FDS, MMAP_HOLDS_FD, map_fd
from apir.host.vhost_user.protocol import close_quietly

__all__ = ["GpuDevice", "DeviceCounts", "CAPSET_MAX_VERSION", "MAX_GUEST_ENTRIES", "DISPLAY_SIZE"]

log = logging.getLogger(__name__)

CAPSET_MAX_VERSION = 0  # the only capset version (the C guest and apir ask for 0)
MAX_GUEST_ENTRIES = 1 << 16  # page entries of one GUEST blob (256 MiB of 4 KiB pages)
MAX_PENDING_SUBMITS = 256  # SUBMIT_3D waiting on one context's worker
# Any job waiting on one context's worker, past which ATTACH / DETACH are refused: a guest
# looping them while the context computes would otherwise grow the queue without bound
# (CREATE_BLOB / UNREF are bounded by the resource limit, SUBMIT_3D by MAX_PENDING_SUBMITS).
MAX_PENDING_JOBS = 4096
DISPLAY_SIZE = (1024, 768)  # scanout 0's mode (a headless device still reports one)
_BLOB_FLAGS = (
    VIRTGPU_BLOB_FLAG_USE_MAPPABLE | VIRTIO_GPU_BLOB_FLAG_USE_SHAREABLE | VIRTIO_GPU_BLOB_FLAG_USE_CROSS_DEVICE
)
_PAGE = mmap.PAGESIZE

Send = Callable[[bytes], None]


@dataclass
class _Blob:
    """One resource. `mm`: a HOST3D blob's mapping (None once freed), `fd` its memfd while it
    can be mapped into the host-visible region (a blob without USE_MAPPABLE keeps none),
    `charge` what both hold of the front-end's share;
    `entries`: a GUEST blob's pages; `attached`: contexts it is attached to; `hosts`: contexts
    whose HostContext holds it or will (a job posted); `doomed`: its memory goes once no
    HostContext can hold it."""

    res_id: int
    blob_mem: int
    blob_flags: int
    size: int
    owner: int
    fd: Optional[int] = None
    mm: Optional[mmap.mmap] = None
    entries: List[Tuple[int, int]] = field(default_factory=list)
    attached: Set[int] = field(default_factory=set)
    hosts: Dict[int, int] = field(default_factory=dict)  # ctx_id -> registrations posted, not undone
    mapped_at: Optional[int] = None
    doomed: bool = False
    charge: Dict[str, int] = field(default_factory=dict)


@dataclass
class _Context:
    ctx_id: int
    capset_id: int
    name: str
    host: ApirContext
    worker: ContextWorker


@dataclass
class DeviceCounts:
    """What one device holds: live contexts, blobs holding memory, their bytes, contexts
    being torn down, ggml buffers (-1 when a HostContext cannot count them)."""

    contexts: int = 0
    blobs: int = 0
    blob_bytes: int = 0
    closing_contexts: int = 0
    ggml_buffers: int = 0


class GpuDevice:
    """The virtio-gpu state of one front-end. `memory`: its memory table (GUEST blobs);
    `capsets`: the capset ids offered, in GET_CAPSET_INFO order; `shm_size`: bytes of the
    host-visible region; `backend`: the back-end channel, once the front-end gave one;
    `peer`: who its contexts belong to (apir.host.peer; default: this device alone). Blobs
    are charged to `memory.share`, the front-end's bounds."""

    def __init__(
        self,
        memory: GuestMemory,
        context_factory: ContextFactory,
        config: Optional[dict] = None,
        capsets: Tuple[int, ...] = (VIRTGPU_DRM_CAPSET_APIR,),
        shm_size: int = 0,
        peer: Optional[str] = None,
    ):
        self.memory = memory
        self.peer = peer if peer is not None else f"vhost-user-device-{id(self):x}"
        self.context_factory = context_factory
        self.config = config
        self.capsets = capsets
        self.shm_size = shm_size
        self.backend: Optional[BackendChannel] = None
        self.max_contexts = int(config_limit(config, CONFIG_KEY_VHOST_MAX_CONTEXTS, DEFAULT_VHOST_MAX_CONTEXTS))
        self.max_resources = int(config_limit(config, CONFIG_KEY_VHOST_MAX_RESOURCES, DEFAULT_VHOST_MAX_RESOURCES))
        self.contexts: Dict[int, _Context] = {}
        self.resources: Dict[int, _Blob] = {}
        self._closing: Dict[int, _Context] = {}  # destroyed, HostContext not closed yet
        self._dying: List[_Blob] = []  # unreferenced, memory held by a HostContext still
        self._lock = threading.RLock()  # the tables; never held while a HostContext runs
        self._fences = FenceOrder()
        self.closed = False
        self._handlers: Dict[int, Callable[[Header, bytes, Optional[Ticket], Send], Optional[bytes]]] = {
            T.CMD_GET_DISPLAY_INFO: self._get_display_info,
            T.CMD_GET_CAPSET_INFO: self._get_capset_info,
            T.CMD_GET_CAPSET: self._get_capset,
            T.CMD_CTX_CREATE: self._ctx_create,
            T.CMD_CTX_DESTROY: self._ctx_destroy,
            T.CMD_CTX_ATTACH_RESOURCE: self._ctx_attach,
            T.CMD_CTX_DETACH_RESOURCE: self._ctx_detach,
            T.CMD_RESOURCE_CREATE_BLOB: self._create_blob,
            T.CMD_RESOURCE_MAP_BLOB: self._map_blob,
            T.CMD_RESOURCE_UNMAP_BLOB: self._unmap_blob,
            T.CMD_RESOURCE_UNREF: self._unref,
            T.CMD_SUBMIT_3D: self._submit_3d,
        }

    # --- entry point ------------------------------------------------------------------------
    def handle(self, request: bytes, send: Send) -> None:
        """Serves one control command; `send(response)` is called exactly once (maybe later,
        from another thread). Never raises for guest input."""
        try:
            hdr, body = parse_header(request)
        except GpuError as exc:
            log.warning("control command refused: %s", exc)
            send(response(NO_HEADER, exc.code))
            return
        fences = self._fences  # the one this command's ticket is on, also after a reset
        ticket = fences.ticket(hdr.timeline) if hdr.fenced else None

        def reply(data: bytes) -> None:
            fences.finish(ticket, lambda: send(data))

        handler = self._handlers.get(hdr.type)
        try:
            if handler is None:
                raise GpuError(T.RESP_ERR_UNSPEC, f"unsupported command {hdr.type:#x}")
            result = handler(hdr, body, ticket, reply)
        except GpuError as exc:
            log.info("%s refused (%s): %s", _name(hdr.type), exc.code.name, exc)
            reply(response(hdr, exc.code))
            return
        except Exception:  # noqa: BLE001 - a host bug must not take the device down
            log.exception("%s: internal error", _name(hdr.type))
            reply(response(hdr, T.RESP_ERR_UNSPEC))
            return
        if result is not None:
            reply(result)

    # --- queries ----------------------------------------------------------------------------
    def _get_display_info(self, hdr: Header, body: bytes, ticket, reply) -> bytes:
        width, height = DISPLAY_SIZE
        modes = DISPLAY_ONE.pack(0, 0, width, height, 1, 0)
        modes += DISPLAY_ONE.pack(0, 0, 0, 0, 0, 0) * (VIRTIO_GPU_MAX_SCANOUTS - 1)
        return response(hdr, T.RESP_OK_DISPLAY_INFO, modes)

    def _capset_data(self) -> bytes:
        return CapsetApir(CAPSET_APIR_VERSION, True).pack()

    def _get_capset_info(self, hdr: Header, body: bytes, ticket, reply) -> bytes:
        (index, _) = unpack_body(CAPSET_INFO_REQ, body, "GET_CAPSET_INFO")
        if index >= len(self.capsets):
            raise GpuError(T.RESP_ERR_INVALID_PARAMETER, f"capset index {index} of {len(self.capsets)}")
        info = CAPSET_INFO_RESP.pack(self.capsets[index], CAPSET_MAX_VERSION, len(self._capset_data()), 0)
        return response(hdr, T.RESP_OK_CAPSET_INFO, info)

    def _get_capset(self, hdr: Header, body: bytes, ticket, reply) -> bytes:
        # Both capsets answer with the APIR struct (apir.host.local.kernel.KernelContext.get_caps).
        capset_id, version = unpack_body(GET_CAPSET_REQ, body, "GET_CAPSET")
        if capset_id not in self.capsets or version > CAPSET_MAX_VERSION:
            raise GpuError(T.RESP_ERR_INVALID_PARAMETER, f"no capset {capset_id} version {version}")
        return response(hdr, T.RESP_OK_CAPSET, self._capset_data())

    # --- contexts ---------------------------------------------------------------------------
    def _context(self, ctx_id: int) -> _Context:
        ctx = self.contexts.get(ctx_id)
        if ctx is None:
            raise GpuError(T.RESP_ERR_INVALID_CONTEXT_ID, f"no context {ctx_id}")
        return ctx

    def _ctx_create(self, hdr: Header, body: bytes, ticket, reply) -> bytes:
        nlen, context_init, raw_name = unpack_body(CTX_CREATE_REQ, body, "CTX_CREATE")
        if nlen > CTX_NAME_SIZE:
            raise GpuError(T.RESP_ERR_INVALID_PARAMETER, f"debug name of {nlen} bytes")
        capset_id = context_init & VIRTIO_GPU_CONTEXT_INIT_CAPSET_ID_MASK
        if context_init & ~VIRTIO_GPU_CONTEXT_INIT_CAPSET_ID_MASK or capset_id not in self.capsets:
            raise GpuError(T.RESP_ERR_INVALID_PARAMETER, f"context_init {context_init:#x}: capset not offered")
        name = raw_name[:nlen].decode("utf-8", "replace")
        with self._lock:
            if hdr.ctx_id == 0 or hdr.ctx_id in self.contexts or hdr.ctx_id in self._closing:
                raise GpuError(T.RESP_ERR_INVALID_CONTEXT_ID, f"context id {hdr.ctx_id} is taken or 0")
            if len(self.contexts) + len(self._closing) >= self.max_contexts:
                raise GpuError(
                    T.RESP_ERR_OUT_OF_MEMORY, f"{self.max_contexts} contexts already ({CONFIG_KEY_VHOST_MAX_CONTEXTS})"
                )
            config = dict(self.config or {})
            config.setdefault(CONFIG_KEY_PEER, self.peer)
            try:
                host = self.context_factory(hdr.ctx_id, capset_id, config)
            except Exception as exc:
                log.exception("context %d: creation failed", hdr.ctx_id)
                raise GpuError(T.RESP_ERR_UNSPEC, f"context creation failed: {exc}") from None
            try:
                worker = ContextWorker(f"apir-vgpu-ctx-{hdr.ctx_id}")
            except RuntimeError as exc:  # no thread to be had (RLIMIT_NPROC, memory): this VM's error
                _close_quietly(host, hdr.ctx_id)
                raise GpuError(T.RESP_ERR_OUT_OF_MEMORY, f"context {hdr.ctx_id}: no thread: {exc}") from None
            self.contexts[hdr.ctx_id] = _Context(hdr.ctx_id, capset_id, name, host, worker)
        log.info("context %d created (capset %d, %r)", hdr.ctx_id, capset_id, name)
        return response(hdr, T.RESP_OK_NODATA)

    def _ctx_destroy(self, hdr: Header, body: bytes, ticket, reply) -> None:
        with self._lock:
            ctx = self._context(hdr.ctx_id)
            self._retire_context(ctx)
        # Answered once the HostContext is closed: its buffers and blobs are gone by then.
        ctx.worker.post(lambda: reply(response(hdr, T.RESP_OK_NODATA)))
        ctx.worker.stop()
        return None

    def _retire_context(self, ctx: _Context) -> None:
        """Takes `ctx` out of the table (lock held): its compute is cancelled, its blobs freed
        and detached from other contexts, and its HostContext closed on its worker."""
        del self.contexts[ctx.ctx_id]
        self._closing[ctx.ctx_id] = ctx
        if isinstance(ctx.host, Cancellable):
            try:
                ctx.host.cancel_compute("the virtio-gpu context is destroyed")
            except Exception:  # noqa: BLE001
                log.exception("context %d: cancel_compute failed", ctx.ctx_id)
        for blob in list(self.resources.values()):
            blob.attached.discard(ctx.ctx_id)
            if blob.owner == ctx.ctx_id and not blob.doomed:
                blob.doomed = True  # a tombstone: UNMAP / UNREF still answer
                self._detach_everywhere(blob)
        ctx.worker.post(lambda: self._close_host(ctx))

    def _close_host(self, ctx: _Context) -> None:
        _close_quietly(ctx.host, ctx.ctx_id)
        with self._lock:
            self._closing.pop(ctx.ctx_id, None)
            for blob in list(self.resources.values()) + list(self._dying):
                if blob.hosts.pop(ctx.ctx_id, 0):
                    self._maybe_free(blob)
        log.info("context %d closed", ctx.ctx_id)

    # --- blobs and HostContexts (lock held; the HostContext calls run on workers) -----------
    def _register(self, ctx: _Context, blob: _Blob) -> None:
        blob.attached.add(ctx.ctx_id)
        blob.hosts[ctx.ctx_id] = blob.hosts.get(ctx.ctx_id, 0) + 1
        mm = blob.mm
        assert mm is not None

        def add() -> None:
            try:
                ctx.host.add_resource(blob.res_id, mm)
            except Exception:  # noqa: BLE001 - a HostContext refusal (its own duplicate check)
                log.exception("context %d: add_resource(%d) failed", ctx.ctx_id, blob.res_id)
                self._release_hold(ctx, blob)

        ctx.worker.post(add)

    def _unregister(self, ctx: _Context, blob: _Blob) -> None:
        blob.attached.discard(ctx.ctx_id)

        def remove() -> None:
            try:
                ctx.host.remove_resource(blob.res_id)
            except Exception:  # noqa: BLE001
                log.exception("context %d: remove_resource(%d) failed", ctx.ctx_id, blob.res_id)
            self._release_hold(ctx, blob)

        ctx.worker.post(remove)

    def _release_hold(self, ctx: _Context, blob: _Blob) -> None:
        with self._lock:
            left = blob.hosts.get(ctx.ctx_id, 0) - 1
            if left > 0:
                blob.hosts[ctx.ctx_id] = left
            else:
                blob.hosts.pop(ctx.ctx_id, None)
            self._maybe_free(blob)

    def _detach_everywhere(self, blob: _Blob) -> None:
        for ctx_id in list(blob.attached):
            ctx = self.contexts.get(ctx_id)
            if ctx is not None:
                self._unregister(ctx, blob)
        blob.attached.clear()
        self._maybe_free(blob)

    def _maybe_free(self, blob: _Blob) -> None:
        """Frees a doomed blob's memory once no HostContext holds it (lock held)."""
        if not blob.doomed or blob.hosts or blob.mm is None:
            return
        try:
            blob.mm.close()
        except BufferError:  # a view still alive: the collector unmaps it later
            log.error("blob %d: memory still in use; left to the collector", blob.res_id)
        close_quietly(blob.fd)
        blob.fd, blob.mm = None, None
        self.memory.share.give(blob.charge)
        blob.charge = {}
        if blob in self._dying:
            self._dying.remove(blob)

    def _blob(self, res_id: int, live: bool = True) -> _Blob:
        blob = self.resources.get(res_id)
        if blob is None or (live and blob.doomed):
            raise GpuError(T.RESP_ERR_INVALID_RESOURCE_ID, f"no resource {res_id}")
        return blob

    def _create_blob(self, hdr: Header, body: bytes, ticket, reply) -> bytes:
        res_id, blob_mem, blob_flags, nr_entries, blob_id, size = unpack_body(
            CREATE_BLOB_REQ, body, "RESOURCE_CREATE_BLOB"
        )
        if size == 0 or blob_flags & ~_BLOB_FLAGS:
            raise GpuError(T.RESP_ERR_INVALID_PARAMETER, f"blob size {size}, flags {blob_flags:#x}")
        with self._lock:
            if res_id == 0 or res_id in self.resources:
                raise GpuError(T.RESP_ERR_INVALID_RESOURCE_ID, f"resource id {res_id} is taken or 0")
            if len(self.resources) + len(self._dying) >= self.max_resources:
                raise GpuError(T.RESP_ERR_OUT_OF_MEMORY, f"{self.max_resources} resources already")
            if blob_mem == VIRTGPU_BLOB_MEM_HOST3D:
                blob = self._create_host3d(hdr, res_id, blob_flags, nr_entries, blob_id, size)
            elif blob_mem == VIRTIO_GPU_BLOB_MEM_GUEST:
                blob = self._create_guest(hdr, body, res_id, blob_flags, nr_entries, size)
            else:
                raise GpuError(T.RESP_ERR_INVALID_PARAMETER, f"blob_mem {blob_mem} not supported")
            self.resources[res_id] = blob
        log.debug("blob %d: mem %d, %d bytes, context %d", res_id, blob_mem, size, hdr.ctx_id)
        return response(hdr, T.RESP_OK_NODATA)

    def _create_host3d(self, hdr: Header, res_id: int, flags: int, nr_entries: int, blob_id: int, size: int) -> _Blob:
        ctx = self._context(hdr.ctx_id)
        if nr_entries or blob_id:
            raise GpuError(T.RESP_ERR_INVALID_PARAMETER, f"HOST3D blob with {nr_entries} entries, blob_id {blob_id}")
        rounded = _page_round(size)
        # The memfd is kept only while SHMEM_MAP may need it; the mapping's own copy (before
        # Python 3.13) lives as long as the mapping.
        keep_fd = bool(flags & VIRTGPU_BLOB_FLAG_USE_MAPPABLE)
        charge = {FDS: int(keep_fd) + int(MMAP_HOLDS_FD), BLOB_BYTES: rounded}
        why = self.memory.share.take(charge)
        if why is not None:
            raise GpuError(T.RESP_ERR_OUT_OF_MEMORY, f"blob {res_id} of {size} bytes: {why}")
        fd: Optional[int] = None
        try:
            fd = os.memfd_create(f"apir-vgpu-blob-{res_id}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.ftruncate(fd, rounded)
            # SHMEM_MAP gives this file to the front-end: sealed, it cannot truncate it under
            # the HostContext (a host access past the end would be SIGBUS, the host process gone).
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            mm = map_fd(fd, rounded)
        except (OSError, OverflowError, ValueError) as exc:
            close_quietly(fd)
            self.memory.share.give(charge)
            raise GpuError(T.RESP_ERR_OUT_OF_MEMORY, f"blob of {size} bytes: {exc}") from None
        if not keep_fd:
            close_quietly(fd)
            fd = None
        blob = _Blob(res_id, VIRTGPU_BLOB_MEM_HOST3D, flags, size, ctx.ctx_id, fd=fd, mm=mm, charge=charge)
        self._register(ctx, blob)
        return blob

    def _create_guest(self, hdr: Header, body: bytes, res_id: int, flags: int, nr_entries: int, size: int) -> _Blob:
        if nr_entries == 0 or nr_entries > MAX_GUEST_ENTRIES:
            raise GpuError(T.RESP_ERR_INVALID_PARAMETER, f"GUEST blob with {nr_entries} entries")
        start = CREATE_BLOB_REQ.size
        if len(body) < start + nr_entries * MEM_ENTRY.size:
            raise GpuError(T.RESP_ERR_INVALID_PARAMETER, f"{nr_entries} entries announced, fewer sent")
        entries = []
        for i in range(nr_entries):
            addr, length, _ = MEM_ENTRY.unpack_from(body, start + i * MEM_ENTRY.size)
            if length == 0 or not self.memory.contains(addr, length):
                raise GpuError(T.RESP_ERR_INVALID_PARAMETER, f"entry {i} ({addr:#x}+{length:#x}) outside guest memory")
            entries.append((addr, length))
        if sum(n for _, n in entries) != size:
            raise GpuError(
                T.RESP_ERR_INVALID_PARAMETER, f"entries cover {sum(n for _, n in entries)} bytes, not {size}"
            )
        return _Blob(res_id, VIRTIO_GPU_BLOB_MEM_GUEST, flags, size, hdr.ctx_id, entries=entries)

    def _ctx_attach(self, hdr: Header, body: bytes, ticket, reply) -> bytes:
        (res_id, _) = unpack_body(RESOURCE_ID_REQ, body, "CTX_ATTACH_RESOURCE")
        with self._lock:
            ctx = self._context(hdr.ctx_id)
            blob = self._blob(res_id)
            if ctx.ctx_id not in blob.attached:
                _check_backlog(ctx)
                if blob.mm is not None:
                    self._register(ctx, blob)
                else:
                    blob.attached.add(ctx.ctx_id)
        return response(hdr, T.RESP_OK_NODATA)

    def _ctx_detach(self, hdr: Header, body: bytes, ticket, reply) -> bytes:
        (res_id, _) = unpack_body(RESOURCE_ID_REQ, body, "CTX_DETACH_RESOURCE")
        with self._lock:
            ctx = self._context(hdr.ctx_id)
            blob = self._blob(res_id, live=False)
            if ctx.ctx_id in blob.attached:
                _check_backlog(ctx)
                self._unregister(ctx, blob)
        return response(hdr, T.RESP_OK_NODATA)

    def _unref(self, hdr: Header, body: bytes, ticket, reply) -> bytes:
        (res_id, _) = unpack_body(RESOURCE_ID_REQ, body, "RESOURCE_UNREF")
        with self._lock:
            blob = self._blob(res_id, live=False)
            del self.resources[res_id]
        if blob.mapped_at is not None:
            self._shmem_unmap(blob)
        with self._lock:
            blob.doomed = True
            if blob.mm is not None:
                self._dying.append(blob)
            self._detach_everywhere(blob)
        return response(hdr, T.RESP_OK_NODATA)

    # --- mapping into the host-visible region -----------------------------------------------
    def _map_blob(self, hdr: Header, body: bytes, ticket, reply) -> bytes:
        res_id, _, offset = unpack_body(MAP_BLOB_REQ, body, "RESOURCE_MAP_BLOB")
        with self._lock:
            blob = self._blob(res_id)
            if blob.fd is None or not blob.blob_flags & VIRTGPU_BLOB_FLAG_USE_MAPPABLE:
                raise GpuError(T.RESP_ERR_INVALID_PARAMETER, f"resource {res_id} is not a mappable HOST3D blob")
            if blob.mapped_at is not None:
                raise GpuError(T.RESP_ERR_INVALID_PARAMETER, f"resource {res_id} is mapped already")
            length = _page_round(blob.size)
            if offset % _PAGE or offset + length > self.shm_size:
                raise GpuError(
                    T.RESP_ERR_INVALID_PARAMETER,
                    f"{length} bytes at {offset:#x} do not fit the {self.shm_size:#x}-byte host-visible region",
                )
            for other in self.resources.values():
                if other.mapped_at is not None and offset < other.mapped_at + _page_round(other.size):
                    if other.mapped_at < offset + length:
                        raise GpuError(T.RESP_ERR_INVALID_PARAMETER, f"{offset:#x} overlaps resource {other.res_id}")
            if self.backend is None:
                raise GpuError(T.RESP_ERR_UNSPEC, "no back-end channel (BACKEND_REQ) to map blobs with")
            backend, fd = self.backend, blob.fd
            blob.mapped_at = offset  # reserved while QEMU maps it
        try:  # no lock: QEMU may send memory table changes before it acks
            backend.shmem_map(VIRTIO_GPU_SHM_ID_HOST_VISIBLE, fd, 0, offset, length)
        except BackendError as exc:
            with self._lock:
                blob.mapped_at = None
            raise GpuError(T.RESP_ERR_UNSPEC, f"SHMEM_MAP of resource {res_id}: {exc}") from None
        return response(hdr, T.RESP_OK_MAP_INFO, MAP_INFO_RESP.pack(VIRTIO_GPU_MAP_CACHE_CACHED, 0))

    def _unmap_blob(self, hdr: Header, body: bytes, ticket, reply) -> bytes:
        (res_id, _) = unpack_body(RESOURCE_ID_REQ, body, "RESOURCE_UNMAP_BLOB")
        with self._lock:
            blob = self._blob(res_id, live=False)
            if blob.mapped_at is None:
                raise GpuError(T.RESP_ERR_INVALID_PARAMETER, f"resource {res_id} is not mapped")
        if not self._shmem_unmap(blob):
            raise GpuError(T.RESP_ERR_UNSPEC, f"SHMEM_UNMAP of resource {res_id} failed")
        return response(hdr, T.RESP_OK_NODATA)

    def _shmem_unmap(self, blob: _Blob) -> bool:
        offset, blob.mapped_at = blob.mapped_at, None
        if self.backend is None or offset is None:
            return False
        try:
            self.backend.shmem_unmap(VIRTIO_GPU_SHM_ID_HOST_VISIBLE, offset, _page_round(blob.size))
        except BackendError as exc:
            # (a front-end that left took its mappings with it: nothing went wrong here)
            log.log(
                logging.INFO if exc.peer_gone else logging.ERROR, "SHMEM_UNMAP of resource %d: %s", blob.res_id, exc
            )
            return False
        return True

    # --- commands ---------------------------------------------------------------------------
    def _submit_3d(self, hdr: Header, body: bytes, ticket, reply) -> None:
        size, _ = unpack_body(SUBMIT_3D_REQ, body, "SUBMIT_3D")
        if size > MAX_EXEC_COMMAND or size > len(body) - SUBMIT_3D_REQ.size:
            raise GpuError(T.RESP_ERR_INVALID_PARAMETER, f"command of {size} bytes ({len(body)} sent)")
        with self._lock:
            ctx = self._context(hdr.ctx_id)
            if ctx.worker.pending >= MAX_PENDING_SUBMITS:
                raise GpuError(
                    T.RESP_ERR_OUT_OF_MEMORY, f"context {ctx.ctx_id} has {MAX_PENDING_SUBMITS} commands queued"
                )
        command = body[SUBMIT_3D_REQ.size : SUBMIT_3D_REQ.size + size]

        def run() -> None:
            try:
                ctx.host.submit(command)
                rtype = T.RESP_OK_NODATA
            except Exception:  # noqa: BLE001 - submit never raises for guest input: a host bug
                log.exception("context %d: submit raised", ctx.ctx_id)
                rtype = T.RESP_ERR_UNSPEC
            reply(response(hdr, rtype))

        ctx.worker.post(run)
        return None

    # --- counts and teardown ----------------------------------------------------------------
    def counts(self) -> DeviceCounts:
        with self._lock:
            c = DeviceCounts(contexts=len(self.contexts), closing_contexts=len(self._closing))
            for blob in list(self.resources.values()) + self._dying:
                if blob.mm is not None:
                    c.blobs += 1
                    c.blob_bytes += _page_round(blob.size)
            for ctx in self.contexts.values():
                n = ggml_buffer_count(ctx.host)
                c.ggml_buffers = -1 if n is None or c.ggml_buffers < 0 else c.ggml_buffers + n
        return c

    def close(self, timeout_s: float = 10.0) -> None:
        """The front-end is gone: every context's compute cancelled, HostContext closed, blob
        freed. Waits up to `timeout_s` for the workers. Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        self._drop_all(timeout_s)

    def reset(self, timeout_s: float = 10.0) -> None:
        """The guest's driver reset the device (a reboot in the same VM): as `close`, but the
        device serves on, and blobs still mapped leave the host-visible region first
        (SHMEM_UNMAP), so the new guest kernel can map its own there. The queue thread calls
        it (the back-end channel's acks come while the control channel is free)."""
        with self._lock:
            mapped = [blob for blob in self.resources.values() if blob.mapped_at is not None]
        for blob in mapped:
            self._shmem_unmap(blob)
        self._drop_all(timeout_s)
        with self._lock:
            self._fences = FenceOrder()  # a ticket of a compute that never ends must not block the new guest
        log.info("device reset: every context and blob of the previous guest freed")

    def _drop_all(self, timeout_s: float) -> None:
        with self._lock:
            retiring = list(self.contexts.values())
            for ctx in retiring:
                self._retire_context(ctx)
            for blob in list(self.resources.values()):
                blob.doomed = True
                blob.mapped_at = None  # QEMU drops the region's mappings with the device
                if blob.mm is not None:
                    self._dying.append(blob)
                self._detach_everywhere(blob)
            self.resources.clear()
            workers = [ctx.worker for ctx in list(self._closing.values())]
        for worker in workers:
            worker.stop()
        for worker in workers:
            if not worker.join(timeout_s):
                log.error("%s still running after %s s: its memory stays until it ends", worker.name, timeout_s)


def _close_quietly(host: ApirContext, ctx_id: int) -> None:
    try:
        host.close()
    except Exception:  # noqa: BLE001
        log.exception("context %d: close failed", ctx_id)


def _check_backlog(ctx: _Context) -> None:
    if ctx.worker.pending >= MAX_PENDING_JOBS:
        raise GpuError(T.RESP_ERR_OUT_OF_MEMORY, f"context {ctx.ctx_id} has {MAX_PENDING_JOBS} jobs queued")


def _page_round(n: int) -> int:
    return (n + _PAGE - 1) // _PAGE * _PAGE


def _name(ctrl_type: int) -> str:
    try:
        return T(ctrl_type).name
    except ValueError:
        return f"command {ctrl_type:#x}"
