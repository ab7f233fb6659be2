"""A vhost-user session (apir.host.vhost_user) under a hostile front-end: memory tables changed
under running commands, rings in odd places, hostile kick / call descriptors, and resources
crossing contexts and VMs. The device serves on after each (docs/security.md says why).
- Guest RAM in a file not sealed against shrinking, truncated under the device: read with
  pread / pwrite, so an error, not a SIGBUS; a sealed one (QEMU's memory-backend-memfd) mapped.
- A call eventfd at its maximum count blocks nothing (kick and call descriptors are made
  non-blocking); a kick descriptor always ready that never kicks (a hung-up pipe, a regular
  file) is dropped, not spun on.
- The region of a command's response buffer removed, or the whole table replaced, while the
  command computes: the response is dropped or lands in the new table only.
- Bad SET_MEM_TABLE (overlaps, zero size, offsets past the file, a pipe): refused, the old
  table stays; a descriptor table straddling two regions; a response written over the
  descriptor table it was walked from; SET_VRING_BASE far ahead of avail.idx; a command split
  over 48 two-byte descriptors.
- A blob of context 1 attached to context 2, then context 1 destroyed; another VM's resource
  ids; fenced commands on a context destroyed mid-compute: all answered, in fence order.
"""

import os
import socket
import struct
import threading
import time

import pytest

from apir.codec.virtgpu import VirtioGpuCtrlType as T
from apir.host.vhost_user import protocol as vu

from .sessionkit import (
    region,
    spawn_device,
    table,
    wait_used_polled,
)
from .conftest import wait_for
from .frontend import (
    F_NEXT,
    F_WRITE,
    FREE_BASE,
    GPA_BASE,
    MEM_SIZE,
    RING_OFFSETS,
    UVA_BASE,
    FakeFrontend,
    guest_ram,
    hdr,
    resp_type,
)
from .gpu import create_blob, ctx_create, ctx_destroy, map_blob, res_cmd, submit

OK = T.RESP_OK_NODATA
DISPLAY = hdr(T.CMD_GET_DISPLAY_INFO)
DISPLAY_SIZE = 24 + 16 * 24
R = vu.Request
REQ = GPA_BASE + FREE_BASE  # crafted chains' request and response buffers
RESP = REQ + 0x1000
GPA2, UVA2, SIZE2 = GPA_BASE + MEM_SIZE, UVA_BASE + MEM_SIZE, 1 << 20  # a second region, adjacent


def served(fe, timeout: float = 30.0) -> None:
    assert resp_type(fe.command(DISPLAY, DISPLAY_SIZE, timeout=timeout)) == T.RESP_OK_DISPLAY_INFO


# --- bugs -------------------------------------------------------------------------------------
def test_guest_ram_truncated_under_the_device_faults_nothing(tmp_path):
    paths = [str(tmp_path / "a.sock"), str(tmp_path / "b.sock")]
    proc = spawn_device(paths)
    try:
        # a's RAM is a file it can truncate (memory-backend-file's), b's sealed (memfd's)
        a, b = FakeFrontend.connect(paths[0], sealed=False), FakeFrontend.connect(paths[1])
        served(a)
        base = a.stop_queue(0)
        os.ftruncate(a.mem_fd, 0)  # the rings, and every buffer, are gone from the file
        # restarting the ring reads its used index (on the control thread, before the ack)
        assert a.ack(R.SET_VRING_BASE, vu.VRING_STATE.pack(0, base)) == 0
        assert a.ack(R.SET_VRING_KICK, vu.U64.pack(0), fds=[a.kick[0]]) == 0
        a.kick_queue(1)  # the queue thread reads the cursor ring
        served(b, timeout=10)  # the other VM: the process is alive and serving
        assert proc.poll() is None
        a.close()
        again = FakeFrontend.connect(paths[0], sealed=False)  # the truncating VM's session ended alone
        served(again)
        again.close()
        b.close()
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_a_region_sealed_as_qemu_seals_it_is_served(server):
    fe = FakeFrontend.connect(server.path)  # (sealed as QEMU seals it)
    try:
        served(fe)
        with pytest.raises(PermissionError):
            os.ftruncate(fe.mem_fd, 0)
        assert resp_type(fe.command(ctx_create(1))) == OK
    finally:
        fe.close()


