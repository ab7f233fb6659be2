"""ApirBackend's objects as ggml sees them, against a fake client that logs what reaches the
"host": names and props through ggml's API, allocation with ggml's own allocators, tensor
data on both buffer kinds, copies, clears, frees, graph compute, and failures."""

import ctypes
import gc

import numpy as np
import pytest

from apir.ggml.lib import InitParams
from apir.guest.backend import (ApirBackend, BackendCallbackError, BackendInitError, tensor_get,
                                tensor_set)
from apir.guest.backend.buffer import tensor_field
from tests.guest_backend.fake_client import HOST_BASE, FakeClient


@pytest.fixture
def ctx(ggml):
    c = ggml.ggml_init(InitParams(64 * ggml.ggml_tensor_overhead() + ggml.ggml_graph_overhead(), None, True))
    yield c
    ggml.ggml_free(c)


def make(ggml, **kw):
    client = FakeClient(ggml, **{k: v for k, v in kw.items() if k in ("from_ptr", "device_count", "alignment")})
    be = ApirBackend(client, ggml, **{k: v for k, v in kw.items() if k in ("zero_copy", "remote_supports_op")})
    gc.collect()  # every callback must be held by the backend, not by a temporary
    return client, be


def test_names_props_and_memory_through_ggml(ggml):
    g = ggml
    client, be = make(g, device_count=2)
    assert g.ggml_backend_reg_name(be.reg) == b"ggml-virtgpu"
    assert g.ggml_backend_reg_dev_count(be.reg) == 2
    assert [g.ggml_backend_reg_dev_get(be.reg, i) for i in range(2)] == be.devices
    dev = be.device
    assert g.ggml_backend_dev_name(dev) == b"[virtgpu] FakeGPU"
    assert g.ggml_backend_dev_description(dev) == b"a fake remote GPU"
    assert g.ggml_backend_dev_type(dev) == 1
    assert g.ggml_backend_dev_backend_reg(dev) == be.reg
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    g.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
    assert (free.value, total.value) == (3 << 30, 8 << 30)
    props = be.abi.DevProps()
    g.ggml_backend_dev_get_props(dev, ctypes.byref(props))
    assert ctypes.string_at(props.name) == b"[virtgpu] FakeGPU"
    assert (props.memory_free, props.memory_total, props.type) == (3 << 30, 8 << 30, 1)
    caps = props.caps
    # As the C guest: async/events/buffer_from_host_ptr forced off, the rest from the host.
    assert (getattr(caps, "async"), caps.events, caps.buffer_from_host_ptr) == (False, False, False)
    assert (caps.host_buffer, caps.mmap_support) == (False, True)

    buft = g.ggml_backend_dev_buffer_type(dev)
    assert buft == be.buffer_type
    assert g.ggml_backend_buft_name(buft) == b"[virtgpu] FakeBuft"
    assert g.ggml_backend_buft_get_alignment(buft) == 64
    assert g.ggml_backend_buft_get_max_size(buft) == 1 << 30
    assert not g.ggml_backend_buft_is_host(buft)
    assert g.ggml_backend_buft_get_device(buft) == dev
    assert g.ggml_backend_dev_supports_buft(dev, buft)
    assert not g.ggml_backend_dev_supports_buft(dev, g.ggml_backend_cpu_buffer_type())
    assert not g.ggml_backend_dev_supports_buft(be.devices[1], buft)

    assert g.ggml_backend_name(be.backend) == b"API Remoting backend"
    assert g.ggml_backend_get_device(be.backend) == dev
    assert g.ggml_backend_get_default_buffer_type(be.backend) == buft
    # Cached: asking ggml again costs no remote call.
    n = len(client.calls)
    g.ggml_backend_dev_name(dev), g.ggml_backend_buft_get_alignment(buft)
    assert len(client.calls) == n
    be2 = g.ggml_backend_dev_init(be.devices[1], None)
    assert be2 and g.ggml_backend_get_device(be2) == be.devices[1]
    g.ggml_backend_free(be2)
    be.close()


def test_supports_op_local_by_default_remote_when_asked(ggml, ctx):
    g = ggml
    t = g.ggml_new_tensor_1d(ctx, g.types["F32"], 4)
    client, be = make(g)
    assert g.ggml_backend_dev_supports_op(be.device, t)  # the C's USE_ALWAYS_TRUE_SUPPORTS_OP
    assert "device_supports_op" not in client.names()
    be.close()
    client, be = make(g, remote_supports_op=True)
    assert not g.ggml_backend_dev_supports_op(be.device, t)
    assert client.calls[-1] == ("device_supports_op", t, 0)
    be.close()


