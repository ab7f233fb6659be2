"""The backend proper (`ggml_backend`, ggml's "stream"), twin of the C guest's ggml-backend.cpp.

Theory of operation: `graph_compute` is the only real work: the cgraph is serialized with
`apir.codec.graph.serialize_graph` (tensor buffers become host handles through the backend's
`BufferTable`) and sent with `backend_graph_compute`; the host's `ggml_status` is returned
as is. Everything else ggml asks of a stream is optional and left NULL as in the C: no async
tensor access, no synchronize (calls are synchronous), no plans, no events; the C's
`graph_optimize` is a no-op, which NULL means too. The struct is Python-owned: `free` drops
it (ggml does not touch it after the call).
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
    from apir.codec.graph import serialize_graph

    g, abi, cb = owner.g, owner.abi, owner.callbacks
    name = cb.cstring(BACKEND_NAME)
    # Each thread serializes into the array its last graph used (so it keeps the largest one):
    # a fresh array per graph may fault its pages in again each time (serialize_graph's `out`).
    scratch = threading.local()

    def graph_compute(backend, cgraph):
        graph = serialize_graph(g, cgraph, owner.buffer_table, out=getattr(scratch, "out", None))
        scratch.out = graph.base
        return int(owner.client.backend_graph_compute(graph))

    return cb.iface(
        abi.BackendI,
        abi.protos["ggml_backend_i"],
        {
            "get_name": (lambda backend: name, None),
            "free": (lambda backend: owner.forget_backend(backend), None),
            "graph_compute": (graph_compute, g.statuses["FAILED"]),  # on an exception
        },
        "backend",
    )


def new_backend(owner, iface, device_ptr: int):
    """A new `ggml_backend` struct for device `device_ptr`; the caller keeps it alive."""
    return owner.abi.Backend(guid=ctypes.addressof(_GUID_C), iface=iface, device=device_ptr, context=None)
