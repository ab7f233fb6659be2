"""What the graph cache tests (test_graph_cache.py, test_graph_cache_structure_hostile.py)
share: a small guest graph with links, a view and row ids (`cached_graph`: mul_mat + add + get_rows + soft_max + a
view), its inputs (`graph_inputs`), ggml CPU's answer for them (`direct_output`), and a
`GraphSession` that sends it, or altered bytes of it, through a hostkit Guest's graph_compute."""

from __future__ import annotations

import numpy as np

from apir.codec.constants import ApirBackendCommandType as Cmd
from apir.codec.records import rpc_tensor_dtype
from apir.host.graph.cache import GraphCache
from tests.host.hostkit import DATA_RES, GgmlScratch, RemoteGraph, cpu_compute

__all__ = ["N_ROWS", "cached_graph", "graph_inputs", "direct_output", "GraphSession"]

N_ROWS = 10  # rows of the GET_ROWS table


def cached_graph(g, ctx):
    """(graph, its 4 inputs, its output) in ggml context `ctx`: mul_mat + add + get_rows +
    soft_max + a view."""
    f32 = g.types["F32"]
    w = g.ggml_new_tensor_2d(ctx, f32, 16, 12)
    x = g.ggml_new_tensor_2d(ctx, f32, 16, 3)
    emb = g.ggml_new_tensor_2d(ctx, f32, 12, N_ROWS)
    rows = g.ggml_new_tensor_1d(ctx, g.types["I32"], 3)
    inputs = [w, x, emb, rows]
    for i, t in enumerate(inputs):
        g.ggml_set_name(t, f"in{i}".encode())
        g.ggml_set_input(t)
    y = g.ggml_add(ctx, g.ggml_mul_mat(ctx, w, x), g.ggml_get_rows(ctx, emb, rows))
    y = g.ggml_soft_max_ext(ctx, y, None, 0.5, 0.0)
    y = g.ggml_cont(ctx, g.ggml_view_2d(ctx, y, 6, 3, g.ggml_row_size(f32, 12), 0))
    g.ggml_set_output(y)
    graph = g.ggml_new_graph(ctx)
    g.ggml_build_forward_expand(graph, y)
    return graph, inputs, y


def graph_inputs(seed, rows=(1, 7, 3)):
    """The bytes of `cached_graph`'s inputs: random from `seed`, the GET_ROWS ids `rows`."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(16 * 12).astype(np.float32).tobytes(),
            rng.standard_normal(16 * 3).astype(np.float32).tobytes(),
            rng.standard_normal(12 * N_ROWS).astype(np.float32).tobytes(),
            np.array(rows, np.int32).tobytes()]


def direct_output(g, data):
    """`cached_graph`'s output bytes for inputs `data`, computed by ggml CPU directly."""
    s = GgmlScratch(g)
    graph, inputs, y = cached_graph(g, s.ctx)
    out = cpu_compute(g, s.ctx, graph, zip(inputs, data), y)
    s.close()
    return out


class GraphSession:
    """`cached_graph` on a host context: set inputs, send (possibly altered) wire bytes."""

    def __init__(self, guest, g):
        self.guest, self.g = guest, g
        self.s = GgmlScratch(g)
        graph, self.inputs, self.y = cached_graph(g, self.s.ctx)
        self.remote = RemoteGraph(guest, g, self.s.ctx, graph)
        self.wire = self.remote.wire

    @property
    def cache(self) -> GraphCache:
        return self.guest.ctx._library.graph_cache

    def set_inputs(self, data):
        for t, d in zip(self.inputs, data):
            assert self.guest.set_tensor(self.remote.handle, self.remote.rpc(t), d) == 0

    def compute(self, wire=None):
        """(rc, status or None)."""
        wire = self.wire if wire is None else wire
        self.guest.data[: len(wire)] = wire
        rc, dec = self.guest.forward(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(DATA_RES), e.size_t(len(wire))))
        return rc, (dec.i32() if rc == 0 else None)

    def output(self):
        rc, out = self.guest.get_tensor(self.remote.handle, self.remote.rpc(self.y), self.g.ggml_nbytes(self.y))
        assert rc == 0
        return out

    def records(self):
        """(n_nodes, a copy of the wire's tensor records)."""
        n_nodes = int.from_bytes(self.wire[:4], "little")
        return n_nodes, np.frombuffer(self.wire, rpc_tensor_dtype(self.g.limits), offset=8 + 8 * n_nodes).copy()

    def wire_with(self, records):
        """The wire with its tensor records replaced by `records`."""
        n_nodes = int.from_bytes(self.wire[:4], "little")
        return self.wire[: 8 + 8 * n_nodes] + records.tobytes()

    def close(self):
        self.remote.close()
        self.s.close()
