"""apir.host.backend.extensions: EXT_QUERY's bytes as docs/protocol.md's example gives them,
a host with the extensions off answering as APIR 0.2, a 0.2 guest of a two-device host served
by device 0 alone, device routing by handle, graph replay computing new inputs, and ASYNC:
posted commands run in order without a reply, a posted failure answered at the next waited-for
command and named by SYNCHRONIZE, the bound on posts, events."""

import numpy as np

from apir.codec.constants import (
    APIR_BACKEND_FORWARD_INDEX_INVALID,
    APIR_BACKEND_GRAPH_UNKNOWN,
    APIR_BACKEND_POSTED_FAILED,
    APIR_BACKEND_QUEUE_FULL,
    APIR_FORWARD_POSTED,
    APIR_MAX_POSTED,
    ApirBackendCommandType as Cmd,
    ApirCommandType,
    ApirExtensionCommandType as X,
)
from apir.codec.wire import Encoder
from apir.guest.client import ApirClient
from apir.host import HostContext
from apir.local.embedded import EmbeddedDevice
from apir.host.config import MAX_EVENTS
from tests.host.hostkit import DATA_RES, REPLY_RES, Guest, GgmlScratch, RemoteGraph, add_chain, rpc_bytes, rpc_record
from tests.local.localkit import record_execbuffers

TWO_CPUS = {"apir.host.backend": "cpu,cpu"}


def _query(guest: Guest, wanted: int = 3):
    rc, dec = guest.command(ApirCommandType.FORWARD, int(X.EXT_QUERY), lambda e: e.u32(wanted))
    return rc, (dec.u32(), dec.u32())


def test_ext_query_bytes_are_the_spec_example():
    """docs/protocol.md, Extensions, "EXT_QUERY byte by byte": the command and the reply of a
    host serving two devices."""
    g = Guest(HostContext(7, TWO_CPUS))
    try:
        command = bytes.fromhex("02000000" "00010000" "01000000" "03000000")
        assert REPLY_RES == 1
        assert g.raw(command) == 4
        assert bytes(g.reply[:12]) == bytes.fromhex("05000000" "03000000" "02000000")
    finally:
        g.close()


def test_the_guest_sends_the_spec_example():
    client = ApirClient.connect(EmbeddedDevice(config=TWO_CPUS), extensions=0)
    try:
        sent = record_execbuffers(client.remote.device)
        assert client.negotiate_extensions(3) == 3 and client.device_count == 2
        reply_res = client.remote.reply.res_id
    finally:
        client.close()
    assert sent == [bytes.fromhex("02000000" "00010000") + reply_res.to_bytes(4, "little") + bytes.fromhex("03000000")]


def test_a_host_with_extensions_off_answers_as_apir_0_2():
    g = Guest(HostContext(7, {"apir.host.extensions": "off", **TWO_CPUS}))
    try:
        rc, _ = _query(g)
        assert rc == 4 + APIR_BACKEND_FORWARD_INDEX_INVALID
        rc, _ = g.forward(X.DEVICE_SELECT, lambda e: e.u32(1))
        assert rc == APIR_BACKEND_FORWARD_INDEX_INVALID
    finally:
        g.close()
    client = ApirClient.connect(EmbeddedDevice(config={"apir.host.extensions": "off"}))
    try:
        assert client.extensions == 0 and client.device_count == 1
        assert client.device_get_name() == "CPU"
    finally:
        client.close()


def test_a_0_2_guest_of_a_two_device_host_is_served_by_device_0():
    g = Guest(HostContext(7, TWO_CPUS))
    try:
        lib = g.ctx._library
        assert len(lib.devices) == 2
        rc, dec = g.forward(Cmd.DEVICE_GET_COUNT)
        assert (rc, dec.i32()) == (0, 1)
        handle = g.alloc(4096)
        assert handle in lib.devices[0].buffers and not len(lib.devices[1].buffers)
    finally:
        g.close()


