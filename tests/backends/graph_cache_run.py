"""A repeated GET_ROWS graph through apir's host on one ggml backend, in a process of its own
(the ggml build and the Vulkan driver are chosen by environment when ggml loads).

    python -m tests.backends.graph_cache_run --backend SPEC OUT.json

Two host contexts in this process compute on SPEC's device (`apir.host.backend`): one with the
graph cache (apir.host.graph.cache), one whose cache keeps nothing (every graph a fresh
build). Graph A (GET_ROWS of 5 ids, scaled) is sent again and again with new row ids; in
between, other graphs with row ids write theirs over the context's device ids buffer (7 ids)
or make it replace that buffer by a larger one (20000 ids). Each of A's results is compared
with the fresh build's and with ggml on SPEC's device directly. Then A is sent with an id out
of range (refused?) and once more with good ids. OUT.json: per step of A the sha256 of the
three results, the cache's hits and misses, the refusal's return code and the last result's
check.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import sys

import numpy as np

N_ROWS = 10  # rows of the table
STEPS = ([3, 0, 9, 9, 1], [8, 8, 2, 5, 0], [1, 4, 6, 7, 2])
OTHER_IDS = (7, 20000)  # the ids buffer starts at 64 KiB: 20000 int32 ids make it larger


def get_rows_graph(g, ctx, n_ids=5):
    f32 = g.types["F32"]
    emb = g.ggml_new_tensor_2d(ctx, f32, 16, N_ROWS)
    ids = g.ggml_new_tensor_1d(ctx, g.types["I32"], n_ids)
    y = g.ggml_scale(ctx, g.ggml_get_rows(ctx, emb, ids), 2.0)
    graph = g.ggml_new_graph(ctx)
    g.ggml_build_forward_expand(graph, y)
    return graph, [emb, ids], y


def rows_data(ids):
    rng = np.random.default_rng(2)
    return [rng.standard_normal(16 * N_ROWS).astype(np.float32).tobytes(), np.asarray(ids, np.int32).tobytes()]


def direct(g, dev, n_ids, data) -> bytes:
    """The graph computed by ggml on device `dev` directly (no apir)."""
    from tests.host.hostkit import GgmlScratch

    s = GgmlScratch(g)
    graph, inputs, y = get_rows_graph(g, s.ctx, n_ids)
    buf = g.ggml_backend_alloc_ctx_tensors_from_buft(s.ctx, g.ggml_backend_dev_buffer_type(dev))
    backend = g.ggml_backend_dev_init(dev, None)
    try:
        for t, d in zip(inputs, data):
            g.ggml_backend_tensor_set(t, d, 0, len(d))
        assert g.ggml_backend_graph_compute(backend, graph) == 0
        out = ctypes.create_string_buffer(g.ggml_nbytes(y))
        g.ggml_backend_tensor_get(y, out, 0, len(out.raw))
        return out.raw
    finally:
        g.ggml_backend_free(backend)
        g.ggml_backend_buffer_free(buf)
        s.close()


def Repeated(guest, g, n_ids=5):
    """Graph A (or another GET_ROWS graph of `n_ids` ids) sent again and again on `guest`."""
    from tests.host.hostkit import RepeatedGraph  # after main() chose the ggml build

    return RepeatedGraph(guest, g, lambda g, ctx: get_rows_graph(g, ctx, n_ids))


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", required=True)
    p.add_argument("out")
    args = p.parse_args(argv)

    import apir.ggml
    from apir.ggml.backend_spec import resolve
    from apir.host import HostContext
    from apir.host.graph.cache import GraphCache
    from tests.host.hostkit import Guest

    g = apir.ggml.load()
    dev = resolve(g, args.backend).devices[0]
    config = {"apir.host.backend": args.backend, "apir.host.n_threads": "1"}
    cached, fresh = (Guest(HostContext(7 + k, config), data_size=2 << 20) for k in range(2))
    fresh.ctx._library.graph_cache = GraphCache(max_entries=0)  # keeps nothing: every graph built anew
    cache = cached.ctx._library.graph_cache
    report: dict = {"backend": g.ggml_backend_dev_name(dev).decode(), "steps": []}
    rng = np.random.default_rng(5)
    runs = {k: [Repeated(guest, g)] + [Repeated(guest, g, n) for n in OTHER_IDS] for k, guest in (("cached", cached), ("fresh", fresh))}
    try:
        for step, ids in enumerate(STEPS):
            data = rows_data(ids)
            row = {"ids": ids}
            for k in ("cached", "fresh"):
                rc, status, out = runs[k][0].compute(data)
                row[k] = [rc, status, sha(out)]
            row["direct"] = sha(direct(g, dev, 5, data))
            report["steps"].append(row)
            n = OTHER_IDS[step % 2]
            other = rows_data(rng.integers(0, N_ROWS, n).tolist())
            for k in ("cached", "fresh"):
                rc, status, out = runs[k][1 + step % 2].compute(other)
                assert (rc, status) == (0, 0), (k, rc, status)
                assert out == direct(g, dev, n, other), k
        report["hits"], report["misses"] = cache.hits, cache.misses
        report["refused_rc"] = runs["cached"][0].compute(rows_data([3, 0, N_ROWS, 9, 1]))[0]
        data = rows_data([9, 9, 9, 0, 0])
        rc, status, out = runs["cached"][0].compute(data)
        report["after_refusal"] = [rc, status, out == direct(g, dev, 5, data)]
    finally:
        for rs in runs.values():
            for r in rs:
                r.close()
        cached.close()
        fresh.close()
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
