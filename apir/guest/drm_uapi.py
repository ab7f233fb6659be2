"""The kernel's DRM and virtio-gpu UAPI as ctypes structures and ioctl request numbers.

Theory of operation: each structure of `drm/drm.h` and `drm/virtgpu_drm.h` that apir passes
to the kernel is declared once here as a `ctypes.Structure` with the C field names; each
request number is computed from its structure type by `_IOWR` / `_IOW` (the kernel's
`asm-generic/ioctl.h` encoding: dir << 30 | size << 16 | type << 8 | nr), so the size inside
a number cannot drift from the structure. Tests compile a C program against the kernel header
and compare sizes, offsets and numbers with these.

EXECBUFFER has two layouts, the 40-byte one of kernels before syncobj support (6.1 LTS) and
the 64-byte one of newer kernels; either number works on either kernel, and `apir.guest.drm`
keeps whichever the kernel accepts. The `_IOC` encoding is the generic one (x86-64, ARM64,
RISC-V); other architectures are not supported. docs/protocol.md (section 1) says why both.

The values these structures carry (params, flags, capsets) are apir.codec.virtgpu's, shared
with every other device. No I/O happens here.
"""

from __future__ import annotations

import ctypes

from apir.codec.virtgpu import IoctlName

__all__ = [
    "DrmVersion",
    "DrmGemClose",
    "DrmVirtgpuGetparam",
    "DrmVirtgpuGetCaps",
    "DrmVirtgpuContextSetParam",
    "DrmVirtgpuContextInit",
    "DrmVirtgpuResourceCreateBlob",
    "DrmVirtgpuMap",
    "DrmVirtgpuExecbuffer",
    "DrmVirtgpuExecbuffer61",
    "DRM_IOCTL_VERSION",
    "DRM_IOCTL_GEM_CLOSE",
    "DRM_IOCTL_VIRTGPU_MAP",
    "DRM_IOCTL_VIRTGPU_EXECBUFFER",
    "DRM_IOCTL_VIRTGPU_EXECBUFFER_61",
    "DRM_IOCTL_VIRTGPU_GETPARAM",
    "DRM_IOCTL_VIRTGPU_GET_CAPS",
    "DRM_IOCTL_VIRTGPU_RESOURCE_CREATE_BLOB",
    "DRM_IOCTL_VIRTGPU_CONTEXT_INIT",
    "REQUEST_NAMES",
]

# --- asm-generic/ioctl.h ------------------------------------------------------------------
_IOC_NRBITS, _IOC_TYPEBITS, _IOC_SIZEBITS = 8, 8, 14
_IOC_NRSHIFT = 0
_IOC_TYPESHIFT = _IOC_NRSHIFT + _IOC_NRBITS
_IOC_SIZESHIFT = _IOC_TYPESHIFT + _IOC_TYPEBITS
_IOC_DIRSHIFT = _IOC_SIZESHIFT + _IOC_SIZEBITS
_IOC_WRITE, _IOC_READ = 1, 2


def _IOC(direction: int, type_: int, nr: int, struct_type) -> int:
    size = ctypes.sizeof(struct_type)
    if size >= 1 << _IOC_SIZEBITS:
        raise ValueError(f"{struct_type.__name__} is too large for an ioctl number ({size} bytes)")
    return (direction << _IOC_DIRSHIFT) | (type_ << _IOC_TYPESHIFT) | (nr << _IOC_NRSHIFT) | (size << _IOC_SIZESHIFT)


# --- drm/drm.h --------------------------------------------------------------------------
DRM_IOCTL_BASE = ord("d")
DRM_COMMAND_BASE = 0x40


def DRM_IOWR(nr: int, struct_type) -> int:
    return _IOC(_IOC_READ | _IOC_WRITE, DRM_IOCTL_BASE, nr, struct_type)


def DRM_IOW(nr: int, struct_type) -> int:
    return _IOC(_IOC_WRITE, DRM_IOCTL_BASE, nr, struct_type)