def test_handles_name_their_device():
    g = Guest(HostContext(7, TWO_CPUS))
    try:
        assert _query(g) == (4, (3, 2))
        lib = g.ctx._library
        first = g.alloc(4096)  # device 0: selected at first
        assert g.forward(X.DEVICE_SELECT, lambda e: e.u32(1))[0] == 0
        second = g.alloc(4096)
        assert first in lib.devices[0].buffers and second in lib.devices[1].buffers
        assert g.forward(X.DEVICE_SELECT, lambda e: e.u32(0))[0] == 0
        # a buffer function finds device 1's buffer whatever is selected
        assert g.base(second) != g.base(first)
        assert g.forward(Cmd.BUFFER_FREE_BUFFER, lambda e: e.handle(second))[0] == 0
        assert not len(lib.devices[1].buffers)
    finally:
        g.close()


def _keep(g: Guest, graph_id: int, wire: bytes):
    g.data[: len(wire)] = wire
    rc, dec = g.forward(X.GRAPH_COMPUTE_KEEP, lambda e: (e.size_t(graph_id), e.u32(DATA_RES), e.size_t(len(wire))))
    return rc, dec.i32() if rc == 0 else None


def _recompute(g: Guest, graph_id: int):
    rc, dec = g.forward(X.GRAPH_RECOMPUTE, lambda e: e.size_t(graph_id))
    return rc, dec.i32() if rc == 0 else None


def test_graph_replay_computes_the_new_inputs(ggml):
    g = Guest(HostContext(7))
    s = GgmlScratch(ggml)
    try:
        assert _query(g)[1][0] == 3
        graph = add_chain(ggml, s.ctx, 3)
        remote = RemoteGraph(g, ggml, s.ctx, graph)
        y = ggml.ggml_graph_node(graph, ggml.ggml_graph_n_nodes(graph) - 1)
        leaf = _leaf(ggml, graph)
        outs = []
        for k, value in enumerate((1.0, 2.5)):
            data = np.full(32, value, dtype=np.float32).tobytes()
            assert g.set_tensor(remote.handle, remote.rpc(leaf), data) == 0
            rc, status = _keep(g, 9, remote.wire) if k == 0 else _recompute(g, 9)
            assert (rc, status) == (0, 0)
            outs.append(g.get_tensor(remote.handle, remote.rpc(y), ggml.ggml_nbytes(y))[1])
        assert np.frombuffer(outs[0], dtype=np.float32).tolist() == [4.0] * 32
        assert np.frombuffer(outs[1], dtype=np.float32).tolist() == [10.0] * 32
        assert _recompute(g, 10) == (APIR_BACKEND_GRAPH_UNKNOWN, None)
        remote.close()
    finally:
        s.close()
        g.close()


def _leaf(ggml, graph):
    """add_chain's input x: the first node's first source."""
    from apir.ggml.layout import tensor_record

    return int(tensor_record(ggml.ggml_graph_node(graph, 0), ggml.tensor_dtype)["src"][0])



# --- ASYNC (docs/protocol.md 12.7) -----------------------------------------------------------
ASYNC = 4


def _async_guest(ggml, s, n_floats=64):
    """A host guest with ASYNC agreed, a buffer and an F32 tensor of `n_floats` in it."""
    g = Guest(HostContext(7))
    assert _query(g, ASYNC) == (4, (ASYNC, 1))
    handle = g.alloc(4096)
    t = ggml.ggml_new_tensor_1d(s.ctx, ggml.types["F32"], n_floats)
    return g, handle, rpc_bytes(rpc_record(ggml, t, buffer=handle))


def _posted(function, encode) -> bytes:
    """A posted Forward's bytes: its third header word is its length."""
    buf = bytearray(1 << 12)
    enc = Encoder(buf)
    enc.u32(ApirCommandType.FORWARD)
    enc.u32(int(function) | APIR_FORWARD_POSTED)
    enc.u32(0)
    encode(enc)
    enc.check()
    buf[8:12] = enc.written.to_bytes(4, "little")
    return bytes(buf[: enc.written])


def _post(g, function, encode):
    """A posted Forward: the return code the reply word then holds (None: untouched)."""
    return g.raw(_posted(function, encode))


