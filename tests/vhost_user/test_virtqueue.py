"""Crafted descriptor chains: every one gets an error (or an empty used element), the device
reads nothing outside guest memory, and the next command is served."""

import struct

import pytest

from apir.codec.virtgpu import VirtioGpuCtrlType as T
from apir.host.vhost_user import protocol as vu

from .frontend import F_INDIRECT, F_NEXT, F_WRITE, FREE_BASE, GPA_BASE, MEM_SIZE, hdr, resp_type

REQ = GPA_BASE + FREE_BASE
RESP = REQ + 0x1000
DISPLAY = hdr(T.CMD_GET_DISPLAY_INFO)


def still_served(fe):
    assert resp_type(fe.command(DISPLAY)) == T.RESP_OK_DISPLAY_INFO


def send_chain(fe, descs, head=40):
    """Writes descriptors head, head+1, ... (addr, len, flags, next) and publishes head."""
    fe.write(REQ, DISPLAY)
    fe.write(RESP, bytes(64))
    for i, (addr, length, flags, nxt) in enumerate(descs):
        fe.write_desc(0, head + i, addr, length, flags, nxt)
    fe.publish(0, head)
    fe.kick_queue(0)
    return fe.wait_used(0, head, timeout=10)


CHAINS = [
    # (name, descriptors with head 40, written bytes expected)
    ("loop", [(REQ, 24, F_NEXT, 40)], 0),
    ("loop of empty descriptors", [(REQ, 0, F_NEXT, 41), (REQ, 0, F_NEXT, 40)], 0),
    ("next index past the ring", [(REQ, 24, F_NEXT, 64)], 0),
    ("indirect", [(REQ, 24, F_INDIRECT | F_NEXT, 41), (RESP, 512, F_WRITE, 0)], 0),
    ("huge length", [(REQ, 0xFFFFFFFF, F_NEXT, 41), (RESP, 64, F_WRITE, 0)], 0),
    ("request outside guest memory", [(0x1000, 24, F_NEXT, 41), (RESP, 64, F_WRITE, 0)], 24),
    ("request runs off guest memory", [(GPA_BASE + MEM_SIZE - 8, 24, F_NEXT, 41), (RESP, 64, F_WRITE, 0)], 24),
    ("request address wraps", [(2**64 - 8, 24, F_NEXT, 41), (RESP, 64, F_WRITE, 0)], 24),
    ("response outside guest memory", [(REQ, 24, F_NEXT, 41), (0x2000, 4096, F_WRITE, 0)], 0),
    ("response buffer too small", [(REQ, 24, F_NEXT, 41), (RESP, 8, F_WRITE, 0)], 0),
    ("readable after writable", [(RESP, 64, F_WRITE | F_NEXT, 41), (REQ, 24, 0, 0)], 24),
    ("no response buffer", [(REQ, 24, 0, 0)], 0),
]


@pytest.mark.parametrize("descs,written", [c[1:] for c in CHAINS], ids=[c[0] for c in CHAINS])
def test_crafted_chains(fe, descs, written):
    assert send_chain(fe, descs) == written
    if written:
        data = fe.read(RESP, written)
        assert resp_type(data) in (T.RESP_ERR_INVALID_PARAMETER, T.RESP_ERR_UNSPEC)
    still_served(fe)


def test_head_index_past_the_ring(fe):
    fe.publish(0, 1000)
    fe.kick_queue(0)
    assert fe.wait_used(0, 1000, timeout=10) == 0
    still_served(fe)


def test_request_split_over_descriptors_is_gathered(fe):
    # GET_CAPSET_INFO's header and body in two readable descriptors, response in two writable
    fe.write(REQ, hdr(T.CMD_GET_CAPSET_INFO))
    fe.write(REQ + 0x800, struct.pack("<II", 0, 0))
    descs = [
        (REQ, 24, F_NEXT, 41),
        (REQ + 0x800, 8, F_NEXT, 42),
        (RESP, 10, F_WRITE | F_NEXT, 43),
        (RESP + 0x100, 30, F_WRITE, 0),
    ]
    for i, d in enumerate(descs):
        fe.write_desc(0, 40 + i, *d)
    fe.publish(0, 40)
    fe.kick_queue(0)
    assert fe.wait_used(0, 40) == 40
    data = fe.read(RESP, 10) + fe.read(RESP + 0x100, 30)
    assert resp_type(data) == T.RESP_OK_CAPSET_INFO
    assert struct.unpack_from("<III", data, 24) == (10, 0, 24)


