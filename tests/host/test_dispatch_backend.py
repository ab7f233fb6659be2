"""graph_compute: real ggml graphs through the host give ggml CPU's own bytes."""

import ctypes

import numpy as np
import pytest

from apir.codec.constants import ApirBackendCommandType as Cmd
from tests.host.hostkit import DATA_RES, GgmlScratch, RemoteGraph, cpu_compute


def _attention_like(g, ctx):
    """softmax(scale * (W x) + b) with a mask, plus a permute+cont and get_rows: the ops
    a small transformer layer uses."""
    f32 = g.types["F32"]
    w = g.ggml_new_tensor_2d(ctx, g.types["F16"], 32, 24)
    x = g.ggml_new_tensor_2d(ctx, f32, 32, 5)
    b = g.ggml_new_tensor_1d(ctx, f32, 24)
    mask = g.ggml_new_tensor_2d(ctx, f32, 24, 5)
    emb = g.ggml_new_tensor_2d(ctx, f32, 24, 10)
    rows = g.ggml_new_tensor_1d(ctx, g.types["I32"], 5)
    inputs = [w, x, b, mask, emb, rows]
    for i, t in enumerate(inputs):
        g.ggml_set_name(t, f"in{i}".encode())
        g.ggml_set_input(t)
    y = g.ggml_add(ctx, g.ggml_mul_mat(ctx, w, x), b)
    y = g.ggml_add(ctx, y, g.ggml_get_rows(ctx, emb, rows))
    y = g.ggml_soft_max_ext(ctx, y, mask, 0.125, 0.0)
    y = g.ggml_cont(ctx, g.ggml_transpose(ctx, y))
    y = g.ggml_norm(ctx, y, 1e-5)
    g.ggml_set_output(y)
    graph = g.ggml_new_graph(ctx)
    g.ggml_build_forward_expand(graph, y)
    return graph, inputs, y


def _input_data(g, inputs):
    rng = np.random.default_rng(5)
    out = []
    for t in inputs:
        n = g.ggml_nelements(t)
        ttype = g.type_names[int(np.frombuffer(ctypes.string_at(t, 4), np.uint32)[0])]
        if ttype == "F16":
            out.append(rng.standard_normal(n).astype(np.float16).tobytes())
        elif ttype == "I32":
            out.append(rng.integers(0, 10, n).astype(np.int32).tobytes())
        else:
            out.append(rng.standard_normal(n).astype(np.float32).tobytes())
    return out


def _direct(g, data):
    """The same graph computed with ggml CPU directly."""
    s = GgmlScratch(g)
    graph, inputs, y = _attention_like(g, s.ctx)
    out = cpu_compute(g, s.ctx, graph, zip(inputs, data), y)
    s.close()
    return out


def _remote(guest, g, data):
    s = GgmlScratch(g)
    graph, inputs, y = _attention_like(g, s.ctx)
    remote = RemoteGraph(guest, g, s.ctx, graph)
    buf, wire = remote.handle, remote.wire
    for t, d in zip(inputs, data):
        assert guest.set_tensor(buf, remote.rpc(t), d) == 0
    guest.data[: len(wire)] = wire
    rc, dec = guest.forward(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(DATA_RES), e.size_t(len(wire))))
    assert rc == 0
    status = dec.i32()
    rc, out = guest.get_tensor(buf, remote.rpc(y), g.ggml_nbytes(y))
    assert rc == 0
    remote.close()
    s.close()
    return status, out, wire


def test_graph_compute_matches_ggml_cpu(guest, ggml):
    s = GgmlScratch(ggml)
    _, inputs, _ = _attention_like(ggml, s.ctx)
    data = _input_data(ggml, inputs)
    s.close()
    expect = _direct(ggml, data)
    status, got, _ = _remote(guest, ggml, data)
    assert status == 0
    assert got == expect
    assert np.isfinite(np.frombuffer(got, np.float32)).all()


def test_graph_compute_twice_is_stable(guest, ggml):
    s = GgmlScratch(ggml)
    _, inputs, _ = _attention_like(ggml, s.ctx)
    data = _input_data(ggml, inputs)
    s.close()
    assert _remote(guest, ggml, data)[1] == _remote(guest, ggml, data)[1]