def _set_at(g, handle, rpc, at, data, offset=0):
    if at + len(data) <= len(g.data):
        g.data[at : at + len(data)] = data
    return _post(
        g,
        X.BUFFER_SET_TENSOR_AT,
        lambda e: (e.handle(handle), e.blob(rpc), e.u32(DATA_RES), e.size_t(at), e.size_t(offset), e.size_t(len(data))),
    )


def _synchronize(g):
    rc, dec = g.forward(X.SYNCHRONIZE)
    return rc, (dec.u32(), dec.u32(), dec.u32(), dec.u32())


def test_synchronize_bytes_are_the_spec_example(ggml):
    """docs/protocol.md 12.7, "SYNCHRONIZE byte by byte": two posts, the second refused."""
    s = GgmlScratch(ggml)
    g, handle, rpc = _async_guest(ggml, s)
    try:
        assert _set_at(g, handle, rpc, 0, bytes(16)) is None
        assert _post(g, Cmd.BUFFER_CLEAR, lambda e: (e.handle(handle + 100), e.u8(0))) is None
        assert g.raw(bytes.fromhex("02000000" "04010000" "01000000")) == 4
        assert bytes(g.reply[:20]) == bytes.fromhex("05000000" "02000000" "01000000" "14000000" "05000000")
        clear = bytes.fromhex("02000000" "14000080" "18000000" "0200000000000000" "00000000")
        assert _posted(Cmd.BUFFER_CLEAR, lambda e: (e.handle(2), e.u8(0))) == clear
    finally:
        g.close()
        s.close()


def test_posted_commands_share_a_payload_with_the_call_after_them(ggml):
    s = GgmlScratch(ggml)
    g, handle, rpc = _async_guest(ggml, s)
    try:
        g.data[:64] = np.full(16, 3, dtype=np.float32).tobytes()
        set_at = _posted(
            X.BUFFER_SET_TENSOR_AT,
            lambda e: (e.handle(handle), e.blob(rpc), e.u32(DATA_RES), e.size_t(0), e.size_t(0), e.size_t(64)),
        )
        clear = _posted(Cmd.BUFFER_CLEAR, lambda e: (e.handle(handle), e.u8(1)))
        get = bytes.fromhex("02000000" "12000000" "01000000") + _posted(
            Cmd.BUFFER_GET_TENSOR,
            lambda e: (e.handle(handle), e.blob(rpc), e.u32(DATA_RES), e.size_t(0), e.size_t(64)),
        )[12:]
        assert g.raw(clear + set_at + get) == 4  # the get's reply, after both posts ran
        assert bytes(g.data[:64]) == np.full(16, 3, dtype=np.float32).tobytes()
        assert g.raw(set_at + clear) is None  # posts alone: no reply
        assert g.get_tensor(handle, rpc, 4) == (0, b"\1\1\1\1")
        bad = bytearray(clear)
        bad[8:12] = (len(clear) + len(get) + 4).to_bytes(4, "little")  # past the payload: all dropped
        assert g.raw(bytes(bad) + get) is None
        assert _synchronize(g) == (0, (1, 0, int(Cmd.BUFFER_CLEAR), 5))
    finally:
        g.close()
        s.close()


def test_posted_sets_then_a_get_see_the_data(ggml):
    s = GgmlScratch(ggml)
    g, handle, rpc = _async_guest(ggml, s)
    try:
        parts = [np.full(16, k, dtype=np.float32).tobytes() for k in range(1, 5)]
        for k, part in enumerate(parts):  # each from its own place in one resource
            assert _set_at(g, handle, rpc, 4096 * (k + 1), part, offset=64 * k) is None
        assert g.get_tensor(handle, rpc, 256) == (0, b"".join(parts))
        assert _synchronize(g) == (0, (0, 0, 0, 0))  # the get was the synchronization point
    finally:
        g.close()
        s.close()