@pytest.mark.parametrize("from_ptr", [False, True])
def test_alloc_ctx_tensors_set_get_clear_free(ggml, ctx, from_ptr):
    g = ggml
    client, be = make(g, from_ptr=from_ptr)
    f32, i32 = g.types["F32"], g.types["I32"]
    a = g.ggml_new_tensor_2d(ctx, f32, 5, 3)
    b = g.ggml_new_tensor_1d(ctx, i32, 7)
    buf = g.ggml_backend_alloc_ctx_tensors_from_buft(ctx, be.buffer_type)
    assert buf and be.has_buffer(buf)
    (handle,) = client.buffers
    assert g.ggml_backend_buffer_get_size(buf) == len(client.buffers[handle])
    base = g.ggml_backend_buffer_get_base(buf)
    if from_ptr:
        assert client.names()[-1] == "device_buffer_from_ptr"  # the zero-copy path
        assert "buffer_type_alloc_buffer" not in client.names()
    else:
        assert base == client.base(handle) == HOST_BASE + (handle << 24)
    for t in (a, b):
        assert tensor_field(g, t, "buffer") == buf
        assert (tensor_field(g, t, "data") - base) % 64 == 0

    rng = np.random.default_rng(1)
    xa = rng.standard_normal((3, 5), dtype=np.float32)
    xb = rng.integers(-100, 100, 7, dtype=np.int32)
    tensor_set(g, a, xa)
    tensor_set(g, b, xb)
    # What the host holds at each tensor's offset is exactly the data.
    host = client.buffers[handle]
    for t, x in ((a, xa), (b, xb)):
        off = tensor_field(g, t, "data") - base
        assert bytes(host[off:off + x.nbytes]) == x.tobytes()
    np.testing.assert_array_equal(tensor_get(g, a), xa)
    np.testing.assert_array_equal(tensor_get(g, b), xb)
    assert ("buffer_set_tensor" in client.names()) == (not from_ptr)

    # Partial set/get with an offset through ggml's API.
    g.ggml_backend_tensor_set(b, np.int32([42, 43]).ctypes.data, 8, 8)
    assert list(tensor_get(g, b)[:5]) == [xb[0], xb[1], 42, 43, xb[4]]

    g.ggml_backend_tensor_memset(a, 0x3F, 4, 8)
    assert tensor_get(g, a).view(np.uint8).ravel()[4:12].tolist() == [0x3F] * 8

    g.ggml_backend_buffer_clear(buf, 0xAB)
    assert client.calls[-1] == ("buffer_clear", handle, 0xAB)
    assert set(bytes(client.buffers[handle])) == {0xAB}
    assert set(tensor_get(g, b).view(np.uint8).ravel()) == {0xAB}

    blob = client.blobs.get(handle)
    g.ggml_backend_buffer_free(buf)
    assert client.freed == [handle] and not be.has_buffer(buf) and buf not in be.buffer_table
    assert client.destroyed == ([blob] if from_ptr else [])
    be.close()


def test_cpy_tensor_remote_and_from_cpu(ggml, ctx):
    g = ggml
    client, be = make(g)
    f32 = g.types["F32"]
    src, dst, dst2 = (g.ggml_new_tensor_1d(ctx, f32, 16) for _ in range(3))
    buf = g.ggml_backend_alloc_ctx_tensors_from_buft(ctx, be.buffer_type)
    x = np.arange(16, dtype=np.float32)
    tensor_set(g, src, x)
    g.ggml_backend_tensor_copy(src, dst)
    assert client.calls[-1] == ("buffer_cpy_tensor", next(iter(client.buffers)), src, dst)
    np.testing.assert_array_equal(tensor_get(g, dst), x)

    # From a CPU tensor ggml goes through tensor_set; no remote copy of a foreign buffer.
    cctx = g.ggml_init(InitParams(4 * g.ggml_tensor_overhead(), None, True))
    csrc = g.ggml_new_tensor_1d(cctx, f32, 16)
    cbuf = g.ggml_backend_alloc_ctx_tensors_from_buft(cctx, g.ggml_backend_cpu_buffer_type())
    tensor_set(g, csrc, x * 2)
    n = client.names().count("buffer_cpy_tensor")
    g.ggml_backend_tensor_copy(csrc, dst2)
    assert client.names().count("buffer_cpy_tensor") == n
    np.testing.assert_array_equal(tensor_get(g, dst2), x * 2)
    g.ggml_backend_buffer_free(cbuf)
    g.ggml_free(cctx)
    g.ggml_backend_buffer_free(buf)
    be.close()


