"""The guest's transport seam: the virtgpu device interface and its shared-memory blobs.

Theory of operation: everything the guest needs from virtio-gpu is seven calls, named after
the DRM ioctls they stand for (GETPARAM, GET_CAPS, CONTEXT_INIT, RESOURCE_CREATE_BLOB + MAP,
GEM_CLOSE, EXECBUFFER) plus close. `DrmDevice` (apir.guest.drm) does them with a real
`/dev/dri/renderD*`; other transports (a host process over a socket: apir.guest.local; a host
in this process: apir.local.embedded) implement the same `VirtgpuDevice` protocol, and nothing
above this seam (remote call, client, ggml backend) knows which one it has. apir.devices opens
each by its spec (``drm:NODE``, ``unix:PATH``, ``embedded``).

A `Blob` is one host-visible, guest-mappable resource: the host knows it by `res_id`, the
guest's kernel by `bo_handle`, and the guest reads and writes it through `memory`, a mapped
writable buffer (an mmap) of `size` bytes. Sizes are rounded up to `BLOB_ALIGNMENT` (16 KiB)
by `apir.codec.virtgpu.blob_size`, as the C `virtgpu_shmem_create` does, before they reach
`create_blob`. The numbers every device uses (params, flags, capsets) are apir.codec.virtgpu's.
"""

from __future__ import annotations

from dataclasses import dataclass
import mmap
from typing import Protocol, runtime_checkable

__all__ = ["Blob", "VirtgpuDevice", "WatchedDevice", "NoWaitDevice"]


@dataclass
class Blob:
    """A mapped blob resource (`struct virtgpu_shmem`).

    `res_id`: the resource id the host sees (commands carry it); `bo_handle`: the guest
    kernel's GEM handle; `size`: bytes mapped; `memory`: the mapping, a writable buffer
    (mmap for DRM) valid until `destroy_blob`."""

    res_id: int
    bo_handle: int
    size: int
    memory: mmap.mmap


@runtime_checkable
class VirtgpuDevice(Protocol):
    """What the guest needs from a virtio-gpu device (docs/design.md, "Guest seam").

    Every method raises `apir.guest.errors.DeviceError` (or a subclass) on failure."""

    def get_param(self, param: int) -> int:
        """DRM_IOCTL_VIRTGPU_GETPARAM: the value of `VIRTGPU_PARAM_*` `param` (0 when the
        device does not know it)."""
        ...

    def get_caps(self, capset_id: int, size: int) -> bytes:
        """DRM_IOCTL_VIRTGPU_GET_CAPS: up to `size` bytes of capset `capset_id`, version 0."""
        ...

    def context_init(self, capset_id: int, num_rings: int = 1) -> None:
        """DRM_IOCTL_VIRTGPU_CONTEXT_INIT with this capset, `num_rings` rings and no fence
        events (POLL_RINGS_MASK 0). Once per device."""
        ...

    def create_blob(self, size: int) -> Blob:
        """DRM_IOCTL_VIRTGPU_RESOURCE_CREATE_BLOB (HOST3D, MAPPABLE) of `size` bytes, then
        MAP + mmap. `size` should already be rounded by `apir.codec.virtgpu.blob_size`."""
        ...

    def destroy_blob(self, blob: Blob) -> None:
        """Unmaps the blob and closes its GEM handle (the host then drops the resource)."""
        ...

    def execbuffer(self, payload, ring_idx: int = 0) -> None:
        """DRM_IOCTL_VIRTGPU_EXECBUFFER: submits the bytes of `payload` (any bytes-like) to
        the host on ring `ring_idx`. Returns once submitted; replies come through a blob."""
        ...

    def close(self) -> None:
        """Releases the device (remaining blobs are released with it)."""
        ...


@runtime_checkable
class WatchedDevice(Protocol):
    """A device that can tell, while the guest waits on a reply notification word, that its
    host is gone (apir.guest.remote uses `watch` in place of sleeping when a device has it).

    A device whose class sets `watch_wakes = True` also returns from `watch` as soon as the
    host has run every command submitted so far (its reply notification is then set), so a
    waiter may pass long timeouts at no cost in latency (apir.guest.remote then sleeps up to
    `_WOKEN_SLEEP_MAX_S` a look, not 1 ms: a long graph compute is waited for in tens of
    looks, not one a millisecond)."""

    def watch(self, timeout_s: float) -> None:
        """Waits up to `timeout_s` seconds (less when something arrives); raises DeviceError
        at once when the host is gone (socket EOF, dead host thread)."""
        ...


@runtime_checkable
class NoWaitDevice(Protocol):
    """A device whose `execbuffer` waits a while for the command to run (saving a caller that
    only waits a sleep on the reply word), and that can also submit without waiting, for a
    caller with work of its own to do first (apir.guest.remote, `call(meanwhile=...)`)."""

    def execbuffer_nowait(self, payload, ring_idx: int = 0) -> None:
        """EXECBUFFER that returns once the command is submitted, as the ioctl does; the
        reply comes through the reply notification word. Errors as `execbuffer`'s."""
        ...
