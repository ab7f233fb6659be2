"""apir.guest.backend.stream: ggml's async entries of apir's backend. With the ASYNC extension
agreed, ggml_backend_tensor_set_async posts (no EXECBUFFER waited for), a get after it sees the
bytes, ggml_backend_tensor_copy_async copies on the host, and ggml's events work (the
scheduler's pattern: record after a copy, wait, synchronize; only new and free reach the host). Without ASYNC the entries are
NULL, as in the C guest of APIR 0.2, and every set is waited for."""

import ctypes

import numpy as np
import pytest

from apir.ggml.lib import InitParams
from apir.guest.backend import ApirBackend, BackendCallbackError, tensor_get
from apir.guest.backend.callbacks import clear_errors, raise_errors
from apir.guest.client import ApirClient
from apir.guest.errors import PostedCommandError
from apir.local.embedded import EmbeddedDevice


@pytest.fixture(params=[None, 0], ids=["async", "apir-0.2"])
def setup(request, ggml):
    client = ApirClient.connect(EmbeddedDevice(), extensions=request.param)
    backend = ApirBackend(client, ggml, zero_copy=False)
    ctx = ggml.ggml_init(InitParams(8 * ggml.ggml_tensor_overhead(), None, True))
    yield ggml, client, backend, ctx
    ggml.ggml_free(ctx)
    backend.close()
    client.close()


def _tensors(g, ctx, backend, n):
    f32 = g.types["F32"]
    tensors = [g.ggml_new_tensor_1d(ctx, f32, 256) for _ in range(n)]
    buf = g.ggml_backend_alloc_ctx_tensors_from_buft(ctx, backend.buffer_type)
    assert buf
    return tensors, buf


def _props_caps(g, backend):
    props = backend.abi.DevProps()
    g.ggml_backend_dev_get_props(backend.device, ctypes.addressof(props))
    return getattr(props.caps, "async"), props.caps.events


def test_posted_sets_then_a_get_see_the_data(setup):
    g, client, backend, ctx = setup
    (a, b), buf = _tensors(g, ctx, backend, 2)
    posting = client.extensions != 0
    assert _props_caps(g, backend) == (posting, posting)
    values = [np.arange(256, dtype=np.float32) * k for k in (1, 2)]
    waited, posted = client.remote.waited, client.remote.posted
    for tensor, value in zip((a, b), values):
        g.ggml_backend_tensor_set_async(backend.backend, tensor, value.ctypes.data, 0, value.nbytes)
    g.ggml_backend_synchronize(backend.backend)
    if posting:
        # two posts, one SYNCHRONIZE
        assert (client.remote.posted - posted, client.remote.waited - waited) == (2, 1)
    else:  # ggml falls back to the synchronous set: one waited-for EXECBUFFER each
        assert (client.remote.posted - posted, client.remote.waited - waited) == (0, 2)
    later = [value + 1 for value in values]
    for tensor, value in zip((a, b), later):
        g.ggml_backend_tensor_set(tensor, value.ctypes.data, 0, value.nbytes)  # posted too
    out = np.zeros(256, dtype=np.float32)
    g.ggml_backend_tensor_get_async(backend.backend, b, out.ctypes.data, 0, out.nbytes)
    np.testing.assert_array_equal(out, later[1])
    np.testing.assert_array_equal(tensor_get(g, a), later[0])
    assert client.in_flight == 0
    g.ggml_backend_buffer_free(buf)


def test_copy_async_and_events(setup):
    g, client, backend, ctx = setup
    (a, b), buf = _tensors(g, ctx, backend, 2)
    value = np.linspace(-1, 1, 256, dtype=np.float32)
    g.ggml_backend_tensor_set(a, value.ctypes.data, 0, value.nbytes)
    posted = client.remote.posted
    g.ggml_backend_tensor_copy_async(backend.backend, backend.backend, a, b)
    if client.extensions:
        assert client.remote.posted - posted == 1  # the copy, on the host
        waited = client.remote.waited
        event = g.ggml_backend_event_new(backend.device)
        assert event and client.remote.waited == waited + 1  # event_new, with the copy posted before it
        # in order, every compute and read waited for: record, wait and synchronize send nothing
        g.ggml_backend_event_record(event, backend.backend)
        g.ggml_backend_event_wait(backend.backend, event)
        g.ggml_backend_event_synchronize(event)
        assert client.remote.waited == waited + 1 and client.remote.posted == posted + 1
        g.ggml_backend_event_free(event)
        assert client.remote.waited == waited + 2
    else:
        assert not g.ggml_backend_event_new(backend.device)  # no events in APIR 0.2
    g.ggml_backend_synchronize(backend.backend)
    np.testing.assert_array_equal(tensor_get(g, b), value)
    g.ggml_backend_buffer_free(buf)


