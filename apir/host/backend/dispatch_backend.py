"""Backend handler (C `backend-dispatched-backend.cpp`): graph_compute.

Arguments (laid out as apir.codec.forward lists them): a shared-memory resource and a size;
the serialized graph is bytes [0, size) of that resource. Reply: the `enum ggml_status` of the
compute. The size is checked against the resource's real size (the C has a placeholder there),
the graph is parsed and checked (`parse_graph`, `apir.host.graph.build`), ggml's planned work
buffer is bounded by the context's work budget (`apir.host.graph.work_plan`), and only a graph
that passes is computed (on a backend without a profile, apir.host.graph.profiles, none is);
one that does not is refused (BACKEND_RC_ERROR, no status). Where the profile `caches_graphs`
(CPU, Vulkan, RPC), a graph the context built before is reused after the re-checks
`apir.host.graph.cache` describes: found where it lies, sent again byte for byte or under
other ids (`GraphCache.take_same`, no parse), else by the parsed graph's key (`prepare_graph`).
The compute runs under the context's abort flag: past `apir.host.graph_time_limit_s`, or once
the context is being destroyed, it stops with GGML_STATUS_ABORTED (between nodes, or, on a
backend without an abort callback, between ranges of `apir.host.graph_chunk_nodes` nodes).

Nodes without GGML_TENSOR_FLAG_COMPUTE are skipped, as ggml skips them (docs/protocol.md
section 7); a graph in which no node has it computes nothing and reports SUCCESS, as on the C
host, with a warning (once per built graph): it is almost always a guest that forgot the flag.
"""

from __future__ import annotations

from typing import Optional

from apir.codec.constants import ApirBackendCommandType as F
from apir.codec.graph import GraphError, ParsedGraph, parse_graph
from apir.codec.wire import Decoder, Encoder
from apir.host.backend.forward import args
from apir.host.backend.seams import HandlerLibrary
from apir.host.errors import BACKEND_RC_OK, Refused, log
from apir.host.graph.build import BuiltGraph, build_graph_parts, graph_scratch
from apir.host.graph.cache import GraphCache, GraphCacheEntry, GraphWire, graph_key, graph_wire, link_key
from apir.host.graph.seams import profile_of
from apir.host.tensors import Scratch
from apir.host.graph.work_plan import check_work_size


__all__ = ["graph_compute", "compute_graph", "graph_bytes", "prepare_graph"]


def graph_compute(lib: HandlerLibrary, dec: Decoder, enc: Encoder) -> int:
    res_id, size = args(dec, F.BACKEND_GRAPH_COMPUTE, lib.checker, lib.host)
    lib.host.forward_replies["backend_graph_compute"](enc, compute_graph(lib, graph_bytes(lib, res_id, size), size))
    return BACKEND_RC_OK


def graph_bytes(lib: HandlerLibrary, res_id: int, size: int) -> memoryview:
    """The memory of resource `res_id`, whose bytes [0, size) hold a serialized graph.
    Raises Refused."""
    res = lib.shmem(res_id, "backend_graph_compute")
    if size == 0 or size > res.size:
        raise Refused(f"backend_graph_compute: graph of {size} bytes in resource {res_id} ({res.size} bytes)")
    return res.memory


def compute_graph(lib: HandlerLibrary, memory, size: int) -> int:
    """Checks, builds (or finds in the graph cache) and computes the serialized graph in bytes
    [0, size) of `memory`; its `ggml_status`. Raises Refused."""
    g, chk = lib.g, lib.checker
    profile = profile_of(lib)  # (refused where the host has no rules for the backend)
    # only where the backend's compute leaves the built graph as it was (the profile says so)
    cache = lib.graph_cache if profile.caches_graphs else None
    entry = _same_graph_again(lib, cache, memory, size)
    if entry is None:
        try:
            parsed = parse_graph(memory, 0, size, limits=g.limits, op_count=g.op_count, type_valid=chk.valid_types)
        except GraphError as exc:
            raise Refused(f"backend_graph_compute: {exc}") from None
        wire = graph_wire(parsed, _counts(lib)) if cache is not None else None
        entry = prepare_graph(lib, parsed, cache, wire)
        if wire is not None:
            entry.remember_wire(wire)
    try:
        check_work_size(lib, entry.graph, entry.planned)  # before the CPU backend allocates its work buffer
        lib.set_graph_threads()  # no more than the work-size bound planned with
        # under the context's time limit and cancellation (apir.host.backend.compute_abort)
        status = lib.abort.compute_graph(lib.backend, entry.graph, lambda n: entry.chunks(g, n))
        g.ggml_backend_synchronize(lib.backend)
    except BaseException:
        entry.close()
        raise
    if cache is not None:
        cache.put(entry)
    else:
        entry.close()
    return status