def test_a_call_eventfd_at_its_maximum_blocks_nothing(fe, server):
    call = os.eventfd(0)  # blocking, as a hostile front-end may hand it
    try:
        assert fe.ack(R.SET_VRING_CALL, vu.U64.pack(0), fds=[call]) == 0
        os.eventfd_write(call, (1 << 64) - 2)  # the next signal would overflow: write() blocks
        for _ in range(3):
            slot = fe.post(DISPLAY, DISPLAY_SIZE)
            assert wait_used_polled(fe, 2 * slot) == DISPLAY_SIZE
            fe.free_slots.append(slot)
        assert os.eventfd_read(call) == (1 << 64) - 2  # the device's signals were dropped, not queued
    finally:
        os.close(call)


def test_kick_and_call_descriptors_are_made_non_blocking(fe, server):
    # A front-end that reads its own kick eventfd between the device's poll and read would
    # otherwise leave the queue thread blocked in read() for good.
    kick, call = os.eventfd(0), os.eventfd(0)
    try:
        assert fe.ack(R.SET_VRING_CALL, vu.U64.pack(1), fds=[call]) == 0
        assert fe.ack(R.SET_VRING_KICK, vu.U64.pack(1), fds=[kick]) == 0
        vq = server.session.queues[1]
        assert not os.get_blocking(vq.kick_fd)
        assert not os.get_blocking(vq.call_fd)
    finally:
        os.close(kick)
        os.close(call)
    served(fe)


@pytest.mark.parametrize("kind", ["hung-up pipe", "regular file"])
def test_a_kick_descriptor_that_never_kicks_is_dropped_not_spun_on(fe, server, tmp_path, kind):
    if kind == "hung-up pipe":
        fd, w = os.pipe()
        os.close(w)
    else:
        fd = os.open(tmp_path / "kick", os.O_RDWR | os.O_CREAT)
    try:
        assert fe.ack(R.SET_VRING_KICK, vu.U64.pack(0), fds=[fd]) == 0
    finally:
        os.close(fd)
    vq = server.session.queues[0]
    wait_for(lambda: vq.kick_fd is None, timeout=20, what="the dead kick descriptor dropped")
    fe.restart_queue(0, vq.last_avail)  # a working kick again
    served(fe)


# --- memory table changes under running commands --------------------------------------------
def _busy_submit(fe, contexts, resp_gpa):
    """A SUBMIT_3D on context 1 (computing until released) whose response buffer is at
    `resp_gpa`; returns its head."""
    assert resp_type(fe.command(ctx_create(1))) == OK
    fe.write(REQ, submit(1, b"x"))
    fe.write_desc(0, 40, REQ, len(submit(1, b"x")), F_NEXT, 41)
    fe.write_desc(0, 41, resp_gpa, 24, F_WRITE)
    fe.publish(0, 40)
    fe.kick_queue(0)
    wait_for(lambda: 1 in contexts and contexts[1].busy.is_set(), what="context 1 computing")
    return 40


def test_removing_a_response_buffers_region_while_its_command_computes(busy):
    srv, fe, contexts = busy
    fd = guest_ram(SIZE2, sealed=False)
    try:
        assert fe.ack(R.ADD_MEM_REG, region(GPA2, SIZE2, UVA2), fds=[fd]) == 0
        head = _busy_submit(fe, contexts, GPA2 + 0x100)
        assert fe.ack(R.REM_MEM_REG, region(GPA2, SIZE2, UVA2)) == 0
        assert srv.session.memory.region_count == 1
        contexts[1].release.set()
        assert fe.wait_used(0, head, timeout=10) == 0  # the response had nowhere to go
        assert os.pread(fd, SIZE2, 0) == bytes(SIZE2)  # and did not go to the removed file
    finally:
        os.close(fd)
    served(fe)


