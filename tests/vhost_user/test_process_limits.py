"""What the vhost-user front-ends of one process hold, per VM and together: descriptors (a
blob keeps only those it needs), blob bytes, guest memory regions and their bytes. A VM past a
bound gets an error; every other VM is served."""

import os
import resource

import pytest

from apir.codec.virtgpu import VirtioGpuCtrlType as T
from apir.host.vhost_user import protocol as vu
from apir.host.vhost_user.process_limits import (
    BLOB_BYTES,
    FDS,
    MEM_BYTES,
    MEM_REGIONS,
    MMAP_HOLDS_FD,
    PROCESS,
    Pool,
    Share,
)

from .conftest import wait_for
from .frontend import GPA_BASE, MEM_SIZE, UVA_BASE, FakeFrontend, guest_ram, hdr, resp_type
from .gpu import create_blob, ctx_create, res_cmd

OK = T.RESP_OK_NODATA
OOM = T.RESP_ERR_OUT_OF_MEMORY
PER_BLOB = 1 + int(MMAP_HOLDS_FD)  # a mappable blob: its memfd, and the mapping's copy before 3.13
RAM_FDS = int(MMAP_HOLDS_FD)  # the fake front-end's guest RAM region, mapped


def _blob_fds(res_id: int) -> int:
    """Descriptors of this process open on blob `res_id`'s memfd."""
    name = f"/memfd:apir-vgpu-blob-{res_id} "
    found = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            found += os.readlink(f"/proc/self/fd/{fd}").startswith(name)
        except OSError:
            continue
    return found


def _serves(fe) -> None:
    assert resp_type(fe.command(hdr(T.CMD_GET_DISPLAY_INFO), 24 + 16 * 24)) == T.RESP_OK_DISPLAY_INFO


def _fill(fe, first_res_id: int, limit: int = 64) -> int:
    """Creates 4 KiB blobs until one is refused: how many were made (the refusal asserted)."""
    for i in range(limit):
        rtype = resp_type(fe.command(create_blob(first_res_id + i, 4096)))
        if rtype != OK:
            assert rtype == OOM
            return i
    raise AssertionError(f"{limit} blobs and no refusal")


def test_share_charges_within_its_own_and_the_process_bounds():
    pool = Pool()
    config = {"apir.vhost.max_fds": "3", "apir.vhost.process_max_fds": "5"}
    a, b = Share(config, pool), Share(config, pool)
    assert a.take({FDS: 3}) is None
    why = a.take({FDS: 1})
    assert why is not None and "apir.vhost.max_fds" in why
    assert b.take({FDS: 2}) is None
    why = b.take({FDS: 1, BLOB_BYTES: 4096})  # the process's bound, and nothing charged
    assert why is not None and "apir.vhost.process_max_fds" in why
    assert (b.held[FDS], b.held[BLOB_BYTES], pool.used[FDS]) == (2, 0, 5)
    a.give({FDS: 3})
    assert b.take({FDS: 1}) is None and pool.used[FDS] == 3


def test_default_descriptor_bounds_leave_the_process_room():
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    share = Share(None, Pool())
    if soft != resource.RLIM_INFINITY:
        assert share.own[FDS] == soft // 4 and share.every[FDS] == soft // 2
    assert share.own[MEM_BYTES] == 1 << 40 and share.every[MEM_BYTES] == 16 << 40
    assert share.own[MEM_REGIONS] == 509


@pytest.mark.parametrize("mappable", [True, False])
def test_a_blob_holds_only_the_descriptors_it_needs(fe, server, mappable):
    assert resp_type(fe.command(ctx_create(1))) == OK
    assert resp_type(fe.command(create_blob(7, 8192, flags=1 if mappable else 0))) == OK
    # a blob that can never be mapped into the host-visible region needs no memfd of its own
    expected = PER_BLOB if mappable else PER_BLOB - 1
    assert _blob_fds(7) == expected
    assert server.session.memory.share.held[FDS] == RAM_FDS + expected
    assert resp_type(fe.command(res_cmd(T.CMD_RESOURCE_UNREF, 7))) == OK
    wait_for(lambda: _blob_fds(7) == 0, what="blob's descriptors closed")
    assert server.session.memory.share.held[FDS] == RAM_FDS


