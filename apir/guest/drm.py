"""`DrmDevice`: the virtgpu device through a real `/dev/dri/renderD*` node.

Theory of operation: every kernel call goes through one `Kernel` object (`ioctl` and `mmap`,
the real ones by default; tests pass a fake kernel) and one wrapper, `DrmDevice._ioctl`,
which retries EINTR/EAGAIN like libdrm's `drmIoctl` and turns any other errno into an
`IoctlError` naming the node and the request. Structures and request numbers come from
`apir.guest.drm_uapi`, the values they carry from apir.codec.virtgpu.

Opening: `DrmDevice()` takes the first render node whose driver (DRM_IOCTL_VERSION) is
`virtio_gpu` with major version 0, as the C `virtgpu_open_device` does; `DrmDevice(path)`
insists on that node. It then checks the three capabilities APIR needs (GETPARAM
RESOURCE_BLOB, HOST_VISIBLE, CONTEXT_INIT) and raises `MissingCapability` naming the node
and the capability. Which capset to use is decided above this layer (apir.guest.remote).

EXECBUFFER: the first submission uses the current 64-byte structure; when the kernel rejects
its number (EINVAL / ENOTTY) the 40-byte structure of older kernels (6.1) is tried, and the
accepted one is kept. See apir.guest.drm_uapi for why both normally work.
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import glob
import logging
import mmap
import os
import threading
from typing import Dict, Iterator, Optional, Tuple

from apir.codec.virtgpu import (
    VIRTGPU_BLOB_FLAG_USE_MAPPABLE,
    VIRTGPU_BLOB_MEM_HOST3D,
    VIRTGPU_EXECBUF_RING_IDX,
    VirtgpuContextParam,
    VirtgpuParam,
)
from apir.guest import drm_uapi as uapi
from apir.guest.device import Blob
from apir.guest.errors import DeviceError, DeviceNotFound, IoctlError, MissingCapability

__all__ = ["DrmDevice", "Kernel", "find_virtgpu_nodes", "DRI_DIR", "VIRTIO_GPU_DRIVER"]

log = logging.getLogger(__name__)

DRI_DIR = "/dev/dri"
VIRTIO_GPU_DRIVER = "virtio_gpu"
_RETRY_ERRNOS = (errno_mod.EINTR, errno_mod.EAGAIN)
_NAME_MAX = 64  # bytes of the driver name read by DRM_IOCTL_VERSION


class Kernel:
    """The system calls DrmDevice makes; tests replace it with a fake kernel."""

    def ioctl(self, fd: int, request: int, arg: ctypes.Structure) -> None:
        """ioctl(2) with `arg` passed by address and updated in place. Raises OSError."""
        import fcntl

        fcntl.ioctl(fd, request, arg, True)

    def mmap(self, fd: int, size: int, offset: int):
        """A read/write shared mapping of `size` bytes of `fd` at `offset`. Raises OSError."""
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)

    def open(self, path: str) -> int:
        return os.open(path, os.O_RDWR | os.O_CLOEXEC)

    def close(self, fd: int) -> None:
        os.close(fd)


def _ioctl(kernel: Kernel, fd: int, node: str, request: int, arg) -> None:
    """The one ioctl wrapper: retries EINTR/EAGAIN, maps other errnos to IoctlError."""
    while True:
        try:
            kernel.ioctl(fd, request, arg)
            return
        except OSError as exc:
            if exc.errno in _RETRY_ERRNOS:
                continue
            name = uapi.REQUEST_NAMES.get(request, hex(request))
            raise IoctlError(node, name, exc.errno or 0, os.strerror(exc.errno or 0)) from None


def _driver_version(kernel: Kernel, fd: int, node: str) -> Tuple[str, int]:
    """(driver name, major version) of an open DRM node (DRM_IOCTL_VERSION)."""
    name = ctypes.create_string_buffer(_NAME_MAX)
    ver = uapi.DrmVersion(name_len=_NAME_MAX, name=ctypes.addressof(name))
    _ioctl(kernel, fd, node, uapi.DRM_IOCTL_VERSION, ver)
    length = min(ver.name_len, _NAME_MAX)
    return name.raw[:length].split(b"\0", 1)[0].decode("ascii", "replace"), ver.version_major


def find_virtgpu_nodes(dri_dir: str = DRI_DIR, kernel: Optional[Kernel] = None) -> Iterator[str]:
    """Paths of the render nodes under `dri_dir` whose driver is virtio_gpu, sorted.
    Nodes that cannot be opened or queried are skipped (and logged)."""
    kernel = kernel or Kernel()
    for path in sorted(glob.glob(os.path.join(dri_dir, "renderD*"))):
        try:
            fd = kernel.open(path)
        except OSError as exc:
            log.info("%s: cannot open: %s", path, exc)
            continue
        try:
            name, major = _driver_version(kernel, fd, path)
        except DeviceError as exc:
            log.info("%s: %s", path, exc)
            continue
        finally:
            kernel.close(fd)
        if name == VIRTIO_GPU_DRIVER and major == 0:
            yield path
        else:
            log.info("%s: driver %s version %d, not virtio_gpu", path, name, major)


class DrmDevice:
    """A virtio-gpu render node through ioctls (implements `VirtgpuDevice`).

    `path`: a render node, or None for the first virtio_gpu node under `dri_dir`.
    Raises DeviceNotFound, MissingCapability or IoctlError. A context manager; `close()` is
    idempotent and releases every blob still open."""

    def __init__(self, path: Optional[str] = None, *, dri_dir: str = DRI_DIR, kernel: Optional[Kernel] = None):
        self.kernel = kernel or Kernel()
        if path is None:
            path = next(find_virtgpu_nodes(dri_dir, self.kernel), None)
            if path is None:
                raise DeviceNotFound(f"no render node with the {VIRTIO_GPU_DRIVER} driver under {dri_dir}")
        self.name = path
        self._lock = threading.Lock()
        self._blobs: Dict[int, Blob] = {}
        # (request, structure) once the kernel accepted one
        self._execbuffer_layout: Optional[Tuple[int, type]] = None
        try:
            self.fd = self.kernel.open(path)
        except OSError as exc:
            raise DeviceNotFound(f"{path}: cannot open: {exc.strerror}") from None
        try:
            driver, major = _driver_version(self.kernel, self.fd, path)
            if driver != VIRTIO_GPU_DRIVER or major != 0:
                raise DeviceNotFound(f"{path}: driver {driver!r} version {major}, not {VIRTIO_GPU_DRIVER} 0")
            self._check_capabilities()
        except BaseException:
            self.kernel.close(self.fd)
            self.fd = -1
            raise

    def _check_capabilities(self) -> None:
        for param, what in (
            (VirtgpuParam.RESOURCE_BLOB, "blob resources (VIRTGPU_PARAM_RESOURCE_BLOB)"),
            (VirtgpuParam.HOST_VISIBLE, "host-visible blobs (VIRTGPU_PARAM_HOST_VISIBLE)"),
            (VirtgpuParam.CONTEXT_INIT, "context init (VIRTGPU_PARAM_CONTEXT_INIT)"),
        ):
            if not self.get_param(param):
                raise MissingCapability(self.name, what)

    def _ioctl(self, request: int, arg) -> None:
        if self.fd < 0:
            raise DeviceError(f"{self.name}: device is closed")
        _ioctl(self.kernel, self.fd, self.name, request, arg)

    # --- VirtgpuDevice ---------------------------------------------------------------------
    def get_param(self, param: int) -> int:
        """GETPARAM; 0 when the kernel does not know `param` (EINVAL), as the C does."""
        value = ctypes.c_uint64(0)  # the kernel writes only the low 32 bits
        args = uapi.DrmVirtgpuGetparam(param=param, value=ctypes.addressof(value))
        try:
            self._ioctl(uapi.DRM_IOCTL_VIRTGPU_GETPARAM, args)
        except IoctlError as exc:
            if exc.errno == errno_mod.EINVAL:
                return 0
            raise
        return value.value

    def get_caps(self, capset_id: int, size: int) -> bytes:
        """GET_CAPS version 0. Raises MissingCapability when the kernel does not offer the
        capset (EINVAL), IoctlError otherwise."""
        buf = ctypes.create_string_buffer(size)
        args = uapi.DrmVirtgpuGetCaps(cap_set_id=capset_id, cap_set_ver=0, addr=ctypes.addressof(buf), size=size)
        try:
            self._ioctl(uapi.DRM_IOCTL_VIRTGPU_GET_CAPS, args)
        except IoctlError as exc:
            if exc.errno == errno_mod.EINVAL:
                raise MissingCapability(self.name, f"capset {capset_id}", str(exc)) from None
            raise
        return buf.raw

    def context_init(self, capset_id: int, num_rings: int = 1) -> None:
        params = (uapi.DrmVirtgpuContextSetParam * 3)(
            uapi.DrmVirtgpuContextSetParam(VirtgpuContextParam.CAPSET_ID, capset_id),
            uapi.DrmVirtgpuContextSetParam(VirtgpuContextParam.NUM_RINGS, num_rings),
            # no drm events on fence signaling: replies are polled in shared memory
            uapi.DrmVirtgpuContextSetParam(VirtgpuContextParam.POLL_RINGS_MASK, 0),
        )
        args = uapi.DrmVirtgpuContextInit(num_params=len(params), ctx_set_params=ctypes.addressof(params))
        self._ioctl(uapi.DRM_IOCTL_VIRTGPU_CONTEXT_INIT, args)

    def create_blob(self, size: int) -> Blob:
        """RESOURCE_CREATE_BLOB (HOST3D, MAPPABLE) + MAP + mmap. On a MAP or mmap failure
        the GEM handle is closed before the error is raised."""
        args = uapi.DrmVirtgpuResourceCreateBlob(
            blob_mem=VIRTGPU_BLOB_MEM_HOST3D, blob_flags=VIRTGPU_BLOB_FLAG_USE_MAPPABLE, size=size
        )
        self._ioctl(uapi.DRM_IOCTL_VIRTGPU_RESOURCE_CREATE_BLOB, args)
        bo_handle, res_id = args.bo_handle, args.res_handle
        try:
            map_args = uapi.DrmVirtgpuMap(handle=bo_handle)
            self._ioctl(uapi.DRM_IOCTL_VIRTGPU_MAP, map_args)
            try:
                memory = self.kernel.mmap(self.fd, size, map_args.offset)
            except OSError as exc:
                raise DeviceError(f"{self.name}: mmap of blob {res_id} ({size} bytes) failed: {exc}") from None
        except BaseException:
            self._gem_close(bo_handle)
            raise
        blob = Blob(res_id=res_id, bo_handle=bo_handle, size=size, memory=memory)
        with self._lock:
            self._blobs[bo_handle] = blob
        return blob

    def destroy_blob(self, blob: Blob) -> None:
        with self._lock:
            if self._blobs.pop(blob.bo_handle, None) is None:
                return  # already destroyed
        try:
            blob.memory.close()
        finally:
            self._gem_close(blob.bo_handle)

    def _gem_close(self, bo_handle: int) -> None:
        self._ioctl(uapi.DRM_IOCTL_GEM_CLOSE, uapi.DrmGemClose(handle=bo_handle))

    def execbuffer(self, payload, ring_idx: int = 0) -> None:
        data = memoryview(payload).cast("B")
        command = (ctypes.c_char * len(data)).from_buffer_copy(data)
        layouts = (
            [self._execbuffer_layout]
            if self._execbuffer_layout
            else [
                (uapi.DRM_IOCTL_VIRTGPU_EXECBUFFER, uapi.DrmVirtgpuExecbuffer),
                (uapi.DRM_IOCTL_VIRTGPU_EXECBUFFER_61, uapi.DrmVirtgpuExecbuffer61),
            ]
        )
        first_error: Optional[IoctlError] = None
        for request, structure in layouts:
            args = structure(
                flags=VIRTGPU_EXECBUF_RING_IDX, size=len(data), command=ctypes.addressof(command), ring_idx=ring_idx
            )
            try:
                self._ioctl(request, args)
            except IoctlError as exc:
                if exc.errno not in (errno_mod.EINVAL, errno_mod.ENOTTY) or self._execbuffer_layout:
                    raise
                first_error = first_error or exc
                continue
            if self._execbuffer_layout is None:
                log.info("%s: EXECBUFFER uses the %d-byte layout", self.name, ctypes.sizeof(structure))
                self._execbuffer_layout = (request, structure)
            return
        assert first_error is not None  # the loop ran (two layouts) and every one failed
        raise first_error

    @property
    def execbuffer_size(self) -> Optional[int]:
        """Size of the EXECBUFFER structure the kernel accepted (64 or 40), None before the
        first submission."""
        return ctypes.sizeof(self._execbuffer_layout[1]) if self._execbuffer_layout else None

    def close(self) -> None:
        if self.fd < 0:
            return
        with self._lock:
            blobs = list(self._blobs.values())
        for blob in blobs:
            try:
                self.destroy_blob(blob)
            except DeviceError as exc:
                log.warning("%s", exc)
        self.kernel.close(self.fd)
        self.fd = -1

    def __enter__(self) -> "DrmDevice":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DrmDevice({self.name!r})"
