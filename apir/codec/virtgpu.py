"""The virtio-gpu vocabulary every device speaks: DRM params, capsets, blob and EXECBUFFER flags.

Theory of operation: the guest's device seam (`apir.guest.device.VirtgpuDevice`) is the set of
virtgpu DRM ioctls, and every device (a real render node, the local socket transport, the
embedded host) and the host side of the local transport (apir.host.local.kernel) use the same
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
    "VirtioGpuCtrlType",
    "VirtioGpuFeature",
    "VIRTIO_GPU_FLAG_FENCE",
    "VIRTIO_GPU_FLAG_INFO_RING_IDX",
    "VIRTIO_GPU_CONTEXT_INIT_CAPSET_ID_MASK",
    "VIRTIO_GPU_MAX_SCANOUTS",
    "VIRTIO_GPU_SHM_ID_HOST_VISIBLE",
    "VIRTIO_GPU_BLOB_MEM_GUEST",
    "VIRTIO_GPU_BLOB_MEM_HOST3D_GUEST",
    "VIRTIO_GPU_BLOB_FLAG_USE_SHAREABLE",
    "VIRTIO_GPU_BLOB_FLAG_USE_CROSS_DEVICE",
    "VIRTIO_GPU_MAP_CACHE_CACHED",
    "VIRTIO_ID_GPU",
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


# --- the virtio-gpu device protocol (linux/virtio_gpu.h), for a device that serves the guest
# kernel's virtqueues (apir.host.vhost_user). Same numbers as the VIRTGPU_* above where they meet.
VIRTIO_ID_GPU = 16  # the virtio device id (QEMU's `virtio-id=16`)


class VirtioGpuFeature(enum.IntEnum):
    """`VIRTIO_GPU_F_*` device feature bits."""

    VIRGL = 0
    EDID = 1
    RESOURCE_UUID = 2
    RESOURCE_BLOB = 3
    CONTEXT_INIT = 4


class VirtioGpuCtrlType(enum.IntEnum):
    """`enum virtio_gpu_ctrl_type`: command types (0x1xx 2D, 0x2xx 3D, 0x3xx cursor) and
    response types (0x11xx ok, 0x12xx errors)."""

    CMD_GET_DISPLAY_INFO = 0x0100
    CMD_RESOURCE_CREATE_2D = 0x0101
    CMD_RESOURCE_UNREF = 0x0102
    CMD_SET_SCANOUT = 0x0103
    CMD_RESOURCE_FLUSH = 0x0104
    CMD_TRANSFER_TO_HOST_2D = 0x0105
    CMD_RESOURCE_ATTACH_BACKING = 0x0106
    CMD_RESOURCE_DETACH_BACKING = 0x0107
    CMD_GET_CAPSET_INFO = 0x0108
    CMD_GET_CAPSET = 0x0109
    CMD_GET_EDID = 0x010A
    CMD_RESOURCE_ASSIGN_UUID = 0x010B
    CMD_RESOURCE_CREATE_BLOB = 0x010C
    CMD_SET_SCANOUT_BLOB = 0x010D
    CMD_CTX_CREATE = 0x0200
    CMD_CTX_DESTROY = 0x0201
    CMD_CTX_ATTACH_RESOURCE = 0x0202
    CMD_CTX_DETACH_RESOURCE = 0x0203
    CMD_RESOURCE_CREATE_3D = 0x0204
    CMD_TRANSFER_TO_HOST_3D = 0x0205
    CMD_TRANSFER_FROM_HOST_3D = 0x0206
    CMD_SUBMIT_3D = 0x0207
    CMD_RESOURCE_MAP_BLOB = 0x0208
    CMD_RESOURCE_UNMAP_BLOB = 0x0209
    CMD_UPDATE_CURSOR = 0x0300
    CMD_MOVE_CURSOR = 0x0301
    RESP_OK_NODATA = 0x1100
    RESP_OK_DISPLAY_INFO = 0x1101
    RESP_OK_CAPSET_INFO = 0x1102
    RESP_OK_CAPSET = 0x1103
    RESP_OK_EDID = 0x1104
    RESP_OK_RESOURCE_UUID = 0x1105
    RESP_OK_MAP_INFO = 0x1106
    RESP_ERR_UNSPEC = 0x1200
    RESP_ERR_OUT_OF_MEMORY = 0x1201
    RESP_ERR_INVALID_SCANOUT_ID = 0x1202
    RESP_ERR_INVALID_RESOURCE_ID = 0x1203
    RESP_ERR_INVALID_CONTEXT_ID = 0x1204
    RESP_ERR_INVALID_PARAMETER = 0x1205


# virtio_gpu_ctrl_hdr.flags: the command carries a fence (answered when done); fence_id is on
# the timeline of ring `ring_idx` of context `ctx_id` rather than the device's global one.
VIRTIO_GPU_FLAG_FENCE = 0x01
VIRTIO_GPU_FLAG_INFO_RING_IDX = 0x02
VIRTIO_GPU_CONTEXT_INIT_CAPSET_ID_MASK = 0xFF  # CTX_CREATE's context_init: capset id in bits 0..7
VIRTIO_GPU_MAX_SCANOUTS = 16  # GET_DISPLAY_INFO always answers this many pmodes
VIRTIO_GPU_SHM_ID_HOST_VISIBLE = 1  # the shared memory region HOST3D blobs are mapped into
# RESOURCE_CREATE_BLOB's blob_mem (HOST3D is VIRTGPU_BLOB_MEM_HOST3D above) and blob_flags
VIRTIO_GPU_BLOB_MEM_GUEST = 0x0001
VIRTIO_GPU_BLOB_MEM_HOST3D_GUEST = 0x0003
VIRTIO_GPU_BLOB_FLAG_USE_SHAREABLE = 0x0002
VIRTIO_GPU_BLOB_FLAG_USE_CROSS_DEVICE = 0x0004
VIRTIO_GPU_MAP_CACHE_CACHED = 0x01  # RESOURCE_MAP_BLOB's map_info: the guest maps it cached
