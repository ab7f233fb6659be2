"""Deferred uploads and batched row-id reads (apir.host.backend.transfers), on ggml CPU with a profile
that has `async_transfers` (Vulkan's, renamed): which copies are queued, when the queue is
flushed, the staging bound, and where the synchronous path stays. ggml CPU has no async
copies (ggml_backend_tensor_set_async copies at once there), so the bytes cannot tell a
missing flush here: the calls into ggml are recorded instead. tests/backends/test_vulkan.py
checks the bytes on ggml Vulkan (lavapipe), where a missing flush shows."""

import dataclasses
import mmap

import numpy as np
import pytest

import apir.host.backend.library as backend_library
from apir.codec.constants import ApirBackendCommandType as Cmd
from apir.codec.graph import BufferTable, rpc_tensor_from_ggml
from apir.host import HostContext
from apir.host.graph import profiles
from apir.host.backend.transfers import DeviceTransfers
from tests.host.hostkit import Guest, GgmlScratch, RemoteGraph, RepeatedGraph, cpu_compute

ASYNC = dataclasses.replace(profiles.VULKAN, name="async-device")
BLOB_RES = 3
_CALLS = ("ggml_backend_tensor_set_async", "ggml_backend_tensor_get_async", "ggml_backend_synchronize",
          "ggml_backend_tensor_set", "ggml_backend_tensor_get")


@pytest.fixture
def calls(monkeypatch, ggml):
    """The ggml calls of interest, in order: (short name, size or None)."""
    seen = []
    for name in _CALLS:
        real = getattr(ggml, name)

        def spy(*args, _real=real, _name=name):
            seen.append((_name.replace("ggml_backend_", ""), args[-1] if "tensor" in _name else None))
            return _real(*args)

        monkeypatch.setattr(ggml, name, spy)
    return seen


def _guest(monkeypatch, profile=ASYNC, capacity=None, data_size=1 << 20):
    monkeypatch.setattr(backend_library, "profile_for", lambda name: profile)
    guest = Guest(HostContext(7), data_size=data_size)
    lib = guest.ctx._library
    if capacity is not None:
        lib.transfers = DeviceTransfers(lib.g, lib.backend, lib.dev, capacity)
    return guest, lib


def _add(g, ctx, n=64):
    f32 = g.types["F32"]
    a, b = g.ggml_new_tensor_1d(ctx, f32, n), g.ggml_new_tensor_1d(ctx, f32, n)
    y = g.ggml_add(ctx, a, b)
    graph = g.ggml_new_graph(ctx)
    g.ggml_build_forward_expand(graph, y)
    return graph, [a, b], y


def _data(n, seed):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32).tobytes()


def test_only_a_profile_with_async_transfers_defers():
    assert profiles.VULKAN.async_transfers
    assert not profiles.CPU.async_transfers and not profiles.RPC.async_transfers


@pytest.mark.parametrize("profile", [profiles.CPU, profiles.RPC], ids=["CPU", "RPC"])
def test_without_async_transfers_every_set_is_synchronous(monkeypatch, ggml, calls, profile):
    guest, lib = _guest(monkeypatch, profile)
    s = GgmlScratch(ggml)
    try:
        graph, (a, _), _ = _add(ggml, s.ctx)
        r = RemoteGraph(guest, ggml, s.ctx, graph)
        assert lib.transfers is None
        assert guest.set_tensor(r.handle, r.rpc(a), _data(64, 1)) == 0
        assert calls == [("tensor_set", 256)]
        r.close()
    finally:
        s.close()
        guest.close()


@pytest.mark.parametrize("how", ["config", "env"])
def test_config_turns_the_deferral_off(monkeypatch, ggml, calls, how):
    monkeypatch.setattr(backend_library, "profile_for", lambda name: ASYNC)
    if how == "env":
        monkeypatch.setenv("APIR_HOST_ASYNC_TRANSFERS", "0")
    guest = Guest(HostContext(7, {"apir.host.async_transfers": "off"} if how == "config" else {}))
    s = GgmlScratch(ggml)
    try:
        graph, (a, _), _ = _add(ggml, s.ctx)
        r = RemoteGraph(guest, ggml, s.ctx, graph)
        assert guest.ctx._library.transfers is None
        assert guest.set_tensor(r.handle, r.rpc(a), _data(64, 1)) == 0
        assert calls == [("tensor_set", 256)]
        r.close()
    finally:
        s.close()
        guest.close()