class DrmVersion(ctypes.Structure):
    """`struct drm_version`: the driver's name ("virtio_gpu"), date and description. The
    kernel fills each *_len with the full length and copies at most the caller's *_len."""

    _fields_ = [
        ("version_major", ctypes.c_int),
        ("version_minor", ctypes.c_int),
        ("version_patchlevel", ctypes.c_int),
        ("name_len", ctypes.c_size_t),
        ("name", ctypes.c_void_p),
        ("date_len", ctypes.c_size_t),
        ("date", ctypes.c_void_p),
        ("desc_len", ctypes.c_size_t),
        ("desc", ctypes.c_void_p),
    ]


class DrmGemClose(ctypes.Structure):
    """`struct drm_gem_close`."""

    _fields_ = [("handle", ctypes.c_uint32), ("pad", ctypes.c_uint32)]


DRM_IOCTL_VERSION = DRM_IOWR(0x00, DrmVersion)
DRM_IOCTL_GEM_CLOSE = DRM_IOW(0x09, DrmGemClose)

# --- drm/virtgpu_drm.h ----------------------------------------------------------------------
DRM_VIRTGPU_MAP = 0x01
DRM_VIRTGPU_EXECBUFFER = 0x02
DRM_VIRTGPU_GETPARAM = 0x03
DRM_VIRTGPU_GET_CAPS = 0x09
DRM_VIRTGPU_RESOURCE_CREATE_BLOB = 0x0A
DRM_VIRTGPU_CONTEXT_INIT = 0x0B


class DrmVirtgpuMap(ctypes.Structure):
    """`struct drm_virtgpu_map`: in `handle`, out `offset` (for mmap of the DRM fd)."""

    _fields_ = [("offset", ctypes.c_uint64), ("handle", ctypes.c_uint32), ("pad", ctypes.c_uint32)]


class DrmVirtgpuExecbuffer(ctypes.Structure):
    """`struct drm_virtgpu_execbuffer` of current kernels (64 bytes, with syncobjs)."""

    _fields_ = [
        ("flags", ctypes.c_uint32),
        ("size", ctypes.c_uint32),
        ("command", ctypes.c_uint64),
        ("bo_handles", ctypes.c_uint64),
        ("num_bo_handles", ctypes.c_uint32),
        ("fence_fd", ctypes.c_int32),
        ("ring_idx", ctypes.c_uint32),
        ("syncobj_stride", ctypes.c_uint32),
        ("num_in_syncobjs", ctypes.c_uint32),
        ("num_out_syncobjs", ctypes.c_uint32),
        ("in_syncobjs", ctypes.c_uint64),
        ("out_syncobjs", ctypes.c_uint64),
    ]