@pytest.mark.parametrize("size_delta,rc", [(-1, 1), (-304, 1), (8, 0)])
def test_graph_size(guest, ggml, size_delta, rc):
    """A size short of the counts is refused; trailing bytes are ignored, as by the C."""
    s = GgmlScratch(ggml)
    _, inputs, _ = _attention_like(ggml, s.ctx)
    data = _input_data(ggml, inputs)
    s.close()
    _, _, wire = _remote(guest, ggml, data)
    guest.data[: len(wire)] = wire
    got, _ = guest.forward(Cmd.BACKEND_GRAPH_COMPUTE,
                           lambda e: (e.u32(DATA_RES), e.size_t(len(wire) + size_delta)))
    assert got == rc


def test_graph_without_compute_flags_computes_nothing_and_warns(guest, ggml, caplog):
    """Nodes without GGML_TENSOR_FLAG_COMPUTE are skipped, as ggml does (status SUCCESS, the
    result untouched); when no node has it the host says so in its log."""
    from apir.codec.records import rpc_tensor_dtype

    s = GgmlScratch(ggml)
    graph, inputs, y = _attention_like(ggml, s.ctx)
    data = _input_data(ggml, inputs)
    remote = RemoteGraph(guest, ggml, s.ctx, graph)
    for t, d in zip(inputs, data):
        assert guest.set_tensor(remote.handle, remote.rpc(t), d) == 0
    wire = bytearray(remote.wire)
    n_nodes = int.from_bytes(wire[:4], "little")
    nodes = set(np.frombuffer(bytes(wire[4: 4 + 8 * n_nodes]), np.uint64).tolist())
    records = np.frombuffer(wire, rpc_tensor_dtype(ggml.limits), offset=8 + 8 * n_nodes)
    assert (records["flags"][np.isin(records["id"], list(nodes))] & ggml.tensor_flags["COMPUTE"]).all()
    cleared = records.copy()
    cleared["flags"][np.isin(cleared["id"], list(nodes))] = 0
    wire[8 + 8 * n_nodes:] = cleared.tobytes()
    before = guest.get_tensor(remote.handle, remote.rpc(y), ggml.ggml_nbytes(y))[1]
    guest.data[: len(wire)] = wire
    with caplog.at_level("WARNING", logger="apir.host"):
        rc, dec = guest.forward(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(DATA_RES), e.size_t(len(wire))))
    assert rc == 0 and dec.i32() == 0
    assert guest.get_tensor(remote.handle, remote.rpc(y), ggml.ggml_nbytes(y))[1] == before
    assert any("has GGML_TENSOR_FLAG_COMPUTE" in r.getMessage() for r in caplog.records)
    caplog.clear()
    _remote_status = _remote(guest, ggml, data)[0]  # the flagged graph: no warning
    assert _remote_status == 0
    assert not any("GGML_TENSOR_FLAG_COMPUTE" in r.getMessage() for r in caplog.records)
    remote.close()
    s.close()


@pytest.mark.parametrize("configured", ["free", None, "3"])
def test_n_threads_free_computes_each_graph_on_the_free_cores(ggml, monkeypatch, configured):
    """apir.host.n_threads=free: a graph computes on no more threads than the cores (3 here)
    other processes leave free as it starts (apir.local.spin_policy.free_cores), all of them
    again once free; unset or a number, the count never changes. ggml CPU's bytes either way."""
    from apir.host import HostContext
    from apir.host.backend import library as backend_library
    from apir.host.config import CONFIG_KEY_N_THREADS
    from tests.host.hostkit import Guest

    monkeypatch.setattr(backend_library.os, "cpu_count", lambda: 3)
    ctx = HostContext(7)
    if configured:
        ctx.set_config(CONFIG_KEY_N_THREADS, configured)
    guest = Guest(ctx)
    try:
        lib = guest.ctx._library
        counts = []
        if lib._free_threads is not None:
            set_threads = lib._free_threads
            lib._free_threads = lambda backend, n: (counts.append(n), set_threads(backend, n))
        s = GgmlScratch(ggml)
        _, inputs, _ = _attention_like(ggml, s.ctx)
        data = _input_data(ggml, inputs)
        s.close()
        expect = _direct(ggml, data)
        for free in (1, 1, 2, 3, 3):
            monkeypatch.setattr(backend_library, "free_cores", lambda: free)
            status, got, _ = _remote(guest, ggml, data)
            assert (status, got) == (0, expect)
        assert lib.n_threads == 3
        assert counts == ([1, 2, 3] if configured == "free" else [])  # set when it changes only
    finally:
        guest.close()
