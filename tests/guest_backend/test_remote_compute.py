"""End to end: ApirBackend over an ApirClient over the embedded device, whose host is apir's
HostContext with ggml's CPU backend. A real graph computed remotely equals the same graph
computed here with ggml's CPU backend, byte for byte; ggml's allocators place tensors in remote
buffers; tensor data round-trips on both buffer kinds."""

import ctypes

import numpy as np
import pytest

from apir.ggml.lib import InitParams
from apir.guest.backend import ApirBackend, tensor_get, tensor_set
from apir.guest.backend.buffer import tensor_field
from apir.guest.client import ApirClient
from apir.local.embedded import EmbeddedDevice


@pytest.fixture(scope="module")
def client():
    dev = EmbeddedDevice()
    c = ApirClient.connect(dev)
    yield c
    c.close()


@pytest.fixture(params=[True, False], ids=["zero-copy", "host-only"])
def backend(request, client, ggml):
    be = ApirBackend(client, ggml, zero_copy=request.param)
    yield be
    be.close()
    assert be.live_buffers == 0


class Ctx:
    def __init__(self, g, n=64):
        self.g = g
        self.ptr = g.ggml_init(InitParams(n * g.ggml_tensor_overhead() + g.ggml_graph_overhead(), None, True))

    def free(self):
        self.g.ggml_free(self.ptr)


def _inputs(rng):
    return {
        "emb": rng.standard_normal((10, 16), dtype=np.float32),
        "w": rng.standard_normal((16, 16)).astype(np.float16),
        "ids": np.int32([3, 0, 9, 3]),
        "bias": rng.standard_normal((4, 16), dtype=np.float32),
    }


def _build(g, weights: Ctx, compute: Ctx):
    """get_rows -> mul_mat (F16 weight) -> add -> rms_norm -> soft_max. Weights in
    their own context (placed with ggml_backend_alloc_ctx_tensors_from_buft), the rest placed
    by ggml_gallocr."""
    f32, f16, i32 = g.types["F32"], g.types["F16"], g.types["I32"]
    w, c = weights.ptr, compute.ptr
    t = {"emb": g.ggml_new_tensor_2d(w, f32, 16, 10), "w": g.ggml_new_tensor_2d(w, f16, 16, 16)}
    t["ids"] = g.ggml_new_tensor_1d(c, i32, 4)
    t["bias"] = g.ggml_new_tensor_2d(c, f32, 16, 4)
    for name in ("ids", "bias"):
        g.ggml_set_input(t[name])
    x = g.ggml_get_rows(c, t["emb"], t["ids"])
    x = g.ggml_mul_mat(c, t["w"], x)
    x = g.ggml_add(c, x, t["bias"])
    x = g.ggml_rms_norm(c, x, 1e-5)
    out = g.ggml_soft_max(c, g.ggml_scale(c, x, 0.5))
    g.ggml_set_output(out)
    gf = g.ggml_new_graph(c)
    g.ggml_build_forward_expand(gf, out)
    return t, out, gf


def _run(g, buft, compute_fn, inputs):
    weights, compute = Ctx(g), Ctx(g)
    wbuf = galloc = None
    try:
        t, out, gf = _build(g, weights, compute)
        wbuf = g.ggml_backend_alloc_ctx_tensors_from_buft(weights.ptr, buft)
        assert wbuf
        galloc = g.ggml_gallocr_new(buft)
        assert g.ggml_gallocr_alloc_graph(galloc, gf)
        for name, value in inputs.items():
            tensor_set(g, t[name], value)
        compute_fn(gf)
        buffers = {wbuf} | {tensor_field(g, p, "buffer") for p in (t["ids"], out)}
        return tensor_get(g, out), buffers
    finally:
        if galloc:
            g.ggml_gallocr_free(galloc)
        if wbuf:
            g.ggml_backend_buffer_free(wbuf)
        weights.free()
        compute.free()


