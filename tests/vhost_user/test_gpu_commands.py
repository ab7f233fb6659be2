"""The virtio-gpu control commands, through the fake front-end's control queue."""

import struct

import pytest

from apir.codec.constants import CapsetApir
from apir.codec.virtgpu import VirtioGpuCtrlType as T

from .conftest import SHM_SIZE, BusyContext, wait_for
from .frontend import FakeFrontend, hdr, resp_type
from .gpu import GUEST, create_blob, ctx_create, ctx_destroy, map_blob, res_cmd

OK = T.RESP_OK_NODATA


def test_display_info_reports_one_enabled_scanout(fe):
    data = fe.command(hdr(T.CMD_GET_DISPLAY_INFO, fence_id=7, flags=1))
    assert resp_type(data) == T.RESP_OK_DISPLAY_INFO and len(data) == 24 + 16 * 24
    assert struct.unpack_from("<IIQ", data) == (T.RESP_OK_DISPLAY_INFO, 1, 7)  # fence kept
    assert struct.unpack_from("<6I", data, 24) == (0, 0, 1024, 768, 1, 0)
    assert not any(data[48:])


def test_capset_info_and_capset(make_server):
    fe = FakeFrontend.connect(make_server(capsets=(10, 4)).path)
    try:
        infos = [
            struct.unpack_from("<III", fe.command(hdr(T.CMD_GET_CAPSET_INFO) + struct.pack("<II", i, 0)), 24)
            for i in (0, 1)
        ]
        assert infos == [(10, 0, 24), (4, 0, 24)]
        for capset in (10, 4):
            data = fe.command(hdr(T.CMD_GET_CAPSET) + struct.pack("<II", capset, 0))
            assert resp_type(data) == T.RESP_OK_CAPSET
            assert data[24:] == CapsetApir(1, True).pack()
    finally:
        fe.close()


def test_context_blob_lifecycle_counts_back_to_zero(fe, server):
    assert resp_type(fe.command(ctx_create(1))) == OK
    assert resp_type(fe.command(create_blob(5, 10000))) == OK
    c = server.counts()
    assert (c.contexts, c.blobs, c.blob_bytes) == (1, 1, 12288)  # page-rounded
    assert resp_type(fe.command(map_blob(5, 0x10000))) == T.RESP_OK_MAP_INFO
    assert fe.backend_requests[-1] == (9, (1, 0, 0x10000, 12288, 1))  # SHMEM_MAP: shmid 1, rw
    # the guest's mapping and the host's are the same pages
    fe.bar[0x10000][:4] = b"abcd"
    blob = server.session.device.resources[5]
    assert blob.mm[:4] == b"abcd"
    assert resp_type(fe.command(res_cmd(T.CMD_RESOURCE_UNMAP_BLOB, 5))) == OK
    assert fe.backend_requests[-1] == (10, (1, 0, 0x10000, 12288, 0))
    assert resp_type(fe.command(res_cmd(T.CMD_CTX_DETACH_RESOURCE, 5, ctx_id=1))) == OK
    assert resp_type(fe.command(res_cmd(T.CMD_RESOURCE_UNREF, 5))) == OK
    wait_for(lambda: server.counts().blobs == 0, what="blob freed")
    assert resp_type(fe.command(ctx_destroy(1))) == OK
    c = server.counts()
    assert (c.contexts, c.closing_contexts, c.blobs, c.blob_bytes) == (0, 0, 0, 0)


def test_ctx_destroy_frees_exactly_that_contexts_blobs(fe, server):
    for ctx in (1, 2):
        assert resp_type(fe.command(ctx_create(ctx))) == OK
    for res_id, ctx in ((1, 1), (2, 1), (3, 2)):
        assert resp_type(fe.command(create_blob(res_id, 4096, ctx_id=ctx))) == OK
    assert resp_type(fe.command(map_blob(1, 0))) == T.RESP_OK_MAP_INFO
    assert server.counts().blobs == 3
    assert resp_type(fe.command(ctx_destroy(1))) == OK  # answered once its host context closed
    c = server.counts()
    assert (c.contexts, c.blobs, c.blob_bytes) == (1, 1, 4096)
    # the guest kernel's later UNMAP / UNREF of the destroyed context's blobs still succeed
    assert resp_type(fe.command(res_cmd(T.CMD_RESOURCE_UNMAP_BLOB, 1))) == OK
    assert resp_type(fe.command(res_cmd(T.CMD_RESOURCE_UNREF, 1))) == OK
    assert resp_type(fe.command(res_cmd(T.CMD_RESOURCE_UNREF, 2))) == OK
    # but they are gone for anything else
    assert resp_type(fe.command(res_cmd(T.CMD_RESOURCE_UNREF, 1))) == T.RESP_ERR_INVALID_RESOURCE_ID
    assert server.session.device.resources.keys() == {3}


