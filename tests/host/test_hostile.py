"""One test per class of hostile input: an error code, a log line, and the host still serves."""

import logging
import struct

import numpy as np
import pytest

from apir.codec.constants import ApirBackendCommandType as Cmd
from apir.codec.records import rpc_tensor_dtype
from apir.host import HostContext
from tests.host.hostkit import DATA_RES, Guest, GgmlScratch, RemoteGraph, inline_tensor, rpc_bytes, rpc_record

ERROR = 1  # BACKEND_RC_ERROR


@pytest.fixture
def refused(guest, caplog):
    """refused(cmd, encode): asserts the error code, a host log line, and that the host then
    answers a valid command."""
    def check(cmd, encode=None):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="apir.host"):
            rc, _ = guest.forward(cmd, encode)
        assert rc == ERROR
        assert any(r.name == "apir.host" for r in caplog.records), "refusal without a log line"
        rc, d = guest.forward(Cmd.DEVICE_GET_COUNT)
        assert rc == 0 and d.i32() >= 1
    return check


@pytest.fixture
def small(ggml):
    s = GgmlScratch(ggml)
    yield s
    s.close()


def _f32(ggml, s, n=16):
    return ggml.ggml_new_tensor_1d(s.ctx, ggml.types["F32"], n)


def _set(buf, rec, size=64, offset=0, res=DATA_RES):
    return lambda e: (e.handle(buf), e.blob(rpc_bytes(rec)), e.u32(res), e.size_t(offset), e.size_t(size))


def test_unknown_buffer_handles(guest, refused, ggml):
    buf = guest.alloc(256)
    real = guest.ctx._library.buffers.get(buf).ptr
    for bad in (0, real, buf + 1000, guest.buffer_type()):
        refused(Cmd.BUFFER_GET_BASE, lambda e, b=bad: e.handle(b))
        refused(Cmd.BUFFER_CLEAR, lambda e, b=bad: (e.handle(b), e.u8(1)))
        refused(Cmd.BUFFER_FREE_BUFFER, lambda e, b=bad: e.handle(b))


def test_unknown_buffer_type_handles(guest, refused, ggml):
    real = ggml.ggml_backend_dev_buffer_type(ggml.ggml_backend_dev_by_type(0))
    buf = guest.alloc(64)
    for bad in (0, real, buf, 1 << 63):
        refused(Cmd.BUFFER_TYPE_GET_NAME, lambda e, b=bad: e.handle(b))
        refused(Cmd.BUFFER_TYPE_ALLOC_BUFFER, lambda e, b=bad: (e.handle(b), e.size_t(64)))


def test_handles_of_another_context(ggml, caplog):
    mine, other = Guest(HostContext(98)), Guest(HostContext(99))
    foreign = other.alloc(64)
    with caplog.at_level(logging.WARNING, logger="apir.host"):
        rc, _ = mine.forward(Cmd.BUFFER_GET_BASE, lambda e: e.handle(foreign))
    refusals = [r.refusal for r in caplog.records if getattr(r, "refusal", None) is not None]
    assert rc == ERROR and len(refusals) == 1, refusals
    assert "unknown buffer handle" in refusals[0].reason, refusals[0].reason
    assert mine.forward(Cmd.DEVICE_GET_COUNT)[0] == 0
    assert other.base(foreign)  # still valid where it belongs
    mine.close()
    other.close()


def test_offset_and_size_against_the_tensor(guest, refused, ggml, small):
    t = _f32(ggml, small)  # 64 bytes
    buf = guest.alloc(256)
    rec = rpc_record(ggml, t, buf, 0)
    refused(Cmd.BUFFER_SET_TENSOR, _set(buf, rec, size=65))
    refused(Cmd.BUFFER_GET_TENSOR, _set(buf, rec, size=8, offset=60))
    refused(Cmd.BUFFER_SET_TENSOR, _set(buf, rec, size=8, offset=(1 << 64) - 4))


def test_size_against_the_shared_memory_resource(guest, refused, ggml, small):
    t = _f32(ggml, small, 1 << 20)
    buf = guest.alloc(4 << 20)
    rec = rpc_record(ggml, t, buf, 0)
    tiny = bytearray(16)
    guest.ctx.add_resource(40, tiny)
    refused(Cmd.BUFFER_SET_TENSOR, _set(buf, rec, size=64, res=40))
    refused(Cmd.BUFFER_GET_TENSOR, _set(buf, rec, size=len(guest.data) + 4))
    refused(Cmd.DEVICE_BUFFER_FROM_PTR, lambda e: (e.u32(40), e.size_t(17), e.size_t(17)))
    refused(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(40), e.size_t(17)))
    refused(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(DATA_RES), e.size_t(0)))