def test_sets_are_queued_and_flushed_before_any_other_command(monkeypatch, ggml, calls):
    """Every backend function but set_tensor first makes the queued uploads land; the results
    are the bytes set (set/set/compute/get, set then get, set then cpy, set then clear)."""
    guest, lib = _guest(monkeypatch)
    s = GgmlScratch(ggml)
    try:
        graph, (a, b), y = _add(ggml, s.ctx)
        r = RemoteGraph(guest, ggml, s.ctx, graph)
        da, db = _data(64, 1), _data(64, 2)
        del calls[:]
        assert guest.set_tensor(r.handle, r.rpc(a), da) == 0
        assert guest.set_tensor(r.handle, r.rpc(b), db) == 0
        assert calls == [("tensor_set_async", 256), ("tensor_set_async", 256)]
        assert lib.transfers.pending == 2
        # graph_compute: the flush comes first, then the compute's own synchronize
        guest.data[: len(r.wire)] = r.wire
        rc, dec = guest.forward(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(2), e.size_t(len(r.wire))))
        assert rc == 0 and dec.i32() == 0
        assert calls[2] == ("synchronize", None) and lib.transfers.pending == 0
        want = cpu_compute(ggml, s.ctx, graph, [(a, da), (b, db)], y)
        assert guest.get_tensor(r.handle, r.rpc(y), 256) == (0, want)

        other = guest.alloc(4096)
        base = guest.base(r.handle)
        commands = {
            "get_tensor": lambda: guest.get_tensor(r.handle, r.rpc(a), 256)[0],
            "get_base": lambda: guest.forward(Cmd.BUFFER_GET_BASE, lambda e: e.handle(r.handle))[0],
            "clear": lambda: guest.forward(Cmd.BUFFER_CLEAR, lambda e: (e.handle(other), e.u8(0)))[0],
            "device_get_name": lambda: guest.forward(Cmd.DEVICE_GET_NAME)[0],
            "free_buffer": lambda: guest.forward(Cmd.BUFFER_FREE_BUFFER, lambda e: e.handle(guest.alloc(64)))[0],
        }
        for what, command in commands.items():
            assert guest.set_tensor(r.handle, r.rpc(a), da) == 0
            assert lib.transfers.pending == 1, what
            del calls[:]
            assert command() == 0, what
            assert calls[0] == ("synchronize", None), (what, calls)
            assert lib.transfers.pending == 0, what
        assert guest.base(r.handle) == base
        r.close()
    finally:
        s.close()
        guest.close()


def test_a_refused_set_is_refused_at_once_and_queues_nothing(monkeypatch, ggml, calls):
    guest, lib = _guest(monkeypatch)
    s = GgmlScratch(ggml)
    try:
        graph, (a, _), _ = _add(ggml, s.ctx)
        r = RemoteGraph(guest, ggml, s.ctx, graph)
        del calls[:]
        assert guest.set_tensor(r.handle, r.rpc(a), _data(65, 1)) != 0  # 4 bytes past the tensor
        assert guest.set_tensor(r.handle, r.rpc(a), _data(64, 1), offset=4) != 0
        assert calls == [] and lib.transfers.pending == 0
        assert guest.set_tensor(r.handle, r.rpc(a), _data(64, 1)) == 0  # the next one is served
        assert lib.transfers.pending == 1
        r.close()
    finally:
        s.close()
        guest.close()


def test_a_hostile_guest_cannot_grow_the_staging(monkeypatch, ggml, calls):
    """Sets of every size, far more bytes in all than the staging holds: the staging never
    holds more than its capacity (a set that does not fit behind the queued ones flushes
    first; one larger than the staging is synchronous, after a flush), and every byte lands."""
    capacity = 64 << 10
    guest, lib = _guest(monkeypatch, capacity=capacity)
    s = GgmlScratch(ggml)
    try:
        n = 64 << 10  # floats: 256 KiB, 4x the staging
        graph, (a, _), _ = _add(ggml, s.ctx, n)
        r = RemoteGraph(guest, ggml, s.ctx, graph)
        want = bytearray(4 * n)
        rng = np.random.default_rng(3)
        for size in [100, 30000, 40000, 65536, 65537, 200000, 1, 4096] * 4:
            off = int(rng.integers(0, 4 * n - size + 1))
            data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
            del calls[:]
            assert guest.set_tensor(r.handle, r.rpc(a), data, offset=off) == 0
            want[off : off + size] = data
            assert lib.transfers._used <= capacity
            if size > capacity:
                assert calls[-1] == ("tensor_set", size) and lib.transfers.pending == 0
            else:
                assert calls[-1] == ("tensor_set_async", size)
        assert lib.transfers.syncs > 5
        assert guest.get_tensor(r.handle, r.rpc(a), 4 * n) == (0, bytes(want))
        r.close()
    finally:
        s.close()
        guest.close()


