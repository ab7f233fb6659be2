"""Test kit for apir.host: a HostContext with its blobs, and guest-side encoders.

`Guest` drives a HostContext the way a guest does: it owns a reply blob and a data blob
(mmaps, page-aligned), builds commands with apir.codec.wire.Encoder, submits them and reads
the notification word. The tensor encoders build wire bytes straight from real ggml tensors
(raw struct bytes for inline tensors, `apir_rpc_tensor` records like the C
`apir_serialize_tensor`), so the host sees what a ggml guest would send.
"""

from __future__ import annotations

import ctypes
import mmap
import struct
from typing import Callable, Dict, Optional

import numpy as np

from apir.codec.constants import ApirBackendCommandType as Cmd, ApirCommandType
from apir.codec.records import rpc_tensor_dtype
from apir.codec.wire import Decoder, Encoder
from apir.ggml.layout import tensor_record
from apir.ggml.lib import InitParams
from apir.host import HostContext

REPLY_RES, DATA_RES = 1, 2


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


def serialize_graph(g, graph: int, handle: int, offsets: Dict[int, int]) -> bytes:
    """The C `apir_serialize_graph` wire of `graph`: every tensor in buffer `handle` at
    `offsets[address]` (views: their source's offset + view_offs)."""
    n_nodes = g.ggml_graph_n_nodes(graph)
    nodes = [g.ggml_graph_node(graph, i) for i in range(n_nodes)]
    seen, records = set(), []

    def add(t):
        if not t or t in seen:
            return
        seen.add(t)
        rec = tensor_record(t, g.tensor_dtype)
        for s in rec["src"]:
            add(int(s))
        add(int(rec["view_src"]))
        records.append(rpc_record(g, t, handle, offsets[t]))

    for t in nodes:
        add(t)
    out = struct.pack("<I", n_nodes) + struct.pack(f"<{n_nodes}Q", *nodes)
    out += struct.pack("<I", len(records)) + b"".join(r.tobytes() for r in records)
    return out


def place_tensors(g, graph: int, align: int) -> Dict[int, int]:
    """Offsets in one buffer for every tensor of `graph`, views at their source's offset."""
    offsets: Dict[int, int] = {}
    pos = 0
    order = []

    def visit(t):
        if not t or t in offsets or t in order:
            return
        rec = tensor_record(t, g.tensor_dtype)
        for s in rec["src"]:
            visit(int(s))
        visit(int(rec["view_src"]))
        order.append(t)

    for i in range(g.ggml_graph_n_nodes(graph)):
        visit(g.ggml_graph_node(graph, i))
    for t in order:
        rec = tensor_record(t, g.tensor_dtype)
        if int(rec["view_src"]):
            offsets[t] = offsets[int(rec["view_src"])] + int(rec["view_offs"])
        else:
            offsets[t] = pos
            pos += (g.ggml_nbytes(t) + align - 1) // align * align
    offsets[0] = pos  # total bytes needed
    return offsets
