"""The guest kernel's virtio_gpu driver, reduced to apir's device seam (`VirtgpuDevice`) over
the fake front-end: CONTEXT_INIT is CTX_CREATE, a blob is RESOURCE_CREATE_BLOB (HOST3D,
MAPPABLE) + RESOURCE_MAP_BLOB at an offset of the host-visible region (the guest's mapping is
the front-end's mmap of the memfd the device sent), EXECBUFFER is SUBMIT_3D (returns once
queued, as the kernel does), GEM_CLOSE is UNMAP_BLOB + DETACH + UNREF."""

from __future__ import annotations

import struct

from apir.codec import virtgpu
from apir.codec.virtgpu import VirtioGpuCtrlType as T
from apir.guest.device import Blob
from apir.guest.errors import DeviceError
from apir.host.local.kernel import GETPARAMS

from .frontend import FakeFrontend, hdr, resp_type


class FrontendDriver:
    def __init__(self, fe: FakeFrontend, ctx_id: int = 1, first_res_id: int = 1, bar_base: int = 0):
        self.fe = fe
        self.ctx_id = ctx_id
        self.next_res_id = first_res_id
        self.bar_next = bar_base
        self.blobs: dict[int, Blob] = {}
        self.offsets: dict[int, int] = {}
        self.submits: list[int] = []

    def _ok(self, data: bytes, what: str, expect: int = T.RESP_OK_NODATA) -> bytes:
        if resp_type(data) != expect:
            raise DeviceError(f"{what}: response {resp_type(data):#x}")
        return data

    def _reap(self) -> None:
        self.fe.reap(0)
        for slot in list(self.submits):
            if 2 * slot in self.fe.done[0]:
                self.submits.remove(slot)
                self._ok(self.fe.wait(slot), "SUBMIT_3D")

    def get_param(self, param: int) -> int:
        return GETPARAMS.get(param, 0)

    def get_caps(self, capset_id: int, size: int) -> bytes:
        data = self.fe.command(hdr(T.CMD_GET_CAPSET) + struct.pack("<II", capset_id, 0))
        return self._ok(data, "GET_CAPSET", T.RESP_OK_CAPSET)[24 : 24 + size]

    def context_init(self, capset_id: int, num_rings: int = 1) -> None:
        body = struct.pack("<II64s", 4, capset_id, b"test")
        self._ok(self.fe.command(hdr(T.CMD_CTX_CREATE, self.ctx_id) + body), "CTX_CREATE")

    def create_blob(self, size: int) -> Blob:
        self._reap()
        res_id = self.next_res_id
        self.next_res_id += 1
        body = struct.pack(
            "<IIIIQQ", res_id, virtgpu.VIRTGPU_BLOB_MEM_HOST3D, virtgpu.VIRTGPU_BLOB_FLAG_USE_MAPPABLE, 0, 0, size
        )
        self._ok(self.fe.command(hdr(T.CMD_RESOURCE_CREATE_BLOB, self.ctx_id) + body), "CREATE_BLOB")
        offset = self.bar_next
        self.bar_next += size
        data = self.fe.command(hdr(T.CMD_RESOURCE_MAP_BLOB, self.ctx_id) + struct.pack("<IIQ", res_id, 0, offset))
        self._ok(data, "MAP_BLOB", T.RESP_OK_MAP_INFO)
        blob = Blob(res_id, res_id, size, self.fe.bar[offset])
        self.blobs[res_id] = blob
        self.offsets[res_id] = offset
        return blob

    def destroy_blob(self, blob: Blob) -> None:
        self._reap()
        rid = struct.pack("<II", blob.res_id, 0)
        self._ok(self.fe.command(hdr(T.CMD_RESOURCE_UNMAP_BLOB, self.ctx_id) + rid), "UNMAP_BLOB")
        self._ok(self.fe.command(hdr(T.CMD_CTX_DETACH_RESOURCE, self.ctx_id) + rid), "DETACH")
        self._ok(self.fe.command(hdr(T.CMD_RESOURCE_UNREF) + rid), "UNREF")
        self.blobs.pop(blob.res_id, None)

    def execbuffer(self, payload, ring_idx: int = 0) -> None:
        self._reap()
        data = bytes(payload)
        self.submits.append(self.fe.post(hdr(T.CMD_SUBMIT_3D, self.ctx_id) + struct.pack("<II", len(data), 0) + data))

    def close(self) -> None:
        for slot in self.submits:
            self._ok(self.fe.wait(slot), "SUBMIT_3D")
        self.submits.clear()
        for blob in list(self.blobs.values()):
            self.destroy_blob(blob)
        self._ok(self.fe.command(hdr(T.CMD_CTX_DESTROY, self.ctx_id)), "CTX_DESTROY")