class DrmVirtgpuExecbuffer61(ctypes.Structure):
    """`struct drm_virtgpu_execbuffer` of kernels before syncobj support (6.1 LTS among
    them): 40 bytes, `pad` where the newer layout has `syncobj_stride`."""

    _fields_ = [
        ("flags", ctypes.c_uint32),
        ("size", ctypes.c_uint32),
        ("command", ctypes.c_uint64),
        ("bo_handles", ctypes.c_uint64),
        ("num_bo_handles", ctypes.c_uint32),
        ("fence_fd", ctypes.c_int32),
        ("ring_idx", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
    ]


class DrmVirtgpuGetparam(ctypes.Structure):
    """`struct drm_virtgpu_getparam`: `value` is the *address* of a u64 the kernel writes
    (its low 32 bits only: zero it first)."""

    _fields_ = [("param", ctypes.c_uint64), ("value", ctypes.c_uint64)]


class DrmVirtgpuGetCaps(ctypes.Structure):
    """`struct drm_virtgpu_get_caps`: the kernel copies up to `size` bytes of capset
    `cap_set_id` version `cap_set_ver` to address `addr`."""

    _fields_ = [
        ("cap_set_id", ctypes.c_uint32),
        ("cap_set_ver", ctypes.c_uint32),
        ("addr", ctypes.c_uint64),
        ("size", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
    ]


class DrmVirtgpuResourceCreateBlob(ctypes.Structure):
    """`struct drm_virtgpu_resource_create_blob`: out `bo_handle` (GEM) and `res_handle`
    (the resource id the host sees)."""

    _fields_ = [
        ("blob_mem", ctypes.c_uint32),
        ("blob_flags", ctypes.c_uint32),
        ("bo_handle", ctypes.c_uint32),
        ("res_handle", ctypes.c_uint32),
        ("size", ctypes.c_uint64),
        ("pad", ctypes.c_uint32),
        ("cmd_size", ctypes.c_uint32),
        ("cmd", ctypes.c_uint64),
        ("blob_id", ctypes.c_uint64),
    ]


class DrmVirtgpuContextSetParam(ctypes.Structure):
    """`struct drm_virtgpu_context_set_param`."""

    _fields_ = [("param", ctypes.c_uint64), ("value", ctypes.c_uint64)]


class DrmVirtgpuContextInit(ctypes.Structure):
    """`struct drm_virtgpu_context_init`: `ctx_set_params` is the address of an array of
    `num_params` DrmVirtgpuContextSetParam."""

    _fields_ = [("num_params", ctypes.c_uint32), ("pad", ctypes.c_uint32), ("ctx_set_params", ctypes.c_uint64)]


DRM_IOCTL_VIRTGPU_MAP = DRM_IOWR(DRM_COMMAND_BASE + DRM_VIRTGPU_MAP, DrmVirtgpuMap)
DRM_IOCTL_VIRTGPU_EXECBUFFER = DRM_IOWR(DRM_COMMAND_BASE + DRM_VIRTGPU_EXECBUFFER, DrmVirtgpuExecbuffer)
DRM_IOCTL_VIRTGPU_EXECBUFFER_61 = DRM_IOWR(DRM_COMMAND_BASE + DRM_VIRTGPU_EXECBUFFER, DrmVirtgpuExecbuffer61)
DRM_IOCTL_VIRTGPU_GETPARAM = DRM_IOWR(DRM_COMMAND_BASE + DRM_VIRTGPU_GETPARAM, DrmVirtgpuGetparam)
DRM_IOCTL_VIRTGPU_GET_CAPS = DRM_IOWR(DRM_COMMAND_BASE + DRM_VIRTGPU_GET_CAPS, DrmVirtgpuGetCaps)
DRM_IOCTL_VIRTGPU_RESOURCE_CREATE_BLOB = DRM_IOWR(
    DRM_COMMAND_BASE + DRM_VIRTGPU_RESOURCE_CREATE_BLOB, DrmVirtgpuResourceCreateBlob
)
DRM_IOCTL_VIRTGPU_CONTEXT_INIT = DRM_IOWR(DRM_COMMAND_BASE + DRM_VIRTGPU_CONTEXT_INIT, DrmVirtgpuContextInit)

# request number -> C name, for error messages and logs
REQUEST_NAMES = {
    DRM_IOCTL_VERSION: IoctlName.VERSION,
    DRM_IOCTL_GEM_CLOSE: IoctlName.GEM_CLOSE,
    DRM_IOCTL_VIRTGPU_MAP: IoctlName.MAP,
    DRM_IOCTL_VIRTGPU_EXECBUFFER: IoctlName.EXECBUFFER,
    DRM_IOCTL_VIRTGPU_EXECBUFFER_61: IoctlName.EXECBUFFER + " (6.1 layout)",
    DRM_IOCTL_VIRTGPU_GETPARAM: IoctlName.GETPARAM,
    DRM_IOCTL_VIRTGPU_GET_CAPS: IoctlName.GET_CAPS,
    DRM_IOCTL_VIRTGPU_RESOURCE_CREATE_BLOB: IoctlName.RESOURCE_CREATE_BLOB,
    DRM_IOCTL_VIRTGPU_CONTEXT_INIT: IoctlName.CONTEXT_INIT,
}