def test_losing_the_front_end_frees_everything_and_the_next_one_is_served(server):
    fe = FakeFrontend.connect(server.path)
    for ctx in (1, 2):
        assert resp_type(fe.command(ctx_create(ctx))) == OK
        assert resp_type(fe.command(create_blob(ctx, 1 << 20, ctx_id=ctx))) == OK
    assert resp_type(fe.command(map_blob(1, 0))) == T.RESP_OK_MAP_INFO
    device = server.session.device
    assert server.counts().blobs == 2
    fe.close()
    wait_for(lambda: server.sessions_served == 1, what="session end")
    c = device.counts()
    assert (c.contexts, c.closing_contexts, c.blobs, c.blob_bytes) == (0, 0, 0, 0)
    fe2 = FakeFrontend.connect(server.path)
    try:
        assert resp_type(fe2.command(ctx_create(1))) == OK  # a fresh device: id 1 is free
    finally:
        fe2.close()


def test_guest_blob_pages_are_checked_against_guest_memory(fe, server):
    from .frontend import FREE_BASE, GPA_BASE, MEM_SIZE

    base = GPA_BASE + FREE_BASE
    assert (
        resp_type(
            fe.command(create_blob(7, 8192, ctx_id=0, mem=GUEST, flags=0, entries=[(base, 4096), (base + 8192, 4096)]))
        )
        == OK
    )
    assert server.session.device.resources[7].entries == [(base, 4096), (base + 8192, 4096)]
    assert resp_type(fe.command(ctx_create(1))) == OK
    assert resp_type(fe.command(res_cmd(T.CMD_CTX_ATTACH_RESOURCE, 7, ctx_id=1))) == OK
    bad = [
        [(GPA_BASE + MEM_SIZE - 4096, 8192)],  # runs off the end of guest memory
        [(0, 8192)],  # not guest memory
        [(2**64 - 4096, 8192)],  # wraps
        [(base, 4096)],  # covers less than the size
        [(base, 0), (base, 8192)],  # an empty entry
    ]
    for i, entries in enumerate(bad):
        data = fe.command(create_blob(20 + i, 8192, ctx_id=0, mem=GUEST, flags=0, entries=entries))
        assert resp_type(data) == T.RESP_ERR_INVALID_PARAMETER, entries
    assert (
        resp_type(fe.command(create_blob(30, 8192, ctx_id=0, mem=GUEST, flags=0, nr=3, entries=[(base, 8192)])))
        == T.RESP_ERR_INVALID_PARAMETER
    )
    assert (
        resp_type(fe.command(create_blob(31, 8192, ctx_id=0, mem=GUEST, flags=0, nr=1 << 20)))
        == T.RESP_ERR_INVALID_PARAMETER
    )
    assert server.session.device.resources.keys() == {7}


