"""Backend profiles (apir.host.graph.profiles): a backend without one supports nothing and computes
no graph; a profile whose kernels do not read host memory (Vulkan's, RPC's) reads row ids
through the backend, refuses them in guest memory and asks the device about every node.

The non-host-addressable paths run here on ggml CPU with such a profile substituted, so they
are tested without a GPU; tests/backends/test_vulkan.py runs them on ggml Vulkan itself."""

import dataclasses
import mmap

import numpy as np
import pytest

import apir.host.backend.library as backend_library
from apir.codec.constants import ApirBackendCommandType as Cmd
from apir.codec.graph import BufferTable, serialize_graph
from apir.ggml.layout import tensor_record
from apir.host import HostContext
from apir.host.graph import profiles
from tests.host.hostkit import DATA_RES, Guest, GgmlScratch, RemoteGraph, RepeatedGraph, cpu_compute, inline_tensor

BLOB_RES = 3


@pytest.mark.parametrize(
    "reg_name,expect",
    [("CPU", profiles.CPU), ("Vulkan", profiles.VULKAN), ("vulkan", profiles.VULKAN),
     ("RPC", profiles.RPC), ("RPC[127.0.0.1:50052]", profiles.RPC), ("BLAS", None), ("CUDA", None)],
)
def test_profile_for(reg_name, expect):
    assert profiles.profile_for(reg_name) is expect


def test_profiles_name_the_cpu_facts():
    from apir.host.graph.shapes import CHECKED_OPS
    from apir.host.graph.shapes.base import op_enums

    assert profiles.CPU.rules is CHECKED_OPS and profiles.CPU.type_traits is op_enums
    assert profiles.CPU.host_addressable and profiles.CPU.plans_work_buffer
    assert not profiles.VULKAN.host_addressable and not profiles.VULKAN.plans_work_buffer
    assert profiles.VULKAN.device_checks_nodes and not profiles.CPU.device_checks_nodes


def _guest_with_profile(monkeypatch, profile):
    monkeypatch.setattr(backend_library, "profile_for", lambda name: profile)
    return Guest(HostContext(7))


def _add_graph(g, ctx):
    f32 = g.types["F32"]
    a = g.ggml_new_tensor_2d(ctx, f32, 8, 4)
    b = g.ggml_new_tensor_2d(ctx, f32, 8, 4)
    y = g.ggml_add(ctx, a, b)
    graph = g.ggml_new_graph(ctx)
    g.ggml_build_forward_expand(graph, y)
    return graph, [a, b], y


def _get_rows_graph(g, ctx, n_ids=5):
    f32 = g.types["F32"]
    emb = g.ggml_new_tensor_2d(ctx, f32, 16, 10)
    ids = g.ggml_new_tensor_1d(ctx, g.types["I32"], n_ids)
    y = g.ggml_scale(ctx, g.ggml_get_rows(ctx, emb, ids), 2.0)
    graph = g.ggml_new_graph(ctx)
    g.ggml_build_forward_expand(graph, y)
    return graph, [emb, ids], y


def _compute(guest, g, build, data):
    """(rc, status, output bytes) of `build`'s graph with `data` through the host."""
    s = GgmlScratch(g)
    graph, inputs, y = build(g, s.ctx)
    remote = RemoteGraph(guest, g, s.ctx, graph)
    for t, d in zip(inputs, data):
        assert guest.set_tensor(remote.handle, remote.rpc(t), d) == 0
    guest.data[: len(remote.wire)] = remote.wire
    rc, dec = guest.forward(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(DATA_RES), e.size_t(len(remote.wire))))
    status = dec.i32() if rc == 0 else None
    out = guest.get_tensor(remote.handle, remote.rpc(y), g.ggml_nbytes(y))[1]
    remote.close()
    s.close()
    return rc, status, out


def _direct(g, build, data):
    s = GgmlScratch(g)
    graph, inputs, y = build(g, s.ctx)
    out = cpu_compute(g, s.ctx, graph, zip(inputs, data), y)
    s.close()
    return out


def _add_data():
    rng = np.random.default_rng(1)
    return [rng.standard_normal(32).astype(np.float32).tobytes() for _ in range(2)]


def test_backend_without_profile_supports_nothing_and_computes_nothing(monkeypatch, ggml):
    guest = _guest_with_profile(monkeypatch, None)
    try:
        s = GgmlScratch(ggml)
        _, _, y = _add_graph(ggml, s.ctx)
        blob = inline_tensor(ggml, y)
        s.close()
        rc, d = guest.forward(Cmd.DEVICE_SUPPORTS_OP, lambda e: e.blob(blob))
        assert rc == 0 and d.bool() is False
        rc, status, _ = _compute(guest, ggml, _add_graph, _add_data())
        assert rc != 0 and status is None  # refused, no status
        # the host serves the next command
        rc, d = guest.forward(Cmd.DEVICE_GET_NAME)
        assert rc == 0 and d.string()
    finally:
        guest.close()


