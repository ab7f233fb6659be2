"""apir.ggml.cgraph: a graph the host builds node by node carries the use counts ggml's own
graph building gives the same graph (so backends fuse as they do locally), and none under
apir.host.use_counts=off; the slots it picks are found by ggml's own lookup."""

import numpy as np
import pytest

from apir.codec.constants import ApirBackendCommandType as Cmd
from apir.ggml.cgraph import CgraphLayout, _insert, _use_count, source_uses, write_hash_set
from apir.host import HostContext
from tests.host.hostkit import DATA_RES, GgmlScratch, Guest, RemoteGraph, norm_mul_graph


@pytest.mark.parametrize("config", [{}, {"apir.host.use_counts": "off"}], ids=["on", "off"])
def test_host_graphs_carry_ggmls_use_counts(ggml, config):
    g = ggml
    assert CgraphLayout.of(g) is not None
    guest = Guest(HostContext(7, config))
    s = GgmlScratch(g)
    try:
        gf = norm_mul_graph(g, s.ctx)
        n = g.ggml_graph_n_nodes(gf)
        local = [_use_count(gf, g.ggml_graph_node(gf, i)) for i in range(n)]
        assert local == [1, 1, 1, 1, 0]
        remote = RemoteGraph(guest, g, s.ctx, gf)
        guest.data[: len(remote.wire)] = remote.wire
        rc, dec = guest.forward(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(DATA_RES), e.size_t(len(remote.wire))))
        assert (rc, dec.i32()) == (0, 0)
        (entry,) = guest.ctx._library.graph_cache._entries.values()
        built = [_use_count(entry.graph, g.ggml_graph_node(entry.graph, i)) for i in range(n)]
        assert built == (local if not config else [0] * n)
        remote.close()
    finally:
        s.close()
        guest.close()


def test_insert_places_every_key_where_linear_probing_finds_it():
    rng = np.random.default_rng(3)
    size = 67
    # clustered keys: many share a home slot
    keys = np.unique((rng.integers(0, 8, 60) * size + rng.integers(0, 5, 60)).astype(np.uint64) << np.uint64(4))
    slots = _insert(keys, size)
    assert len(set(slots.tolist())) == len(keys)
    taken = np.zeros(size, dtype=bool)
    taken[slots] = True
    for key, slot in zip(keys.tolist(), slots.tolist()):
        i = (key >> 4) % size
        while i != slot:  # every slot between home and its own is taken (ggml_hash_find's walk)
            assert taken[i]
            i = (i + 1) % size


def _hash_set(size):
    return np.zeros((size + 31) // 32, np.uint32), np.zeros(size, np.uint64), np.zeros(size, np.int32)


def _found(used, table, counts, key):
    """ggml_hash_find's walk from `key`'s home: its count, or None where it is not in the set."""
    size = len(table)
    i = (key >> 4) % size
    while used[i >> 5] >> (i & 31) & 1:
        if int(table[i]) == key:
            return int(counts[i])
        i = (i + 1) % size
    return None


@pytest.mark.parametrize("writer", ["plain", "kernel"])
def test_write_hash_set_plain_and_kernel_give_every_node_its_count(writer):
    """The same inputs through write_hash_set and its Numba twin: every node found by ggml's
    walk with its count (source_uses of the graph's source slots), no other key in the set.
    Clustered keys make long probe runs, wrapping past the table's end."""
    if writer == "kernel":
        pytest.importorskip("numba")
        from apir.host.graph.kernels import use_counts_kernel as write
    else:
        write = write_hash_set
    rng = np.random.default_rng(7)
    size = 67
    n_tensors = 50
    host_at = (rng.choice(8, n_tensors) * size + 60 + rng.choice(12, n_tensors)).astype(np.uint64) << np.uint64(4)
    host_at = np.unique(host_at)[:40]
    n_tensors = len(host_at)
    src_index = rng.integers(-1, n_tensors, (n_tensors, 4)).astype(np.int32)
    node_index = rng.permutation(n_tensors)[: n_tensors // 2 + 3].astype(np.int64)
    used, table, counts = _hash_set(size)
    uses = source_uses(src_index, n_tensors)
    write(host_at, node_index, uses, used, table, counts)
    want = [sum(int(s) == j for s in src_index.reshape(-1)) for j in range(n_tensors)]
    for j in node_index.tolist():
        assert _found(used, table, counts, int(host_at[j])) == want[j]
    others = np.setdiff1d(np.arange(n_tensors), node_index)
    assert all(_found(used, table, counts, int(host_at[j])) is None for j in others.tolist())
    assert int(np.unpackbits(used.view(np.uint8)).sum()) == len(node_index)
