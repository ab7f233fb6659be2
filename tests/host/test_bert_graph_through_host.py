"""A whole model's graph through the host: the MiniLM graph of apir.models.bert_graph (its
ops' rules together, with the graph-level checks) computes to ggml CPU's own bytes."""

import ctypes

import numpy as np

from apir.codec.constants import ApirBackendCommandType as Cmd
from tests.host.hostkit import DATA_RES, RemoteGraph, cpu_compute


def _minilm_graph(g, ctx):
    """A 2-layer, 64-wide BERT through apir.models.bert_graph (the MiniLM graph's ops)."""
    from apir.models.assets import BertConfig
    from apir.models.bert_graph import build_graph, weight_ne
    from tests.models.reference import tiny_weights

    cfg = BertConfig(50, 64, 2, 4, 96, 40, 2, 1e-12, "gelu", 40)
    w = tiny_weights(np.random.default_rng(1), 64, 96, 2, 50, 40)
    tensors = {}
    for name, arr in w.items():
        ne = weight_ne(arr.shape)
        tensors[name] = g.ggml_new_tensor(ctx, g.types["F32"], len(ne), (ctypes.c_int64 * len(ne))(*ne))
    bg = build_graph(g, ctx, tensors, cfg, 3, 17)
    data = [(tensors[k], v.tobytes()) for k, v in w.items()]
    rng = np.random.default_rng(2)
    for t in vars(bg.inputs).values():
        n = g.ggml_nelements(t)
        type_name = g.type_names[int(np.frombuffer(ctypes.string_at(t, 4), np.uint32)[0])]
        arr = {"I32": lambda: rng.integers(0, 2, n).astype(np.int32),  # valid ids, types, positions
               "F16": lambda: rng.random(n).astype(np.float16)}.get(type_name, lambda: rng.random(n).astype(np.float32))()
        data.append((t, arr.tobytes()))
    return bg, data


def test_minilm_graph_matches_ggml_cpu(guest, ggml):
    from apir.ggml import InitParams
    from apir.models.bert_graph import GRAPH_SIZE

    g = ggml
    size = g.ggml_tensor_overhead() * (GRAPH_SIZE + 200) + g.ggml_graph_overhead_custom(GRAPH_SIZE, False)
    outs = []
    for through_host in (False, True):
        ctx = g.ggml_init(InitParams(size, None, True))
        bg, data = _minilm_graph(g, ctx)
        nbytes = g.ggml_nbytes(bg.output)
        if through_host:
            remote = RemoteGraph(guest, g, ctx, bg.graph)
            for t, d in data:
                assert guest.set_tensor(remote.handle, remote.rpc(t), d) == 0
            wire = remote.wire
            guest.data[: len(wire)] = wire
            rc, dec = guest.forward(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(DATA_RES), e.size_t(len(wire))))
            assert rc == 0 and dec.i32() == 0
            rc, got = guest.get_tensor(remote.handle, remote.rpc(bg.output), nbytes)
            assert rc == 0
            remote.close()
        else:
            got = cpu_compute(g, ctx, bg.graph, data, bg.output)
        g.ggml_free(ctx)
        outs.append(got)
    assert outs[1] == outs[0]
    emb = np.frombuffer(outs[0], np.float32).reshape(3, 64)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, rtol=1e-5)  # L2_NORM ran

