"""apir.host.backend.extensions against hostile guests: extension functions before EXT_QUERY
agreed on them, devices out of range, truncated arguments, a graph mixing two devices'
buffers, graphs kept beyond the per-context bounds; posted commands (ASYNC) read within their
length, only postable functions run posted, a wrong length ends its payload."""

import struct

import numpy as np
import pytest

from apir.codec.constants import (
    APIR_BACKEND_FORWARD_INDEX_INVALID,
    APIR_BACKEND_GRAPH_UNKNOWN,
    APIR_FORWARD_POSTED,
    ApirBackendCommandType as Cmd,
    ApirCommandType,
    ApirExtensionCommandType as X,
)
from apir.host import HostContext
from apir.host.config import MAX_KEPT_GRAPHS
from tests.host.hostkit import DATA_RES, Guest, GgmlScratch, RemoteGraph, add_chain

TWO_CPUS = {"apir.host.backend": "cpu,cpu"}
ERROR = 1


def _query(g: Guest, wanted: int = 3) -> int:
    rc, _ = g.command(ApirCommandType.FORWARD, int(X.EXT_QUERY), lambda e: e.u32(wanted))
    return rc


@pytest.mark.parametrize("function", [X.DEVICE_SELECT, X.GRAPH_COMPUTE_KEEP, X.GRAPH_RECOMPUTE])
def test_extension_functions_before_agreement_are_unknown_functions(function):
    g = Guest(HostContext(7, TWO_CPUS))
    try:
        assert g.forward(function, lambda e: (e.u64(0), e.u64(0), e.u64(0)))[0] == APIR_BACKEND_FORWARD_INDEX_INVALID
        assert _query(g, 1) == 4  # devices only: replay stays unknown
        if function is not X.DEVICE_SELECT:
            assert g.forward(function, lambda e: e.u64(0))[0] == APIR_BACKEND_FORWARD_INDEX_INVALID
    finally:
        g.close()


def test_bad_selections_and_truncated_arguments_are_refused():
    g = Guest(HostContext(7, TWO_CPUS))
    try:
        assert _query(g) == 4
        assert g.forward(X.DEVICE_SELECT, lambda e: e.u32(2))[0] == ERROR
        assert g.forward(X.DEVICE_SELECT, lambda e: e.u32(0xFFFFFFFF))[0] == ERROR
        assert g.forward(X.DEVICE_SELECT)[0] == ERROR  # no argument
        assert g.command(ApirCommandType.FORWARD, int(X.EXT_QUERY))[0] == 4 + ERROR
        assert g.ctx._library.selected == 0
        # a graph larger than its resource, and one in an unknown resource
        size = len(g.data) + 1
        assert g.forward(X.GRAPH_COMPUTE_KEEP, lambda e: (e.u64(1), e.u32(DATA_RES), e.u64(size)))[0] == ERROR
        assert g.forward(X.GRAPH_COMPUTE_KEEP, lambda e: (e.u64(1), e.u32(99), e.u64(64)))[0] == ERROR
        assert g.forward(X.GRAPH_RECOMPUTE, lambda e: e.u64(1))[0] == APIR_BACKEND_GRAPH_UNKNOWN
    finally:
        g.close()


def test_a_graph_naming_two_devices_buffers_is_refused(ggml):
    g = Guest(HostContext(7, TWO_CPUS))
    s = GgmlScratch(ggml)
    try:
        assert _query(g) == 4
        graph = add_chain(ggml, s.ctx, 2)
        remote = RemoteGraph(g, ggml, s.ctx, graph)  # its buffer on device 0
        lib = g.ctx._library
        assert remote.handle in lib.devices[0].buffers
        assert g.forward(X.DEVICE_SELECT, lambda e: e.u32(1))[0] == 0
        other = g.alloc(4096)  # device 1
        wire = bytearray(remote.wire)
        # the last record (the output) moved to device 1's buffer
        rec = len(wire) - 304
        wire[rec + 16 : rec + 24] = other.to_bytes(8, "little")
        g.data[: len(wire)] = bytes(wire)
        rc, _ = g.forward(X.GRAPH_COMPUTE_KEEP, lambda e: (e.u64(3), e.u32(DATA_RES), e.u64(len(wire))))
        assert rc == ERROR
        assert g.forward(X.GRAPH_RECOMPUTE, lambda e: e.u64(3))[0] == APIR_BACKEND_GRAPH_UNKNOWN
        remote.close()
    finally:
        s.close()
        g.close()