E = T
BAD_COMMANDS = [
    # (name, setup commands, bad command, expected response)
    ("short header", [], b"\x00" * 10, E.RESP_ERR_UNSPEC),
    ("unknown command", [], hdr(0x1FF), E.RESP_ERR_UNSPEC),
    ("2D command not served", [], hdr(T.CMD_RESOURCE_CREATE_2D) + bytes(24), E.RESP_ERR_UNSPEC),
    ("capset info index", [], hdr(T.CMD_GET_CAPSET_INFO) + struct.pack("<II", 1, 0), E.RESP_ERR_INVALID_PARAMETER),
    ("capset info short", [], hdr(T.CMD_GET_CAPSET_INFO) + b"\x00", E.RESP_ERR_INVALID_PARAMETER),
    ("capset not offered", [], hdr(T.CMD_GET_CAPSET) + struct.pack("<II", 4, 0), E.RESP_ERR_INVALID_PARAMETER),
    ("capset version", [], hdr(T.CMD_GET_CAPSET) + struct.pack("<II", 10, 1), E.RESP_ERR_INVALID_PARAMETER),
    ("ctx id 0", [], ctx_create(0), E.RESP_ERR_INVALID_CONTEXT_ID),
    ("ctx twice", [ctx_create(1)], ctx_create(1), E.RESP_ERR_INVALID_CONTEXT_ID),
    ("ctx capset not offered", [], ctx_create(1, capset=4), E.RESP_ERR_INVALID_PARAMETER),
    ("ctx capset 0", [], ctx_create(1, capset=0), E.RESP_ERR_INVALID_PARAMETER),
    ("ctx context_init high bits", [], ctx_create(1, capset=0x100 | 10), E.RESP_ERR_INVALID_PARAMETER),
    ("ctx name length", [], ctx_create(1, nlen=65), E.RESP_ERR_INVALID_PARAMETER),
    ("ctx create short", [], hdr(T.CMD_CTX_CREATE, 1) + bytes(8), E.RESP_ERR_INVALID_PARAMETER),
    ("destroy unknown ctx", [], ctx_destroy(3), E.RESP_ERR_INVALID_CONTEXT_ID),
    ("blob in unknown ctx", [], create_blob(1, 4096, ctx_id=9), E.RESP_ERR_INVALID_CONTEXT_ID),
    ("blob res id 0", [ctx_create(1)], create_blob(0, 4096), E.RESP_ERR_INVALID_RESOURCE_ID),
    ("blob res id taken", [ctx_create(1), create_blob(1, 4096)], create_blob(1, 4096), E.RESP_ERR_INVALID_RESOURCE_ID),
    ("blob size 0", [ctx_create(1)], create_blob(1, 0), E.RESP_ERR_INVALID_PARAMETER),
    ("blob unknown flags", [ctx_create(1)], create_blob(1, 4096, flags=0x10), E.RESP_ERR_INVALID_PARAMETER),
    ("blob mem 3", [ctx_create(1)], create_blob(1, 4096, mem=3), E.RESP_ERR_INVALID_PARAMETER),
    ("blob mem 9", [ctx_create(1)], create_blob(1, 4096, mem=9), E.RESP_ERR_INVALID_PARAMETER),
    ("host3d with entries", [ctx_create(1)], create_blob(1, 4096, nr=1), E.RESP_ERR_INVALID_PARAMETER),
    ("host3d blob_id", [ctx_create(1)], create_blob(1, 4096, blob_id=5), E.RESP_ERR_INVALID_PARAMETER),
    ("blob over the byte limit", [ctx_create(1)], create_blob(1, 17 << 30), E.RESP_ERR_OUT_OF_MEMORY),
    ("blob size 2**64-1", [ctx_create(1)], create_blob(1, 2**64 - 1), E.RESP_ERR_OUT_OF_MEMORY),
    ("blob short", [ctx_create(1)], hdr(T.CMD_RESOURCE_CREATE_BLOB, 1) + bytes(20), E.RESP_ERR_INVALID_PARAMETER),
    ("map unknown", [], map_blob(4, 0), E.RESP_ERR_INVALID_RESOURCE_ID),
    (
        "map past the region",
        [ctx_create(1), create_blob(1, 8192)],
        map_blob(1, SHM_SIZE - 4096),
        E.RESP_ERR_INVALID_PARAMETER,
    ),
    (
        "map wrapping offset",
        [ctx_create(1), create_blob(1, 8192)],
        map_blob(1, 2**64 - 4096),
        E.RESP_ERR_INVALID_PARAMETER,
    ),
    ("map unaligned", [ctx_create(1), create_blob(1, 8192)], map_blob(1, 100), E.RESP_ERR_INVALID_PARAMETER),
    (
        "map twice",
        [ctx_create(1), create_blob(1, 8192), map_blob(1, 0)],
        map_blob(1, 0x100000),
        E.RESP_ERR_INVALID_PARAMETER,
    ),
    (
        "map overlap",
        [ctx_create(1), create_blob(1, 8192), create_blob(2, 8192), map_blob(1, 0x10000)],
        map_blob(2, 0x11000),
        E.RESP_ERR_INVALID_PARAMETER,
    ),
    ("map not mappable", [ctx_create(1), create_blob(1, 8192, flags=0)], map_blob(1, 0), E.RESP_ERR_INVALID_PARAMETER),
    ("map short", [], hdr(T.CMD_RESOURCE_MAP_BLOB) + bytes(4), E.RESP_ERR_INVALID_PARAMETER),
    (
        "unmap unmapped",
        [ctx_create(1), create_blob(1, 8192)],
        res_cmd(T.CMD_RESOURCE_UNMAP_BLOB, 1),
        E.RESP_ERR_INVALID_PARAMETER,
    ),
    ("unmap unknown", [], res_cmd(T.CMD_RESOURCE_UNMAP_BLOB, 1), E.RESP_ERR_INVALID_RESOURCE_ID),
    ("unref unknown", [], res_cmd(T.CMD_RESOURCE_UNREF, 77), E.RESP_ERR_INVALID_RESOURCE_ID),
    ("attach unknown res", [ctx_create(1)], res_cmd(T.CMD_CTX_ATTACH_RESOURCE, 77, 1), E.RESP_ERR_INVALID_RESOURCE_ID),
    (
        "attach unknown ctx",
        [ctx_create(1), create_blob(1, 4096)],
        res_cmd(T.CMD_CTX_ATTACH_RESOURCE, 1, 5),
        E.RESP_ERR_INVALID_CONTEXT_ID,
    ),
    ("detach unknown ctx", [], res_cmd(T.CMD_CTX_DETACH_RESOURCE, 1, 5), E.RESP_ERR_INVALID_CONTEXT_ID),
    ("submit unknown ctx", [], hdr(T.CMD_SUBMIT_3D, 4) + struct.pack("<II", 0, 0), E.RESP_ERR_INVALID_CONTEXT_ID),
    (
        "submit size past body",
        [ctx_create(1)],
        hdr(T.CMD_SUBMIT_3D, 1) + struct.pack("<II", 100, 0) + bytes(50),
        E.RESP_ERR_INVALID_PARAMETER,
    ),
    (
        "submit size huge",
        [ctx_create(1)],
        hdr(T.CMD_SUBMIT_3D, 1) + struct.pack("<II", 2**32 - 1, 0),
        E.RESP_ERR_INVALID_PARAMETER,
    ),
    ("submit short", [ctx_create(1)], hdr(T.CMD_SUBMIT_3D, 1) + bytes(4), E.RESP_ERR_INVALID_PARAMETER),
]


