"""What the virtio-gpu kernel driver and the hypervisor do for one guest, without either.

Theory of operation: `KernelContext` is one opened render node on the host side of the local
transport. It answers GETPARAM and GET_CAPS from fixed tables, creates the APIR context
(`HostContext`) on CONTEXT_INIT, places blobs in the context's shared memory file
(apir.host.local.memfile) and registers them with the context as resources, and runs EXECBUFFER
payloads with `HostContext.submit`. The socket server (apir.host.local.server) and the embedded
device (apir.local.embedded) both drive it: the first decodes requests off the wire, the second
calls it directly. Every refusal is a `KernelError` carrying the errno the ioctl would set.
"""

from __future__ import annotations

import errno
import itertools
import logging
import threading
from typing import Optional, Union

from apir.codec.constants import CapsetApir
from apir.host.config import CONFIG_KEY_MAX_BLOBS
from apir.local.wire import MAX_EXEC_COMMAND
from apir.codec.virtgpu import (
    VIRTGPU_BLOB_FLAG_USE_MAPPABLE,
    VIRTGPU_BLOB_MEM_HOST3D,
    VIRTGPU_DRM_CAPSET_APIR,
    VIRTGPU_DRM_CAPSET_VENUS,
    VIRTGPU_EXECBUF_RING_IDX,
    VIRTGPU_MAX_RINGS,
    VirtgpuParam,
)
from apir.errors import ApirError
from apir.host.component.context import HostContext
from apir.host.component.seams import ApirContext, BufferCounting, Cancellable, ContextFactory
from apir.host.config import DEFAULT_MAX_BLOBS, config_limit
from apir.host.local.memfile import HostBlob, MemFile, MemFileFull, Share

__all__ = [
    "KernelContext",
    "KernelError",
    "default_context_factory",
    "ggml_buffer_count",
    "GETPARAMS",
    "CAPSET_APIR_VERSION",
    "next_ctx_id",
]

log = logging.getLogger(__name__)

# The capset content virglrenderer's APIR component reports (apir_renderer_get_capset).
CAPSET_APIR_VERSION = 1
# DRM_IOCTL_VIRTGPU_GETPARAM answers of a device with blobs, context init and the two capsets.
# Keyed by int: the param comes off the wire as a plain int (IntEnum members hash alike).
GETPARAMS: dict[int, int] = {
    VirtgpuParam.FEATURES_3D: 1,
    VirtgpuParam.CAPSET_QUERY_FIX: 1,
    VirtgpuParam.RESOURCE_BLOB: 1,
    VirtgpuParam.HOST_VISIBLE: 1,
    VirtgpuParam.CROSS_DEVICE: 0,
    VirtgpuParam.CONTEXT_INIT: 1,
    VirtgpuParam.SUPPORTED_CAPSET_IDS: (1 << VIRTGPU_DRM_CAPSET_VENUS) | (1 << VIRTGPU_DRM_CAPSET_APIR),
    VirtgpuParam.EXPLICIT_DEBUG_NAME: 0,
}
CAPSETS = (VIRTGPU_DRM_CAPSET_APIR, VIRTGPU_DRM_CAPSET_VENUS)

# Context ids are unique per host process (the guest never sees them: logs only). Resource ids
# are the guest's names, drawn per KernelContext: one guest learns nothing of another's blobs.
_lock = threading.Lock()
_ctx_ids = itertools.count(1)


def next_ctx_id() -> int:
    with _lock:
        return next(_ctx_ids)


class KernelError(ApirError):
    """A request refused with `err` (an errno), as the ioctl would fail."""

    def __init__(self, err: int, why: str):
        super().__init__(why)
        self.err = err


def default_context_factory(ctx_id: int, capset_id: int, config: Optional[dict]) -> ApirContext:
    """A fresh `apir.host.component.context.HostContext` for context `ctx_id` on capset `capset_id`."""
    return HostContext(ctx_id, config, capset_id=capset_id)


def ggml_buffer_count(ctx: ApirContext) -> Optional[int]:
    """How many ggml buffers `ctx` holds, when it can tell (else None)."""
    return ctx.buffer_count() if isinstance(ctx, BufferCounting) else None


