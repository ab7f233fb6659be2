"""Contexts run on their own workers: a long compute stalls neither the queue, the vhost-user
channel, nor another context; fenced responses keep fence order; teardown cancels."""

import struct
import threading

import pytest

from apir.codec.virtgpu import VirtioGpuCtrlType as T
from apir.host.vhost_user import protocol as vu

from .conftest import wait_for
from .frontend import FakeFrontend, hdr, resp_type
from .gpu import create_blob, ctx_create, ctx_destroy, submit

OK = T.RESP_OK_NODATA


class SlowContext:
    """A HostContext stand-in: a b"block" command runs until cancel_compute (or 30 s)."""

    def __init__(self, ctx_id, log):
        self.ctx_id = ctx_id
        self.log = log
        self.release = threading.Event()
        self.resources = {}

    def add_resource(self, res_id, memory):
        self.resources[res_id] = memory

    def remove_resource(self, res_id):
        self.resources.pop(res_id, None)

    def submit(self, command):
        self.log.append((self.ctx_id, bytes(command)))
        if bytes(command) == b"block":
            self.release.wait(30)

    def cancel_compute(self, reason):
        self.release.set()

    def close(self):
        self.log.append((self.ctx_id, "closed"))


@pytest.fixture
def slow(make_server):
    log, contexts = [], {}

    def factory(ctx_id, capset_id, config):
        contexts[ctx_id] = SlowContext(ctx_id, log)
        return contexts[ctx_id]

    srv = make_server(context_factory=factory)
    fe = FakeFrontend.connect(srv.path)
    yield srv, fe, log, contexts
    for c in contexts.values():
        c.release.set()
    fe.close()


def test_a_blocked_context_stalls_nothing_else(slow):
    srv, fe, log, contexts = slow
    assert resp_type(fe.command(ctx_create(1))) == OK
    assert resp_type(fe.command(ctx_create(2))) == OK
    blocked = fe.post(submit(1, b"block"))
    wait_for(lambda: (1, b"block") in log)
    # the control queue, another context and the vhost-user channel go on
    assert resp_type(fe.command(hdr(T.CMD_GET_DISPLAY_INFO))) == T.RESP_OK_DISPLAY_INFO
    assert resp_type(fe.command(submit(2, b"quick"))) == OK
    assert resp_type(fe.command(create_blob(9, 4096, ctx_id=2))) == OK
    assert fe.ack(vu.Request.SET_VRING_ENABLE, vu.VRING_STATE.pack(0, 1)) == 0
    assert 2 * blocked not in fe.done[0]
    # destroying the blocked context cancels its compute; both are answered
    destroy = fe.post(ctx_destroy(1))
    assert resp_type(fe.wait(blocked)) == OK
    assert resp_type(fe.wait(destroy)) == OK
    assert log[-1] == (1, "closed")
    assert srv.counts().contexts == 1


def test_fenced_responses_keep_fence_order(slow):
    srv, fe, log, contexts = slow
    assert resp_type(fe.command(ctx_create(1))) == OK
    first = fe.post(submit(1, b"block", flags=1, fence_id=1))
    wait_for(lambda: (1, b"block") in log)
    second = fe.post(hdr(T.CMD_GET_DISPLAY_INFO, flags=1, fence_id=2))
    unfenced = fe.command(hdr(T.CMD_GET_DISPLAY_INFO))  # not on a timeline: answered at once
    assert resp_type(unfenced) == T.RESP_OK_DISPLAY_INFO
    fe.reap(0)
    assert 2 * second not in fe.done[0]  # fence 2 waits for fence 1
    contexts[1].release.set()
    assert struct.unpack_from("<IIQ", fe.wait(first)) == (OK, 1, 1)
    assert struct.unpack_from("<IIQ", fe.wait(second))[2] == 2


