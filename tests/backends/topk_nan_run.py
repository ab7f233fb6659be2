"""Child process of tests/backends/test_vulkan_topk_fusion.py (ggml Vulkan on lavapipe): TOP_K
of rows of -NaN (ggml-vulkan's n-ary search counts none of them and leaves slots holding its
padding's id, ne00), its ids read by GET_ROWS of a table of ne00 rows, through the host.
Prints the host's rc, status and the TOP_K's ids; refused (rc 1) or every id in range is right."""

import numpy as np

from apir.codec.constants import ApirBackendCommandType as Cmd
from apir.ggml import load
from apir.host import HostContext
from tests.host.hostkit import DATA_RES, GgmlScratch, Guest, RemoteGraph

N, K, ROWS = 100, 10, 4


def main():
    g = load()
    s = GgmlScratch(g)
    f32 = g.types["F32"]
    x = g.ggml_new_tensor_2d(s.ctx, f32, N, ROWS)
    table = g.ggml_new_tensor_3d(s.ctx, f32, 4, N, ROWS)
    ids = g.ggml_top_k(s.ctx, x, K)
    out = g.ggml_get_rows(s.ctx, table, ids)
    graph = g.ggml_new_graph(s.ctx)
    g.ggml_build_forward_expand(graph, out)
    guest = Guest(HostContext(7, {"apir.host.backend": "vulkan:0"}))
    remote = RemoteGraph(guest, g, s.ctx, graph)
    values = np.full((ROWS, N), -np.nan, np.float32)
    values[:, :3] = 1.0
    for t, d in ((x, values), (table, np.ones((ROWS, N, 4), np.float32))):
        assert guest.set_tensor(remote.handle, remote.rpc(t), d.tobytes()) == 0
    guest.data[: len(remote.wire)] = remote.wire
    rc, dec = guest.forward(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(DATA_RES), e.size_t(len(remote.wire))))
    status = dec.i32() if rc == 0 else None
    got = np.frombuffer(guest.get_tensor(remote.handle, remote.rpc(ids), K * ROWS * 4)[1], np.int32)
    print("rc", rc, "status", status)
    print("ids", " ".join(map(str, got.tolist())))
    remote.close()
    guest.close()
    s.close()


if __name__ == "__main__":
    main()
