"""Test kit for apir.host: a HostContext with its blobs, and guest-side encoders.

`Guest` drives a HostContext the way a guest does: it owns a reply blob and a data blob
(mmaps, page-aligned), builds commands with apir.codec.wire.Encoder, submits them and reads
the notification word. The tensor encoders build wire bytes straight from real ggml tensors
(raw struct bytes for inline tensors, `apir_rpc_tensor` records like the C
`apir_serialize_tensor`; graphs through the codec's `serialize_graph`), so the host sees what
a ggml guest would send.
"""

from __future__ import annotations

import ctypes
import mmap
import struct
import threading
from typing import Callable, List, Optional

import numpy as np
import pytest

from apir import accel
from apir.codec.constants import (
    APIR_FORWARD_POSTED,
    ApirBackendCommandType as Cmd,
    ApirCommandType,
    ApirExtensionCommandType as X,
)
from apir.codec.graph import BufferTable, rpc_tensor_from_ggml, serialize_graph
from apir.codec.records import rpc_tensor_dtype
from apir.codec.wire import Decoder, Encoder
from apir.ggml.layout import tensor_record
from apir.ggml.lib import InitParams
from apir.host import HostContext

REPLY_RES, DATA_RES = 1, 2
# apir's guest computes through graph replay when the host has it (docs/protocol.md section 12)
GRAPH_COMPUTES = (Cmd.BACKEND_GRAPH_COMPUTE, X.GRAPH_COMPUTE_KEEP, X.GRAPH_RECOMPUTE)


def graph_status_recorder(statuses: List[int], threads: Optional[List[str]] = None) -> type:
    """A HostContext class (a LocalServer's context_factory) that appends the ggml status of
    each graph it computed to `statuses`, and the name of the thread that computed it to
    `threads`. Posted commands at the head of a command are skipped (ASYNC: a waited-for
    command comes after them)."""

    class GraphStatusRecorder(HostContext):
        def __init__(self, ctx_id, capset_id, config):
            super().__init__(ctx_id, config, capset_id=capset_id)

        def submit(self, command):
            super().submit(command)
            cmd_type, flags, reply_res = struct.unpack_from("<III", command)
            pos = 0
            while flags & APIR_FORWARD_POSTED and pos + reply_res < len(command):
                pos += reply_res  # a posted command's third word: its length
                cmd_type, flags, reply_res = struct.unpack_from("<III", command, pos)
            if cmd_type == ApirCommandType.FORWARD and flags in GRAPH_COMPUTES:
                reply = self.get_shmem(reply_res)
                if reply is not None:
                    statuses.append(struct.unpack_from("<i", reply.memory, 4)[0])
                    if threads is not None:
                        threads.append(threading.current_thread().name)

    return GraphStatusRecorder

# A test of the host's accelerated path itself (its kernels, or what only they do).
needs_kernels = pytest.mark.skipif(not accel.enabled(), reason="the host's kernels are off (APIR_ACCEL=0 or no Numba)")


