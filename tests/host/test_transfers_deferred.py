"""Deferred uploads (apir.host.backend.transfers) against a backend whose async copies really are
deferred: ggml CPU's ggml_backend_tensor_set_async / _get_async replaced by ones that compute
the device address at the call (as ggml-vulkan does) but copy only at the backend's next
ggml_backend_synchronize, and never for any other call (a synchronous set or get, a graph
compute, a buffer free). A missing flush then shows as wrong bytes or as a buffer freed
with a copy into it still queued, as on a GPU; every result is checked against the bytes the
guest sent. Inputs a hostile guest chooses: sizes around the staging's capacity, a data
window overwritten after the reply, edges of the tensor, a free and a new buffer at once, a
close with uploads queued, two contexts, row ids out of range only in a queued upload."""

import ctypes
import dataclasses

import numpy as np
import pytest

import apir.host.backend.library as backend_library
from apir.codec.graph import BufferTable, rpc_tensor_from_ggml
from apir.codec.constants import ApirBackendCommandType as Cmd
from apir.host import HostContext
from apir.host.graph import profiles
from apir.host.backend.transfers import DEFAULT_STAGING_BYTES
from tests.host.hostkit import DATA_RES, Guest, GgmlScratch, RemoteGraph, RepeatedGraph, cpu_compute

ASYNC = dataclasses.replace(profiles.VULKAN, name="async-device")


class DeferringBackend:
    """Queues async copies per backend until its synchronize; records every buffer freed
    while a queued copy still points into it (`late`)."""

    def __init__(self, g):
        self.g = g
        self.queued = {}  # backend -> [(dst, src, n)]
        self.late = []
        self.data_at = None

    def _data(self, tensor):
        if self.data_at is None:
            from apir.host.tensors import TensorChecker

            self.data_at = TensorChecker(self.g).tensor_dtype.fields["data"][1]
        return ctypes.c_void_p.from_address(tensor + self.data_at).value

    def set_async(self, backend, tensor, src, offset, size):
        self.queued.setdefault(backend, []).append((self._data(tensor) + offset, src, size))

    def get_async(self, backend, tensor, dst, offset, size):
        self.queued.setdefault(backend, []).append((dst, self._data(tensor) + offset, size))

    def synchronize(self, backend, _real):
        for dst, src, n in self.queued.pop(backend, []):
            ctypes.memmove(dst, src, n)
        return _real(backend)

    def buffer_free(self, buf, _real):
        if buf:
            base, size = self.g.ggml_backend_buffer_get_base(buf) or 0, self.g.ggml_backend_buffer_get_size(buf)
            for copies in self.queued.values():
                self.late += [c for c in copies if base <= c[0] < base + size or base <= c[1] < base + size]
        return _real(buf)


@pytest.fixture
def deferring(monkeypatch, ggml):
    d = DeferringBackend(ggml)
    monkeypatch.setattr(ggml, "ggml_backend_tensor_set_async", d.set_async)
    monkeypatch.setattr(ggml, "ggml_backend_tensor_get_async", d.get_async)
    sync, free = ggml.ggml_backend_synchronize, ggml.ggml_backend_buffer_free
    monkeypatch.setattr(ggml, "ggml_backend_synchronize", lambda b: d.synchronize(b, sync))
    monkeypatch.setattr(ggml, "ggml_backend_buffer_free", lambda b: d.buffer_free(b, free))
    monkeypatch.setattr(backend_library, "profile_for", lambda name: ASYNC)
    yield d
    assert d.late == [], "a buffer freed with a copy into it still queued"


def _vector(g, ctx, n):
    a = g.ggml_new_tensor_1d(ctx, g.types["F32"], n)
    y = g.ggml_scale(ctx, a, 2.0)
    graph = g.ggml_new_graph(ctx)
    g.ggml_build_forward_expand(graph, y)
    return graph, a, y