def test_replacing_the_table_under_a_computing_command_writes_the_new_table_only(busy):
    srv, fe, contexts = busy
    used = GPA_BASE + RING_OFFSETS[0][2]
    head = _busy_submit(fe, contexts, RESP)
    idx_before = fe.used_idx(0)
    fd = guest_ram(MEM_SIZE, sealed=False)
    try:
        assert fe.ack(R.SET_MEM_TABLE, table((GPA_BASE, MEM_SIZE, UVA_BASE, 0)), fds=[fd]) == 0
        contexts[1].release.set()
        new_idx = lambda: struct.unpack("<H", os.pread(fd, 2, used + 2 - GPA_BASE))[0]  # noqa: E731
        wait_for(lambda: new_idx() != 0, what="the used element in the new table")
        assert new_idx() == (idx_before + 1) & 0xFFFF
        slot = idx_before % 64
        assert struct.unpack("<II", os.pread(fd, 8, used + 4 + 8 * slot - GPA_BASE)) == (head, 24)
        assert resp_type(os.pread(fd, 24, RESP - GPA_BASE)) == OK
    finally:
        os.close(fd)
    assert fe.used_idx(0) == idx_before and fe.read(RESP, 24) == bytes(24)  # old file untouched


def _bad_tables(fe_fd, tmp_path):
    pipe_r, pipe_w = os.pipe()
    os.close(pipe_w)
    return [
        ("overlap", table((GPA_BASE, MEM_SIZE, UVA_BASE, 0), (GPA_BASE + 4096, 4096, UVA2, 0)), [fe_fd, fe_fd]),
        ("zero size", table((GPA_BASE, 0, UVA_BASE, 0)), [fe_fd]),
        ("offset past the file", table((GPA_BASE, 4096, UVA_BASE, MEM_SIZE + 4096)), [fe_fd]),
        ("region past the file", table((GPA_BASE, MEM_SIZE + 4096, UVA_BASE, 0)), [fe_fd]),
        ("a pipe", table((GPA_BASE, 4096, UVA_BASE, 0)), [pipe_r]),
    ], pipe_r


def test_bad_memory_tables_are_refused_and_the_old_one_stays(fe, server, tmp_path):
    cases, pipe_r = _bad_tables(fe.mem_fd, tmp_path)
    try:
        for name, payload, fds in cases:
            assert fe.ack(R.SET_MEM_TABLE, payload, fds=fds) != 0, name
            assert server.session.memory.region_count == 1, name
            served(fe)
    finally:
        os.close(pipe_r)


# --- rings in odd places ----------------------------------------------------------------------
def test_a_descriptor_table_straddling_two_regions(fe, server):
    fd = guest_ram(SIZE2, sealed=False)
    try:
        assert fe.ack(R.ADD_MEM_REG, region(GPA2, SIZE2, UVA2), fds=[fd]) == 0
        _, avail, used = RING_OFFSETS[1]
        # cursor queue: descriptor 0 is the last 8 bytes of guest RAM and the first 8 of region 2
        addr = vu.VRING_ADDR.pack(1, 0, UVA2 - 8, UVA_BASE + used, UVA_BASE + avail, 0)
        base = fe.stop_queue(1)
        assert fe.ack(R.SET_VRING_ADDR, addr) == 0
        fe.restart_queue(1, base)
        fe.publish(1, 0)
        fe.kick_queue(1)
        assert fe.wait_used(1, 0, timeout=10) == 0  # an error, consumed
        assert os.pread(fd, SIZE2, 0) == bytes(SIZE2)
    finally:
        os.close(fd)
    served(fe)


def test_a_response_written_over_the_descriptor_table_it_was_walked_from(fe):
    desc = GPA_BASE + RING_OFFSETS[0][0]
    fe.write(REQ, DISPLAY)
    fe.write_desc(0, 40, REQ, len(DISPLAY), F_NEXT, 41)
    fe.write_desc(0, 41, desc + 16 * 40, DISPLAY_SIZE, F_WRITE)  # over descriptors 40..65
    fe.publish(0, 40)
    fe.kick_queue(0)
    assert fe.wait_used(0, 40, timeout=10) == DISPLAY_SIZE
    assert resp_type(fe.read(desc + 16 * 40, 24)) == T.RESP_OK_DISPLAY_INFO
    served(fe)