def test_graph_remote_equals_local_cpu_byte_for_byte(ggml, backend):
    g = ggml
    inputs = _inputs(np.random.default_rng(7))
    cpu = g.ggml_backend_cpu_init()
    try:
        local, _ = _run(g, g.ggml_backend_cpu_buffer_type(), lambda gf: g.ggml_backend_graph_compute(cpu, gf),
                           inputs)
    finally:
        g.ggml_backend_free(cpu)
    seen = []

    def remote_compute(gf):
        seen.extend(tensor_field(g, g.ggml_graph_node(gf, i), "buffer") for i in range(g.ggml_graph_n_nodes(gf)))
        backend.graph_compute(gf)

    remote, buffers = _run(g, backend.buffer_type, remote_compute, inputs)
    assert remote.shape == (4, 16) and remote.dtype == np.float32
    assert np.isfinite(local).all() and not (local == 0).all()
    assert remote.tobytes() == local.tobytes()
    # ggml's allocator put every node in this backend's (now freed) remote buffers.
    assert seen and all(b in buffers for b in seen)


def test_tensor_round_trip_copy_clear_on_the_host(ggml, backend, client):
    g = ggml
    ctx = Ctx(g)
    try:
        f16, i32, f32 = g.types["F16"], g.types["I32"], g.types["F32"]
        a = g.ggml_new_tensor_3d(ctx.ptr, f16, 5, 3, 2)
        b = g.ggml_new_tensor_1d(ctx.ptr, i32, 1000)
        c = g.ggml_new_tensor_1d(ctx.ptr, i32, 1000)
        d = g.ggml_new_tensor_2d(ctx.ptr, f32, 3, 3)
        buf = g.ggml_backend_alloc_ctx_tensors_from_buft(ctx.ptr, backend.buffer_type)
        assert buf and backend.has_buffer(buf)
        rng = np.random.default_rng(3)
        xa = rng.standard_normal((2, 3, 5)).astype(np.float16)
        xb = rng.integers(-(2**31), 2**31 - 1, 1000, dtype=np.int32)
        tensor_set(g, a, xa)
        tensor_set(g, b, xb)
        assert tensor_get(g, a).tobytes() == xa.tobytes()
        np.testing.assert_array_equal(tensor_get(g, b), xb)
        # The host's own view of the buffer agrees (get_alloc_size asks it for a placed tensor).
        assert g.ggml_backend_buft_get_alloc_size(backend.buffer_type, b) >= 4000
        g.ggml_backend_tensor_copy(b, c)  # remote cpy_tensor inside the host
        np.testing.assert_array_equal(tensor_get(g, c), xb)
        g.ggml_backend_tensor_memset(d, 0x40, 0, 36)
        assert tensor_get(g, d).tobytes() == b"\x40" * 36
        g.ggml_backend_buffer_clear(buf, 0)
        assert not tensor_get(g, b).any()
        g.ggml_backend_buffer_free(buf)
        assert not backend.has_buffer(buf)
    finally:
        ctx.free()


def test_device_answers_come_from_the_host(ggml, backend, client):
    g = ggml
    name = client.device_get_name()
    assert g.ggml_backend_dev_name(backend.device) == b"[virtgpu] " + name.encode()
    assert g.ggml_backend_buft_get_alignment(backend.buffer_type) == client.buffer_type_get_alignment(
        client.device_get_buffer_type())
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    g.ggml_backend_dev_memory(backend.device, ctypes.byref(free), ctypes.byref(total))
    # Cached at start, as the C: the total is the host's, the free memory what it was then.
    assert total.value == client.device_get_memory()[1]
    assert free.value == backend.info.memory_free


def test_threads_share_one_backend(ggml, backend):
    g = ggml
    n_threads, rounds = 4, 10
    ctx = Ctx(g, 2 * n_threads)
    errors = []
    try:
        tensors = [g.ggml_new_tensor_1d(ctx.ptr, g.types["F32"], 3000) for _ in range(n_threads)]
        buf = g.ggml_backend_alloc_ctx_tensors_from_buft(ctx.ptr, backend.buffer_type)

        def work(i):
            try:
                for r in range(rounds):
                    x = np.full(3000, i * 1000 + r, np.float32)
                    tensor_set(g, tensors[i], x)
                    assert (tensor_get(g, tensors[i]) == x).all()
            except BaseException as exc:  # reported below
                errors.append(exc)

        import threading

        threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        g.ggml_backend_buffer_free(buf)
    finally:
        ctx.free()
    assert errors == []