@pytest.mark.parametrize("limit", [None, 2000])
def test_kept_graphs_are_bounded(ggml, limit):
    """At most MAX_KEPT_GRAPHS graphs and apir.host.kept_graph_bytes bytes (add_chain(2)'s wire
    is 936 bytes: 2,000 hold two), the least recently used evicted; a graph whose buffer was
    freed is refused once and then forgotten."""
    config = {} if limit is None else {"apir.host.kept_graph_bytes": str(limit)}
    g = Guest(HostContext(7, config))
    s = GgmlScratch(ggml)
    try:
        assert _query(g) == 4
        remote = RemoteGraph(g, ggml, s.ctx, add_chain(ggml, s.ctx, 2))
        wire = remote.wire
        assert len(wire) == 936
        g.data[: len(wire)] = wire
        last = MAX_KEPT_GRAPHS + 3
        for graph_id in range(last + 1):
            rc, _ = g.forward(X.GRAPH_COMPUTE_KEEP, lambda e, i=graph_id: (e.u64(i), e.u32(DATA_RES), e.u64(len(wire))))
            assert rc == 0
        lib = g.ctx._library
        kept = MAX_KEPT_GRAPHS if limit is None else 2
        assert len(lib._kept) == kept and lib._kept_bytes == kept * len(wire)
        assert sorted(lib._kept) == list(range(last + 1 - kept, last + 1))
        assert g.forward(X.GRAPH_RECOMPUTE, lambda e: e.u64(0))[0] == APIR_BACKEND_GRAPH_UNKNOWN  # evicted
        assert g.forward(X.GRAPH_RECOMPUTE, lambda e: e.u64(last))[0] == 0
        rc, _ = g.forward(X.GRAPH_COMPUTE_KEEP, lambda e: (e.u64(last), e.u32(DATA_RES), e.u64(len(wire))))
        assert rc == 0 and len(lib._kept) == kept  # the same id again replaces its graph
        from apir.codec.constants import ApirBackendCommandType as Cmd

        assert g.forward(Cmd.BUFFER_FREE_BUFFER, lambda e: e.handle(remote.handle))[0] == 0
        assert g.forward(X.GRAPH_RECOMPUTE, lambda e: e.u64(last))[0] == ERROR
        assert g.forward(X.GRAPH_RECOMPUTE, lambda e: e.u64(last))[0] == APIR_BACKEND_GRAPH_UNKNOWN
        remote.close()
    finally:
        s.close()
        g.close()


def test_a_copy_between_two_devices_buffers_is_refused(ggml):
    from apir.codec.constants import ApirBackendCommandType as Cmd
    from tests.host.hostkit import rpc_bytes, rpc_record

    g = Guest(HostContext(7, TWO_CPUS))
    s = GgmlScratch(ggml)
    try:
        assert _query(g) == 4
        first = g.alloc(4096)
        assert g.forward(X.DEVICE_SELECT, lambda e: e.u32(1))[0] == 0
        second, third = g.alloc(4096), g.alloc(4096)
        t = ggml.ggml_new_tensor_1d(s.ctx, ggml.types["F32"], 16)
        src, dst, same = (rpc_bytes(rpc_record(ggml, t, buffer=h, data=0)) for h in (first, second, third))
        rc, dec = g.forward(Cmd.BUFFER_CPY_TENSOR, lambda e: (e.handle(second), e.blob(src), e.blob(dst)))
        assert rc == ERROR
        rc, dec = g.forward(Cmd.BUFFER_CPY_TENSOR, lambda e: (e.handle(second), e.blob(same), e.blob(dst)))
        assert (rc, dec.bool()) == (0, True)
    finally:
        s.close()
        g.close()


def test_kept_graphs_count_in_their_peers_memory(ggml):
    # kept graphs (up to apir.host.kept_graph_bytes per context) are host memory: charged to the
    # peer's and the process's pools like buffers, or a peer's 16 socket connections would keep
    # 1 GiB beyond its peer_memory_limit
    from apir.host.backend.budget import HOST_MEMORY

    g = Guest(HostContext(7, {"apir.host.peer": "kept-graphs-peer"}))
    s = GgmlScratch(ggml, 1100)
    try:
        assert _query(g) == 4
        remote = RemoteGraph(g, ggml, s.ctx, add_chain(ggml, s.ctx, 1000))
        wire = remote.wire
        g.data[: len(wire)] = wire
        before = HOST_MEMORY.by_peer.get("kept-graphs-peer", 0)
        rc, _ = g.forward(X.GRAPH_COMPUTE_KEEP, lambda e: (e.u64(1), e.u32(DATA_RES), e.u64(len(wire))))
        assert rc == 0 and g.ctx._library._kept_bytes == len(wire) > 300_000
        assert HOST_MEMORY.by_peer.get("kept-graphs-peer", 0) - before >= len(wire)
        remote.close()
    finally:
        s.close()
        g.close()
    assert HOST_MEMORY.by_peer.get("kept-graphs-peer", 0) == 0  # given back with the context