def test_a_missing_profile_is_refused_on_every_graph_path(monkeypatch, ggml):
    """One decision (apir.host.graph.seams.profile_of): a library whose profile is None is
    refused by graph_compute, by a graph's build, by the work plan and by a cached graph's
    re-check, whichever of them is reached first; supports_op answers false."""
    from apir.codec.graph import parse_graph
    from apir.host.errors import Refused
    from apir.host.graph import build, work_plan
    from apir.host.graph.seams import profile_of

    guest = _guest_with_profile(monkeypatch, profiles.CPU)
    lib = guest.ctx._library
    s = GgmlScratch(ggml)
    try:
        data = _rows_data([3, 0, 9, 9, 1])
        assert _compute(guest, ggml, _get_rows_graph, data)[:2] == (0, 0)  # (now cached)
        ((_, entry),) = lib.graph_cache._entries.items()
        graph, _, y = _get_rows_graph(ggml, s.ctx)
        remote = RemoteGraph(guest, ggml, s.ctx, graph)
        parsed = parse_graph(
            remote.wire, 0, len(remote.wire), limits=ggml.limits, op_count=ggml.op_count,
            type_valid=lib.checker.valid_types,
        )
        blob = inline_tensor(ggml, y)
        lib.profile = None
        with pytest.raises(Refused, match="no profile of ggml backend 'CPU'"):
            profile_of(lib)
        rc, status, _ = _compute(guest, ggml, _get_rows_graph, data)
        assert rc != 0 and status is None
        with build.graph_scratch(lib, parsed) as scratch, pytest.raises(Refused, match="no profile"):
            build.build_graph_parts(lib, parsed, scratch, lib.op_enums)
        with pytest.raises(Refused, match="no profile"):
            work_plan.check_work_size(lib, entry.graph)
        with pytest.raises(Refused, match="no profile"):
            entry.recheck(lib, lib.op_enums)
        rc, d = guest.forward(Cmd.DEVICE_SUPPORTS_OP, lambda e: e.blob(blob))
        assert rc == 0 and d.bool() is False
        remote.close()
    finally:
        s.close()
        guest.close()


def test_cpu_profile_supports_and_computes(monkeypatch, ggml):
    guest = _guest_with_profile(monkeypatch, profiles.CPU)
    try:
        s = GgmlScratch(ggml)
        _, _, y = _add_graph(ggml, s.ctx)
        blob = inline_tensor(ggml, y)
        s.close()
        rc, d = guest.forward(Cmd.DEVICE_SUPPORTS_OP, lambda e: e.blob(blob))
        assert rc == 0 and d.bool() is True
        data = _add_data()
        rc, status, out = _compute(guest, ggml, _add_graph, data)
        assert (rc, status) == (0, 0) and out == _direct(ggml, _add_graph, data)
    finally:
        guest.close()


# Vulkan's profile on the CPU backend: row ids read with ggml_backend_tensor_get, every node
# asked of the device.
_DEVICE_MEMORY = dataclasses.replace(profiles.VULKAN, name="device-memory")


def _rows_data(ids):
    rng = np.random.default_rng(2)
    return [rng.standard_normal(160).astype(np.float32).tobytes(), np.asarray(ids, np.int32).tobytes()]


def test_device_memory_profile_reads_row_ids_through_the_backend(monkeypatch, ggml):
    guest = _guest_with_profile(monkeypatch, _DEVICE_MEMORY)
    try:
        data = _rows_data([3, 0, 9, 9, 1])
        rc, status, out = _compute(guest, ggml, _get_rows_graph, data)
        assert (rc, status) == (0, 0) and out == _direct(ggml, _get_rows_graph, data)
        # an id out of range is seen in the copy read through the backend and refused
        rc, status, _ = _compute(guest, ggml, _get_rows_graph, _rows_data([3, 0, 10, 9, 1]))
        assert rc != 0 and status is None
    finally:
        guest.close()


def test_device_memory_profile_reads_no_host_address(monkeypatch, ggml):
    """The snapshot comes from TensorInfo.fetch, never from the buffer's address."""
    from apir.host.graph.shapes import base

    import ctypes
    import types

    calls = []
    # the rules' own ctypes (base.copy_ids' memmove from an address), not the process's
    spy = types.SimpleNamespace(**vars(ctypes))
    spy.memmove = lambda *a: calls.append(a) or ctypes.memmove(*a)
    monkeypatch.setattr(base, "ctypes", spy)
    guest = _guest_with_profile(monkeypatch, _DEVICE_MEMORY)
    try:
        rc, status, _ = _compute(guest, ggml, _get_rows_graph, _rows_data([1, 2, 3, 4, 5]))
        assert (rc, status) == (0, 0)
        assert calls == []
    finally:
        guest.close()


