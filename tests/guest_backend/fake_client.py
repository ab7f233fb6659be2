"""A small in-memory stand-in for ApirClient: host buffers are bytearrays (or shared mmaps
for the guest-mapped path), every call is logged, and graphs are parsed with the host's
validating parser. It checks what the backend sends (handles, offsets, sizes); it does not
compute. The real host is used in test_remote_compute.py."""

from __future__ import annotations

import mmap
from types import SimpleNamespace

import numpy as np

from apir.codec.graph import parse_graph

HOST_BASE = 0x7F00_0000_0000  # a host address the guest only subtracts


class FakeBlob:
    def __init__(self, size):
        self.size = size
        self.memory = mmap.mmap(-1, size)
        self.res_id = id(self)


class FakeClient:
    def __init__(self, g, *, from_ptr=False, device_count=1, alignment=64, max_size=1 << 30):
        self.g = g
        self.calls = []
        self.buffers = {}  # handle -> bytearray or mmap
        self.blobs = {}
        self.freed = []
        self.destroyed = []
        self.graphs = []
        self.fail = set()  # method names that raise
        self.next_handle = 0x1000
        self.props = SimpleNamespace(async_=True, host_buffer=False, buffer_from_host_ptr=from_ptr,
                                     events=True, mmap_support=True)
        self.device_count = device_count
        self.alignment = alignment
        self.max_size = max_size
        self.graph_status = 0
        self.alloc_handle = None  # force a handle (0: the host failed)

    def _log(self, name, *args):
        self.calls.append((name,) + args)
        if name in self.fail:
            raise RuntimeError(f"fake {name} failed")

    def base(self, handle):
        return HOST_BASE + (handle << 24)

    # device
    def device_get_count(self):
        self._log("device_get_count")
        return self.device_count

    def device_get_name(self):
        self._log("device_get_name")
        return "FakeGPU"

    def device_get_description(self):
        self._log("device_get_description")
        return "a fake remote GPU"

    def device_get_type(self):
        self._log("device_get_type")
        return 1  # GGML_BACKEND_DEVICE_TYPE_GPU

    def device_get_memory(self):
        self._log("device_get_memory")
        return (3 << 30, 8 << 30)

    def device_get_props(self):
        self._log("device_get_props")
        return self.props

    def device_get_buffer_type(self):
        self._log("device_get_buffer_type")
        return 0xB0F7

    def device_supports_op(self, tensor_addr, buffer_handle=0):
        self._log("device_supports_op", tensor_addr, buffer_handle)
        return False

    def device_buffer_from_ptr(self, size, max_tensor_size):
        self._log("device_buffer_from_ptr", size, max_tensor_size)
        blob = FakeBlob(size)
        handle = self._new_handle()
        self.buffers[handle] = blob.memory
        self.blobs[handle] = blob
        return blob, handle, 0xB0F7

    def destroy_blob(self, blob):
        self._log("destroy_blob", blob)
        self.destroyed.append(blob)
        blob.memory.close()

    # buffer type
    def buffer_type_get_name(self, buft):
        self._log("buffer_type_get_name", buft)
        return "FakeBuft"

    def buffer_type_get_alignment(self, buft):
        self._log("buffer_type_get_alignment", buft)
        return self.alignment

    def buffer_type_get_max_size(self, buft):
        self._log("buffer_type_get_max_size", buft)
        return self.max_size

    def buffer_type_alloc_buffer(self, buft, size):
        self._log("buffer_type_alloc_buffer", buft, size)
        assert buft == 0xB0F7
        if self.alloc_handle is not None:
            return self.alloc_handle
        handle = self._new_handle()
        self.buffers[handle] = bytearray(size)
        return handle

    def buffer_type_get_alloc_size(self, buft, tensor_addr, buffer_handle=0):
        self._log("buffer_type_get_alloc_size", buft, tensor_addr, buffer_handle)
        return 4096

    def _new_handle(self):
        self.next_handle += 0x10
        return self.next_handle

    # buffer
    def buffer_get_base(self, handle):
        self._log("buffer_get_base", handle)
        return self.base(handle)

    def _span(self, handle, rpc, offset, size):
        assert int(rpc["buffer"]) == handle, (hex(int(rpc["buffer"])), hex(handle))
        start = int(rpc["data"]) + offset
        buf = self.buffers[handle]
        assert 0 <= start and start + size <= len(buf)
        return buf, start

    def buffer_set_tensor(self, handle, rpc, offset, data):
        data = bytes(data)
        self._log("buffer_set_tensor", handle, int(rpc["id"]), offset, len(data))
        buf, start = self._span(handle, rpc, offset, len(data))
        buf[start:start + len(data)] = data

    def buffer_get_tensor(self, handle, rpc, offset, out):
        self._log("buffer_get_tensor", handle, int(rpc["id"]), offset, len(out))
        buf, start = self._span(handle, rpc, offset, len(out))
        out[:] = buf[start:start + len(out)]

    def buffer_cpy_tensor(self, handle, src, dst):
        self._log("buffer_cpy_tensor", handle, int(src["id"]), int(dst["id"]))
        n = int(src["nb"][3]) * int(src["ne"][3])
        sbuf, s = self._span(int(src["buffer"]), src, 0, n)
        dbuf, d = self._span(handle, dst, 0, n)
        dbuf[d:d + n] = sbuf[s:s + n]
        return True

    def buffer_clear(self, handle, value):
        self._log("buffer_clear", handle, value)
        buf = self.buffers[handle]
        buf[:] = bytes([value]) * len(buf)

    def buffer_free_buffer(self, handle):
        self._log("buffer_free_buffer", handle)
        self.freed.append(handle)
        del self.buffers[handle]

    # backend
    def backend_graph_compute(self, graph):
        self._log("backend_graph_compute", len(graph))
        g = self.g
        self.graphs.append(parse_graph(np.asarray(graph, dtype=np.uint8), limits=g.limits,
                                       op_count=g.op_count, type_valid=g.valid_types))
        return self.graph_status

    def names(self):
        return [c[0] for c in self.calls]