def test_a_graph_over_the_peers_memory_is_computed_but_not_kept(ggml):
    from apir.host.backend.budget import HOST_MEMORY

    g = Guest(HostContext(8, {"apir.host.peer": "small-peer", "apir.host.peer_memory_limit": "200000"}))
    s = GgmlScratch(ggml, 1100)
    try:
        assert _query(g) == 4
        remote = RemoteGraph(g, ggml, s.ctx, add_chain(ggml, s.ctx, 1000))
        wire = remote.wire
        g.data[: len(wire)] = wire
        rc, _ = g.forward(X.GRAPH_COMPUTE_KEEP, lambda e: (e.u64(1), e.u32(DATA_RES), e.u64(len(wire))))
        assert rc == 0 and g.ctx._library._kept_bytes == 0  # computed, not kept
        rc, _ = g.forward(X.GRAPH_RECOMPUTE, lambda e: e.u64(1))
        assert rc == APIR_BACKEND_GRAPH_UNKNOWN  # the guest sends it again
        assert HOST_MEMORY.by_peer.get("small-peer", 0) <= 200000
        remote.close()
    finally:
        s.close()
        g.close()


# --- ASYNC: posted commands (docs/protocol.md 12.7) --------------------------------------------
def _posts(*commands) -> bytes:
    """Posted Forwards, each (function id, argument bytes, length or None for its own)."""
    out = b""
    for function, args, length in commands:
        size = 12 + len(args)
        out += struct.pack("<III", ApirCommandType.FORWARD, int(function) | APIR_FORWARD_POSTED, size if length is None else length) + args
    return out


def _report(g: Guest):
    rc, dec = g.forward(X.SYNCHRONIZE)
    return rc, (dec.u32(), dec.u32(), dec.u32(), dec.u32())


def test_a_posted_command_reads_nothing_past_its_length():
    g = Guest(HostContext(7))
    try:
        assert _query(g, 4) == 4
        handle = g.alloc(4096)
        clear = struct.pack("<QI", handle, 7)
        # the first clear's length cuts its value off: refused, not read from the next command
        payload = _posts((Cmd.BUFFER_CLEAR, clear[:8], None), (Cmd.BUFFER_CLEAR, clear, None))
        assert g.raw(payload) is None
        assert _report(g) == (0, (2, 0, int(Cmd.BUFFER_CLEAR), 4 + ERROR))
    finally:
        g.close()


@pytest.mark.parametrize(
    "function", [Cmd.BACKEND_GRAPH_COMPUTE, Cmd.BUFFER_GET_TENSOR, Cmd.BUFFER_FREE_BUFFER, X.SYNCHRONIZE, X.EXT_QUERY]
)
def test_only_functions_without_a_needed_reply_may_be_posted(function):
    g = Guest(HostContext(7))
    try:
        assert _query(g, 4) == 4
        handle = g.alloc(4096)
        assert g.raw(_posts((function, struct.pack("<QQQQ", handle, 0, 0, 0), None))) is None
        assert _report(g) == (0, (1, 0, int(function), 4 + APIR_BACKEND_FORWARD_INDEX_INVALID))
        assert g.base(handle)  # not freed, nothing run
    finally:
        g.close()


@pytest.mark.parametrize("length", [0, 11, 1 << 31])
def test_a_wrong_length_ends_the_payload(length):
    g = Guest(HostContext(7))
    try:
        assert _query(g, 4) == 4
        handle = g.alloc(4096)
        clear = struct.pack("<QI", handle, 7)
        payload = _posts((Cmd.BUFFER_CLEAR, clear, length), (Cmd.BUFFER_CLEAR, clear, None))
        assert g.raw(payload) is None
        rc, (posted, index, function, code) = _report(g)
        assert (rc, posted, index, function, code) == (0, 1, 0, int(Cmd.BUFFER_CLEAR), 4 + ERROR)
        assert g.get_tensor(handle, _rpc_u8(handle), 1) == (0, b"\0")  # neither clear ran
    finally:
        g.close()


def _rpc_u8(handle: int) -> bytes:
    import apir.ggml
    from apir.codec.records import rpc_tensor_dtype

    g = apir.ggml.load()
    rec = np.zeros(1, dtype=rpc_tensor_dtype(g.limits))[0]
    rec["id"], rec["type"], rec["buffer"] = 1, g.types["I8"], handle
    rec["ne"], rec["nb"] = [1, 1, 1, 1], [1, 1, 1, 1]
    return rec.tobytes()