def test_a_failed_post_surfaces_at_synchronize(ggml):
    g = ggml
    client = ApirClient.connect(EmbeddedDevice())
    backend = ApirBackend(client, g, zero_copy=False)
    ctx = g.ggml_init(InitParams(8 * g.ggml_tensor_overhead(), None, True))
    try:
        (a,), buf = _tensors(g, ctx, backend, 1)
        value = np.ones(256, dtype=np.float32)
        g.ggml_backend_tensor_set_async(backend.backend, a, value.ctypes.data, 0, value.nbytes)
        client.buffer_free_buffer(backend.buffer(buf).host_handle)  # the host's buffer goes
        g.ggml_backend_tensor_set_async(backend.backend, a, value.ctypes.data, 0, value.nbytes)
        clear_errors()
        g.ggml_backend_synchronize(backend.backend)
        with pytest.raises(BackendCallbackError) as info:
            raise_errors("ggml_backend_synchronize")
        error = info.value.errors[0][1]
        assert isinstance(error, PostedCommandError)
        assert (error.function, error.code, error.index) == ("buffer_set_tensor_at", 5, 0)
        assert "buffer_set_tensor" in str(error) and "1024 bytes" in str(error)
    finally:
        g.ggml_free(ctx)
        backend.remove_buffer(buf)
        backend.close()
        client.close()


@pytest.mark.parametrize("extensions", [None, 0], ids=["use-counts", "apir-0.2"])
def test_a_split_carries_the_whole_graphs_use_counts(ggml, extensions):
    """A split of a graph (its first two nodes, sharing the whole graph's counts as
    ggml_graph_view does): under USE_COUNTS each record carries its count in the whole graph,
    and the host's graph keeps the second node's use by a later split (1, where the split
    alone says 0); without it the records' padding is zero and the host counts the split's."""
    from apir.codec.constants import ApirExtension
    from apir.codec.records import rpc_tensor_dtype
    from apir.ggml.cgraph import _use_count, share_use_counts
    from tests.host.hostkit import GgmlScratch

    g = ggml
    client = ApirClient.connect(EmbeddedDevice(), extensions=extensions)
    backend = ApirBackend(client, g, zero_copy=False)
    s = GgmlScratch(g)
    try:
        on = bool(client.extensions & ApirExtension.USE_COUNTS)
        assert on == (extensions is None)
        f32 = g.types["F32"]
        x, w = g.ggml_new_tensor_2d(s.ctx, f32, 16, 2), g.ggml_new_tensor_1d(s.ctx, f32, 16)
        n = g.ggml_rms_norm(s.ctx, x, 1e-6)
        y = g.ggml_mul(s.ctx, n, w)
        z = g.ggml_add(s.ctx, g.ggml_rms_norm(s.ctx, y, 1e-6), x)
        whole = g.ggml_new_graph(s.ctx)
        g.ggml_build_forward_expand(whole, z)
        buf = g.ggml_backend_alloc_ctx_tensors_from_buft(s.ctx, backend.buffer_type)
        part = g.ggml_new_graph_custom(s.ctx, 8, False)
        for t in (n, y):
            g.ggml_graph_add_node(part, t)
        assert share_use_counts(g, part, whole)
        sent = []
        compute = client.backend_graph_compute
        client.backend_graph_compute = lambda graph: (sent.append(bytes(graph)), compute(graph))[1]
        assert g.ggml_backend_graph_compute(backend.backend, part) == 0
        (wire,) = sent
        at = 8 + 8 * 2
        recs = np.frombuffer(wire, rpc_tensor_dtype(g.limits), offset=at)
        padding = np.ascontiguousarray(recs["padding"]).view("<i4").reshape(-1)
        want = [_use_count(whole, int(t)) for t in recs["id"]] if on else [0] * len(recs)
        assert padding.tolist() == want
        if on:
            assert dict(zip(recs["id"].tolist(), want)) == {x: 2, w: 1, n: 1, y: 1}
        (entry,) = client.remote.device.kernel.ctx._library.graph_cache._entries.values()
        built = [_use_count(entry.graph, g.ggml_graph_node(entry.graph, i)) for i in range(2)]
        assert built == ([1, 1] if on else [1, 0])
        g.ggml_backend_buffer_free(buf)
    finally:
        s.close()
        backend.close()
        client.close()
