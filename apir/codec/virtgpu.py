"""The virtio-gpu vocabulary every device speaks: DRM params, capsets, blob and EXECBUFFER flags.

Theory of operation: the guest's device seam (`apir.guest.device.VirtgpuDevice`) is the set of
virtgpu DRM ioctls, and every device (a real render node, the local socket transport, the
embedded host) and the host side of the local transport (apir.host.local_kernel) use the same
numbers for them. They are declared once, here, with the names of `drm/virtgpu_drm.h` (the
kernel UAPI) and of the C guest (`virtgpu.cpp`, `virtgpu-shm.cpp`); tests compare them with the
kernel header (tests/guest/test_drm_uapi.py). The ioctl request numbers and structures, which
only a real render node needs, are in apir.guest.drm_uapi.

Pure constants: no I/O, no library.
"""

from __future__ import annotations

import enum

__all__ = [
    "VIRTGPU_DRM_CAPSET_VENUS",
    "VIRTGPU_DRM_CAPSET_APIR",
    "VirtgpuParam",
    "VirtgpuContextParam",
    "VIRTGPU_BLOB_MEM_HOST3D",
    "VIRTGPU_BLOB_FLAG_USE_MAPPABLE",
    "VIRTGPU_EXECBUF_RING_IDX",
    "VIRTGPU_MAX_RINGS",
    "BLOB_ALIGNMENT",
    "blob_size",
    "IoctlName",
]

# Capset ids (virglrenderer's VIRGL_RENDERER_CAPSET_*; the C guest's VIRTGPU_DRM_CAPSET_*).
VIRTGPU_DRM_CAPSET_VENUS = 4
VIRTGPU_DRM_CAPSET_APIR = 10


class VirtgpuParam(enum.IntEnum):
    """`VIRTGPU_PARAM_*` for DRM_IOCTL_VIRTGPU_GETPARAM."""

    FEATURES_3D = 1  # VIRTGPU_PARAM_3D_FEATURES
    CAPSET_QUERY_FIX = 2
    RESOURCE_BLOB = 3
    HOST_VISIBLE = 4
    CROSS_DEVICE = 5
    CONTEXT_INIT = 6
    SUPPORTED_CAPSET_IDS = 7  # VIRTGPU_PARAM_SUPPORTED_CAPSET_IDs: bit n set when capset n is offered
    EXPLICIT_DEBUG_NAME = 8


class VirtgpuContextParam(enum.IntEnum):
    """`VIRTGPU_CONTEXT_PARAM_*` for DRM_IOCTL_VIRTGPU_CONTEXT_INIT."""

    CAPSET_ID = 0x0001
    NUM_RINGS = 0x0002
    POLL_RINGS_MASK = 0x0003
    DEBUG_NAME = 0x0004


# RESOURCE_CREATE_BLOB: APIR blobs are host memory (HOST3D) the guest maps (USE_MAPPABLE).
VIRTGPU_BLOB_MEM_HOST3D = 0x0002
VIRTGPU_BLOB_FLAG_USE_MAPPABLE = 0x0001
# EXECBUFFER: the command goes to ring `ring_idx` (the only flag APIR uses: no fences).
VIRTGPU_EXECBUF_RING_IDX = 0x04
VIRTGPU_MAX_RINGS = 64  # the kernel's bound on CONTEXT_INIT's NUM_RINGS

# Every blob is a multiple of this: the C guest rounds blob sizes to 16 KiB (virtgpu-shm.cpp,
# align64(size, 16384)), and mmap offsets must be page aligned on 4 KiB and 16 KiB kernels.
BLOB_ALIGNMENT = 16384


def blob_size(size: int) -> int:
    """`size` rounded up to a multiple of BLOB_ALIGNMENT (at least one), as the C
    `virtgpu_shmem_create` does. Raises ValueError for a negative size."""
    if size < 0:
        raise ValueError(f"negative blob size {size}")
    return max(BLOB_ALIGNMENT, (size + BLOB_ALIGNMENT - 1) // BLOB_ALIGNMENT * BLOB_ALIGNMENT)


class IoctlName:
    """The C names of the ioctls a device stands for, as `IoctlError.request` reports them."""

    VERSION = "DRM_IOCTL_VERSION"
    GEM_CLOSE = "DRM_IOCTL_GEM_CLOSE"
    GETPARAM = "DRM_IOCTL_VIRTGPU_GETPARAM"
    GET_CAPS = "DRM_IOCTL_VIRTGPU_GET_CAPS"
    CONTEXT_INIT = "DRM_IOCTL_VIRTGPU_CONTEXT_INIT"
    RESOURCE_CREATE_BLOB = "DRM_IOCTL_VIRTGPU_RESOURCE_CREATE_BLOB"
    MAP = "DRM_IOCTL_VIRTGPU_MAP"
    EXECBUFFER = "DRM_IOCTL_VIRTGPU_EXECBUFFER"
