"""Codec speed against the C, measured in the same run (no assertions; numbers printed).

1. Serializing a 10,000-node ggml graph: apir's `serialize_graph` (Numba kernel over ggml's
   structs) against ggml-virtgpu's C++ `apir_serialize_graph` (built here from the C
   reference, timed in C so no ctypes overhead is charged to it). Target: ours <= 0.25x the C.
2. Copying 256 MiB with `copy_bytes` against a plain memcpy (`ctypes.memmove`) of the same
   bytes. Target: >= 80% of memcpy's throughput.
3. Parsing (validating) the serialized graph on the host, for reference.
4. The host's whole front half of graph_compute on the same graph with every tensor placed in
   a buffer: apir's parse_graph + build_graph (every check: records, views, spans, each node's
   shape rule, row ids) against the C host's apir_decode_ggml_cgraph / apir_deserialize_graph
   (which builds the same ggml graph and checks only that each tensor's bytes lie in its
   buffer), timed in C. Each side: the best of its builds, the host context's ggml_free not
   timed (the C harness frees it after its clock stops); ours in 4 rounds of 8 interleaved
   with the C's 4 rounds of 5 (on a 2-core VM the first builds after the C's run up to twice
   as slow and warm up over several builds: rounds of 5 missed the warm figure by up to 15%).
   Target: ours <= 1.0x the C.
   For reference, against the same C time: ours on the host's plain path (apir.accel off for
   the build's checks; the parse stays as the codec runs it), and what graph_compute itself
   does with a graph the cache does not hold (the parse and build plus the cache's part: the
   wire kept for matching the next graph in place, and the entry's `link_key`; no target: the
   C keeps no cache). Also the same graph again from the context's graph cache, as
   graph_compute finds it (apir.host.graph.cache.GraphCache.take_same: compared in place, no
   parse, then the re-check): under other tensor ids (as built in another ggml context), and
   the very same bytes. Target: each <= 0.2x a first build.

Run: python benchmarks/bench_codec.py  (builds the C reference into ~/.cache/apir/cref on
first use, about a minute; the C harness in about 3 s; tests/cref.py says where else).
"""

from __future__ import annotations

import ctypes
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import apir.ggml  # noqa: E402
from apir.codec.copy import copy_bytes  # noqa: E402
from apir.codec.graph import parse_graph, serialize_graph  # noqa: E402
from tests import cref  # noqa: E402
from tests.codec import cbuild  # noqa: E402
from tests.codec.graphs import build_graph  # noqa: E402


def best_of(fn, reps: int, rounds: int = 5) -> float:
    """Best mean seconds per call over `rounds` rounds of `reps` calls."""
    return best_of_pair(fn, None, reps, rounds)[0]


def best_of_pair(fn_a, fn_b, reps: int, rounds: int = 7):
    """(best a, best b) seconds per call, rounds of a and b interleaved so that load from
    other processes on the machine hits both alike."""
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for k, fn in enumerate((fn_a, fn_b)):
            if fn is None:
                continue
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            best[k] = min(best[k], (time.perf_counter() - t0) / reps)
    return best


def bench_graph(g, ref) -> None:
    bg = build_graph(g, 500, ref.ref_new_buffer, graph_size=16384)
    try:
        n_nodes = g.ggml_graph_n_nodes(bg.cgraph)
        out = serialize_graph(g, bg.cgraph, bg.buffers)  # compiles / loads the cache
        n_tensors = (len(out) - 8 - 8 * n_nodes) // 304
        reps = 20
        # Best mean of `reps` calls (the graph then stays in cache, as the target was set), rounds
        # of ours and the C's interleaved so that load from other processes hits both alike.
        ours, theirs = float("inf"), float("inf")
        for _ in range(15):
            ours = min(ours, best_of(lambda: serialize_graph(g, bg.cgraph, bg.buffers), reps, rounds=1))
            theirs = min(theirs, ref.ref_time_serialize_graph(bg.cgraph, reps) * 1e-9)
        print(f"serialize graph: {n_nodes} nodes, {n_tensors} tensors, {len(out) / 1e6:.2f} MB")
        print(f"  apir serialize_graph      {ours * 1e3:8.3f} ms/graph  {ours * 1e9 / n_nodes:6.1f} ns/node")
        print(f"  C++ apir_serialize_graph  {theirs * 1e3:8.3f} ms/graph  {theirs * 1e9 / n_nodes:6.1f} ns/node")
        print(f"  ratio ours/C              {ours / theirs:8.2f}x   (target <= 0.25x)")
        valid = np.zeros(g.type_count, bool)
        valid[list(g.type_names)] = True
        data = out.tobytes()
        parse = best_of(lambda: parse_graph(data, op_count=g.op_count, type_valid=valid, limits=g.limits), reps)
        print(f"  apir parse_graph (host)   {parse * 1e3:8.3f} ms/graph  {parse * 1e9 / n_nodes:6.1f} ns/node")
    finally:
        bg.free(g)