def test_vring_base_moved_far_ahead_while_the_ring_runs(fe, server):
    vq = server.session.queues[0]
    served(fe)
    base = vq.last_avail
    assert fe.ack(R.SET_VRING_BASE, vu.VRING_STATE.pack(0, base + 1000)) == 0
    slot = fe.post(DISPLAY, DISPLAY_SIZE)  # avail.idx is now 999 behind the device's count
    wait_for(lambda: vq.broken, what="the ring refused")
    fe.free_slots.append(slot)
    fe.restart_queue(0, fe.avail_idx[0])  # QEMU sets it right: served again
    served(fe)


def test_a_command_over_48_two_byte_descriptors_is_gathered(fe, server):
    request = ctx_create(7, name=b"tiny")  # 96 bytes
    pieces = [request[i : i + 2] for i in range(0, len(request), 2)]
    for i, piece in enumerate(pieces):
        fe.write(REQ + 0x100 * i, piece)  # scattered, not contiguous
        fe.write_desc(0, i, REQ + 0x100 * i, 2, F_NEXT, i + 1)
    fe.write_desc(0, len(pieces), RESP, 24, F_WRITE)
    fe.publish(0, 0)
    fe.kick_queue(0)
    assert fe.wait_used(0, 0, timeout=10) == 24
    assert resp_type(fe.read(RESP, 24)) == OK
    assert server.session.device.contexts[7].name == "tiny"
    served(fe)


# --- resources across contexts and VMs --------------------------------------------------------
def test_a_blob_attached_elsewhere_goes_with_its_creating_context(busy):
    srv, fe, contexts = busy
    for ctx in (1, 2):
        assert resp_type(fe.command(ctx_create(ctx))) == OK
    assert resp_type(fe.command(create_blob(5, 8192, ctx_id=1))) == OK
    assert resp_type(fe.command(res_cmd(T.CMD_CTX_ATTACH_RESOURCE, 5, ctx_id=2))) == OK
    wait_for(lambda: 5 in contexts[2].resources, what="attached to context 2")
    assert resp_type(fe.command(ctx_destroy(1))) == OK
    wait_for(lambda: 5 not in contexts[2].resources, what="context 2 let go")
    assert resp_type(fe.command(map_blob(5, 0, ctx_id=2))) == T.RESP_ERR_INVALID_RESOURCE_ID
    assert resp_type(fe.command(res_cmd(T.CMD_CTX_ATTACH_RESOURCE, 5, ctx_id=2))) == T.RESP_ERR_INVALID_RESOURCE_ID
    wait_for(lambda: srv.counts().blobs == 0, what="the blob's memory freed")
    assert resp_type(fe.command(res_cmd(T.CMD_RESOURCE_UNREF, 5))) == OK
    assert resp_type(fe.command(res_cmd(T.CMD_RESOURCE_UNREF, 5))) == T.RESP_ERR_INVALID_RESOURCE_ID
    assert srv.session.device.resources == {}


def test_another_vms_resource_ids_mean_nothing(make_server):
    a_srv, b_srv = make_server("a.sock"), make_server("b.sock")
    a, b = FakeFrontend.connect(a_srv.path), FakeFrontend.connect(b_srv.path)
    try:
        for fe in (a, b):
            assert resp_type(fe.command(ctx_create(1))) == OK
        assert resp_type(a.command(create_blob(5, 8192))) == OK
        assert resp_type(b.command(res_cmd(T.CMD_CTX_ATTACH_RESOURCE, 5, ctx_id=1))) == T.RESP_ERR_INVALID_RESOURCE_ID
        assert resp_type(b.command(map_blob(5, 0))) == T.RESP_ERR_INVALID_RESOURCE_ID
        assert resp_type(b.command(res_cmd(T.CMD_RESOURCE_UNREF, 5))) == T.RESP_ERR_INVALID_RESOURCE_ID
        assert a_srv.counts().blobs == 1 and b_srv.counts().blobs == 0
        assert resp_type(a.command(map_blob(5, 0))) == T.RESP_OK_MAP_INFO
    finally:
        a.close()
        b.close()