def test_avail_index_far_ahead_breaks_the_ring_not_the_device(fe, server):
    used_before = fe.used_idx(0)
    fe.set_avail_idx(0, fe.avail_idx[0] + 1000)
    fe.kick_queue(0)
    # the front-end channel is still served; the ring stops until it is set up again
    reply = fe.request(vu.Request.GET_VRING_BASE, vu.VRING_STATE.pack(0, 0))
    assert vu.VRING_STATE.unpack(reply.payload) == (0, fe.avail_idx[0])
    assert fe.used_idx(0) == used_before
    fe.set_avail_idx(0, fe.avail_idx[0])
    assert fe.ack(vu.Request.SET_VRING_BASE, vu.VRING_STATE.pack(0, fe.avail_idx[0])) == 0
    assert fe.ack(vu.Request.SET_VRING_KICK, vu.U64.pack(0), fds=[fe.kick[0]]) == 0
    still_served(fe)


def test_cursor_queue_commands_are_consumed(fe):
    cursor = hdr(T.CMD_UPDATE_CURSOR) + bytes(32)
    fe.write(REQ, cursor)
    fe.write_desc(1, 0, REQ, len(cursor))
    fe.publish(1, 0)
    fe.kick_queue(1)
    assert fe.wait_used(1, 0) == 0
    fe.write_desc(1, 1, 0x10, 4096)  # outside guest memory: consumed all the same
    fe.publish(1, 1)
    fe.kick_queue(1)
    assert fe.wait_used(1, 1) == 0
    still_served(fe)


class _Memory:
    """Guest memory as a bytearray (what Virtqueue uses of GuestMemory)."""

    def __init__(self, size=0x4000):
        self.buf = bytearray(size)

    def read(self, gpa, n):
        return bytes(self.buf[gpa : gpa + n])

    def write(self, gpa, data):
        self.buf[gpa : gpa + len(data)] = data

    def read_into(self, gpa, out, pos, n):
        out[pos : pos + n] = self.buf[gpa : gpa + n]


def _ring(num=8):
    from apir.host.vhost_user.virtqueue import Virtqueue

    mem = _Memory()
    vq = Virtqueue(0, mem, 1 << 20)
    vq.set_num(num)
    vq.set_addresses(desc=0, used=0x1000, avail=0x800)
    vq.set_kick(None)
    mem.write(16 * 3, struct.pack("<QIHH", 0x2000, 24, 0, 0))  # descriptor 3: one readable buffer
    return vq, mem


def _make_available(mem, *heads):
    idx = struct.unpack_from("<H", mem.buf, 0x802)[0]
    for head in heads:
        struct.pack_into("<H", mem.buf, 0x804 + 2 * (idx % 8), head)
        idx += 1
    struct.pack_into("<H", mem.buf, 0x802, idx)


def test_a_chain_made_available_again_while_in_flight_is_refused_not_queued_again():
    """A guest re-posting one fenced chain behind a long compute made the device pop it (and
    queue a job and a fenced response) again and again: memory grew without bound. A head is
    in flight from pop to push; made available again meanwhile, it is an error."""
    from apir.host.vhost_user.virtqueue import QueueError

    vq, mem = _ring()
    _make_available(mem, 3, 3, 3)
    chain = vq.pop()
    assert chain.head == 3
    with pytest.raises(QueueError, match="in flight"):
        vq.pop()
    assert vq.pop() is None  # the ring is broken: nothing more is popped until it is set up again
    assert vq.push(chain, 0)  # the chain in flight still completes


def test_a_chain_used_may_be_made_available_again():
    vq, mem = _ring()
    for _ in range(20):  # more than the ring's size: heads are reused as a driver does
        _make_available(mem, 3)
        chain = vq.pop()
        assert chain.head == 3
        assert vq.push(chain, 0)
    assert vq.pop() is None


def test_a_restarted_ring_forgets_the_chains_in_flight_before():
    vq, mem = _ring()
    _make_available(mem, 3)
    stale = vq.pop()
    vq.stop()
    vq.set_kick(None)  # the ring restarts: chains popped before are dropped on push
    _make_available(mem, 3)
    assert vq.pop().head == 3
    assert not vq.push(stale, 0)