def test_row_ids_in_guest_memory_are_read_from_the_checked_copy(monkeypatch, ggml):
    """Ids in a buffer wrapping guest memory (buffer_from_ptr) can change between the check and
    the kernel: on both kinds of profile the kernel reads the checked copy (the CPU's: the
    snapshot itself; a device-memory one: a device buffer made for the graph, freed after).
    The ids are rewritten in guest memory right after the graph's checks; the result is still
    the checked ids'."""
    from apir.host.graph import build as host_graph

    checked_ids, later_ids = [1, 2, 3, 4, 5], [0, 0, 0, 0, 0]
    want = _direct(ggml, _get_rows_graph, _rows_data(checked_ids))
    assert want != _direct(ggml, _get_rows_graph, _rows_data(later_ids))
    real_needs = host_graph._check_graph_needs
    for profile in (_DEVICE_MEMORY, profiles.CPU):
        monkeypatch.setattr(backend_library, "profile_for", lambda name, p=profile: p)
        guest = Guest(HostContext(7))
        blob = mmap.mmap(-1, 1 << 16)
        guest.ctx.add_resource(BLOB_RES, blob)
        s = GgmlScratch(ggml)
        try:
            rc, d = guest.forward(
                Cmd.DEVICE_BUFFER_FROM_PTR, lambda e: (e.u32(BLOB_RES), e.size_t(1 << 16), e.size_t(1 << 16))
            )
            assert rc == 0
            handle = d.handle()
            assert handle
            graph, inputs, y = _get_rows_graph(ggml, s.ctx)
            remote = RemoteGraph(guest, ggml, s.ctx, graph)
            # the same layout, in the guest-memory buffer instead
            table = BufferTable()
            base = ggml.ggml_backend_buffer_get_base(remote.local)
            table.register(remote.local, handle, base)
            wire = serialize_graph(ggml, graph, table).tobytes()
            offs = [int(tensor_record(t, ggml.tensor_dtype)["data"]) - base for t in inputs + [y]]
            for off, data in zip(offs, _rows_data(checked_ids)):
                blob[off : off + len(data)] = data
            ids_off = offs[1]

            def needs_then_rewrite(*args, **kw):
                real_needs(*args, **kw)
                later = np.asarray(later_ids, np.int32).tobytes()
                blob[ids_off : ids_off + len(later)] = later

            monkeypatch.setattr(host_graph, "_check_graph_needs", needs_then_rewrite)
            guest.data[: len(wire)] = wire
            rc, dec = guest.forward(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(DATA_RES), e.size_t(len(wire))))
            assert rc == 0 and dec.i32() == 0, profile.name
            got = bytes(blob[offs[2] : offs[2] + ggml.ggml_nbytes(y)])
            assert got == want, profile.name
            monkeypatch.setattr(host_graph, "_check_graph_needs", real_needs)
            remote.close()
        finally:
            s.close()
            guest.close()


def test_device_memory_profile_hit_uploads_the_rechecked_row_ids(monkeypatch, ggml):
    """A repeated graph on a profile whose kernels read a device copy of the row ids is served
    from the graph cache, and each hit computes the ids checked for it: the device copy is
    written again, though other graphs wrote their ids over it (the context's one ids buffer)
    or replaced it by a larger one in between; out-of-range ids on a hit are refused."""
    monkeypatch.setattr(backend_library, "profile_for", lambda name: _DEVICE_MEMORY)
    guest = Guest(HostContext(7), data_size=2 << 20)  # the 20000-row result is 1.25 MiB
    cache = guest.ctx._library.graph_cache
    rng = np.random.default_rng(5)
    a = RepeatedGraph(guest, ggml, _get_rows_graph)
    # other structures with row ids: 7 ids (written over a's copy), and enough ids that the
    # ids buffer (64 KiB at first) is freed and allocated larger
    others = [(RepeatedGraph(guest, ggml, lambda g, ctx, n=n: _get_rows_graph(g, ctx, n)), n) for n in (7, 20000)]
    try:
        for step, ids in enumerate(([3, 0, 9, 9, 1], [8, 8, 2, 5, 0], [1, 4, 6, 7, 2])):
            data = _rows_data(ids)
            assert a.compute(data) == (0, 0, _direct(ggml, _get_rows_graph, data)), step
            other, n = others[step % 2]
            other_ids = rng.integers(0, 10, n).tolist()
            rc, status, out = other.compute(_rows_data(other_ids))
            assert (rc, status) == (0, 0)
            assert out == _direct(ggml, lambda g, ctx, n=n: _get_rows_graph(g, ctx, n), _rows_data(other_ids))
        # a came 3 times (hit twice), the 7-id graph twice (hit once), the 20000-id one once
        assert (cache.hits, cache.misses) == (3, 3)
        rc, status, _ = a.compute(_rows_data([3, 0, 10, 9, 1]))
        assert rc != 0 and status is None
        data = _rows_data([9, 9, 9, 0, 0])
        assert a.compute(data) == (0, 0, _direct(ggml, _get_rows_graph, data))
    finally:
        a.close()
        for other, _ in others:
            other.close()
        guest.close()