def test_three_vms_cannot_exhaust_the_process_descriptors(make_server):
    """Each VM within its own bound, the three together within the process's: the one that
    runs out gets ERR_OUT_OF_MEMORY, the others are served, and a descriptor given back by one
    is there for another."""
    base = PROCESS.used[FDS]
    full = base + 3 * RAM_FDS + 10 * PER_BLOB
    config = {"apir.vhost.max_fds": str(RAM_FDS + 4 * PER_BLOB), "apir.vhost.process_max_fds": str(full)}
    fes = [FakeFrontend.connect(make_server(f"vm{i}.sock", config=config).path) for i in range(3)]
    try:
        for fe in fes:
            assert resp_type(fe.command(ctx_create(1))) == OK
        assert [_fill(fe, 100) for fe in fes] == [4, 4, 2]
        assert PROCESS.used[FDS] == full
        for fe in fes:
            _serves(fe)
        assert resp_type(fes[0].command(res_cmd(T.CMD_RESOURCE_UNREF, 100))) == OK
        wait_for(lambda: PROCESS.used[FDS] < full, what="a descriptor given back")
        assert resp_type(fes[2].command(create_blob(200, 4096))) == OK
        assert resp_type(fes[1].command(create_blob(200, 4096))) == OOM  # its own bound
    finally:
        for fe in fes:
            fe.close()
    wait_for(lambda: PROCESS.used[FDS] == base, what="every VM's descriptors given back")


def test_blob_bytes_are_bounded_in_all_as_well_as_per_vm(make_server):
    base = PROCESS.used[BLOB_BYTES]
    config = {"apir.vhost.max_blob_bytes": str(3 << 20), "apir.vhost.process_max_blob_bytes": str(base + (4 << 20))}
    a = FakeFrontend.connect(make_server("a.sock", config=config).path)
    b = FakeFrontend.connect(make_server("b.sock", config=config).path)
    try:
        for fe in (a, b):
            assert resp_type(fe.command(ctx_create(1))) == OK
        assert resp_type(a.command(create_blob(1, 3 << 20))) == OK
        assert resp_type(b.command(create_blob(1, 2 << 20))) == OOM  # 5 MiB in all: over
        assert resp_type(b.command(create_blob(2, 1 << 20))) == OK
        _serves(a)
    finally:
        a.close()
        b.close()


# --- the front-end's memory regions ----------------------------------------------------------
def _add_region(fe, fd: int, gpa: int, size: int) -> int:
    payload = vu.U64.pack(0) + vu.MEMORY_REGION.pack(gpa, size, UVA_BASE + (gpa - GPA_BASE), 0)
    return fe.ack(vu.Request.ADD_MEM_REG, payload, fds=[fd])


def _sparse_sealed_memfd(size: int) -> int:
    fd = guest_ram(0, sealed=False)
    os.ftruncate(fd, size)
    import fcntl

    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
    return fd


def test_a_sparse_sealed_region_larger_than_the_bound_is_refused(fe, server):
    """16 TiB of a sparse sealed memfd cost no memory: mapped, they took the address space
    other VMs' contexts and ggml's threads needed. Refused, and the VM goes on."""
    fd = _sparse_sealed_memfd(16 << 40)
    try:
        assert _add_region(fe, fd, GPA_BASE + (1 << 40), 16 << 40) != 0
    finally:
        os.close(fd)
    assert server.session.memory.region_count == 1
    assert server.session.memory.share.held[MEM_BYTES] == MEM_SIZE
    _serves(fe)


def test_memory_regions_are_bounded_in_count_and_bytes_per_front_end(make_server):
    config = {"apir.vhost.max_mem_regions": "3", "apir.vhost.max_mem_bytes": str(MEM_SIZE + (8 << 20))}
    server = make_server(config=config)
    fe = FakeFrontend.connect(server.path)
    fd = _sparse_sealed_memfd(64 << 20)
    try:
        assert vu.U64.unpack(fe.request(vu.Request.GET_MAX_MEM_SLOTS).payload)[0] == 3
        top = GPA_BASE + MEM_SIZE
        assert _add_region(fe, fd, top, 16 << 20) != 0  # bytes: 32 + 16 MiB over 40
        assert _add_region(fe, fd, top, 4 << 20) == 0
        assert _add_region(fe, fd, top + (4 << 20), 4 << 20) == 0
        assert _add_region(fe, fd, top + (8 << 20), 4096) != 0  # a fourth region
        assert server.session.memory.region_count == 3
        _serves(fe)
    finally:
        os.close(fd)
        fe.close()


def test_memory_regions_are_bounded_in_all_and_freed_with_their_front_end(make_server):
    base = PROCESS.used[MEM_BYTES]
    config = {"apir.vhost.process_max_mem_bytes": str(base + 2 * MEM_SIZE + (4 << 20))}
    a = FakeFrontend.connect(make_server("a.sock", config=config).path)
    b = FakeFrontend.connect(make_server("b.sock", config=config).path)
    fd = _sparse_sealed_memfd(64 << 20)
    try:
        top = GPA_BASE + MEM_SIZE
        assert _add_region(a, fd, top, 4 << 20) == 0
        assert _add_region(b, fd, top, 4 << 20) != 0  # the process's bound; b served on
        _serves(b)
        a.close()
        wait_for(lambda: PROCESS.used[MEM_BYTES] == base + MEM_SIZE, what="a's regions given back")
        assert _add_region(b, fd, top, 4 << 20) == 0
    finally:
        os.close(fd)
        a.close()
        b.close()
