"""The backend proper (`ggml_backend`, ggml's "stream"), twin of the C guest's ggml-backend.cpp.

Theory of operation: `graph_compute` is the only real work: the cgraph is serialized with
`apir.codec.graph.serialize_graph` (tensor buffers become host handles through the backend's
`BufferTable`), with each tensor's use count under the USE_COUNTS extension, and sent with
`backend_graph_compute`; the host's `ggml_status` is returned as is. Without the ASYNC
extension everything else ggml asks of a stream is left NULL as in the C (calls are
synchronous; no plans, no events). With it (`client.posting`):
set_tensor_async posts (apir.guest.client_async), get_tensor_async is a waited-for get (the
host runs it after every posted command, so the bytes are there when it returns),
cpy_tensor_async posts a copy between two of this backend's buffers, synchronize waits for
the posted commands, and event_record / event_wait send nothing: the host runs a context's
commands in order and every graph compute and read is waited for, so there is nothing to
record or wait for (the patched C guest does the same). The C's `graph_optimize` is a no-op,
which NULL means too. The struct is Python-owned: `free` drops it.
"""

from __future__ import annotations

import ctypes
import threading

__all__ = ["build_backend_iface", "new_backend", "BACKEND_NAME", "GUID"]

BACKEND_NAME = "API Remoting backend"
# ggml_backend_remoting_guid(): the same bytes, so ggml_guid_matches tells this backend apart.
GUID = bytes([0xB8, 0xF7, 0x4F, 0x86, 0x14, 0x03, 0x86, 0x02, 0x91, 0xC8, 0xDD, 0xE9, 0x02, 0x3F, 0xC0, 0x2B])
_GUID_C = (ctypes.c_uint8 * 16).from_buffer_copy(GUID)  # static, as in the C


def build_backend_iface(owner):
    """The `ggml_backend_i` of `owner`'s backends."""
    from apir.codec.constants import ApirExtension
    from apir.codec.graph import serialize_graph, write_use_counts
    from apir.ggml.cgraph import tensor_use_counts

    g, abi, cb = owner.g, owner.abi, owner.callbacks
    name = cb.cstring(BACKEND_NAME)
    # Each thread serializes into the array its last graph used (so it keeps the largest one):
    # a fresh array per graph may fault its pages in again each time (serialize_graph's `out`).
    scratch = threading.local()

    # USE_COUNTS: each record carries its tensor's count in the cgraph (a split's view shares
    # the whole graph's), so the host fuses no node that another split reads
    counts = bool(getattr(owner.client, "extensions", 0) & ApirExtension.USE_COUNTS)

    def graph_compute(backend, cgraph):
        graph = serialize_graph(g, cgraph, owner.buffer_table, out=getattr(scratch, "out", None))
        scratch.out = graph.base
        if counts:
            write_use_counts(graph, g.limits, lambda ids: tensor_use_counts(g, cgraph, ids))
        return int(owner.client.backend_graph_compute(graph))

    impls = {
        "get_name": (lambda backend: name, None),
        "free": (lambda backend: owner.forget_backend(backend), None),
        "graph_compute": (graph_compute, g.statuses["FAILED"]),  # on an exception
    }
    if getattr(owner.client, "posting", False):
        impls.update(_async_impls(owner))
    return cb.iface(abi.BackendI, abi.protos["ggml_backend_i"], impls, "backend")


def _async_impls(owner):
    """The ASYNC extension's entries of `ggml_backend_i` (see the module docstring)."""
    from apir.guest.backend.buffer import tensor_field

    g, client, ops = owner.g, owner.client, owner.buffer_ops

    def buffer_of(tensor):
        return tensor_field(g, tensor, "buffer")

    def set_tensor_async(backend, tensor, data, offset, size):
        ops.set_tensor(buffer_of(tensor), tensor, data, offset, size)

    def get_tensor_async(backend, tensor, data, offset, size):
        ops.get_tensor(buffer_of(tensor), tensor, data, offset, size)

    def cpy_tensor_async(backend_src, backend_dst, src, dst):
        dst_buf = buffer_of(dst)
        if len(owner.devices) > 1 or not owner.has_buffer(dst_buf):
            return False  # ggml copies through the guest
        return ops.cpy_tensor(dst_buf, src, dst, post=True)

    return {
        "set_tensor_async": (set_tensor_async, None),
        "get_tensor_async": (get_tensor_async, None),
        "cpy_tensor_async": (cpy_tensor_async, False),
        "synchronize": (lambda backend: client.synchronize(), None),
        "event_record": (lambda backend, event: None, None),
        "event_wait": (lambda backend, event: None, None),
    }


def new_backend(owner, iface, device_ptr: int):
    """A new `ggml_backend` struct for device `device_ptr`; the caller keeps it alive."""
    return owner.abi.Backend(guid=ctypes.addressof(_GUID_C), iface=iface, device=device_ptr, context=None)
