"""apir.host.graph.shapes.layout against results placed over their inputs: an ARGSORT whose
ids overlap the values it sorts makes ggml-cpu's std::sort read what it permutes, and run
past the row (the host process segfaulted: every guest gone). Refused, whether the graph is
new or the cached one again with its result moved; the host then serves the graph as built.
Each run is in a child process, so that a regression fails the test instead of killing it."""

import multiprocessing

import numpy as np
import pytest

N, ROWS = 1000, 16


def _compute(order: int, cached_first: bool, queue) -> None:
    from apir.codec.constants import ApirBackendCommandType as Cmd
    from apir.codec.records import rpc_tensor_dtype
    from apir.ggml import load
    from apir.host import HostContext
    from tests.host.hostkit import DATA_RES, GgmlScratch, Guest, RemoteGraph

    g = load()
    s = GgmlScratch(g)
    x = g.ggml_new_tensor_2d(s.ctx, g.types["F32"], N, ROWS)
    ids = g.ggml_argsort(s.ctx, x, order)
    graph = g.ggml_new_graph(s.ctx)
    g.ggml_build_forward_expand(graph, ids)
    guest = Guest(HostContext(7, {"apir.host.n_threads": "1"}), data_size=1 << 22)
    remote = RemoteGraph(guest, g, s.ctx, graph)
    at = 4 + 8 * int.from_bytes(remote.wire[:4], "little") + 4
    recs = np.frombuffer(remote.wire, dtype=rpc_tensor_dtype(g.limits), offset=at).copy()
    over = bytearray(remote.wire)
    recs[np.flatnonzero(recs["id"] == ids)[0]]["data"] = recs[np.flatnonzero(recs["id"] == x)[0]]["data"]
    over[at:] = recs.tobytes()
    values = np.random.default_rng(4).standard_normal(N * ROWS).astype(np.float32).tobytes()

    def compute(wire):
        assert guest.set_tensor(remote.handle, remote.rpc(x), values) == 0
        guest.data[: len(wire)] = bytes(wire)
        rc, dec = guest.forward(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(DATA_RES), e.size_t(len(wire))))
        return rc, dec.i32() if rc == 0 else None

    rcs = [compute(remote.wire)] if cached_first else []
    rcs += [compute(over), compute(remote.wire)]
    out = guest.get_tensor(remote.handle, remote.rpc(ids), N * ROWS * 4)[1]
    rows = np.frombuffer(out, np.int32).reshape(ROWS, N)
    queue.put((rcs, all(sorted(row.tolist()) == list(range(N)) for row in rows)))


@pytest.mark.parametrize("cached_first", [False, True], ids=["new", "cached"])
@pytest.mark.parametrize("order", [0, 1], ids=["asc", "desc"])
def test_an_argsort_over_its_input_is_refused(order, cached_first):
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_compute, args=(order, cached_first, queue))
    child.start()
    child.join(300)
    assert child.exitcode == 0, f"the host process died (exit {child.exitcode})"
    rcs, permutation = queue.get(timeout=10)
    assert rcs == [(0, 0)] * cached_first + [(1, None), (0, 0)]
    assert permutation  # the graph as built computes ggml's argsort after the refusal