def test_unknown_shared_memory_resource(guest, refused, ggml, small):
    buf = guest.alloc(256)
    rec = rpc_record(ggml, _f32(ggml, small), buf, 0)
    refused(Cmd.BUFFER_SET_TENSOR, _set(buf, rec, res=12345))
    refused(Cmd.DEVICE_BUFFER_FROM_PTR, lambda e: (e.u32(12345), e.size_t(64), e.size_t(64)))
    refused(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(12345), e.size_t(64)))


def test_tensor_data_outside_its_buffer(guest, refused, ggml, small):
    buf = guest.alloc(128)
    t = _f32(ggml, small)
    for data in (65, 128, 1 << 40, (1 << 64) - 8):
        refused(Cmd.BUFFER_SET_TENSOR, _set(buf, rpc_record(ggml, t, buf, data), size=4))
    # nb that spreads a small tensor beyond the buffer
    rec = rpc_record(ggml, ggml.ggml_new_tensor_2d(small.ctx, ggml.types["F32"], 4, 4), buf, 0)
    rec["nb"][1] = 1000
    refused(Cmd.BUFFER_SET_TENSOR, _set(buf, rec, size=4))


def test_tensor_of_another_buffer(guest, refused, ggml, small):
    b1, b2 = guest.alloc(128), guest.alloc(128)
    refused(Cmd.BUFFER_SET_TENSOR, _set(b1, rpc_record(ggml, _f32(ggml, small), b2, 0), size=4))


def test_no_buffer_with_data(guest, refused, ggml, small):
    buf = guest.alloc(128)
    refused(Cmd.BUFFER_SET_TENSOR, _set(buf, rpc_record(ggml, _f32(ggml, small), 0, 16), size=4))


def test_type_out_of_range(guest, refused, ggml, small):
    buf = guest.alloc(128)
    t = _f32(ggml, small)
    for bad in (ggml.type_count, 4, 0xFFFFFFFF):  # 4 is a removed type (a hole)
        rec = rpc_record(ggml, t, buf, 0)
        rec["type"] = bad
        refused(Cmd.BUFFER_SET_TENSOR, _set(buf, rec, size=4))
        raw = bytearray(inline_tensor(ggml, t))
        struct.pack_into("<I", raw, 0, bad)
        refused(Cmd.DEVICE_SUPPORTS_OP, lambda e, r=bytes(raw): e.blob(r))


def test_op_out_of_range(guest, refused, ggml, small):
    buf = guest.alloc(128)
    t = _f32(ggml, small)
    op_off = ggml.tensor_dtype.fields["op"][1]
    for bad in (ggml.op_count, 0xFFFFFFFF):
        rec = rpc_record(ggml, t, buf, 0)
        rec["op"] = bad
        refused(Cmd.BUFFER_SET_TENSOR, _set(buf, rec, size=4))
        raw = bytearray(inline_tensor(ggml, t))
        struct.pack_into("<I", raw, op_off, bad)
        refused(Cmd.BUFFER_TYPE_GET_ALLOC_SIZE, lambda e, r=bytes(raw): (e.handle(guest.buffer_type()), e.blob(r)))


def test_quantized_ne0_not_a_block_multiple(guest, refused, ggml, small):
    buf = guest.alloc(4096)
    t = ggml.ggml_new_tensor_1d(small.ctx, ggml.types["Q4_0"], 64)
    rec = rpc_record(ggml, t, buf, 0)
    rec["ne"][0] = 33
    refused(Cmd.BUFFER_SET_TENSOR, _set(buf, rec, size=4))
    raw = bytearray(inline_tensor(ggml, t))
    struct.pack_into("<q", raw, ggml.tensor_dtype.fields["ne"][1], 33)
    refused(Cmd.BUFFER_TYPE_GET_ALLOC_SIZE, lambda e: (e.handle(guest.buffer_type()), e.blob(bytes(raw))))


def test_inline_tensor_truncated_or_missing_sources(guest, refused, ggml, small):
    a = ggml.ggml_new_tensor_2d(small.ctx, ggml.types["F32"], 8, 2)
    mm = ggml.ggml_mul_mat(small.ctx, a, a)
    raw = inline_tensor(ggml, mm)
    refused(Cmd.DEVICE_SUPPORTS_OP, lambda e: e.blob(raw[:-8]))  # second source cut short
    only_head = bytearray(raw[: ggml.tensor_dtype.itemsize])
    src_off = ggml.tensor_dtype.fields["src"][1]
    struct.pack_into("<QQ", only_head, src_off, 0, 0)  # mul_mat without sources
    refused(Cmd.DEVICE_SUPPORTS_OP, lambda e: e.blob(bytes(only_head)))


