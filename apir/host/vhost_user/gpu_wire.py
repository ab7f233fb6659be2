"""virtio-gpu command and response layouts (linux/virtio_gpu.h), as the device reads them.

Theory of operation: every control command starts with `struct virtio_gpu_ctrl_hdr` (24 bytes:
type, flags, fence_id, ctx_id, ring_idx); the command's own fields follow. `parse_header`
splits a request into header and body; each `*_REQ` struct below is read from the body with
`unpack_body`, which refuses a body too short for it (`GpuError` with
VIRTIO_GPU_RESP_ERR_INVALID_PARAMETER) rather than reading past what the guest sent.
`response` builds a response header: the request's fence and ring (QEMU's
`virtio_gpu_ctrl_response`) and the response type. Numbers: apir.codec.virtgpu.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Tuple

from apir.errors import ApirError
from apir.codec.virtgpu import VIRTIO_GPU_FLAG_FENCE, VIRTIO_GPU_FLAG_INFO_RING_IDX, VirtioGpuCtrlType

__all__ = [
    "CTRL_HDR",
    "GpuError",
    "Header",
    "parse_header",
    "unpack_body",
    "response",
    "RESOURCE_ID_REQ",
    "CAPSET_INFO_REQ",
    "CAPSET_INFO_RESP",
    "GET_CAPSET_REQ",
    "CREATE_BLOB_REQ",
    "MEM_ENTRY",
    "CTX_CREATE_REQ",
    "SUBMIT_3D_REQ",
    "MAP_BLOB_REQ",
    "MAP_INFO_RESP",
    "DISPLAY_ONE",
    "UPDATE_CURSOR_REQ",
    "CTX_NAME_SIZE",
]

CTRL_HDR = struct.Struct("<IIQIB3x")  # type, flags, fence_id, ctx_id, ring_idx
RESOURCE_ID_REQ = struct.Struct("<II")  # resource_id, padding (UNREF, ATTACH/DETACH, UNMAP_BLOB)
CAPSET_INFO_REQ = struct.Struct("<II")  # capset_index, padding
CAPSET_INFO_RESP = struct.Struct("<IIII")  # capset_id, capset_max_version, capset_max_size, padding
GET_CAPSET_REQ = struct.Struct("<II")  # capset_id, capset_version
CREATE_BLOB_REQ = struct.Struct("<IIIIQQ")  # resource_id, blob_mem, blob_flags, nr_entries, blob_id, size
MEM_ENTRY = struct.Struct("<QII")  # addr, length, padding
CTX_NAME_SIZE = 64
CTX_CREATE_REQ = struct.Struct(f"<II{CTX_NAME_SIZE}s")  # nlen, context_init, debug_name
SUBMIT_3D_REQ = struct.Struct("<II")  # size, num_in_fences (then `size` command bytes)
MAP_BLOB_REQ = struct.Struct("<IIQ")  # resource_id, padding, offset
MAP_INFO_RESP = struct.Struct("<II")  # map_info, padding
DISPLAY_ONE = struct.Struct("<IIIIII")  # r.x, r.y, r.width, r.height, enabled, flags
UPDATE_CURSOR_REQ = struct.Struct("<IIIIIIII")  # pos (scanout_id, x, y, pad), resource_id, hot_x, hot_y, pad


class GpuError(ApirError):
    """A command refused with response type `code` (a VIRTIO_GPU_RESP_ERR_*)."""

    def __init__(self, code: VirtioGpuCtrlType, why: str):
        super().__init__(why)
        self.code = code


@dataclass(frozen=True)
class Header:
    type: int
    flags: int
    fence_id: int
    ctx_id: int
    ring_idx: int

    @property
    def fenced(self) -> bool:
        return bool(self.flags & VIRTIO_GPU_FLAG_FENCE)

    @property
    def timeline(self) -> Tuple[int, int]:
        """The fence timeline: (ctx_id, ring_idx) with INFO_RING_IDX, else the global (0, -1)."""
        if self.flags & VIRTIO_GPU_FLAG_INFO_RING_IDX:
            return (self.ctx_id, self.ring_idx)
        return (0, -1)


NO_HEADER = Header(0, 0, 0, 0, 0)


def parse_header(request: bytes) -> Tuple[Header, bytes]:
    """(header, body). Raises GpuError(ERR_UNSPEC) for a request shorter than the header."""
    if len(request) < CTRL_HDR.size:
        raise GpuError(VirtioGpuCtrlType.RESP_ERR_UNSPEC, f"request of {len(request)} bytes has no header")
    return Header(*CTRL_HDR.unpack_from(request)), request[CTRL_HDR.size :]


def unpack_body(layout: struct.Struct, body: bytes, what: str) -> tuple:
    """`layout` read from the start of `body`. Raises GpuError(ERR_INVALID_PARAMETER)."""
    if len(body) < layout.size:
        raise GpuError(VirtioGpuCtrlType.RESP_ERR_INVALID_PARAMETER, f"{what}: {len(body)} bytes, needs {layout.size}")
    return layout.unpack_from(body)


def response(hdr: Header, rtype: int, payload: bytes = b"") -> bytes:
    """A response header for `hdr` (its fence and ring kept), then `payload`."""
    flags = hdr.flags & (VIRTIO_GPU_FLAG_FENCE | VIRTIO_GPU_FLAG_INFO_RING_IDX)
    return CTRL_HDR.pack(rtype, flags, hdr.fence_id, hdr.ctx_id, hdr.ring_idx) + payload