class KernelContext:
    """One guest's render node: its shared memory file, blobs and (after CONTEXT_INIT) context.

    `config` goes to the context factory; `max_bytes` bounds the shared memory file, whose
    growth is also charged to `share` (apir.host.local.memfile) if given. Raises OSError
    (EMFILE, ENFILE, ENOMEM) when no shared memory file can be made. Not thread-safe: one
    caller at a time (the connection thread, or the embedded host thread behind the device's
    lock).
    """

    def __init__(
        self,
        name: str = "apir-context",
        config: Optional[dict] = None,
        context_factory: ContextFactory = default_context_factory,
        max_bytes: int = 1 << 36,
        share: Optional[Share] = None,
    ):
        self.name = name
        self.config = config
        self.context_factory = context_factory
        self.memfile = MemFile(name, limit=max_bytes, share=share)
        self.ctx: Optional[ApirContext] = None
        self.ctx_id = 0
        self.capset_id = 0
        self.num_rings = 0
        self.blobs: dict[int, tuple[int, HostBlob]] = {}  # bo_handle -> (res_id, blob)
        self.max_blobs = config_limit(config, CONFIG_KEY_MAX_BLOBS, DEFAULT_MAX_BLOBS)
        self._bo_handles = itertools.count(1)
        self._res_ids = itertools.count(1)
        self.closed = False

    # --- queries ---------------------------------------------------------------------------
    def get_param(self, param: int) -> int:
        """DRM_IOCTL_VIRTGPU_GETPARAM. EINVAL for an unknown param."""
        if param not in GETPARAMS:
            raise KernelError(errno.EINVAL, f"unknown param {param}")
        return GETPARAMS[param]

    def get_caps(self, capset_id: int, capset_ver: int, size: int) -> bytes:
        """DRM_IOCTL_VIRTGPU_GET_CAPS: min(size, 24) bytes. EINVAL for another capset/version.

        Both capsets answer with the APIR struct: the C guest reads 24 bytes and checks only
        supports_blob_resources, whichever capset it asked for."""
        if capset_id not in CAPSETS or capset_ver != 0:
            raise KernelError(errno.EINVAL, f"no capset {capset_id} version {capset_ver}")
        return CapsetApir(CAPSET_APIR_VERSION, True).pack()[: max(0, size)]

    # --- context ---------------------------------------------------------------------------
    def context_init(self, capset_id: int, num_rings: int) -> None:
        """DRM_IOCTL_VIRTGPU_CONTEXT_INIT: creates the HostContext. EEXIST when done already,
        EINVAL for another capset or a ring count outside 1..64, EIO if the context fails."""
        if self.ctx is not None:
            raise KernelError(errno.EEXIST, "context already initialized")
        if capset_id not in CAPSETS:
            raise KernelError(errno.EINVAL, f"unsupported capset {capset_id}")
        if not 1 <= num_rings <= VIRTGPU_MAX_RINGS:
            raise KernelError(errno.EINVAL, f"bad ring count {num_rings}")
        ctx_id = next_ctx_id()
        try:
            self.ctx = self.context_factory(ctx_id, capset_id, self.config)
        except Exception as exc:
            log.exception("%s: creating context %d failed", self.name, ctx_id)
            raise KernelError(errno.EIO, f"context creation failed: {exc}") from None
        self.ctx_id, self.capset_id, self.num_rings = ctx_id, capset_id, num_rings
        log.info("%s: context %d on capset %d", self.name, ctx_id, capset_id)

    # --- blobs -----------------------------------------------------------------------------
    def create_blob(self, blob_mem: int, blob_flags: int, size: int, blob_id: int = 0) -> tuple[int, int, HostBlob]:
        """RESOURCE_CREATE_BLOB: (res_id, bo_handle, blob). Only mappable HOST3D blobs of a
        context; the size is rounded up to 16 KiB. EINVAL / ENOMEM / EIO on refusal, ENOSPC
        when the context holds `max_blobs` already (apir.local.max_blobs; the kernel's GEM
        handle and resource id allocators fail the same way when exhausted)."""
        if self.ctx is None:
            raise KernelError(errno.EINVAL, "CREATE_BLOB before CONTEXT_INIT")
        if blob_mem != VIRTGPU_BLOB_MEM_HOST3D or not blob_flags & VIRTGPU_BLOB_FLAG_USE_MAPPABLE:
            raise KernelError(errno.EINVAL, f"only mappable HOST3D blobs (mem {blob_mem}, flags {blob_flags:#x})")
        if size == 0 or blob_id != 0:
            raise KernelError(errno.EINVAL, f"bad blob size {size} / blob_id {blob_id}")
        if len(self.blobs) >= self.max_blobs:
            raise KernelError(
                errno.ENOSPC, f"the context holds {len(self.blobs)} blobs, its limit ({CONFIG_KEY_MAX_BLOBS})"
            )
        blob = self.allocate(size)
        res_id = next(self._res_ids)
        try:
            self.ctx.add_resource(res_id, blob.memory)
        except Exception as exc:
            self.memfile.free(blob)
            log.exception("%s: add_resource(%d) failed", self.name, res_id)
            raise KernelError(errno.EIO, f"add_resource failed: {exc}") from None
        bo_handle = next(self._bo_handles)
        self.blobs[bo_handle] = (res_id, blob)
        log.debug("%s: blob res %d bo %d, %d bytes at offset %d", self.name, res_id, bo_handle, blob.size, blob.offset)
        return res_id, bo_handle, blob

    def allocate(self, size: int) -> HostBlob:
        """`size` bytes (rounded up to 16 KiB) of the shared memory file: a blob's, or the
        socket host's exec ring page (apir.host.local.server), which is no resource. ENOMEM
        past the file's limit, the errno of a failed ftruncate / mmap."""
        try:
            return self.memfile.allocate(size)
        except MemFileFull as exc:
            raise KernelError(errno.ENOMEM, str(exc)) from None
        except OSError as exc:
            raise KernelError(exc.errno or errno.ENOMEM, f"shared memory: {exc}") from None

    def map(self, bo_handle: int) -> int:
        """DRM_IOCTL_VIRTGPU_MAP: the blob's offset in the shared memory file. ENOENT."""
        entry = self.blobs.get(bo_handle)
        if entry is None:
            raise KernelError(errno.ENOENT, f"unknown bo_handle {bo_handle}")
        return entry[1].offset

    def gem_close(self, bo_handle: int) -> None:
        """DRM_IOCTL_GEM_CLOSE: drops the resource and frees its range. ENOENT."""
        entry = self.blobs.pop(bo_handle, None)
        if entry is None:
            raise KernelError(errno.ENOENT, f"unknown bo_handle {bo_handle}")
        self._free_blob(*entry)

    def _free_blob(self, res_id: int, blob: HostBlob) -> None:
        try:
            if self.ctx is not None:  # (a blob exists only once the context does)
                self.ctx.remove_resource(res_id)
        except Exception:
            log.exception("%s: remove_resource(%d) failed", self.name, res_id)
        self.memfile.free(blob)

    # --- commands --------------------------------------------------------------------------
    def check_execbuffer(self, flags: int, ring_idx: int, size: int) -> None:
        """The ioctl's own checks of an EXECBUFFER: only the RING_IDX flag (no fences), a ring
        of the context, a command of at most MAX_EXEC_COMMAND bytes, a context. EINVAL."""
        if self.ctx is None:
            raise KernelError(errno.EINVAL, "EXECBUFFER before CONTEXT_INIT")
        if flags & ~VIRTGPU_EXECBUF_RING_IDX:
            raise KernelError(errno.EINVAL, f"unsupported EXECBUFFER flags {flags:#x} (no fences here)")
        if flags & VIRTGPU_EXECBUF_RING_IDX and ring_idx >= self.num_rings:
            raise KernelError(errno.EINVAL, f"ring {ring_idx} of {self.num_rings}")
        if size > MAX_EXEC_COMMAND:
            raise KernelError(errno.EINVAL, f"command of {size} bytes")

    def submit(self, command: Union[bytes, memoryview]) -> None:
        """Runs one checked command with `HostContext.submit`. EIO if submit raises (a host
        bug: submit answers bad guest input in the reply blob, never by raising); EINVAL
        before CONTEXT_INIT."""
        if self.ctx is None:
            raise KernelError(errno.EINVAL, "EXECBUFFER before CONTEXT_INIT")
        try:
            self.ctx.submit(command)
        except Exception as exc:
            log.exception("%s: submit raised", self.name)
            raise KernelError(errno.EIO, f"submit raised {type(exc).__name__}: {exc}") from None

    def execbuffer(self, flags: int, ring_idx: int, command: Union[bytes, memoryview]) -> None:
        """DRM_IOCTL_VIRTGPU_EXECBUFFER, run to completion: check_execbuffer, then submit."""
        self.check_execbuffer(flags, ring_idx, len(command))
        self.submit(command)

    # --- counts and teardown ---------------------------------------------------------------
    @property
    def ggml_buffers(self) -> Optional[int]:
        return None if self.ctx is None else ggml_buffer_count(self.ctx)

    def cancel_compute(self, reason: str) -> None:
        """Stops the context's compute in flight and refuses later ones (its guest is gone).
        Any thread: the one running the compute is busy with it."""
        if isinstance(self.ctx, Cancellable):
            self.ctx.cancel_compute(reason)

    def close(self) -> None:
        """Closes the context (freeing its ggml buffers) and every blob. Idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.ctx is not None:
                try:
                    self.ctx.close()
                except Exception:
                    log.exception("%s: closing context %d failed", self.name, self.ctx_id)
        finally:
            self.blobs.clear()
            self.memfile.close()