def test_truncated_arguments(guest, refused, ggml):
    buf = guest.alloc(64)
    refused(Cmd.BUFFER_GET_BASE, lambda e: e.u32(buf))
    refused(Cmd.BUFFER_TYPE_ALLOC_BUFFER, lambda e: e.handle(guest.buffer_type()))
    refused(Cmd.BUFFER_SET_TENSOR, lambda e: e.handle(buf))
    refused(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: e.u32(DATA_RES))


# --- graphs ---------------------------------------------------------------------------------
class GraphCase:
    """A valid mul_mat + add + soft_max graph in a host buffer, as numpy records to mutate."""

    def __init__(self, guest, ggml, s):
        g = ggml
        f32 = g.types["F32"]
        self.a = g.ggml_new_tensor_2d(s.ctx, f32, 8, 4)
        self.x = g.ggml_new_tensor_2d(s.ctx, f32, 8, 3)
        self.b = g.ggml_new_tensor_2d(s.ctx, f32, 4, 3)
        self.mm = g.ggml_mul_mat(s.ctx, self.a, self.x)
        self.out = g.ggml_soft_max(s.ctx, g.ggml_add(s.ctx, self.mm, self.b))
        graph = g.ggml_new_graph(s.ctx)
        g.ggml_build_forward_expand(graph, self.out)
        self.remote = RemoteGraph(guest, g, s.ctx, graph)
        wire = self.remote.wire
        (self.n_nodes,) = struct.unpack_from("<I", wire, 0)
        self.nodes = np.frombuffer(wire, "<u8", self.n_nodes, 4).copy()
        off = 4 + 8 * self.n_nodes + 4
        self.dtype = rpc_tensor_dtype(g.limits)
        self.recs = np.frombuffer(wire, self.dtype, offset=off).copy()
        self.guest = guest

    def index(self, t):
        return int(np.nonzero(self.recs["id"] == t)[0][0])

    def wire(self, nodes=None, recs=None):
        nodes = self.nodes if nodes is None else nodes
        recs = self.recs if recs is None else recs
        return (struct.pack("<I", len(nodes)) + nodes.astype("<u8").tobytes()
                + struct.pack("<I", len(recs)) + recs.tobytes())

    def send(self, wire):
        self.guest.data[: len(wire)] = wire
        return lambda e: (e.u32(DATA_RES), e.size_t(len(wire)))


@pytest.fixture
def graph(guest, ggml, small):
    case = GraphCase(guest, ggml, small)
    rc, d = guest.forward(Cmd.BACKEND_GRAPH_COMPUTE, case.send(case.wire()))
    assert rc == 0 and d.i32() == 0  # the unmutated graph computes
    yield case
    case.remote.close()


def test_graph_unknown_and_zero_and_duplicate_ids(graph, refused):
    recs = graph.recs.copy()
    recs["src"][graph.index(graph.mm)][0] = 0x1234  # a src that is not in the graph
    refused(Cmd.BACKEND_GRAPH_COMPUTE, graph.send(graph.wire(recs=recs)))
    nodes = graph.nodes.copy()
    nodes[0] = 0xABCD  # a node that is not in the graph
    refused(Cmd.BACKEND_GRAPH_COMPUTE, graph.send(graph.wire(nodes=nodes)))
    recs = graph.recs.copy()
    recs["id"][0] = 0
    refused(Cmd.BACKEND_GRAPH_COMPUTE, graph.send(graph.wire(recs=recs)))
    recs = graph.recs.copy()
    recs["id"][1] = recs["id"][0]
    refused(Cmd.BACKEND_GRAPH_COMPUTE, graph.send(graph.wire(recs=recs)))
    refused(Cmd.BACKEND_GRAPH_COMPUTE, graph.send(graph.wire(nodes=np.concatenate([graph.nodes, graph.nodes[:1]]))))


def test_graph_counts(graph, refused):
    wire = bytearray(graph.wire())
    struct.pack_into("<I", wire, 0, 0xFFFFFFFF)
    refused(Cmd.BACKEND_GRAPH_COMPUTE, graph.send(bytes(wire)))
    wire = bytearray(graph.wire())
    struct.pack_into("<I", wire, 4 + 8 * graph.n_nodes, len(graph.recs) + 1)
    refused(Cmd.BACKEND_GRAPH_COMPUTE, graph.send(bytes(wire)))