def test_sets_into_guest_memory_or_another_buffer_type_stay_synchronous(monkeypatch, ggml, calls):
    """A buffer wrapping guest memory (buffer_from_ptr: the guest reads it itself) and a buffer
    whose type is not the backend's default (ggml-vulkan's async copies abort on one) take the
    synchronous path, after the queued uploads."""
    guest, lib = _guest(monkeypatch)
    s = GgmlScratch(ggml)
    blob = mmap.mmap(-1, 1 << 16)
    guest.ctx.add_resource(BLOB_RES, blob)
    try:
        graph, (a, _), _ = _add(ggml, s.ctx)
        r = RemoteGraph(guest, ggml, s.ctx, graph)
        rc, d = guest.forward(
            Cmd.DEVICE_BUFFER_FROM_PTR, lambda e: (e.u32(BLOB_RES), e.size_t(1 << 16), e.size_t(1 << 16))
        )
        assert rc == 0
        wrapped = d.handle()
        table = BufferTable()
        table.register(r.local, wrapped, ggml.ggml_backend_buffer_get_base(r.local))
        in_blob = rpc_tensor_from_ggml(ggml, a, table).tobytes()
        data = _data(64, 4)
        assert guest.set_tensor(r.handle, r.rpc(a), data) == 0  # queued
        del calls[:]
        assert guest.set_tensor(wrapped, in_blob, data) == 0
        assert calls == [("synchronize", None), ("tensor_set", 256)]
        offset = int(np.frombuffer(in_blob, lib.checker.rpc_dtype)[0]["data"])
        assert bytes(blob[offset : offset + 256]) == data

        # the same buffer, as if its type were not the backend's default
        monkeypatch.setattr(lib.transfers, "default_buft", lib.transfers.default_buft + 1)
        del calls[:]
        assert guest.set_tensor(r.handle, r.rpc(a), data) == 0
        assert calls == [("tensor_set", 256)]
        r.close()
    finally:
        s.close()
        guest.close()


def _two_ids_graph(g, ctx):
    """Two GET_ROWS of one table, each with its own row-id tensor."""
    f32, i32 = g.types["F32"], g.types["I32"]
    emb = g.ggml_new_tensor_2d(ctx, f32, 16, 10)
    ids1, ids2 = g.ggml_new_tensor_1d(ctx, i32, 5), g.ggml_new_tensor_1d(ctx, i32, 3)
    rows1, rows2 = g.ggml_get_rows(ctx, emb, ids1), g.ggml_get_rows(ctx, emb, ids2)
    y = g.ggml_add(ctx, g.ggml_sum(ctx, rows1), g.ggml_sum(ctx, rows2))
    graph = g.ggml_new_graph(ctx)
    g.ggml_build_forward_expand(graph, y)
    return graph, [emb, ids1, ids2], y


def _ids_data(ids1, ids2):
    return [_data(160, 5), np.asarray(ids1, np.int32).tobytes(), np.asarray(ids2, np.int32).tobytes()]


def test_a_hit_reads_its_row_ids_in_one_batch(monkeypatch, ggml, calls):
    """On a cache hit, the row-id tensors are read with get_tensor_async and one synchronize
    (not one synchronous get each); the results are the ids set for that hit; an id out of
    range on a hit is still refused, and the next graph served."""
    guest, lib = _guest(monkeypatch)
    rep = RepeatedGraph(guest, ggml, _two_ids_graph)
    try:

        def direct(data):
            s = GgmlScratch(ggml)
            graph, inputs, y = _two_ids_graph(ggml, s.ctx)
            out = cpu_compute(ggml, s.ctx, graph, zip(inputs, data), y)
            s.close()
            return out

        data = _ids_data([1, 2, 3, 4, 5], [9, 0, 0])
        assert rep.compute(data) == (0, 0, direct(data))  # the miss: built, ids read one by one
        for step, (i1, i2) in enumerate((([5, 4, 3, 2, 1], [1, 1, 9]), ([0, 0, 0, 9, 9], [7, 8, 6]))):
            data = _ids_data(i1, i2)
            want = direct(data)
            del calls[:]
            assert rep.compute(data) == (0, 0, want), step
            reads = [c for c in calls if c[0] in ("tensor_get_async", "tensor_get")]
            # the two ids tensors in one batch (after the flush of the sets), then the result
            assert calls[3:7] == [("synchronize", None), ("tensor_get_async", 20), ("tensor_get_async", 12),
                                  ("synchronize", None)], calls
            assert reads == [("tensor_get_async", 20), ("tensor_get_async", 12), ("tensor_get", 4)], calls
        assert lib.graph_cache.hits == 2
        assert rep.compute(_ids_data([1, 2, 3, 4, 5], [9, 10, 0]))[0] != 0
        data = _ids_data([3, 3, 3, 3, 3], [2, 2, 2])
        assert rep.compute(data) == (0, 0, direct(data))
    finally:
        rep.close()
        guest.close()