def bench_host_build(g, ref) -> None:
    from apir.codec.graph import BufferTable
    from apir import accel
    from apir.host.backend.dispatch_backend import prepare_graph
    from apir.host.graph.build import build_graph_parts, graph_scratch
    from apir.host.graph.cache import GraphCache, graph_wire
    from tests.host.hostkit import Guest

    bg = build_graph(g, 500, ref.ref_new_buffer, graph_size=16384, all_allocated=True)
    guest = Guest(data_size=1 << 20)
    cpu_buft = g.ggml_backend_dev_buffer_type(g.ggml_backend_dev_by_type(0))
    c_buffers = []
    try:
        ours_table, c_table = BufferTable(), BufferTable()
        for ptr, base, used in bg.buffers_used:
            size = max(used, 64)
            ours_table.register(ptr, guest.alloc(size), base)
            c_buf = g.ggml_backend_buft_alloc_buffer(cpu_buft, size)
            c_buffers.append(c_buf)
            ref.ref_track_buffer(c_buf)
            c_table.register(ptr, c_buf, base)  # the C host's handles are its buffer pointers
        ours_wire = serialize_graph(g, bg.cgraph, ours_table).tobytes()
        c_wire = serialize_graph(g, bg.cgraph, c_table)
        n_nodes = g.ggml_graph_n_nodes(bg.cgraph)
        lib = guest.ctx._library
        kw = dict(limits=g.limits, op_count=g.op_count, type_valid=lib.checker.valid_types)
        enums = lib.op_enums

        def first() -> float:
            """Seconds of one parse + build, the context's ggml_free left out (as the C's
            timing leaves it out)."""
            t0 = time.perf_counter()
            parsed = parse_graph(ours_wire, **kw)
            with graph_scratch(lib, parsed) as scratch:
                build_graph_parts(lib, parsed, scratch, enums)
                return time.perf_counter() - t0

        def first_cached() -> float:
            """Seconds of what graph_compute does with a graph no cache entry holds: parse,
            the wire kept for the next graph's match in place, the entry's key, build."""
            t0 = time.perf_counter()
            parsed = parse_graph(ours_wire, **kw)
            wire = graph_wire(parsed)
            entry = prepare_graph(lib, parsed, GraphCache(), wire)  # (an empty cache: a miss)
            entry.remember_wire(wire)
            seconds = time.perf_counter() - t0
            entry.close()
            return seconds

        cache = GraphCache()
        other_ids = _other_ids(ours_wire, n_nodes, parse_graph(ours_wire, **kw).tensors.dtype)

        def again(wire: bytes) -> None:  # graph_compute's way to its cache entry: matched in place
            entry = cache.take_same(wire, len(wire), lib)
            assert entry is not None and entry.recheck(lib, enums)
            cache.put(entry)

        first()
        parsed = parse_graph(ours_wire, **kw)
        entry = prepare_graph(lib, parsed, cache)
        entry.remember_wire(graph_wire(parsed))  # as graph_compute does
        cache.put(entry)
        # each the best of 25 single calls, interleaved (a first build's figure is the best of 32)
        hit, same = best_of_pair(lambda: again(other_ids), lambda: again(ours_wire), 1, rounds=25)
        hits = cache.hits
        # first builds in rounds interleaved with the C's (the module docstring says why 8):
        # ours on the accelerated path and on the plain one
        ours, plain, theirs, cached = float("inf"), float("inf"), float("inf"), float("inf")
        enabled = accel.enabled
        for _ in range(4):
            ours = min([ours] + [first() for _ in range(8)])
            cached = min([cached] + [first_cached() for _ in range(8)])
            accel.enabled = lambda: False
            try:
                plain = min([plain] + [first() for _ in range(5)])
            finally:
                accel.enabled = enabled
            theirs = min(theirs, ref.ref_time_deserialize_graph(c_wire.ctypes.data, len(c_wire), 5) * 1e-9)
        if theirs < 0:
            raise RuntimeError("the C host's apir_decode_ggml_cgraph failed on the graph")
        print(f"host parse + build: {n_nodes} nodes, every tensor in a buffer")
        print(f"  apir parse + build (checked)  {ours * 1e3:8.2f} ms/graph  {ours * 1e9 / n_nodes:7.1f} ns/node")
        print(f"  C apir_deserialize_graph      {theirs * 1e3:8.2f} ms/graph  {theirs * 1e9 / n_nodes:7.1f} ns/node")
        print(f"  ratio ours/C                  {ours / theirs:8.2f}x   (target <= 1.0x)")
        print(
            f"  apir, the host's plain path   {plain * 1e3:8.2f} ms/graph  {plain / theirs:5.2f}x the C  "
            "(apir.accel off for the build)"
        )
        print(
            f"  apir with the graph cache's part {cached * 1e3:6.2f} ms/graph  {cached / theirs:5.2f}x the C  "
            "(graph_compute's first build: parse, graph_wire, link_key, build)"
        )
        print(
            f"  apir same structure, new ids  {hit * 1e3:8.2f} ms/graph  {hit / theirs:5.2f}x the C  "
            f"({hit / ours:.3f}x a first build, target <= 0.2x; GraphWire.same_structure, no parse)"
        )
        print(
            f"  apir same bytes again         {same * 1e3:8.2f} ms/graph  {same / theirs:5.2f}x the C  "
            f"({same / ours:.3f}x a first build, target <= 0.2x; GraphWire.matches, no parse; {hits} hits)"
        )
    finally:
        cache.clear()
        for c_buf in c_buffers:
            ref.ref_untrack_buffer(c_buf)
            g.ggml_backend_buffer_free(c_buf)
        guest.close()
        bg.free(g)


