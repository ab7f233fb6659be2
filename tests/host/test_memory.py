"""Memory a guest is handed and memory a guest can make the host hold.

Fresh buffers read as zeros whoever had the memory before; every ggml buffer a context holds
is charged to its budget and to the host-wide limit shared by every context of the process;
a context holds a bounded number of buffers; graph_compute copies what the graph's counts
claim, not the whole window the guest names. After each refusal the host serves the next
command."""

import struct

import pytest

from apir.codec.constants import ApirBackendCommandType as Cmd
from apir.host import HostContext
from apir.host.errors import Refused
from tests.host.hostkit import DATA_RES, Guest, GgmlScratch, rpc_bytes, rpc_record

SECRET = b"secret!\x00" * 2048  # 16 KiB


def _f32_rpc(ggml, scratch, buffer, n):
    t = ggml.ggml_new_tensor_1d(scratch.ctx, ggml.types["F32"], n)
    return rpc_bytes(rpc_record(ggml, t, buffer, data=0))


def _serves(guest):
    rc, d = guest.forward(Cmd.DEVICE_GET_COUNT)
    assert rc == 0 and d.i32() >= 1


@pytest.mark.parametrize("size", [len(SECRET), 1 << 20])
def test_fresh_buffer_of_another_context_reads_zeros(ggml, size):
    s = GgmlScratch(ggml)
    try:
        a = Guest(HostContext(41))
        buf = a.alloc(size)
        payload = (SECRET * (size // len(SECRET)))[:size]
        assert a.set_tensor(buf, _f32_rpc(ggml, s, buf, size // 4), payload) == 0
        a.close()  # the guest leaves; its buffer is freed
        b = Guest(HostContext(42))
        for _ in range(4):  # several allocations: the allocator may hand the chunk to any
            buf = b.alloc(size)
            b.data[:size] = b"\xa5" * size
            rc, got = b.get_tensor(buf, _f32_rpc(ggml, s, buf, size // 4), size)
            assert rc == 0
            assert got == bytes(size), "a fresh buffer shows old host memory"
        _serves(b)
        b.close()
    finally:
        s.close()


def test_fresh_buffer_after_a_free_in_the_same_context_reads_zeros(guest, ggml):
    s = GgmlScratch(ggml)
    size = 4096
    first = guest.alloc(size)
    assert guest.set_tensor(first, _f32_rpc(ggml, s, first, size // 4), SECRET[:size]) == 0
    assert guest.forward(Cmd.BUFFER_FREE_BUFFER, lambda e: e.handle(first))[0] == 0
    again = guest.alloc(size)
    rc, got = guest.get_tensor(again, _f32_rpc(ggml, s, again, size // 4), size)
    assert rc == 0 and got == bytes(size)
    s.close()


# --- class 7: budgets, the host-wide limit, handles ------------------------------------------
def _alloc(guest, size):
    """buffer_type_alloc_buffer: the handle (0: refused), after asserting the call succeeded."""
    buft = guest.buffer_type()
    rc, d = guest.forward(Cmd.BUFFER_TYPE_ALLOC_BUFFER, lambda e: (e.handle(buft), e.size_t(size)))
    assert rc == 0
    return d.handle()


def _free(guest, handle):
    assert guest.forward(Cmd.BUFFER_FREE_BUFFER, lambda e: e.handle(handle))[0] == 0


@pytest.fixture
def host_memory():
    """The process-wide pool, checked to be back where it started after the test."""
    from apir.host.backend.budget import HOST_MEMORY

    before, peers = HOST_MEMORY.used, dict(HOST_MEMORY.by_peer)
    yield HOST_MEMORY
    assert HOST_MEMORY.used == before, "a closed context left bytes charged"
    assert HOST_MEMORY.by_peer == peers, "a closed context left bytes charged to its peer"


def test_default_context_budget_is_well_below_the_device_memory(ggml, host_memory):
    import ctypes

    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    ggml.ggml_backend_dev_memory(ggml.ggml_backend_dev_by_type(0), ctypes.byref(free), ctypes.byref(total))
    g = Guest(HostContext(43))
    limits = g.ctx._library.budget.limits
    assert limits.context_bytes == total.value // 2
    assert limits.host_bytes == total.value * 3 // 4
    assert limits.max_buffers == 4096
    assert limits.peer is None  # no peer named: a peer of its own
    assert limits.peer_bytes == total.value // 2
    # a buffer of the whole device memory, which the old default (the device total) allowed
    assert _alloc(g, total.value // 2 + 4096) == 0
    _serves(g)
    g.close()


def test_host_wide_limit_is_shared_by_contexts(ggml, host_memory):
    config = {"apir.host.buffer_budget": str(1 << 20), "apir.host.memory_limit": str(host_memory.used + (1 << 20))}
    a, b = Guest(HostContext(44, config)), Guest(HostContext(45, config))
    held = _alloc(a, 600 << 10)
    assert held
    assert _alloc(b, 600 << 10) == 0  # within b's own budget, over what the host has left
    _serves(b)
    assert _alloc(b, 400 << 10)
    a.close()  # a's bytes go back to the host
    assert _alloc(b, 600 << 10)
    b.close()


def test_two_contexts_of_one_peer_share_its_limit(ggml, host_memory):
    """A guest's second context does not double its share of the process's pool: the other
    peers keep theirs."""
    limits = {
        "apir.host.buffer_budget": str(1 << 20),
        "apir.host.peer_memory_limit": str(1 << 20),
        "apir.host.memory_limit": str(host_memory.used + (3 << 20)),
    }
    a1, a2 = (Guest(HostContext(60 + i, dict(limits, **{"apir.host.peer": "vm-a"}))) for i in range(2))
    b = Guest(HostContext(62, dict(limits, **{"apir.host.peer": "vm-b"})))
    assert _alloc(a1, 600 << 10)
    assert _alloc(a2, 600 << 10) == 0  # within a2's own budget, over vm-a's
    _serves(a2)
    assert _alloc(a2, 300 << 10)
    assert _alloc(b, 900 << 10)  # vm-b is not starved by vm-a's two contexts
    assert (host_memory.by_peer["vm-a"], host_memory.by_peer["vm-b"]) == (900 << 10, 900 << 10)
    a1.close()  # its bytes go back to its peer
    assert _alloc(a2, 600 << 10)
    a2.close()
    b.close()


def test_size_zero_buffers_are_counted(ggml, host_memory):
    g = Guest(HostContext(46, {"apir.host.buffer_budget": str(4 * 4096)}))
    handles = [_alloc(g, 0) for _ in range(5)]
    assert all(handles[:4]) and handles[4] == 0
    assert g.ctx._library.budget.bytes == 4 * 4096
    _serves(g)
    _free(g, handles[0])
    assert _alloc(g, 0)
    g.close()


def test_a_buffer_refused_while_registered_gives_its_charge_back(ggml, host_memory):
    """A refusal after ggml made the buffer (here: no virtual base left) frees the buffer and
    refunds its charge, so the budget does not shrink with each such command."""
    g = Guest(HostContext(49, {"apir.host.buffer_budget": str(64 << 10)}))
    assert _alloc(g, 0)  # the library is up; one buffer held
    lib = g.ctx._library
    held = lib.budget.bytes

    def no_room(size, align):
        raise Refused("no virtual address space left")

    lib.vspace.reserve = no_room
    buft = g.buffer_type()
    for _ in range(3):
        rc, _ = g.forward(Cmd.BUFFER_TYPE_ALLOC_BUFFER, lambda e: (e.handle(buft), e.size_t(32 << 10)))
        assert rc != 0  # refused
    assert lib.budget.bytes == held
    del lib.vspace.reserve
    assert _alloc(g, 32 << 10)  # 32 KiB still fits the 64 KiB budget
    _serves(g)
    g.close()


def test_buffer_from_ptr_buffers_are_counted(ggml, host_memory):
    g = Guest(HostContext(47, {"apir.host.buffer_budget": str(96 << 10)}))

    def from_ptr(size):
        rc, d = g.forward(Cmd.DEVICE_BUFFER_FROM_PTR, lambda e: (e.u32(DATA_RES), e.size_t(size), e.size_t(size)))
        assert rc == 0
        return d.handle(), d.handle()

    buf, buft = from_ptr(64 << 10)
    assert buf and buft
    assert from_ptr(64 << 10) == (0, 0)  # 128 KiB of buffers over a 96 KiB budget
    _serves(g)
    assert _alloc(g, 64 << 10) == 0
    assert _alloc(g, 32 << 10)
    _free(g, buf)
    assert from_ptr(64 << 10)[0]
    g.close()


def test_buffer_count_limit(ggml, host_memory):
    g = Guest(HostContext(48, {"apir.host.max_buffers": "3"}))
    handles = [_alloc(g, 4096) for _ in range(4)]
    assert all(handles[:3]) and handles[3] == 0
    _serves(g)
    _free(g, handles[1])
    assert _alloc(g, 4096)
    g.close()


@pytest.mark.parametrize("value", ["lots", "-1", "1e9"])
def test_a_mistyped_limit_refuses_rather_than_lifts(ggml, host_memory, value):
    g = Guest(HostContext(49, {"apir.host.buffer_budget": value}))
    assert _alloc(g, 4096) == 0
    _serves(g)
    g.close()


def test_limits_from_the_environment(ggml, host_memory, monkeypatch):
    monkeypatch.setenv("APIR_HOST_MAX_BUFFERS", "2")
    monkeypatch.setenv("APIR_HOST_BUFFER_BUDGET", str(1 << 20))
    monkeypatch.setenv("APIR_HOST_MEMORY_LIMIT", str(1 << 30))
    g = Guest(HostContext(50))
    assert (g.ctx._library.budget.limits.context_bytes, g.ctx._library.budget.limits.host_bytes) == (1 << 20, 1 << 30)
    assert _alloc(g, 4096) and _alloc(g, 4096) and _alloc(g, 4096) == 0
    g.close()
    g = Guest(HostContext(51, {"apir.host.max_buffers": "3"}))  # the configuration comes first
    assert all(_alloc(g, 4096) for _ in range(3))
    g.close()


# --- class 7: graph_compute copies what the counts claim, not the window ---------------------
@pytest.mark.parametrize("n_nodes", [0, 1])
def test_graph_compute_copies_the_graph_not_the_window(ggml, n_nodes):
    import tracemalloc

    window = 256 << 20  # an untouched anonymous mapping: free until something copies it
    g = Guest(HostContext(52), data_size=window)
    # n_nodes, node ids, n_tensors = 0: an empty graph (0 nodes) or one naming an unknown id
    g.data[0:4 + 8 * n_nodes + 4] = struct.pack(f"<I{n_nodes}QI", n_nodes, *[7] * n_nodes, 0)
    size = 4 + 8 * n_nodes + 4
    # once with the graph's own size first: what a first call costs (imports, compiled
    # kernels) is no part of the window
    warm, _ = g.forward(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(DATA_RES), e.size_t(size)))
    tracemalloc.start()
    try:
        rc, _ = g.forward(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(DATA_RES), e.size_t(window)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert rc == warm == (0 if n_nodes == 0 else 1)
    assert peak < (1 << 20), f"{peak} bytes allocated for a {size}-byte graph"
    _serves(g)
    g.close()
