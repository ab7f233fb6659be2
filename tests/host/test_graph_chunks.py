"""A graph computed in ranges of nodes (apir.host.graph.chunks, for backends without an abort
callback) gives what the whole graph gives, byte for byte, on ggml CPU: a two-layer decode
graph (tests/host/decodekit.py), ranges of 1, 7 and 64 nodes and one range of all, on 1 and
2 threads; and a graph-cache entry makes its ranges once per size."""

from __future__ import annotations

import ctypes

import pytest

from apir.host.graph.chunks import GraphChunks
from tests.host.decodekit import decode_graph, fill


@pytest.fixture
def decode(ggml):
    g = ggml
    d = decode_graph(g)
    dev = g.ggml_backend_dev_by_type(0)
    buf = g.ggml_backend_alloc_ctx_tensors_from_buft(d.ctx, g.ggml_backend_dev_buffer_type(dev))
    backend = g.ggml_backend_dev_init(dev, None)
    yield d, backend
    g.ggml_backend_free(backend)
    g.ggml_backend_buffer_free(buf)
    g.ggml_free(d.ctx)


def _logits(g, d) -> bytes:
    n = g.ggml_nbytes(d.out)
    out = ctypes.create_string_buffer(n)
    g.ggml_backend_tensor_get(d.out, out, 0, n)
    return out.raw


@pytest.mark.parametrize("threads", [1, 2])
def test_ranges_of_nodes_compute_what_the_whole_graph_computes(ggml, decode, threads):
    g, (d, backend) = ggml, decode
    g.ggml_backend_cpu_set_n_threads(backend, threads)
    n = g.ggml_graph_n_nodes(d.graph)
    fill(g, d)
    assert g.ggml_backend_graph_compute(backend, d.graph) == 0
    whole = _logits(g, d)
    assert len(set(whole)) > 16  # (computed, not an untouched buffer)
    for size in (1, 7, 64, n):
        chunks = GraphChunks(g, d.graph, size)
        try:
            assert len(chunks.graphs) == -(-n // size)
            assert sum(g.ggml_graph_n_nodes(c) for c in chunks.graphs) == n
            assert [g.ggml_graph_node(c, i) for c in chunks.graphs for i in range(g.ggml_graph_n_nodes(c))] == [
                g.ggml_graph_node(d.graph, i) for i in range(n)
            ]
            fill(g, d)  # (the KV caches back as they were)
            g.ggml_backend_tensor_set(d.out, bytes(len(whole)), 0, len(whole))
            for c in chunks.graphs:
                assert g.ggml_backend_graph_compute(backend, c) == 0
            assert _logits(g, d) == whole, size
        finally:
            chunks.close()


class _NoInfos:
    nbytes = 0

    def made(self):
        return []


def test_a_cache_entry_makes_its_ranges_once_per_size(ggml, decode):
    from apir.host.graph.cache import GraphCacheEntry
    from apir.host.tensors import Scratch

    d, _ = decode
    n = ggml.ggml_graph_n_nodes(d.graph)
    entry = GraphCacheEntry(b"", Scratch(ggml, 0), d.graph, None, {}, _NoInfos(), None, [])  # type: ignore[arg-type]
    before = entry.nbytes
    first = entry.chunks(ggml, 16)
    assert entry.chunks(ggml, 16) is first and len(first) == -(-n // 16)
    assert entry.nbytes > before  # (counted in the cache's budget)
    assert len(entry.chunks(ggml, 8)) == -(-n // 8)
    entry.close()
    assert entry._chunks is None