def test_ring_timelines_are_independent(slow):
    srv, fe, log, contexts = slow
    for ctx in (1, 2):
        assert resp_type(fe.command(ctx_create(ctx))) == OK
    blocked = fe.post(submit(1, b"block", flags=3, fence_id=1, ring_idx=0))
    wait_for(lambda: (1, b"block") in log)
    data = fe.command(submit(2, b"x", flags=3, fence_id=1, ring_idx=0))
    assert struct.unpack_from("<IIQIB", data) == (OK, 3, 1, 2, 0)
    contexts[1].release.set()
    assert resp_type(fe.wait(blocked)) == OK


def test_losing_the_front_end_mid_compute_cancels_and_frees(slow):
    srv, fe, log, contexts = slow
    assert resp_type(fe.command(ctx_create(1))) == OK
    assert resp_type(fe.command(create_blob(3, 1 << 20))) == OK
    fe.post(submit(1, b"block"))
    wait_for(lambda: (1, b"block") in log)
    device = srv.session.device
    fe.close()
    wait_for(lambda: srv.sessions_served == 1, what="session end")
    assert contexts[1].release.is_set()  # cancelled, not waited out
    assert log[-1] == (1, "closed")
    c = device.counts()
    assert (c.contexts, c.closing_contexts, c.blobs, c.blob_bytes) == (0, 0, 0, 0)


def test_a_front_end_that_never_acks_shmem_map_fails_the_map_not_the_device(make_server):
    srv = make_server(config={"apir.vhost.backend_timeout_s": "0.5"})
    fe = FakeFrontend.connect(srv.path)
    try:
        assert resp_type(fe.command(ctx_create(1))) == OK
        assert resp_type(fe.command(create_blob(1, 4096))) == OK
        fe.shmem_status = 1  # refused
        from .gpu import map_blob

        assert resp_type(fe.command(map_blob(1, 0))) == T.RESP_ERR_UNSPEC
        fe.shmem_status = -1  # never answered
        assert resp_type(fe.command(map_blob(1, 0))) == T.RESP_ERR_UNSPEC
        assert resp_type(fe.command(hdr(T.CMD_GET_DISPLAY_INFO))) == T.RESP_OK_DISPLAY_INFO
    finally:
        fe.close()


def test_commands_queued_on_one_context_are_bounded(slow, monkeypatch):
    from apir.host.vhost_user import gpu_device

    monkeypatch.setattr(gpu_device, "MAX_PENDING_SUBMITS", 3)
    srv, fe, log, contexts = slow
    assert resp_type(fe.command(ctx_create(1))) == OK
    slots = [fe.post(submit(1, b"block"))]
    wait_for(lambda: (1, b"block") in log)
    slots += [fe.post(submit(1, b"x")) for _ in range(2)]
    assert resp_type(fe.command(submit(1, b"x"))) == T.RESP_ERR_OUT_OF_MEMORY
    contexts[1].release.set()
    assert [resp_type(fe.wait(s)) for s in slots] == [OK] * 3
    assert resp_type(fe.command(submit(1, b"x"))) == OK


def test_a_chain_finishing_after_its_ring_stopped_is_not_written(slow):
    srv, fe, log, contexts = slow
    assert resp_type(fe.command(ctx_create(1))) == OK
    fe.post(submit(1, b"block"))
    wait_for(lambda: (1, b"block") in log)
    used = fe.used_idx(0)
    reply = fe.request(vu.Request.GET_VRING_BASE, vu.VRING_STATE.pack(0, 0))  # QEMU stops the ring
    contexts[1].release.set()
    worker = srv.session.device.contexts[1].worker
    wait_for(lambda: worker.pending == 0, what="the submit finished")
    assert fe.used_idx(0) == used  # the old ring incarnation is not written to
    base = vu.VRING_STATE.unpack(reply.payload)[1]
    assert fe.ack(vu.Request.SET_VRING_BASE, vu.VRING_STATE.pack(0, base)) == 0
    assert fe.ack(vu.Request.SET_VRING_KICK, vu.U64.pack(0), fds=[fe.kick[0]]) == 0
    assert resp_type(fe.command(hdr(T.CMD_GET_DISPLAY_INFO))) == T.RESP_OK_DISPLAY_INFO
