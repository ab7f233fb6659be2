"""The graph time limit and cancellation on a backend without an abort callback (ggml-vulkan,
ggml-rpc), through apir's host, in a process of its own (the ggml build and the Vulkan driver
are chosen by environment when ggml loads).

    python -m tests.backends.compute_bound_run --backend SPEC OUT.json

Host contexts in this process compute on SPEC's device (apir.host.backend.compute_abort: the
graph in ranges of apir.host.graph_chunk_nodes nodes, the flag looked at between them).
Scenarios: a two-layer decode graph (tests/host/decodekit.py) computed whole (chunk_nodes 0)
and in ranges of 7 nodes on two contexts, the logits compared byte for byte; a chain of
N_NODES in-place ADDs (its result counts the nodes that ran) over a 0.5 s limit, stopped
with GGML_STATUS_ABORTED at a range's end, then a 3-node chain on the same context run to
its end; the chain on a socket host (apir.host.local) whose guest hangs up mid-compute:
stopped (the status the host's context recorded). And row ids the graph computes
(apir.host.graph.computed_ids): MUL_MAT_ID and GET_ROWS of an argsort's top-k expert ids, whose
result must be ggml CPU's (computed in this process). OUT.json: each scenario's figures.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

N_ELEMENTS = 1 << 20  # F32 of the ADD chain (4 MiB: each node touches all of it)
N_NODES = 6000  # many seconds on lavapipe or an rpc-server: far past the limit
CHUNK = 64


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", required=True)
    p.add_argument("out")
    args = p.parse_args(argv)
    import apir.ggml

    g = apir.ggml.load()
    report: dict = {"statuses": {k: g.statuses[k] for k in ("SUCCESS", "ABORTED")}}
    for scenario in (exact, time_limit, hang_up, computed_ids):
        t0 = time.monotonic()
        report.update(scenario(g, args.backend))
        print(f"{scenario.__name__}: {time.monotonic() - t0:.1f} s", file=sys.stderr)
    Path(args.out).write_text(json.dumps(report))
    return 0


def _guest(backend: str, **config):
    from apir.host import HostContext
    from tests.host.hostkit import Guest

    conf = {"apir.host.backend": backend, "apir.host.n_threads": "1"}
    conf.update({f"apir.host.{k}": str(v) for k, v in config.items()})
    return Guest(HostContext(7, conf), data_size=8 << 20)


def _compute(guest, wire: bytes) -> int:
    from apir.codec.constants import ApirBackendCommandType as Cmd
    from tests.host.hostkit import DATA_RES

    guest.data[: len(wire)] = wire
    rc, dec = guest.forward(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(DATA_RES), e.size_t(len(wire))))
    assert rc == 0, rc
    return dec.i32()


def exact(g, backend: str) -> dict:
    """The decode graph's logits on a context computing whole graphs and on one computing
    ranges of 7 nodes."""
    from tests.host.decodekit import decode_graph, fill
    from tests.host.hostkit import RemoteGraph

    out: dict = {}
    for name, chunk in (("whole", 0), ("ranges", 7)):
        guest = _guest(backend, graph_chunk_nodes=chunk)
        d = decode_graph(g)
        remote = RemoteGraph(guest, g, d.ctx, d.graph)
        fill(g, d)
        for t in d.inputs:  # (the local buffer's bytes of each input, sent as the guest would)
            n = g.ggml_nbytes(t)
            data = ctypes.create_string_buffer(n)
            g.ggml_backend_tensor_get(t, data, 0, n)
            assert guest.set_tensor(remote.handle, remote.rpc(t), data.raw) == 0
        status = _compute(guest, remote.wire)
        rc, logits = guest.get_tensor(remote.handle, remote.rpc(d.out), g.ggml_nbytes(d.out))
        out[name] = {
            "chunked": guest.ctx._library.abort.chunked,
            "status": status,
            "rc": rc,
            "logits": bytes(logits).hex(),
        }
        remote.close()
        g.ggml_free(d.ctx)
        guest.close()
    return {"exact": out}


def _chain(g, guest, n_nodes: int):
    """(remote graph, its scratch, out, reset(), nodes_run()) for an ADD chain on `guest`."""
    from tests.host.hostkit import GgmlScratch, RemoteGraph

    scratch = GgmlScratch(g, 2 * n_nodes + 8)  # (room for the custom-size graph too)
    f32 = g.types["F32"]
    acc, one = g.ggml_new_tensor_1d(scratch.ctx, f32, N_ELEMENTS), g.ggml_new_tensor_1d(scratch.ctx, f32, 1)
    y = acc
    for _ in range(n_nodes):
        y = g.ggml_add_inplace(scratch.ctx, y, one)
    g.ggml_set_output(y)
    graph = g.ggml_new_graph_custom(scratch.ctx, n_nodes + 8, False)
    g.ggml_build_forward_expand(graph, y)
    remote = RemoteGraph(guest, g, scratch.ctx, graph)
    assert guest.set_tensor(remote.handle, remote.rpc(one), np.float32(1.0).tobytes()) == 0
    assert guest.set_tensor(remote.handle, remote.rpc(acc), bytes(4 * N_ELEMENTS)) == 0

    def nodes_run() -> int:
        rc, first = guest.get_tensor(remote.handle, remote.rpc(y), 4)
        assert rc == 0
        return int(np.frombuffer(first, np.float32)[0])

    return remote, scratch, nodes_run


def time_limit(g, backend: str) -> dict:
    guest = _guest(backend, graph_time_limit_s=0.5, graph_chunk_nodes=CHUNK)
    remote, scratch, nodes_run = _chain(g, guest, N_NODES)
    t0 = time.monotonic()
    status = _compute(guest, remote.wire)
    took = time.monotonic() - t0
    out = {"status": status, "nodes": nodes_run(), "took_s": took, "chunked": guest.ctx._library.abort.chunked}
    short, short_scratch, short_run = _chain(g, guest, 3)
    out["next"] = [_compute(guest, short.wire), short_run()]
    for r, s in ((remote, scratch), (short, short_scratch)):
        r.close()
        s.close()
    guest.close()
    return {"time_limit": out}


def hang_up(g, backend: str) -> dict:
    """The chain on a socket host with no time limit; the guest hangs up once the host's
    compute started: the status its context recorded, and whether the host let go of it."""
    from apir.guest.client import ApirClient
    from apir.guest.local import LocalDevice
    from apir.host.local.server import LocalServer
    from tests.host.hostkit import graph_status_recorder

    statuses: list = []
    started = threading.Event()
    compute = g.ggml_backend_graph_compute

    def watched(backend_, graph):
        started.set()
        return compute(backend_, graph)

    g.ggml_backend_graph_compute = watched

    config = {
        "apir.host.backend": backend,
        "apir.host.n_threads": "1",
        "apir.host.graph_time_limit_s": "0",  # only the hang-up may stop it
        "apir.host.graph_chunk_nodes": str(CHUNK),
    }
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        recorder = graph_status_recorder(statuses)
        with LocalServer(str(Path(tmp) / "s.sock"), config=config, context_factory=recorder).start() as srv:
            dev = LocalDevice(srv.path)
            client = ApirClient.connect(dev)

            class ClientGuest:
                def alloc(self, size):
                    return client.buffer_type_alloc_buffer(client.device_get_buffer_type(), size)

                def set_tensor(self, handle, rpc, data, offset=0):
                    client.buffer_set_tensor(handle, rpc, offset, data)
                    return 0

                def get_tensor(self, handle, rpc, size):
                    out = bytearray(size)
                    client.buffer_get_tensor(handle, rpc, 0, out)
                    return 0, bytes(out)

            remote, scratch, _ = _chain(g, ClientGuest(), N_NODES)

            def run():
                try:
                    client.backend_graph_compute(remote.wire)
                except Exception:  # noqa: BLE001 (the connection is gone: expected)
                    pass

            t = threading.Thread(target=run, daemon=True)
            t0 = time.monotonic()
            t.start()
            out["started"] = started.wait(60)
            dev.sock.shutdown(socket.SHUT_RDWR)  # the guest departs mid-compute
            end = time.monotonic() + 60
            while srv.stats().contexts and time.monotonic() < end:
                time.sleep(0.02)
            out["contexts_left"] = srv.stats().contexts
            out["took_s"] = time.monotonic() - t0
            t.join(10)
            remote.close()
            scratch.close()
    g.ggml_backend_graph_compute = compute
    out["statuses"] = statuses
    return {"hang_up": out}


def computed_ids(g, backend: str) -> dict:
    """A MoE layer's routing as llama.cpp builds it: ids = the first 2 columns of ARGSORT(probs)
    (ggml_argsort_top_k; not TOP_K, whose ids ggml-vulkan does not keep in range) of 6 experts, then MUL_MAT_ID of the
    experts' weights and GET_ROWS of the probabilities by those ids; through the host on
    `backend`, and on ggml CPU here."""
    from tests.host.hostkit import GgmlScratch, RemoteGraph, cpu_compute

    def build(ctx):
        f32 = g.types["F32"]
        experts = g.ggml_new_tensor_3d(ctx, f32, 16, 4, 6)
        x = g.ggml_new_tensor_3d(ctx, f32, 16, 1, 3)  # 3 tokens
        probs = g.ggml_new_tensor_2d(ctx, f32, 6, 3)
        order = g.ggml_argsort(ctx, probs, 1)  # (ggml_argsort_top_k: DESC, then a view)
        ids = g.ggml_view_2d(ctx, order, 2, 3, g.ggml_row_size(g.types["I32"], 6), 0)  # [2, 3]
        mm = g.ggml_mul_mat_id(ctx, experts, x, ids)  # [4, 2, 3]
        w = g.ggml_get_rows(ctx, g.ggml_reshape_3d(ctx, probs, 1, 6, 3), ids)  # [1, 2, 3]
        out = g.ggml_mul(ctx, mm, w)
        for t in (experts, x, probs):
            g.ggml_set_input(t)
        g.ggml_set_output(out)
        graph = g.ggml_new_graph(ctx)
        g.ggml_build_forward_expand(graph, out)
        return graph, out, [experts, x, probs]

    rng = np.random.default_rng(4)
    data = [rng.standard_normal(n).astype(np.float32).tobytes() for n in (384, 48)]
    data.append(np.stack([rng.permutation(6) for _ in range(3)]).astype(np.float32).tobytes())  # (no ties)
    s = GgmlScratch(g, 64)
    graph, out, inputs = build(s.ctx)
    want = cpu_compute(g, s.ctx, graph, zip(inputs, data), out)
    s.close()
    guest = _guest(backend)
    s = GgmlScratch(g, 64)
    graph, out, inputs = build(s.ctx)
    remote = RemoteGraph(guest, g, s.ctx, graph)
    for t, d in zip(inputs, data):
        assert guest.set_tensor(remote.handle, remote.rpc(t), d) == 0
    status = _compute(guest, remote.wire)
    rc, got = guest.get_tensor(remote.handle, remote.rpc(out), g.ggml_nbytes(out))
    # (each token's expert slots compared as a set, ordered by their first value: the order
    # of the top k is not ggml's contract)
    def slots(b):
        rows = np.frombuffer(b, np.float32).reshape(3, 2, 4)
        return np.stack([r[np.argsort(r[:, 0])] for r in rows])

    diff = float(np.abs(slots(got) - slots(want)).max())
    remote.close()
    s.close()
    guest.close()
    return {"computed_ids": {"status": status, "rc": rc, "max_abs_diff": diff, "nonzero": any(want)}}


if __name__ == "__main__":
    sys.exit(main())
