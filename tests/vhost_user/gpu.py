"""virtio-gpu command builders for the tests (the guest kernel's side of each command)."""

import struct

from apir.codec import virtgpu
from apir.codec.virtgpu import VirtioGpuCtrlType as T

from .frontend import hdr

HOST3D = virtgpu.VIRTGPU_BLOB_MEM_HOST3D
GUEST = virtgpu.VIRTIO_GPU_BLOB_MEM_GUEST
MAPPABLE = virtgpu.VIRTGPU_BLOB_FLAG_USE_MAPPABLE


def ctx_create(ctx_id, capset=10, name=b"t", nlen=None, **kw):
    return hdr(T.CMD_CTX_CREATE, ctx_id, **kw) + struct.pack(
        "<II64s", len(name) if nlen is None else nlen, capset, name
    )


def ctx_destroy(ctx_id, **kw):
    return hdr(T.CMD_CTX_DESTROY, ctx_id, **kw)


def create_blob(res_id, size, ctx_id=1, mem=HOST3D, flags=MAPPABLE, entries=(), nr=None, blob_id=0):
    body = struct.pack("<IIIIQQ", res_id, mem, flags, len(entries) if nr is None else nr, blob_id, size)
    body += b"".join(struct.pack("<QII", a, n, 0) for a, n in entries)
    return hdr(T.CMD_RESOURCE_CREATE_BLOB, ctx_id) + body


def map_blob(res_id, offset, ctx_id=1):
    return hdr(T.CMD_RESOURCE_MAP_BLOB, ctx_id) + struct.pack("<IIQ", res_id, 0, offset)


def res_cmd(cmd, res_id, ctx_id=0):
    return hdr(cmd, ctx_id) + struct.pack("<II", res_id, 0)


def submit(ctx_id, payload, size=None, **kw):
    return hdr(T.CMD_SUBMIT_3D, ctx_id, **kw) + struct.pack("<II", len(payload) if size is None else size, 0) + payload