def test_fences_on_a_context_destroyed_mid_compute_are_all_answered_in_order(busy):
    srv, fe, contexts = busy
    assert resp_type(fe.command(ctx_create(1))) == OK
    fenced = dict(flags=1)  # VIRTIO_GPU_FLAG_FENCE, timeline (ctx 1, ring 0)
    slots = [fe.post(submit(1, b"x", fence_id=1, **fenced))]
    wait_for(lambda: contexts[1].busy.is_set(), what="context 1 computing")
    slots.append(fe.post(ctx_destroy(1, fence_id=2, **fenced)))
    slots.append(fe.post(submit(1, b"y", fence_id=3, **fenced)))
    answers = [resp_type(fe.wait(s, timeout=30)) for s in slots]
    assert answers == [OK, OK, T.RESP_ERR_INVALID_CONTEXT_ID]
    used = GPA_BASE + RING_OFFSETS[0][2]
    order = [struct.unpack("<I", fe.read(used + 4 + 8 * ((fe.used_seen[0] - 3 + i) % 64), 4))[0] for i in range(3)]
    assert order == [2 * s for s in slots]
    assert srv.counts().contexts == 0
    served(fe)


# --- deadlines: a message begun must end in time ---------------------------------------------
def _trickle(path: str, data: bytes, stop: threading.Event) -> socket.socket:
    """A front-end sending `data` a byte every 50 ms until `stop` (or the device hangs up)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)

    def run():
        for b in data:
            if stop.wait(0.05):
                return
            try:
                sock.send(bytes([b]))
            except OSError:
                return

    threading.Thread(target=run, daemon=True).start()
    return sock


@pytest.mark.parametrize("what", ["header", "payload"])
def test_a_message_trickled_a_byte_at_a_time_has_a_deadline(make_server, what):
    """Each byte comes well within any per-recv timeout; the message as a whole does not come
    within apir.vhost.message_timeout_s, and the session ends, freeing the socket's slot."""
    server = make_server(config={"apir.vhost.message_timeout_s": "0.5"})
    header = vu.HEADER.pack(vu.Request.SET_FEATURES, vu.FLAG_VERSION, 8 if what == "header" else 4096)
    data = header if what == "header" else header + bytes(4096)
    stop = threading.Event()
    sock = _trickle(server.path, data[:-1] if what == "header" else data, stop)
    try:
        wait_for(lambda: server.sessions_served == 1, timeout=30, what="the trickling front-end dropped")
    finally:
        stop.set()
        sock.close()
    fe = FakeFrontend.connect(server.path)  # the next front-end is served
    try:
        assert resp_type(fe.command(hdr(T.CMD_GET_DISPLAY_INFO), 24 + 16 * 24)) == T.RESP_OK_DISPLAY_INFO
    finally:
        fe.close()


def test_an_idle_front_end_is_not_dropped(make_server):
    """The deadline starts at a message's first byte: a VM with nothing to say keeps its session."""
    server = make_server(config={"apir.vhost.message_timeout_s": "0.2"})
    fe = FakeFrontend.connect(server.path)
    try:
        time.sleep(0.5)
        assert server.sessions_served == 0
        assert resp_type(fe.command(hdr(T.CMD_GET_DISPLAY_INFO), 24 + 16 * 24)) == T.RESP_OK_DISPLAY_INFO
    finally:
        fe.close()


def test_a_front_end_that_never_reads_its_replies_is_dropped(make_server):
    """Requests that each have a reply, sent without reading one: once the socket's buffers
    are full the device's send would wait for good; it waits apir.vhost.message_timeout_s."""
    server = make_server(config={"apir.vhost.message_timeout_s": "0.5"})
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(server.path)
    sock.settimeout(0.2)
    stop = threading.Event()
    request = vu.HEADER.pack(vu.Request.GET_FEATURES, vu.FLAG_VERSION, 0)

    def flood():
        while not stop.is_set():
            try:
                sock.send(request * 64)
            except socket.timeout:
                continue
            except OSError:
                return

    threading.Thread(target=flood, daemon=True).start()
    try:
        wait_for(lambda: server.sessions_served == 1, timeout=60, what="the front-end that never reads dropped")
    finally:
        stop.set()
        sock.close()