@pytest.mark.parametrize("setup,bad,expected", [c[1:] for c in BAD_COMMANDS], ids=[c[0] for c in BAD_COMMANDS])
def test_bad_commands_get_error_responses(fe, server, setup, bad, expected):
    for cmd in setup:
        assert resp_type(fe.command(cmd)) in (OK, T.RESP_OK_MAP_INFO)
    before = server.counts()
    data = fe.command(bad)
    assert resp_type(data) == expected
    assert len(data) == 24
    after = server.counts()
    assert (after.contexts, after.blobs, after.blob_bytes) == (before.contexts, before.blobs, before.blob_bytes)
    # and the next command is served
    assert resp_type(fe.command(hdr(T.CMD_GET_DISPLAY_INFO))) == T.RESP_OK_DISPLAY_INFO


def test_resource_and_context_limits(make_server):
    srv = make_server(
        config={
            "apir.vhost.max_contexts": "2",
            "apir.vhost.max_resources": "3",
            "apir.vhost.max_blob_bytes": str(3 << 20),
        }
    )
    fe = FakeFrontend.connect(srv.path)
    try:
        assert [resp_type(fe.command(ctx_create(i))) for i in (1, 2, 3)] == [OK, OK, T.RESP_ERR_OUT_OF_MEMORY]
        assert [resp_type(fe.command(create_blob(i, 1 << 20))) for i in (1, 2, 3, 4)] == [OK] * 3 + [
            T.RESP_ERR_OUT_OF_MEMORY
        ]
        assert resp_type(fe.command(res_cmd(T.CMD_RESOURCE_UNREF, 1))) == OK
        wait_for(lambda: srv.counts().blobs == 2)
        assert resp_type(fe.command(create_blob(4, 1 << 20 + 1))) == T.RESP_ERR_OUT_OF_MEMORY  # 2 MiB: over bytes
        assert resp_type(fe.command(create_blob(4, 1 << 20))) == OK
    finally:
        fe.close()