def prepare_graph(
    lib: HandlerLibrary, parsed: ParsedGraph, cache: Optional[GraphCache], wire: Optional[GraphWire] = None
) -> GraphCacheEntry:
    """The checked, built host graph of `parsed`: from `cache` (an `apir.host.graph.cache`
    GraphCache, or None) when it holds the same structure and the re-check passes, else
    checked and built in full. `wire`: `graph_wire(parsed)`, given by a caller that looked in
    `cache` in place first (`GraphCache.take_same`, as graph_compute does) and will keep it on
    the entry; where it compares (`GraphWire.compares`), that look found every entry of this
    graph's key, so no key is made or looked up, and the entry keeps the counts and index
    arrays alone (`link_key`: what `take_same` reads). Raises Refused; the caller owns the
    entry (put it back or close it)."""
    enums = lib.op_enums
    if cache is not None and wire is not None and wire.compares:
        key = link_key(parsed)
        cache.misses += 1  # (take_same found none: the miss `take` would have counted)
    else:
        key = graph_key(parsed, _counts(lib)) if cache is not None else b""
        entry = _rechecked(lib, cache.take(key, lib) if cache is not None else None, enums)
        if entry is not None:
            return entry
    _warn_if_nothing_to_compute(lib.g, parsed)  # (a hit has the same flags: warned once)
    scratch = graph_scratch(lib, parsed)
    try:
        built = build_graph_parts(lib, parsed, scratch, enums)
    except BaseException:
        scratch.close()
        raise
    return _entry(key, scratch, built, parsed)


def _counts(lib: HandlerLibrary) -> bool:
    """Whether `lib` builds graphs with the guest's use counts (USE_COUNTS): then the records'
    `padding` is part of a graph's key."""
    return lib.wire_use_counts


def _same_graph_again(lib: HandlerLibrary, cache: Optional[GraphCache], memory, size: int) -> Optional[GraphCacheEntry]:
    """The cache entry whose graph the guest sent again, where the host reads: byte for byte
    or under other ids (`GraphCache.take_same`: no parse, no key), after its row ids' re-check; None when
    there is none (or the re-check asks for a rebuild). Raises Refused as the re-check does."""
    entry = cache.take_same(memory, size, lib) if cache is not None else None
    return _rechecked(lib, entry, lib.op_enums) if entry is not None else None


def _rechecked(lib: HandlerLibrary, entry: Optional[GraphCacheEntry], enums) -> Optional[GraphCacheEntry]:
    """`entry` (taken from the cache) after its re-check (`GraphCacheEntry.recheck`), or None
    (closed) when the re-check asks for a rebuild; closed and re-raised when it refuses."""
    if entry is None:
        return None
    try:
        fresh = entry.recheck(lib, enums)
    except BaseException:
        entry.close()
        raise
    if fresh:
        return entry
    entry.close()
    return None


def _entry(key: bytes, scratch: Scratch, built: BuiltGraph, parsed: ParsedGraph) -> GraphCacheEntry:
    """The cache entry of a graph just built (its scratch context now owned by the entry)."""
    readers = sorted({j for info in built.infos.made() if info.snapshot is not None for j in info.read_by or ()})
    return GraphCacheEntry(key, scratch, built.graph, built.host, built.buffers, built.infos, built.src_rows, readers)


def _warn_if_nothing_to_compute(g, parsed) -> None:
    compute = g.tensor_flags.get("COMPUTE", 0)
    nodes = parsed.tensors["flags"][parsed.node_index]
    if compute and len(nodes) and not (nodes & compute).any():
        log.warning(
            "backend_graph_compute: none of the graph's %d nodes has GGML_TENSOR_FLAG_COMPUTE (%d): "
            "ggml computes nothing and reports success",
            len(nodes),
            compute,
        )