def _other_ids(wire: bytes, n_nodes: int, rpc: np.dtype) -> bytes:
    """`wire` (a serialized graph of `n_nodes` nodes, records of dtype `rpc`) with every
    tensor id moved by 2**40: the same graph as built in another ggml context."""
    head = 8 + 8 * n_nodes
    shift = np.uint64(1 << 40)
    nodes = np.frombuffer(wire, np.uint64, n_nodes, 4) + shift
    recs = np.frombuffer(wire, rpc, offset=head).copy()
    for f in ("id", "src", "view_src"):
        recs[f] = np.where(recs[f] != 0, recs[f] + shift, 0)
    return wire[:4] + nodes.tobytes() + wire[head - 4 : head] + recs.tobytes()


def bench_copy() -> None:
    size = 256 << 20
    src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    dst = np.zeros(size, np.uint8)
    copy_bytes(dst, src)  # compile, and fault the pages in
    ctypes.memmove(dst.ctypes.data, src.ctypes.data, size)
    s_addr, d_addr = src.ctypes.data, dst.ctypes.data
    ours, plain = best_of_pair(lambda: copy_bytes(dst, src), lambda: ctypes.memmove(d_addr, s_addr, size), 2)
    assert (dst[:: 1 << 20] == src[:: 1 << 20]).all()
    print(f"bulk copy: {size >> 20} MiB numpy -> numpy")
    print(f"  apir copy_bytes           {ours * 1e3:8.2f} ms  {size / ours / 1e9:6.2f} GB/s")
    print(f"  memcpy (ctypes.memmove)   {plain * 1e3:8.2f} ms  {size / plain / 1e9:6.2f} GB/s")
    print(f"  ours / memcpy throughput  {plain / ours * 100:7.1f}%   (target >= 80%)")


def main() -> None:
    g = apir.ggml.load()
    with tempfile.TemporaryDirectory() as tmp:
        ref = cbuild.load(cbuild.build(cref.build("0.20"), Path(tmp)))
        bench_graph(g, ref)
        bench_host_build(g, ref)
    bench_copy()


if __name__ == "__main__":
    main()