def test_two_front_ends_on_two_sockets_are_isolated(make_server):
    a_srv, b_srv = make_server("a.sock"), make_server("b.sock")
    a, b = FakeFrontend.connect(a_srv.path), FakeFrontend.connect(b_srv.path)
    try:
        for fe, byte in ((a, b"A"), (b, b"B")):  # the same ids in both VMs
            assert resp_type(fe.command(ctx_create(1))) == OK
            assert resp_type(fe.command(create_blob(1, 4096))) == OK
            assert resp_type(fe.command(map_blob(1, 0))) == T.RESP_OK_MAP_INFO
            fe.bar[0][:1] = byte
        assert (a.bar[0][:1], b.bar[0][:1]) == (b"A", b"B")  # two blobs, not one
        a.close()
        wait_for(lambda: a_srv.sessions_served == 1)
        assert a_srv.counts().blobs == 0
        c = b_srv.counts()
        assert (c.contexts, c.blobs) == (1, 1)
        assert resp_type(b.command(create_blob(2, 4096))) == OK
        assert b.bar[0][:1] == b"B"
    finally:
        a.close()
        b.close()


def test_a_guest_reboot_frees_the_old_guests_state(fe, server):
    """The driver reset the device: the control queue starts again at avail index 0."""
    assert resp_type(fe.command(ctx_create(1))) == OK
    assert resp_type(fe.command(create_blob(1, 8192))) == OK
    assert resp_type(fe.command(map_blob(1, 0x2000))) == T.RESP_OK_MAP_INFO
    fe.reset_driver()
    # the new guest's first command finds a clean device: its ids are free, its offsets too
    assert resp_type(fe.command(ctx_create(1))) == OK
    assert fe.backend_requests[-1] == (10, (1, 0, 0x2000, 8192, 0))  # the old blob left the region
    assert resp_type(fe.command(create_blob(1, 8192))) == OK
    assert resp_type(fe.command(map_blob(1, 0x2000))) == T.RESP_OK_MAP_INFO
    c = server.counts()
    assert (c.contexts, c.closing_contexts, c.blobs) == (1, 0, 1)


def test_a_pause_keeps_the_guests_state(fe, server):
    """A VM pause: QEMU stops the rings and starts them again where they stopped."""
    assert resp_type(fe.command(ctx_create(1))) == OK
    assert resp_type(fe.command(create_blob(1, 8192))) == OK
    for q in (0, 1):
        fe.restart_queue(q, fe.stop_queue(q))
    assert resp_type(fe.command(ctx_create(1))) == T.RESP_ERR_INVALID_CONTEXT_ID  # still there
    assert resp_type(fe.command(res_cmd(T.CMD_RESOURCE_UNREF, 1))) == OK
    assert server.counts().contexts == 1


def test_contexts_of_one_vm_are_one_peer_and_vms_are_not(make_server):
    """The host's per-peer bounds (apir.host.peer) see a VM's contexts as one guest."""
    seen = []

    def factory(ctx_id, capset_id, config):
        seen.append(config.get("apir.host.peer"))
        return BusyContext()

    a = FakeFrontend.connect(make_server("a.sock", context_factory=factory).path)
    b = FakeFrontend.connect(make_server("b.sock", context_factory=factory).path)
    try:
        for fe in (a, a, b):
            assert resp_type(fe.command(ctx_create(len(seen) + 1))) == OK
    finally:
        a.close()
        b.close()
    assert seen[0] == seen[1] != seen[2] and seen[0].endswith("a.sock") and seen[2].endswith("b.sock")


def test_a_context_whose_thread_cannot_start_is_refused_and_closed(fe, server, monkeypatch):
    from apir.host.vhost_user import gpu_device

    closed = []

    class NoThread:
        def __init__(self, name):
            raise RuntimeError("can't start new thread")

    class Host(BusyContext):
        def close(self):
            closed.append(True)

    server.session.device.context_factory = lambda *a: Host()
    monkeypatch.setattr(gpu_device, "ContextWorker", NoThread)
    assert resp_type(fe.command(ctx_create(1))) == T.RESP_ERR_OUT_OF_MEMORY
    assert closed == [True] and server.counts().contexts == 0
    monkeypatch.undo()
    assert resp_type(fe.command(ctx_create(1))) == OK