def test_gallocr_allocates_on_remote_buffers_and_graph_reaches_host(ggml, ctx):
    g = ggml
    client, be = make(g)
    f32 = g.types["F32"]
    w = g.ggml_new_tensor_2d(ctx, f32, 8, 4)
    x = g.ggml_new_tensor_2d(ctx, f32, 8, 3)
    bias = g.ggml_new_tensor_2d(ctx, f32, 4, 3)
    for t in (w, x, bias):
        g.ggml_set_input(t)
    out = g.ggml_add(ctx, g.ggml_mul_mat(ctx, w, x), bias)
    g.ggml_set_output(out)
    gf = g.ggml_new_graph(ctx)
    g.ggml_build_forward_expand(gf, out)

    galloc = g.ggml_gallocr_new(be.buffer_type)
    assert g.ggml_gallocr_alloc_graph(galloc, gf)
    assert "buffer_type_alloc_buffer" in client.names()
    size = g.ggml_gallocr_get_buffer_size(galloc, 0)
    assert size > 0 and [len(b) for b in client.buffers.values()] == [size]
    bufs = {tensor_field(g, t, "buffer") for t in (w, x, bias, out)}
    assert len(bufs) == 1 and be.has_buffer(bufs.pop())

    be.graph_compute(gf)
    (pg,) = client.graphs
    assert pg.node_ids.tolist() == [g.ggml_graph_node(gf, i) for i in range(g.ggml_graph_n_nodes(gf))]
    (handle,) = client.buffers
    assert set(int(h) for h in pg.tensors["buffer"]) == {handle}
    assert int(pg.tensors["op"][pg.node_index[-1]]) == g.ops["ADD"]

    g.ggml_gallocr_free(galloc)
    assert client.freed == [handle] and be.live_buffers == 0
    be.close()


def test_graph_compute_sends_each_graph_exactly(ggml):
    """graph_compute serializes into the array of its last graph: a smaller graph after a
    larger one still sends exactly its own bytes (the count the host gets is its size)."""
    from apir.codec.graph import graph_size

    g = ggml
    client, be = make(g)
    ctx = g.ggml_init(InitParams(16 * g.ggml_tensor_overhead() + 3 * g.ggml_graph_overhead(), None, True))
    x = g.ggml_new_tensor_1d(ctx, g.types["F32"], 4)
    chain = [x]
    for _ in range(12):
        chain.append(g.ggml_scale(ctx, chain[-1], 2.0))
    graphs = []
    for end in (chain[12], chain[1], chain[12]):  # large, small, large
        gf = g.ggml_new_graph(ctx)
        g.ggml_build_forward_expand(gf, end)
        graphs.append(gf)
    buf = g.ggml_backend_alloc_ctx_tensors_from_buft(ctx, be.buffer_type)
    for gf in graphs:
        be.graph_compute(gf)
    sent = [c[1] for c in client.calls if c[0] == "backend_graph_compute"]
    assert sent == [graph_size(12, 13, g.limits), graph_size(1, 2, g.limits), graph_size(12, 13, g.limits)]
    for pg, gf in zip(client.graphs, graphs):
        assert pg.node_ids.tolist() == [g.ggml_graph_node(gf, i) for i in range(g.ggml_graph_n_nodes(gf))]
    g.ggml_backend_buffer_free(buf)
    g.ggml_free(ctx)
    be.close()


