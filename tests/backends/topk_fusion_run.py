"""Child process of tests/backends/test_vulkan_topk_fusion.py (ggml Vulkan on lavapipe): a
MoE router (SOFT_MAX, RESHAPE, ARGSORT, VIEW, GET_ROWS: ggml-vulkan's TOPK_MOE_EARLY_SOFTMAX
fusion) whose argsort a second GET_ROWS also reads, through a VIEW node whose src[0] names
another tensor (the guest's choice) so the argsort keeps one use. Fused, the argsort's own
columns past the top k are never written; the ids the guest left there (argv[1]) would reach
the second GET_ROWS. argv[2] (optional): the top-k view's row stride in elements, on one
token (the fused kernel asserts it is the expert count). Prints the host's rc and status, the
argsort's ids, the output and ggml CPU's output as hex."""

import sys

import numpy as np

from apir.codec.constants import ApirBackendCommandType as Cmd
from apir.codec.records import rpc_tensor_dtype
from apir.ggml import load
from apir.host import HostContext
from tests.host.hostkit import DATA_RES, GgmlScratch, Guest, RemoteGraph, cpu_compute

N_EXPERT, K, ROW = 8, 2, 4


def build(g, ctx, n_tokens: int, topk_nb1: int):
    """(graph, logits, table, argsort, view of all its ids, output)."""
    f32, i32 = g.types["F32"], g.types["I32"]
    logits = g.ggml_new_tensor_2d(ctx, f32, N_EXPERT, n_tokens)
    table = g.ggml_new_tensor_3d(ctx, f32, ROW, N_EXPERT, n_tokens)
    probs = g.ggml_soft_max(ctx, logits)
    probs_r = g.ggml_reshape_3d(ctx, probs, 1, N_EXPERT, n_tokens)
    sel = g.ggml_argsort(ctx, probs, 1)  # GGML_SORT_ORDER_DESC
    topk = g.ggml_view_2d(ctx, sel, K, n_tokens, g.ggml_row_size(i32, topk_nb1), 0)
    weights = g.ggml_get_rows(ctx, probs_r, topk)
    every = g.ggml_view_2d(ctx, sel, N_EXPERT, n_tokens, g.ggml_row_size(i32, N_EXPERT), 0)
    out = g.ggml_get_rows(ctx, table, every)
    for t in (weights, out):
        g.ggml_set_output(t)
    graph = g.ggml_new_graph(ctx)
    g.ggml_build_forward_expand(graph, weights)
    g.ggml_build_forward_expand(graph, out)
    return graph, logits, table, sel, every, out


def main():
    stale = int(sys.argv[1])
    topk_nb1 = int(sys.argv[2]) if len(sys.argv) > 2 else N_EXPERT
    n_tokens = 1 if topk_nb1 != N_EXPERT else 2
    g = load()
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n_tokens, N_EXPERT), dtype=np.float32).tobytes()
    tab = rng.standard_normal((n_tokens, N_EXPERT, ROW), dtype=np.float32).tobytes()

    ref = GgmlScratch(g)
    graph, logits, table, _, _, out = build(g, ref.ctx, n_tokens, topk_nb1)
    want = cpu_compute(g, ref.ctx, graph, [(logits, x), (table, tab)], out, n_threads=1)
    ref.close()

    s = GgmlScratch(g)
    graph, logits, table, sel, every, out = build(g, s.ctx, n_tokens, topk_nb1)
    guest = Guest(HostContext(7, {"apir.host.backend": "vulkan:0"}))
    remote = RemoteGraph(guest, g, s.ctx, graph)
    wire = bytearray(remote.wire)
    at = 4 + 8 * int.from_bytes(wire[:4], "little") + 4
    recs = np.frombuffer(wire, dtype=rpc_tensor_dtype(g.limits), offset=at).copy()
    (k,) = np.flatnonzero(recs["id"] == every)
    recs[k]["src"][0] = logits  # the view names another tensor: the argsort keeps one use
    wire[at:] = recs.tobytes()
    left = np.full(N_EXPERT * n_tokens, stale, np.int32).tobytes()
    for t, d in ((logits, x), (table, tab), (sel, left)):
        assert guest.set_tensor(remote.handle, remote.rpc(t), d) == 0
    guest.data[: len(wire)] = bytes(wire)
    rc, dec = guest.forward(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(DATA_RES), e.size_t(len(wire))))
    status = dec.i32() if rc == 0 else None
    got = guest.get_tensor(remote.handle, remote.rpc(out), g.ggml_nbytes(out))[1]
    ids = guest.get_tensor(remote.handle, remote.rpc(sel), g.ggml_nbytes(sel))[1]
    print("rc", rc, "status", status, flush=True)
    print("ids", np.frombuffer(ids, np.int32).tolist())
    print("apir", got.hex())
    print("cpu", want.hex())
    remote.close()
    guest.close()
    s.close()


if __name__ == "__main__":
    main()
