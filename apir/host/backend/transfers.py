"""A context's asynchronous copies to and from device memory: deferred uploads, batched reads.

Theory of operation: on a backend whose buffers are device memory (ggml-vulkan), each
synchronous `ggml_backend_tensor_set` / `_get` waits for its own fence. Where the backend's
profile allows async copies (`BackendProfile.async_transfers`), a `DeviceTransfers` per context
turns them into one fence per batch (docs/design.md, "Deferred uploads and batched reads"):

- `upload`: a `buffer_set_tensor` into a device buffer copies the guest's bytes at once into
  this context's staging (the guest may reuse its window once the reply is sent) and queues
  `ggml_backend_tensor_set_async` from there; its checks and its error come before, as for a
  synchronous set.
- `flush`: `ggml_backend_synchronize`. The dispatcher flushes before every backend command but
  `buffer_set_tensor`, a set that is not deferred flushes first, and buffers are freed only
  after one: whatever reads, frees or depends on device memory sees the uploads in order.
- Bound: the staging is `capacity` bytes; an upload that does not fit behind the queued ones
  flushes first, one larger than the staging is synchronous. A guest cannot make it hold more.
- `read`: the row ids a cached graph re-checks, read async into the staging, one synchronize
  per staging-full. Only a buffer ggml allocated, of the backend's default type, qualifies
  (`eligible`): ggml-vulkan's async copies abort the process on any other type.
"""

from __future__ import annotations

import ctypes
from typing import List, Optional, Sequence, Tuple

from apir.codec.copy import RawMemory, copy_bytes
from apir.host.handles import HostBuffer

__all__ = ["DeviceTransfers", "DEFAULT_STAGING_BYTES"]

DEFAULT_STAGING_BYTES = 4 << 20  # per context: bytes of queued uploads (or one batch of reads)
_ALIGN = 256  # each staged copy starts at a multiple of this (any device's copy alignment)


class DeviceTransfers:
    """The queued copies of one context's ggml backend `backend` on device `dev` of build `g`
    (see the module docstring). `capacity`: bytes of staging. Not thread-safe: the context's
    lock serializes its commands. `syncs` counts the synchronizes this object made."""

    def __init__(self, g, backend: int, dev: int, capacity: int = DEFAULT_STAGING_BYTES):
        self.g = g
        self.backend = backend
        self.dev = dev
        self.capacity = capacity
        self.default_buft = g.ggml_backend_get_default_buffer_type(backend)
        self.pending = 0  # uploads queued since the last flush
        self.syncs = 0
        self._used = 0  # staging bytes the queued uploads hold
        self._staging: Optional[Tuple[int, int, object]] = None  # (ggml buffer or 0, address, anchor)

    def eligible(self, buf: HostBuffer) -> bool:
        """Whether copies to and from `buf` may be asynchronous: ggml allocated it (no guest
        memory) and its type is the backend's default buffer type."""
        return buf.res_id is None and self.g.ggml_backend_buffer_get_type(buf.ptr) == self.default_buft

    def upload(self, buf: HostBuffer, tensor: int, src: int, offset: int, size: int) -> bool:
        """`ggml_backend_tensor_set(tensor, src, offset, size)` deferred: bytes [src, src +
        size) copied into the staging now, the device copy queued. `tensor` lies in `buf`,
        checked by the caller (offset + size within it, size > 0). False (after a flush, so
        the caller's synchronous set comes after the queued ones) where `buf` is not eligible
        or `size` exceeds the staging."""
        if size > self.capacity or not self.eligible(buf):
            self.flush()
            return False
        if self._used + size > self.capacity:
            self.flush()
        staging = self._stage()[1]
        copy_bytes(RawMemory(staging, self.capacity), RawMemory(src, size), size, dst_offset=self._used)
        self.g.ggml_backend_tensor_set_async(self.backend, tensor, staging + self._used, offset, size)
        self._used += -(-size // _ALIGN) * _ALIGN
        self.pending += 1
        return True

    def flush(self) -> None:
        """Waits until every queued upload is in device memory (`ggml_backend_synchronize`);
        the staging is free again. Nothing when none is queued."""
        if self.pending:
            self._synchronize()
            self.pending = 0
        self._used = 0

    def read(self, reads: Sequence[Tuple[int, int]]) -> List[ctypes.Array]:
        """The first `n` bytes of each `(tensor, n)` (a tensor over device memory of an
        eligible buffer, `n` within it), read with `ggml_backend_tensor_get_async` and one
        synchronize per staging-full; queued uploads are flushed first. A read larger than
        the staging is read synchronously."""
        self.flush()
        out: List[ctypes.Array] = [ctypes.create_string_buffer(max(n, 1)) for _, n in reads]
        batch: List[Tuple[int, int, int]] = []  # (index, staging offset, n)
        used = 0
        for k, (tensor, n) in enumerate(reads):
            if n == 0:
                continue
            if n > self.capacity:
                self.g.ggml_backend_tensor_get(tensor, ctypes.addressof(out[k]), 0, n)
                continue
            if used + n > self.capacity:
                self._collect(batch, out)
                batch, used = [], 0
            self.g.ggml_backend_tensor_get_async(self.backend, tensor, self._stage()[1] + used, 0, n)
            batch.append((k, used, n))
            used += -(-n // _ALIGN) * _ALIGN
        self._collect(batch, out)
        return out

    def close(self) -> None:
        """Flushes, then frees the staging (before the backend is freed)."""
        self.flush()
        if self._staging is not None:
            if self._staging[0]:
                self.g.ggml_backend_buffer_free(self._staging[0])
            self._staging = None

    def _collect(self, batch: List[Tuple[int, int, int]], out: List[ctypes.Array]) -> None:
        if not batch:
            return
        self._synchronize()
        staging = RawMemory(self._stage()[1], self.capacity)
        for k, at, n in batch:
            copy_bytes(out[k], staging, n, src_offset=at)

    def _synchronize(self) -> None:
        self.g.ggml_backend_synchronize(self.backend)
        self.syncs += 1

    def _stage(self) -> Tuple[int, int, object]:
        """The staging: `capacity` bytes of the device's host buffer type (pinned), else of
        host memory; made on first use."""
        if self._staging is None:
            g = self.g
            buft = g.ggml_backend_dev_host_buffer_type(self.dev)
            buf = g.ggml_backend_buft_alloc_buffer(buft, self.capacity) if buft else 0
            base = g.ggml_backend_buffer_get_base(buf) if buf else 0
            if buf and base:
                self._staging = (buf, base, None)
            else:
                if buf:
                    g.ggml_backend_buffer_free(buf)
                memory = (ctypes.c_char * self.capacity)()
                self._staging = (0, ctypes.addressof(memory), memory)
        return self._staging