def test_callback_failures_surface_as_exceptions(ggml, ctx):
    g = ggml
    client, be = make(g)
    t = g.ggml_new_tensor_1d(ctx, g.types["F32"], 4)
    buf = g.ggml_backend_alloc_ctx_tensors_from_buft(ctx, be.buffer_type)
    client.fail.add("buffer_set_tensor")
    with pytest.raises(BackendCallbackError, match="buffer.set_tensor.*fake buffer_set_tensor failed"):
        tensor_set(g, t, np.zeros(4, np.float32))
    client.fail.add("buffer_get_tensor")
    with pytest.raises(BackendCallbackError, match="buffer.get_tensor"):
        tensor_get(g, t)

    # Graph compute: a failed remote call gives GGML_STATUS_FAILED to ggml, an exception here.
    client.fail.add("backend_graph_compute")
    g.ggml_backend_buffer_free(buf)
    # A fresh context: `t` pointed into the buffer just freed, and a graph over it would
    # (rightly) be refused by the serializer before any remote call.
    gctx = g.ggml_init(InitParams(8 * g.ggml_tensor_overhead() + g.ggml_graph_overhead(), None, True))
    out = g.ggml_scale(gctx, g.ggml_new_tensor_1d(gctx, g.types["F32"], 4), 2.0)
    gf = g.ggml_new_graph(gctx)
    g.ggml_build_forward_expand(gf, out)
    buf = g.ggml_backend_alloc_ctx_tensors_from_buft(gctx, be.buffer_type)
    assert g.ggml_backend_graph_compute(be.backend, gf) == -1
    with pytest.raises(BackendCallbackError, match="graph_compute"):
        be.graph_compute(gf)
    client.fail.clear()
    client.graph_status = 1  # GGML_STATUS_ABORTED from the host
    from apir.guest.backend import GraphComputeError
    with pytest.raises(GraphComputeError) as ei:
        be.graph_compute(gf)
    assert ei.value.status == 1
    g.ggml_backend_buffer_free(buf)
    g.ggml_free(gctx)

    # The host cannot allocate: ggml gets a NULL buffer, nothing is left registered.
    client.alloc_handle = 0
    ctx2 = g.ggml_init(InitParams(4 * g.ggml_tensor_overhead(), None, True))
    g.ggml_new_tensor_1d(ctx2, g.types["F32"], 4)
    assert not g.ggml_backend_alloc_ctx_tensors_from_buft(ctx2, be.buffer_type)
    assert be.live_buffers == 0
    g.ggml_free(ctx2)
    be.close()


def test_zero_copy_choice(ggml):
    client, be = make(ggml, from_ptr=True, zero_copy=False)
    assert not be.zero_copy
    be.close()
    with pytest.raises(BackendInitError, match="buffer_from_host_ptr"):
        make(ggml, from_ptr=False, zero_copy=True)


def test_close_with_a_live_buffer_keeps_callbacks(ggml, ctx):
    g = ggml
    client, be = make(g)
    g.ggml_new_tensor_1d(ctx, g.types["F32"], 4)
    buf = g.ggml_backend_alloc_ctx_tensors_from_buft(ctx, be.buffer_type)
    be.close()
    be.close()
    del be
    gc.collect()
    g.ggml_backend_buffer_free(buf)  # still lands on live callbacks, still frees the host buffer
    assert len(client.freed) == 1


def test_get_alloc_size_asks_the_host_only_for_its_own_buffers(ggml, ctx):
    g = ggml
    client, be = make(g, remote_supports_op=True)
    t = g.ggml_new_tensor_1d(ctx, g.types["F32"], 10)
    # Not in a buffer yet (what the allocators see): ggml_nbytes, no remote call.
    assert g.ggml_backend_buft_get_alloc_size(be.buffer_type, t) == 40
    assert "buffer_type_get_alloc_size" not in client.names()
    buf = g.ggml_backend_alloc_ctx_tensors_from_buft(ctx, be.buffer_type)
    (handle,) = client.buffers
    assert g.ggml_backend_buft_get_alloc_size(be.buffer_type, t) == 4096
    assert client.calls[-1] == ("buffer_type_get_alloc_size", 0xB0F7, t, handle)
    g.ggml_backend_dev_supports_op(be.device, t)
    assert client.calls[-1] == ("device_supports_op", t, handle)
    g.ggml_backend_buffer_free(buf)
    be.close()


def test_unknown_ggml_version_is_refused_before_any_remote_call(ggml):
    from types import SimpleNamespace

    from apir.guest.backend import UnsupportedGgmlVersion

    client = FakeClient(ggml)
    with pytest.raises(UnsupportedGgmlVersion, match="0.99.0"):
        ApirBackend(client, SimpleNamespace(version="0.99.0", lib_dir="/nowhere"))
    assert client.calls == []
