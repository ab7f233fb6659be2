"""The USE_COUNTS extension (apir.host.backend.extensions, apir.ggml.cgraph): with it agreed,
a built graph's use counts are the guest's from the records' `padding`, raised to the graph's
own where lower (a guest makes the host fuse less, never more) and capped; without it the
padding is not read; the graph cache keys on the counts; ids writers stay pinned."""

import numpy as np
import pytest

from apir.codec.constants import (
    APIR_WIRE_USE_COUNT_MAX,
    ApirBackendCommandType as Cmd,
    ApirCommandType,
    ApirExtension,
    ApirExtensionCommandType as X,
)
from apir.codec.records import rpc_tensor_dtype
from apir.ggml.cgraph import _use_count, fill_use_counts, source_uses
from apir.host import HostContext
from tests.host.hostkit import DATA_RES, GgmlScratch, Guest, RemoteGraph, norm_mul_graph

USE_COUNTS = int(ApirExtension.USE_COUNTS)


def _with_counts(g, wire: bytes, counts: dict) -> bytes:
    """`wire` with the padding of the record of tensor id `k` the int32 `counts[k]`."""
    data = bytearray(wire)
    n_nodes = int.from_bytes(data[:4], "little")
    at = 8 + 8 * n_nodes
    dt = rpc_tensor_dtype(g.limits)
    n = int.from_bytes(data[at - 4 : at], "little")
    recs = np.frombuffer(data, dt, count=n, offset=at)
    pad = dt.fields["padding"][1]
    for k, rec in enumerate(recs):
        if int(rec["id"]) in counts:
            off = at + k * dt.itemsize + pad
            data[off : off + 4] = int(counts[int(rec["id"])]).to_bytes(4, "little", signed=True)
    return bytes(data)


class _Setup:
    def __init__(self, g, wanted):
        self.g = g
        self.guest = Guest(HostContext(7, {}))
        if wanted is not None:
            rc, dec = self.guest.command(ApirCommandType.FORWARD, int(X.EXT_QUERY), lambda e: e.u32(wanted))
            assert (rc, dec.u32()) == (4, wanted)
        self.s = GgmlScratch(g)
        self.gf = norm_mul_graph(g, self.s.ctx)
        self.n = g.ggml_graph_n_nodes(self.gf)
        self.nodes = [g.ggml_graph_node(self.gf, i) for i in range(self.n)]
        self.remote = RemoteGraph(self.guest, g, self.s.ctx, self.gf)

    def built_counts(self, counts: dict):
        """Computes the graph with node i's guest count `counts[i]`: the built graph's counts."""
        wire = _with_counts(self.g, self.remote.wire, {self.nodes[i]: c for i, c in counts.items()})
        self.guest.data[: len(wire)] = wire
        rc, dec = self.guest.forward(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(DATA_RES), e.size_t(len(wire))))
        assert (rc, dec.i32()) == (0, 0)
        cache = self.guest.ctx._library.graph_cache
        entry = next(reversed(cache._entries.values()))  # (the one just put back)
        return [_use_count(entry.graph, self.g.ggml_graph_node(entry.graph, i)) for i in range(self.n)]

    def close(self):
        self.remote.close()
        self.s.close()
        self.guest.close()


@pytest.fixture
def agreed(ggml):
    s = _Setup(ggml, USE_COUNTS)
    yield s
    s.close()


def test_a_guest_count_above_the_graphs_own_is_the_built_graphs(agreed):
    """The first norm has one consumer here, but the guest says 2 (another split reads it):
    the host's graph says 2 as well, and the backend does not fuse it."""
    assert [_use_count(agreed.gf, t) for t in agreed.nodes] == [1, 1, 1, 1, 0]
    assert agreed.built_counts({0: 2, 1: 1, 2: 1, 3: 1}) == [2, 1, 1, 1, 0]


def test_without_the_extension_the_padding_is_not_read(ggml):
    s = _Setup(ggml, None)
    try:
        assert s.built_counts({0: 2, 2: 9}) == [1, 1, 1, 1, 0]
    finally:
        s.close()


def test_hostile_counts_are_raised_to_the_graphs_own_and_capped(agreed):
    """A count below the graph's own (negative, zero) cannot make the host fuse more: it is
    raised to the graph's; one beyond APIR_WIRE_USE_COUNT_MAX is taken as that."""
    got = agreed.built_counts({0: -7, 1: 0, 2: 2**31 - 1, 3: -(2**31)})
    assert got == [1, 1, APIR_WIRE_USE_COUNT_MAX, 1, 0]


def test_the_same_graph_with_other_counts_is_built_again(agreed):
    assert agreed.built_counts({0: 1}) == [1, 1, 1, 1, 0]
    assert agreed.built_counts({0: 3}) == [3, 1, 1, 1, 0]
    assert agreed.built_counts({0: 1}) == [1, 1, 1, 1, 0]


@pytest.mark.parametrize("writer", ["plain", "kernel"])
def test_a_pinned_node_stays_above_its_uses_whatever_the_guest_says(ggml, writer):
    """fill_use_counts on a ggml graph of 4 nodes: an ids writer (pinned: one more than its
    uses) keeps its count under a guest count of its uses or less, and takes a higher one;
    the caller's `uses` stay as they were."""
    g = ggml
    write = None
    if writer == "kernel":
        pytest.importorskip("numba")
        from apir.host.graph.kernels import use_counts_kernel as write
    s = GgmlScratch(g)
    try:
        tensors = [g.ggml_new_tensor_1d(s.ctx, g.types["F32"], 4) for _ in range(4)]
        host_at = np.array(tensors, np.int64)
        node_index = np.arange(4, dtype=np.int64)
        uses = source_uses(np.array([[-1], [0], [1], [1]], np.int32), 4)  # 0 used once, 1 twice
        for guest_counts, want in ((None, [2, 2, 0, 0]), (np.array([1, 5, -1, 0], np.int32), [2, 5, 0, 0])):
            graph = g.ggml_new_graph_custom(s.ctx, 8, False)
            for t in tensors:
                g.ggml_graph_add_node(graph, t)
            assert fill_use_counts(g, graph, host_at, node_index, uses, np.array([0]), write, guest_counts)
            assert [_use_count(graph, t) for t in tensors] == want
        assert uses.tolist() == [1, 2, 0, 0]
    finally:
        s.close()