def test_graph_cycle(graph, refused):
    recs = graph.recs.copy()
    a = graph.index(graph.a)
    recs["src"][a][0] = graph.out  # a leaf that depends on the output
    refused(Cmd.BACKEND_GRAPH_COMPUTE, graph.send(graph.wire(recs=recs)))


def test_graph_custom_op(graph, refused, ggml):
    recs = graph.recs.copy()
    recs["op"][graph.index(graph.mm)] = ggml.ops["MAP_CUSTOM1"]
    recs["op_params"][graph.index(graph.mm)][:2] = [0x41414141, 0x41414141]  # a "function pointer"
    refused(Cmd.BACKEND_GRAPH_COMPUTE, graph.send(graph.wire(recs=recs)))


def test_graph_lying_shapes(graph, refused, ggml):
    mm = graph.index(graph.mm)
    recs = graph.recs.copy()
    recs["ne"][mm][1] = 5  # mul_mat of 8x4 and 8x3 is 4x3: claims 4x5 (still inside the buffer)
    recs["nb"][mm][2:] = 4 * 4 * 5
    refused(Cmd.BACKEND_GRAPH_COMPUTE, graph.send(graph.wire(recs=recs)))
    recs = graph.recs.copy()
    recs["ne"][graph.index(graph.x)][0] = 4  # inner dimensions disagree
    recs["nb"][graph.index(graph.x)][1:] = [16, 48, 48]
    refused(Cmd.BACKEND_GRAPH_COMPUTE, graph.send(graph.wire(recs=recs)))
    recs = graph.recs.copy()
    recs["nb"][mm][0] = 8  # strided destination the kernel would not honour
    refused(Cmd.BACKEND_GRAPH_COMPUTE, graph.send(graph.wire(recs=recs)))
    recs = graph.recs.copy()
    from apir.host.graph.shapes import CHECKED_OPS

    no_rule = next(op for op in ggml.ops if op not in CHECKED_OPS and not op.startswith(("CUSTOM", "MAP_")))
    recs["op"][mm] = ggml.ops[no_rule]  # an op this host has no shape check for
    refused(Cmd.BACKEND_GRAPH_COMPUTE, graph.send(graph.wire(recs=recs)))


def test_graph_view_outside_source(guest, refused, ggml, small):
    g = ggml
    src = g.ggml_new_tensor_1d(small.ctx, g.types["F32"], 16)
    view = g.ggml_view_1d(small.ctx, src, 8, 0)
    out = g.ggml_scale(small.ctx, g.ggml_cont(small.ctx, view), 2.0)
    graph = g.ggml_new_graph(small.ctx)
    g.ggml_build_forward_expand(graph, out)
    remote = RemoteGraph(guest, g, small.ctx, graph)
    wire = bytearray(remote.wire)
    n_nodes = struct.unpack_from("<I", wire, 0)[0]
    off = 4 + 8 * n_nodes + 4
    dtype = rpc_tensor_dtype(g.limits)
    recs = np.frombuffer(bytes(wire[off:]), dtype).copy()
    ok = bytes(wire)
    guest.data[: len(ok)] = ok
    assert guest.forward(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(DATA_RES), e.size_t(len(ok))))[0] == 0
    v = int(np.nonzero(recs["id"] == view)[0][0])
    recs["view_offs"][v] = 40  # 8 floats from byte 40 run past the 64-byte source
    recs["data"][v] += 40
    bad = bytes(wire[:off]) + recs.tobytes()
    guest.data[: len(bad)] = bad
    refused(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(DATA_RES), e.size_t(len(bad))))
    remote.close()


def test_graph_get_rows_ids_out_of_range(guest, refused, ggml, small):
    g = ggml
    emb = g.ggml_new_tensor_2d(small.ctx, g.types["F32"], 4, 10)
    ids = g.ggml_new_tensor_1d(small.ctx, g.types["I32"], 3)
    out = g.ggml_get_rows(small.ctx, emb, ids)
    graph = g.ggml_new_graph(small.ctx)
    g.ggml_build_forward_expand(graph, out)
    remote = RemoteGraph(guest, g, small.ctx, graph)
    buf, rec_ids, wire = remote.handle, remote.rpc(ids), remote.wire
    guest.set_tensor(buf, rec_ids, np.int32([0, 9, 3]).tobytes())
    guest.data[: len(wire)] = wire
    assert guest.forward(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(DATA_RES), e.size_t(len(wire))))[0] == 0
    guest.set_tensor(buf, rec_ids, np.int32([0, 10, 3]).tobytes())
    guest.data[: len(wire)] = wire
    refused(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(DATA_RES), e.size_t(len(wire))))
    remote.close()