def test_a_posted_failure_holds_the_next_waited_command_until_synchronize(ggml):
    s = GgmlScratch(ggml)
    g, handle, rpc = _async_guest(ggml, s)
    try:
        good = np.ones(16, dtype=np.float32).tobytes()
        assert _set_at(g, handle, rpc, 0, good) is None
        assert _set_at(g, handle, rpc, (1 << 20) - 32, good) is None  # past the resource: refused
        assert _set_at(g, handle, rpc, 0, np.full(16, 7, dtype=np.float32).tobytes()) is None  # skipped
        # the next waited-for command is not run: 12 (4 + POSTED_FAILED), for any command
        assert g.forward(Cmd.BUFFER_CLEAR, lambda e: (e.handle(handle), e.u8(9)))[0] == APIR_BACKEND_POSTED_FAILED
        assert g.get_tensor(handle, rpc, 64)[0] == APIR_BACKEND_POSTED_FAILED
        assert _synchronize(g) == (0, (3, 1, int(X.BUFFER_SET_TENSOR_AT), 5))
        assert g.get_tensor(handle, rpc, 64) == (0, good)  # neither the skipped set nor the clear ran
    finally:
        g.close()
        s.close()


def test_posts_past_the_bound_are_refused(ggml):
    s = GgmlScratch(ggml)
    g, handle, rpc = _async_guest(ggml, s)
    try:
        for k in range(APIR_MAX_POSTED):
            assert _post(g, Cmd.BUFFER_CLEAR, lambda e: (e.handle(handle), e.u8(k & 0xFF))) is None
        assert _synchronize(g) == (0, (APIR_MAX_POSTED, 0, 0, 0))  # at the bound: all ran
        for k in range(APIR_MAX_POSTED + 1000):
            _post(g, Cmd.BUFFER_CLEAR, lambda e: (e.handle(handle), e.u8(1)))
        code = 4 + APIR_BACKEND_QUEUE_FULL
        assert _synchronize(g) == (0, (APIR_MAX_POSTED + 1000, APIR_MAX_POSTED, int(Cmd.BUFFER_CLEAR), code))
        assert g.get_tensor(handle, rpc, 4) == (0, b"\1\1\1\1")  # the posts within the bound ran
    finally:
        g.close()
        s.close()


def test_without_async_a_posted_id_is_an_unknown_function(ggml):
    """A 0.2 host, or one that did not agree on ASYNC, answers a posted id as it answers any id
    beyond its table: INDEX_INVALID in the reply word, nothing run."""
    for config, wanted in (({"apir.host.extensions": "off"}, ASYNC), ({}, 3)):
        g = Guest(HostContext(7, config))
        try:
            _query(g, wanted)
            handle = g.alloc(4096)
            flags = int(Cmd.BUFFER_CLEAR) | APIR_FORWARD_POSTED  # (the third word: the reply resource)
            rc = g.command(ApirCommandType.FORWARD, flags, lambda e: (e.handle(handle), e.u8(1)))[0]
            assert rc == 4 + APIR_BACKEND_FORWARD_INDEX_INVALID
            assert g.forward(X.SYNCHRONIZE)[0] == APIR_BACKEND_FORWARD_INDEX_INVALID
        finally:
            g.close()


def test_events_are_handles_of_the_context(ggml):
    s = GgmlScratch(ggml)
    g, handle, rpc = _async_guest(ggml, s)
    try:
        rc, dec = g.forward(X.EVENT_NEW)
        event = dec.handle()
        assert rc == 0 and event and event != handle
        for function in (X.EVENT_RECORD, X.EVENT_WAIT, X.EVENT_SYNCHRONIZE, X.EVENT_FREE):
            assert g.forward(function, lambda e: e.handle(event))[0] == 0
        for function in (X.EVENT_RECORD, X.EVENT_FREE):  # freed; a buffer handle is no event
            assert g.forward(function, lambda e: e.handle(event))[0] == 1
            assert g.forward(function, lambda e: e.handle(handle))[0] == 1
        events = [g.forward(X.EVENT_NEW)[0] for _ in range(MAX_EVENTS + 1)]
        assert events == [0] * MAX_EVENTS + [1]  # bounded per context
    finally:
        g.close()
        s.close()