class Guest:
    def __init__(self, ctx: Optional[HostContext] = None, data_size: int = 1 << 20, load: bool = True,
                 version=(0, 2)):
        self.ctx = ctx or HostContext(7)
        self.reply = mmap.mmap(-1, 16384)
        self.data = mmap.mmap(-1, data_size)
        self.ctx.add_resource(REPLY_RES, self.reply)
        self.ctx.add_resource(DATA_RES, self.data)
        if version is not None:
            rc, _ = self.command(ApirCommandType.HANDSHAKE, 0, lambda e: (e.u32(version[0]), e.u32(version[1])))
            assert rc == 0xAB1E
        if load:
            rc, _ = self.command(ApirCommandType.LOADLIBRARY, 0)
            assert rc == 0

    def raw(self, payload: bytes) -> Optional[int]:
        """Submits raw bytes; the return code, or None when no reply came."""
        self.reply[0:4] = b"\0\0\0\0"
        self.ctx.submit(payload)
        word = struct.unpack_from("<I", self.reply, 0)[0]
        return None if word == 0 else word - 1

    def command(self, cmd_type: int, flags: int, encode: Optional[Callable[[Encoder], object]] = None,
                reply_res: int = REPLY_RES):
        buf = bytearray(1 << 16)
        enc = Encoder(buf)
        enc.u32(cmd_type)
        enc.u32(flags)
        enc.u32(reply_res)
        if encode:
            encode(enc)
        enc.check()
        rc = self.raw(bytes(buf[: enc.written]))
        return rc, Decoder(self.reply, 4)

    def forward(self, cmd: Cmd, encode=None):
        """Forward `cmd`; returns (backend rc, Decoder). Asserts the Forward layer succeeded."""
        rc, dec = self.command(ApirCommandType.FORWARD, int(cmd), encode)
        assert rc is not None and rc >= 4, rc
        return rc - 4, dec

    # --- common calls -------------------------------------------------------------------------
    def buffer_type(self) -> int:
        rc, d = self.forward(Cmd.DEVICE_GET_BUFFER_TYPE)
        assert rc == 0
        return d.handle()

    def alloc(self, size: int) -> int:
        buft = self.buffer_type()
        rc, d = self.forward(Cmd.BUFFER_TYPE_ALLOC_BUFFER, lambda e: (e.handle(buft), e.size_t(size)))
        assert rc == 0
        handle = d.handle()
        assert handle
        return handle

    def base(self, buffer: int) -> int:
        rc, d = self.forward(Cmd.BUFFER_GET_BASE, lambda e: e.handle(buffer))
        assert rc == 0
        return d.uintptr()

    def set_tensor(self, buffer: int, rpc: bytes, data: bytes, offset: int = 0) -> int:
        self.data[: len(data)] = data
        rc, _ = self.forward(Cmd.BUFFER_SET_TENSOR, lambda e: (e.handle(buffer), e.blob(rpc), e.u32(DATA_RES),
                                                               e.size_t(offset), e.size_t(len(data))))
        return rc

    def get_tensor(self, buffer: int, rpc: bytes, size: int, offset: int = 0):
        rc, _ = self.forward(Cmd.BUFFER_GET_TENSOR, lambda e: (e.handle(buffer), e.blob(rpc), e.u32(DATA_RES),
                                                               e.size_t(offset), e.size_t(size)))
        return rc, bytes(self.data[:size])

    def close(self):
        self.ctx.close()


class GgmlScratch:
    """A no_alloc ggml context for building guest-side tensors in tests."""

    def __init__(self, g, n: int = 64):
        self.g = g
        self.ctx = g.ggml_init(InitParams(g.ggml_tensor_overhead() * n + g.ggml_graph_overhead(), None, True))

    def close(self):
        self.g.ggml_free(self.ctx)


def norm_mul_graph(g, ctx: int) -> int:
    """rms_norm -> mul -> rms_norm -> mul -> add, built by ggml (its use counts filled): twice
    the RMS_NORM + MUL pair ggml-cpu fuses where the norm has one use."""
    f32 = g.types["F32"]
    x = g.ggml_new_tensor_2d(ctx, f32, 16, 2)
    w = g.ggml_new_tensor_1d(ctx, f32, 16)
    n = g.ggml_rms_norm(ctx, x, 1e-6)
    y = g.ggml_mul(ctx, n, w)
    m = g.ggml_rms_norm(ctx, y, 1e-6)
    z = g.ggml_add(ctx, g.ggml_mul(ctx, m, w), x)
    gf = g.ggml_new_graph(ctx)
    g.ggml_build_forward_expand(gf, z)
    return gf


def add_chain(g, ctx: int, n: int, graph_size: int = 0) -> int:
    """A graph in no_alloc `ctx` of `n` ADD nodes, each adding an 8x4 F32 input x to the node
    before (x itself first): n + 1 tensors. `graph_size`: the cgraph's room in nodes (0:
    ggml's default, 2,048)."""
    x = g.ggml_new_tensor_2d(ctx, g.types["F32"], 8, 4)
    y = x
    for _ in range(n):
        y = g.ggml_add(ctx, y, x)
    graph = g.ggml_new_graph_custom(ctx, graph_size, False) if graph_size else g.ggml_new_graph(ctx)
    g.ggml_build_forward_expand(graph, y)
    return graph


def cpu_compute(g, ctx: int, graph: int, inputs, output: int, n_threads: int = 0) -> bytes:
    """`graph` (tensors of no_alloc `ctx`) computed with ggml CPU directly, the baseline the
    host's results are compared with: `inputs` are (tensor, bytes) pairs; returns `output`'s
    bytes. `n_threads`: ggml's default when 0 (4 threads, which spin for seconds on a loaded
    machine of 2 cores: large graphs ask for 1)."""
    dev = g.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    buf = g.ggml_backend_alloc_ctx_tensors_from_buft(ctx, g.ggml_backend_dev_buffer_type(dev))
    backend = g.ggml_backend_dev_init(dev, None)
    try:
        if n_threads:
            g.ggml_backend_cpu_set_n_threads(backend, n_threads)
        for t, d in inputs:
            g.ggml_backend_tensor_set(t, d, 0, len(d))
        assert g.ggml_backend_graph_compute(backend, graph) == 0
        out = ctypes.create_string_buffer(g.ggml_nbytes(output))
        g.ggml_backend_tensor_get(output, out, 0, len(out.raw))
        return out.raw
    finally:
        g.ggml_backend_free(backend)
        g.ggml_backend_buffer_free(buf)


