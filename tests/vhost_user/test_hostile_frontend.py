"""A hostile front-end (QEMU replaced by something that wants the host process down): every
malformed set-up message is refused through the vhost-user error path (a failed REPLY_ACK),
the session goes on, and nothing the front-end holds can make the host touch memory that is
gone (SIGBUS)."""

import gc
import os
import struct
import time

import pytest

from apir.codec.virtgpu import VirtioGpuCtrlType as T
from apir.host.vhost_user import protocol as vu
from tests.fdkit import fds_on, target

from .conftest import wait_for
from .frontend import GPA_BASE, MEM_SIZE, UVA_BASE, hdr, resp_type
from .gpu import create_blob, ctx_create, map_blob, res_cmd, submit

OK = T.RESP_OK_NODATA


def _still_serving(fe) -> None:
    assert resp_type(fe.command(hdr(T.CMD_GET_DISPLAY_INFO), 24 + 16 * 24)) == T.RESP_OK_DISPLAY_INFO


@pytest.mark.parametrize(
    "size, offset",
    [
        (1 << 63, 0),  # a length mmap cannot take (over ssize_t)
        ((1 << 64) - GPA_BASE - MEM_SIZE, 0),  # the largest size that does not wrap the address
        (4096, 1 << 63),  # an offset over off_t
        (4096, (1 << 64) - 4096 * 2),
    ],
)
def test_add_mem_reg_with_a_size_or_offset_mmap_cannot_take_is_refused(fe, server, size, offset):
    region = struct.pack("<Q", 0) + vu.MEMORY_REGION.pack(GPA_BASE + MEM_SIZE, size, UVA_BASE + MEM_SIZE, offset)
    assert fe.ack(vu.Request.ADD_MEM_REG, region, fds=[fe.mem_fd]) != 0
    assert server.session.memory.region_count == 1
    _still_serving(fe)


def test_set_mem_table_with_a_size_mmap_cannot_take_is_refused_and_the_old_table_stays(fe, server):
    table = struct.pack("<II", 1, 0) + vu.MEMORY_REGION.pack(GPA_BASE, 1 << 63, UVA_BASE, 0)
    assert fe.ack(vu.Request.SET_MEM_TABLE, table, fds=[fe.mem_fd]) != 0
    assert server.session.memory.region_count == 1
    _still_serving(fe)


def test_the_front_end_cannot_shrink_or_grow_a_blob_it_was_given(fe, server):
    # SHMEM_MAP hands QEMU the blob's memfd. Truncated, every host access to the blob (the
    # HostContext's tensors live there) would raise SIGBUS and kill the host process.
    assert resp_type(fe.command(ctx_create(1))) == OK
    assert resp_type(fe.command(create_blob(5, 8192))) == OK
    assert resp_type(fe.command(map_blob(5, 0))) == T.RESP_OK_MAP_INFO
    blob = server.session.device.resources[5]
    fd = os.dup(blob.fd)  # the same open file the front-end received
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 1 << 30)
        assert os.fstat(fd).st_size == 8192
    finally:
        os.close(fd)
    blob.mm[8191] = 7  # the last page is still there
    assert fe.bar[0][8191] == 7


def test_a_kick_descriptor_numbered_past_fd_setsize_is_served(fe, server):
    # The host's descriptors numbered past 1024 (a guest holding ~500 blobs gets there: a
    # memfd and its mapping's descriptor each; here the test holds them), where select()
    # cannot wait: a ring started again (a VM pause, a reboot) must still be served, not leave
    # a dead queue thread.
    vq = server.session.queues[0]
    base = fe.stop_queue(0)
    wait_for(lambda: not vq.retired_kicks, what="the old kick descriptor closed")
    held = []
    # Every number up to 1100 is held until the host has received the kick descriptor (the
    # lowest free number): an earlier test's socket the collector closed meanwhile would leave
    # one free below 1024 (CI's descriptor count of another test met such a collection)
    gc.collect()
    gc.disable()
    try:
        while True:
            held.append(os.dup(0))
            if held[-1] > 1100:
                break
        fe.restart_queue(0, base)
        assert vq.kick_fd is not None and vq.kick_fd > 1024
        for _ in range(3):  # each once the queue thread waits on the kicks again
            time.sleep(0.2)
            data = fe.command(hdr(T.CMD_GET_DISPLAY_INFO), 24 + 16 * 24, timeout=5)
            assert resp_type(data) == T.RESP_OK_DISPLAY_INFO
    finally:
        gc.enable()
        for fd in held:
            os.close(fd)


def test_attach_detach_loops_against_a_busy_context_are_bounded(busy, monkeypatch):
    # Each ATTACH / DETACH posts a job on the context's worker; while it computes, a guest
    # looping the two must not grow the host's queue (and memory) without bound.
    from apir.host.vhost_user import gpu_device

    monkeypatch.setattr(gpu_device, "MAX_PENDING_JOBS", 8, raising=False)
    srv, fe, contexts = busy
    for ctx in (1, 2):
        assert resp_type(fe.command(ctx_create(ctx))) == OK
    assert resp_type(fe.command(create_blob(5, 4096, ctx_id=2))) == OK
    blocked = fe.post(submit(1, b"block"))
    wait_for(contexts[1].busy.is_set, what="context 1 computing")
    worker = srv.session.device.contexts[1].worker
    answers = []
    for _ in range(20):
        answers.append(resp_type(fe.command(res_cmd(T.CMD_CTX_ATTACH_RESOURCE, 5, ctx_id=1))))
        answers.append(resp_type(fe.command(res_cmd(T.CMD_CTX_DETACH_RESOURCE, 5, ctx_id=1))))
    assert worker.pending <= 8
    assert T.RESP_ERR_OUT_OF_MEMORY in answers and answers[:6] == [OK] * 6
    contexts[1].release.set()
    assert resp_type(fe.wait(blocked)) == OK
    wait_for(lambda: worker.pending == 0, what="the worker drained")
    # served again, and the blob's bookkeeping is whole: attach, then the memory goes only
    # once both contexts let go of it
    assert resp_type(fe.command(res_cmd(T.CMD_CTX_ATTACH_RESOURCE, 5, ctx_id=1))) == OK
    wait_for(lambda: 5 in contexts[1].resources, what="attached")
    assert resp_type(fe.command(res_cmd(T.CMD_RESOURCE_UNREF, 5))) == OK
    wait_for(lambda: srv.counts().blobs == 0, what="blob freed")
    assert 5 not in contexts[1].resources and 5 not in contexts[2].resources


def test_a_backend_req_fd_that_is_not_a_socket_is_refused_and_closed(fe, server):
    # Each refused descriptor left open would let a front-end run the host (every VM it
    # serves) out of descriptors.
    pipes = []
    for _ in range(20):
        r, w = os.pipe()
        try:
            pipes.append(target(r))
            assert fe.ack(vu.Request.SET_BACKEND_REQ_FD, b"", fds=[r]) != 0
        finally:
            os.close(r)
            os.close(w)
    assert fds_on(pipes) == []  # the device closed each copy it was sent
    _still_serving(fe)
