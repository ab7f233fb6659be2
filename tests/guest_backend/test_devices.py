"""Several host devices behind one guest (the devices extension): a host serving
`apir.host.backend=cpu,cpu`, one ApirBackend per device (`client.on_device(i)`), and ggml's
own scheduler splitting a graph over the two by where its weights live. The split computes
what the same graph computes on ggml's CPU backend here, byte for byte, and each device's
buffers and graph stay on that device of the host."""

import ctypes

import numpy as np
import pytest

from apir.codec.constants import ApirExtension
from apir.ggml.lib import InitParams
from apir.guest.backend import ApirBackend, tensor_get, tensor_set
from apir.guest.client import ApirClient
from apir.local.embedded import EmbeddedDevice


def _sched_functions(g):
    lib = g.cdlls[-1]
    p, i, z, b = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_bool
    fns = {
        "ggml_backend_sched_new": (p, [p, p, i, z, b, b]),
        "ggml_backend_sched_free": (None, [p]),
        "ggml_backend_sched_alloc_graph": (b, [p, p]),
        "ggml_backend_sched_graph_compute": (i, [p, p]),
        "ggml_backend_sched_get_n_splits": (i, [p]),
        "ggml_backend_sched_get_tensor_backend": (p, [p, p]),
        "ggml_backend_sched_set_tensor_backend": (None, [p, p, p]),
    }
    out = {}
    for name, (res, args) in fns.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
        out[name] = fn
    return out


@pytest.fixture()
def client():
    c = ApirClient.connect(EmbeddedDevice(config={"apir.host.backend": "cpu,cpu"}))
    yield c
    c.close()


def _graph(g, ctx, w0, w1):
    """x -> mul_mat(w0) -> add -> mul_mat(w1) -> rms_norm: w0's ops on one device, w1's
    on the other."""
    f32 = g.types["F32"]
    x = g.ggml_new_tensor_2d(ctx, f32, 8, 3)
    g.ggml_set_input(x)
    h = g.ggml_add(ctx, g.ggml_mul_mat(ctx, w0, x), x)
    out = g.ggml_rms_norm(ctx, g.ggml_mul_mat(ctx, w1, h), 1e-5)
    g.ggml_set_output(out)
    gf = g.ggml_new_graph(ctx)
    g.ggml_build_forward_expand(gf, out)
    return x, out, gf


def _weights(g, ctx):
    f32 = g.types["F32"]
    return g.ggml_new_tensor_2d(ctx, f32, 8, 8), g.ggml_new_tensor_2d(ctx, f32, 8, 8)


def test_a_graph_split_over_two_host_devices_equals_local_cpu(ggml, client):
    g = ggml
    sched_fns = _sched_functions(g)
    assert client.extensions & ApirExtension.DEVICES and client.device_count == 2
    rng = np.random.default_rng(5)
    xv = rng.standard_normal((3, 8), dtype=np.float32)
    w0v, w1v = (rng.standard_normal((8, 8), dtype=np.float32) for _ in range(2))

    # locally: the whole graph on ggml's CPU backend
    size = 64 * g.ggml_tensor_overhead() + g.ggml_graph_overhead()
    ctx = g.ggml_init(InitParams(size, None, True))
    w0, w1 = _weights(g, ctx)
    x, out, gf = _graph(g, ctx, w0, w1)
    cpu = g.ggml_backend_cpu_init()
    buf = g.ggml_backend_alloc_ctx_tensors_from_buft(ctx, g.ggml_backend_cpu_buffer_type())
    for t, v in ((w0, w0v), (w1, w1v), (x, xv)):
        tensor_set(g, t, v)
    assert g.ggml_backend_graph_compute(cpu, gf) == 0
    local = tensor_get(g, out)
    g.ggml_backend_buffer_free(buf)
    g.ggml_free(ctx)

    dev0, dev1 = ApirBackend(client.on_device(0), g), ApirBackend(client.on_device(1), g)
    wctx = [g.ggml_init(InitParams(size, None, True)) for _ in range(2)]
    cctx = g.ggml_init(InitParams(size, None, True))
    sched = None
    wbufs = []
    try:
        w0 = g.ggml_new_tensor_2d(wctx[0], g.types["F32"], 8, 8)
        w1 = g.ggml_new_tensor_2d(wctx[1], g.types["F32"], 8, 8)
        wbufs = [
            g.ggml_backend_alloc_ctx_tensors_from_buft(wctx[0], dev0.buffer_type),
            g.ggml_backend_alloc_ctx_tensors_from_buft(wctx[1], dev1.buffer_type),
        ]
        for b in wbufs:  # the scheduler runs an op where its weights are
            g.ggml_backend_buffer_set_usage(b, 1)  # GGML_BACKEND_BUFFER_USAGE_WEIGHTS
        tensor_set(g, w0, w0v)
        tensor_set(g, w1, w1v)
        x, out, gf = _graph(g, cctx, w0, w1)
        backends = (ctypes.c_void_p * 3)(dev0.backend, dev1.backend, cpu)
        sched = sched_fns["ggml_backend_sched_new"](backends, None, 3, 2048, False, True)
        assert sched_fns["ggml_backend_sched_alloc_graph"](sched, gf)
        assert sched_fns["ggml_backend_sched_get_n_splits"](sched) >= 2
        placed = {sched_fns["ggml_backend_sched_get_tensor_backend"](sched, g.ggml_graph_node(gf, i))
                  for i in range(g.ggml_graph_n_nodes(gf))}
        assert {dev0.backend, dev1.backend} <= placed
        tensor_set(g, x, xv)
        before = client.selected_device
        assert sched_fns["ggml_backend_sched_graph_compute"](sched, gf) == 0
        remote = tensor_get(g, out)
        assert client.selected_device == before  # graphs go to their buffers' device unselected
        # and again: the same split graphs are replayed by id
        assert sched_fns["ggml_backend_sched_graph_compute"](sched, gf) == 0
        again = tensor_get(g, out)
    finally:
        if sched:
            sched_fns["ggml_backend_sched_free"](sched)
        for b in wbufs:
            if b:
                g.ggml_backend_buffer_free(b)
        for c in wctx + [cctx]:
            g.ggml_free(c)
        dev0.close()
        dev1.close()
        g.ggml_backend_free(cpu)
    assert np.isfinite(local).all() and not (local == 0).all()
    assert remote.tobytes() == local.tobytes() and again.tobytes() == local.tobytes()
    # each device's buffers live in its own host library
    libs = client.remote.device.kernel.ctx._library.devices
    assert len(libs) == 2 and all(lib.graph_cache.misses for lib in libs)  # each built a graph