def tensor_bytes(g, t: int) -> bytes:
    return ctypes.string_at(t, g.tensor_dtype.itemsize)


def inline_tensor(g, t: int, buffer_handle: int = 0xDEAD) -> bytes:
    """`apir_encode_ggml_tensor_inline` of tensor `t`."""
    rec = tensor_record(t, g.tensor_dtype)
    out = bytearray(tensor_bytes(g, t))
    if int(rec["buffer"]):
        out += struct.pack("<Q", buffer_handle)
    if int(rec["view_src"]):
        out += tensor_bytes(g, int(rec["view_src"]))
    for i in range(g.limits.max_src):
        s = int(rec["src"][i])
        if not s:
            break
        out += tensor_bytes(g, s)
    return bytes(out)


def rpc_record(g, t: int, buffer: int = 0, data: Optional[int] = None) -> np.ndarray:
    """`apir_serialize_tensor` of `t`: ids are addresses; `data` is the offset to send."""
    src = tensor_record(t, g.tensor_dtype)
    rec = np.zeros(1, dtype=rpc_tensor_dtype(g.limits))[0]
    rec["id"] = t
    rec["type"] = src["type"]
    rec["buffer"] = buffer
    rec["ne"] = src["ne"]
    rec["nb"] = src["nb"]
    rec["op"] = src["op"]
    rec["op_params"] = src["op_params"]
    rec["flags"] = src["flags"]
    rec["src"] = src["src"]
    rec["view_src"] = src["view_src"]
    rec["view_offs"] = src["view_offs"]
    rec["data"] = 0 if data is None else data
    rec["name"] = src["name"]
    return rec


def rpc_bytes(rec) -> bytes:
    return rec.tobytes()


class RemoteGraph:
    """A guest-side graph laid out for the host: its tensors are allocated in a local CPU
    buffer (the guest's stand-in for a remote buffer), a host buffer of the same size is
    allocated through `guest`, and the codec's `serialize_graph` maps one to the other."""

    def __init__(self, guest: Guest, g, ctx: int, graph: int):
        self.g = g
        dev = g.ggml_backend_dev_by_type(0)
        self.local = g.ggml_backend_alloc_ctx_tensors_from_buft(ctx, g.ggml_backend_dev_buffer_type(dev))
        assert self.local
        self.handle = guest.alloc(g.ggml_backend_buffer_get_size(self.local))
        self.table = BufferTable()
        self.table.register(self.local, self.handle, g.ggml_backend_buffer_get_base(self.local))
        self.wire = serialize_graph(g, graph, self.table).tobytes()

    def rpc(self, t: int) -> bytes:
        return rpc_tensor_from_ggml(self.g, t, self.table).tobytes()

    def close(self) -> None:
        self.g.ggml_backend_buffer_free(self.local)


class RepeatedGraph:
    """One guest graph sent again and again on `guest` (the same buffers, so the same graph
    structure: apir.host.graph.cache), with its inputs set anew before each compute.
    `build(g, ctx)` gives (graph, input tensors, result tensor)."""

    def __init__(self, guest: Guest, g, build):
        self.guest, self.g = guest, g
        self.s = GgmlScratch(g)
        graph, self.inputs, self.y = build(g, self.s.ctx)
        self.remote = RemoteGraph(guest, g, self.s.ctx, graph)

    def compute(self, data):
        """(rc, status, output bytes)."""
        for t, d in zip(self.inputs, data):
            assert self.guest.set_tensor(self.remote.handle, self.remote.rpc(t), d) == 0
        wire = self.remote.wire
        self.guest.data[: len(wire)] = wire
        rc, dec = self.guest.forward(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(DATA_RES), e.size_t(len(wire))))
        status = dec.i32() if rc == 0 else None
        out = self.guest.get_tensor(self.remote.handle, self.remote.rpc(self.y), self.g.ggml_nbytes(self.y))[1]
        return rc, status, out

    def close(self):
        self.remote.close()
        self.s.close()
