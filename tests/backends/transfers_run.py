"""Deferred uploads and batched row-id reads (apir.host.backend.transfers) through apir's host on one
ggml backend, in a process of its own (the ggml build and the Vulkan driver are chosen by
environment when ggml loads).

    python -m tests.backends.transfers_run --backend SPEC OUT.json

Host contexts in this process compute on SPEC's device (`apir.host.backend`). Each scenario
sets tensors (queued where the backend defers them), then runs the command that must see
them, and compares what the guest gets back with the bytes it expects: set/set/compute/get
(ADD, with a tensor set twice and a partial overwrite), set then get, set then free (and a
new buffer reads zeros), set then cpy_tensor, set then clear, sets past the staging bound,
and a repeated GET_ROWS graph whose hits read two row-id tensors in one batch (an id out of
range refused on a hit). Then one decode-like step (4 small sets, a cached graph, a get) is
counted: ggml_backend_synchronize and synchronous tensor_set/get calls, with the deferral and
without (the same context kind with `transfers` off). OUT.json: per scenario true/false, the
staging's largest fill and capacity, and the counts.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

N = 1 << 14  # floats of the ADD operands (64 KiB each)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", required=True)
    p.add_argument("out")
    args = p.parse_args(argv)

    import apir.ggml
    from apir.codec.constants import ApirBackendCommandType as Cmd
    from apir.host import HostContext
    from apir.host.backend.transfers import DeviceTransfers
    from tests.host.hostkit import DATA_RES, GgmlScratch, Guest, RemoteGraph, RepeatedGraph, rpc_bytes, rpc_record

    g = apir.ggml.load()
    f32, i32 = g.types["F32"], g.types["I32"]
    config = {"apir.host.backend": args.backend, "apir.host.n_threads": "1"}
    guest = Guest(HostContext(7, config), data_size=4 << 20)
    lib = guest.ctx._library
    report: dict = {"backend": lib.backend_name, "deferred": lib.transfers is not None}
    rng = np.random.default_rng(11)
    s = GgmlScratch(g)

    def rand(n: int) -> bytes:
        return rng.standard_normal(n).astype(np.float32).tobytes()

    def compute(remote: RemoteGraph):
        guest.data[: len(remote.wire)] = remote.wire
        rc, dec = guest.forward(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(DATA_RES), e.size_t(len(remote.wire))))
        return rc, dec.i32() if rc == 0 else None

    try:
        # set, set (a twice, the second partial), compute, get
        a, b = g.ggml_new_tensor_1d(s.ctx, f32, N), g.ggml_new_tensor_1d(s.ctx, f32, N)
        y = g.ggml_add(s.ctx, a, b)
        graph = g.ggml_new_graph(s.ctx)
        g.ggml_build_forward_expand(graph, y)
        add = RemoteGraph(guest, g, s.ctx, graph)
        ok = True
        for _ in range(3):
            da, db, patch = rand(N), rand(N), rand(100)
            ok &= guest.set_tensor(add.handle, add.rpc(a), da) == 0
            ok &= guest.set_tensor(add.handle, add.rpc(b), db) == 0
            ok &= guest.set_tensor(add.handle, add.rpc(a), patch, offset=4000) == 0
            a_now = bytearray(da)
            a_now[4000:4400] = patch
            want = (np.frombuffer(bytes(a_now), np.float32) + np.frombuffer(db, np.float32)).tobytes()
            ok &= compute(add) == (0, 0)
            ok &= guest.get_tensor(add.handle, add.rpc(y), 4 * N) == (0, want)
        report["set_set_compute_get"] = bool(ok)

        # set then get of the same bytes
        da = rand(N)
        report["set_then_get"] = guest.set_tensor(add.handle, add.rpc(a), da) == 0 and guest.get_tensor(
            add.handle, add.rpc(a), 4 * N
        ) == (0, da)

        # set then cpy_tensor (into another buffer), set then clear
        t = g.ggml_new_tensor_1d(s.ctx, f32, N)
        src_buf, dst_buf = guest.alloc(4 * N), guest.alloc(4 * N)
        r_src, r_dst = rpc_bytes(rpc_record(g, t, src_buf, 0)), rpc_bytes(rpc_record(g, t, dst_buf, 0))
        data = rand(N)
        ok = guest.set_tensor(src_buf, r_src, data) == 0
        rc, d = guest.forward(Cmd.BUFFER_CPY_TENSOR, lambda e: (e.handle(dst_buf), e.blob(r_src), e.blob(r_dst)))
        ok &= rc == 0 and d.bool() is True
        report["set_then_cpy_tensor"] = bool(ok and guest.get_tensor(dst_buf, r_dst, 4 * N) == (0, data))
        # (what a clear gives, from a buffer never set: ggml-vulkan fills 32-bit words with the
        # u8 value, vkCmdFillBuffer, so a non-zero value is not every byte)
        ref = guest.alloc(4 * N)
        ok = guest.forward(Cmd.BUFFER_CLEAR, lambda e: (e.handle(ref), e.u8(0x5A)))[0] == 0
        rc, cleared = guest.get_tensor(ref, rpc_bytes(rpc_record(g, t, ref, 0)), 4 * N)
        ok &= rc == 0 and cleared != bytes(4 * N)
        ok &= guest.set_tensor(src_buf, r_src, rand(N)) == 0
        ok &= guest.forward(Cmd.BUFFER_CLEAR, lambda e: (e.handle(src_buf), e.u8(0x5A)))[0] == 0
        report["set_then_clear"] = bool(ok and guest.get_tensor(src_buf, r_src, 4 * N) == (0, cleared))

        # set then free: the queued copy lands before the buffer goes; a new one reads zeros
        ok = guest.set_tensor(dst_buf, r_dst, rand(N)) == 0
        ok &= guest.forward(Cmd.BUFFER_FREE_BUFFER, lambda e: e.handle(dst_buf))[0] == 0
        fresh = guest.alloc(4 * N)
        r_fresh = rpc_bytes(rpc_record(g, t, fresh, 0))
        report["set_then_free"] = bool(ok and guest.get_tensor(fresh, r_fresh, 4 * N) == (0, bytes(4 * N)))

        # sets of every size past a small staging: the fill stays within it, every byte lands
        if lib.transfers is not None:
            lib.transfers.close()
            lib.transfers = DeviceTransfers(g, lib.backend, lib.dev, 16 << 10)
        big = g.ggml_new_tensor_1d(s.ctx, f32, 1 << 16)
        big_buf = guest.alloc(1 << 18)
        r_big = rpc_bytes(rpc_record(g, big, big_buf, 0))
        want_big = bytearray(1 << 18)
        most, ok = 0, True
        for size in [100, 9000, 9000, 16384, 16385, 70000, 1, 4096] * 3:
            off = int(rng.integers(0, (1 << 18) - size + 1))
            chunk = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
            ok &= guest.set_tensor(big_buf, r_big, chunk, offset=off) == 0
            want_big[off : off + size] = chunk
            most = max(most, lib.transfers._used if lib.transfers is not None else 0)
        report["bounded_sets"] = bool(ok and guest.get_tensor(big_buf, r_big, 1 << 18) == (0, bytes(want_big)))
        report["staging_most"], report["staging_capacity"] = most, 16 << 10
        if lib.transfers is not None:
            lib.transfers.close()
            lib.transfers = DeviceTransfers(g, lib.backend, lib.dev)

        # a repeated graph with two row-id tensors: hits read them in one batch
        def rows_graph(g, ctx):
            emb = g.ggml_new_tensor_2d(ctx, f32, 16, 10)
            ids1, ids2 = g.ggml_new_tensor_1d(ctx, i32, 5), g.ggml_new_tensor_1d(ctx, i32, 3)
            y = g.ggml_concat(ctx, g.ggml_get_rows(ctx, emb, ids1), g.ggml_get_rows(ctx, emb, ids2), 1)
            graph = g.ggml_new_graph(ctx)
            g.ggml_build_forward_expand(graph, y)
            return graph, [emb, ids1, ids2], y

        emb = rng.standard_normal((10, 16)).astype(np.float32)
        rows = RepeatedGraph(guest, g, rows_graph)
        ok, hits = True, lib.graph_cache.hits
        for ids1, ids2 in (([1, 2, 3, 4, 5], [9, 0, 0]), ([5, 4, 3, 2, 1], [1, 1, 9]), ([0, 0, 0, 9, 9], [7, 8, 6])):
            data = [emb.tobytes(), np.int32(ids1).tobytes(), np.int32(ids2).tobytes()]
            ok &= rows.compute(data) == (0, 0, emb[ids1 + ids2].tobytes())
        report["row_ids_on_hits"] = bool(ok) and lib.graph_cache.hits - hits == 2
        bad = [emb.tobytes(), np.int32([1, 2, 3, 4, 5]).tobytes(), np.int32([9, 10, 0]).tobytes()]
        report["row_id_out_of_range_refused_on_hit"] = rows.compute(bad)[0] != 0
        data = [emb.tobytes(), np.int32([3, 3, 3, 3, 3]).tobytes(), np.int32([2, 2, 2]).tobytes()]
        report["after_refusal"] = rows.compute(data) == (0, 0, emb[[3] * 5 + [2] * 3].tobytes())

        # one decode-like step, counted: 3 inputs set (+1 more) then a cached graph, then a get
        counts = {}
        for mode in ("deferred", "synchronous"):
            saved = lib.transfers
            if mode == "synchronous":
                lib.transfers = None
            seen = {"synchronize": 0, "tensor_set": 0, "tensor_get": 0, "tensor_set_async": 0, "tensor_get_async": 0}
            real = {k: getattr(g, "ggml_backend_" + k) for k in seen}

            def spy(k, seen=seen, real=real):
                def call(*a):
                    seen[k] += 1
                    return real[k](*a)

                return call

            for k in seen:
                setattr(g, "ggml_backend_" + k, spy(k))
            try:
                data = [emb.tobytes(), np.int32([4, 4, 1, 2, 3]).tobytes(), np.int32([0, 5, 6]).tobytes()]
                assert guest.set_tensor(add.handle, add.rpc(b), rand(16)) == 0
                ok = rows.compute(data) == (0, 0, emb[[4, 4, 1, 2, 3, 0, 5, 6]].tobytes())
            finally:
                for k in seen:
                    setattr(g, "ggml_backend_" + k, real[k])
                lib.transfers = saved
            counts[mode] = dict(seen, ok=bool(ok))
        report["step_counts"] = counts
        rows.close()
        add.close()
    finally:
        s.close()
        guest.close()
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