def _bytes(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_sizes_around_the_staging_land_in_order_and_survive_the_guest_overwriting(ggml, deferring):
    """capacity - 1, capacity, capacity + 1, many small then one big, overlapping ranges;
    after each reply the guest's data window is overwritten; a get sees every byte set."""
    cap = DEFAULT_STAGING_BYTES
    guest = Guest(HostContext(7), data_size=cap + (1 << 20))
    s = GgmlScratch(ggml)
    try:
        n = (cap + 4096) // 4
        graph, a, y = _vector(ggml, s.ctx, n)
        r = RemoteGraph(guest, ggml, s.ctx, graph)
        lib = guest.ctx._library
        want = bytearray(4 * n)
        plan = [(0, cap - 1), (3, cap), (0, cap + 1), (4 * n - cap, cap)]
        plan += [(k * 1000, 900) for k in range(40)] + [(100, cap - 50), (50, 4000), (0, 4 * n)]
        plan += [(4 * n - 1, 1), (7, 13), (0, 1)]
        for seed, (off, size) in enumerate(plan):
            data = _bytes(size, seed)
            assert guest.set_tensor(r.handle, r.rpc(a), data, offset=off) == 0, (off, size)
            guest.data[: cap + 4096] = b"\xee" * (cap + 4096)  # the guest reuses its window at once
            want[off : off + size] = data
            assert lib.transfers._used <= cap
        assert lib.transfers.pending  # the last ones are still queued
        rc, got = guest.get_tensor(r.handle, r.rpc(a), 4 * n)
        assert rc == 0 and got == bytes(want)
        # a get of a range that overlaps queued uploads
        guest.set_tensor(r.handle, r.rpc(a), b"\x01" * 64, offset=32)
        want[32:96] = b"\x01" * 64
        rc, got = guest.get_tensor(r.handle, r.rpc(a), 128, offset=0)
        assert rc == 0 and got == bytes(want[:128])
        r.close()
    finally:
        s.close()
        guest.close()


def test_set_then_compute_reads_the_new_bytes(ggml, deferring):
    guest = Guest(HostContext(7))
    rep = RepeatedGraph(guest, ggml, lambda g, ctx: (lambda gr, a, y: (gr, [a], y))(*_vector(g, ctx, 256)))
    try:
        for seed in range(3):  # a miss, then hits
            data = np.random.default_rng(seed).standard_normal(256).astype(np.float32).tobytes()
            want = (np.frombuffer(data, np.float32) * 2).astype(np.float32).tobytes()
            assert rep.compute([data]) == (0, 0, want), seed
    finally:
        rep.close()
        guest.close()


def test_edges_of_the_tensor_and_past_them(ggml, deferring):
    guest = Guest(HostContext(7))
    s = GgmlScratch(ggml)
    try:
        graph, a, _ = _vector(ggml, s.ctx, 64)
        r = RemoteGraph(guest, ggml, s.ctx, graph)
        lib = guest.ctx._library
        for off, size in [(256, 1), (255, 2), (0, 257), ((1 << 64) - 1, 2), ((1 << 64) - 256, 512), (1, 256)]:
            assert guest.set_tensor(r.handle, r.rpc(a), b"\x07" * size, offset=off) != 0, (off, size)
            assert lib.transfers.pending == 0 and not deferring.queued
        too_big = guest.forward(
            Cmd.BUFFER_SET_TENSOR,
            lambda e: (e.handle(r.handle), e.blob(r.rpc(a)), e.u32(DATA_RES), e.size_t(0), e.size_t(1 << 40)),
        )
        assert too_big[0] != 0 and lib.transfers.pending == 0
        assert guest.set_tensor(r.handle, r.rpc(a), b"\x05", offset=255) == 0
        assert guest.set_tensor(r.handle, r.rpc(a), b"\x06" * 256) == 0
        assert guest.set_tensor(r.handle, r.rpc(a), b"\x08", offset=0) == 0
        assert guest.get_tensor(r.handle, r.rpc(a), 256) == (0, b"\x08" + b"\x06" * 255)
        r.close()
    finally:
        s.close()
        guest.close()


def test_free_then_a_new_buffer_at_once(ggml, deferring):
    """A set queued into a buffer, the buffer freed and a new one made at once: the copy
    landed before the free (the fixture checks), and the new buffer is zeros."""
    guest = Guest(HostContext(7))
    s = GgmlScratch(ggml)
    try:
        graph, a, _ = _vector(ggml, s.ctx, 1024)
        r = RemoteGraph(guest, ggml, s.ctx, graph)
        handle, size = r.handle, ggml.ggml_backend_buffer_get_size(r.local)
        for _ in range(3):
            table = BufferTable()
            table.register(r.local, handle, ggml.ggml_backend_buffer_get_base(r.local))
            assert guest.set_tensor(handle, rpc_tensor_from_ggml(ggml, a, table).tobytes(), b"\x5a" * 4096) == 0
            rc, _ = guest.forward(Cmd.BUFFER_FREE_BUFFER, lambda e, h=handle: e.handle(h))
            assert rc == 0
            handle = guest.alloc(size)
            table = BufferTable()
            table.register(r.local, handle, ggml.ggml_backend_buffer_get_base(r.local))
            assert guest.get_tensor(handle, rpc_tensor_from_ggml(ggml, a, table).tobytes(), 4096) == (0, bytes(4096))
        r.close()
    finally:
        s.close()
        guest.close()


def test_close_and_two_contexts_with_uploads_queued(ggml, deferring):
    """Two contexts, each with uploads queued: one's commands flush only its own; closing one
    (the guest left) lands its copies before its buffers go; the other still gets its bytes."""
    one, two = Guest(HostContext(7)), Guest(HostContext(8))
    s, s2 = GgmlScratch(ggml), GgmlScratch(ggml)
    try:
        graph, a, _ = _vector(ggml, s.ctx, 1024)
        graph2, a2, _ = _vector(ggml, s2.ctx, 1024)
        r1, r2 = RemoteGraph(one, ggml, s.ctx, graph), RemoteGraph(two, ggml, s2.ctx, graph2)
        d1, d2 = _bytes(4096, 1), _bytes(4096, 2)
        assert one.set_tensor(r1.handle, r1.rpc(a), d1) == 0
        assert two.set_tensor(r2.handle, r2.rpc(a2), d2) == 0
        assert one.get_tensor(r1.handle, r1.rpc(a), 4096) == (0, d1)
        assert two.ctx._library.transfers.pending == 1
        assert one.set_tensor(r1.handle, r1.rpc(a), d2) == 0
        one.close()  # with one upload queued
        assert two.get_tensor(r2.handle, r2.rpc(a2), 4096) == (0, d2)
        r1.close()
        r2.close()
    finally:
        s.close()
        s2.close()
        two.close()
        one.close()


def _ids_graph(g, ctx):
    emb = g.ggml_new_tensor_2d(ctx, g.types["F32"], 8, 10)
    ids = g.ggml_new_tensor_1d(ctx, g.types["I32"], 4)
    y = g.ggml_sum(ctx, g.ggml_get_rows(ctx, emb, ids))
    graph = g.ggml_new_graph(ctx)
    g.ggml_build_forward_expand(graph, y)
    return graph, [emb, ids], y


def test_row_ids_out_of_range_only_in_the_queued_upload_are_refused(ggml, deferring):
    """A hit re-reads its row ids after the uploads queued before it: new ids out of range are
    refused (not the old, checked ones used), new ids in range are the ones computed with."""
    guest = Guest(HostContext(7))
    rep = RepeatedGraph(guest, ggml, _ids_graph)
    emb = np.arange(80, dtype=np.float32).tobytes()

    def direct(ids):
        s = GgmlScratch(ggml)
        graph, inputs, y = _ids_graph(ggml, s.ctx)
        out = cpu_compute(ggml, s.ctx, graph, zip(inputs, [emb, np.asarray(ids, np.int32).tobytes()]), y)
        s.close()
        return out

    try:
        for ids in ([1, 2, 3, 4], [9, 9, 0, 1], [5, 5, 5, 5]):
            assert rep.compute([emb, np.asarray(ids, np.int32).tobytes()]) == (0, 0, direct(ids)), ids
        assert guest.ctx._library.graph_cache.hits >= 2
        assert rep.compute([emb, np.asarray([1, 2, 10, 3], np.int32).tobytes()])[0] != 0
        assert rep.compute([emb, np.asarray([0, 1, 2, -1], np.int32).tobytes()])[0] != 0
        assert rep.compute([emb, np.asarray([7, 7, 8, 9], np.int32).tobytes()]) == (0, 0, direct([7, 7, 8, 9]))
    finally:
        rep.close()
        guest.close()
