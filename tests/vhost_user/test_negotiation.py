"""vhost-user negotiation and set-up messages, against the fake front-end."""

import os
import socket
import struct

import pytest

from apir.codec.virtgpu import VirtioGpuCtrlType as T
from apir.host.vhost_user import protocol as vu
from apir.host.vhost_user.session import DEVICE_FEATURES, PROTOCOL_FEATURES

from .conftest import SHM_SIZE, wait_for
from .frontend import GPA_BASE, MEM_SIZE, UVA_BASE, FakeFrontend, hdr, resp_type
from .gpu import ctx_create


def test_features_are_what_qemu_11_acked(fe):
    assert fe.features == DEVICE_FEATURES
    # MQ, REPLY_ACK, BACKEND_REQ, CONFIG, CONFIGURE_MEM_SLOTS, SHMEM (bit 22): 0x408229
    assert fe.protocol_features == 0x408229 == PROTOCOL_FEATURES
    assert fe.features >> 32 & 1 and fe.features >> 30 & 1  # VERSION_1, PROTOCOL_FEATURES
    assert fe.features & 0b11001 == 0b11001  # VIRGL, RESOURCE_BLOB, CONTEXT_INIT


def test_shmem_config_names_the_host_visible_region(fe):
    nregions, _ = struct.unpack_from("<II", fe.shmem_config)
    sizes = struct.unpack_from("<256Q", fe.shmem_config, 8)
    assert nregions == 1 and sizes[1] == SHM_SIZE and sum(sizes) == SHM_SIZE


def test_config_space_has_one_scanout_and_the_capsets(make_server):
    srv = make_server(capsets=(10, 4))
    fe = FakeFrontend.connect(srv.path)
    try:
        reply = fe.request(vu.Request.GET_CONFIG, vu.CONFIG_HEADER.pack(0, 16, 0) + bytes(16))
        offset, size, _ = vu.CONFIG_HEADER.unpack_from(reply.payload)
        assert (offset, size) == (0, 16)
        assert struct.unpack_from("<IIII", reply.payload, 12) == (0, 0, 1, 2)
    finally:
        fe.close()


def test_refused_messages_are_acked_as_failures_and_the_session_goes_on(fe):
    R = vu.Request
    assert fe.ack(R.SET_VRING_NUM, vu.VRING_STATE.pack(2, 64)) != 0  # no queue 2
    assert fe.ack(R.SET_VRING_NUM, vu.VRING_STATE.pack(0, 100)) != 0  # not a power of 2
    assert fe.ack(R.SET_VRING_NUM, vu.VRING_STATE.pack(0, 65536)) != 0
    assert fe.ack(R.SET_FEATURES, vu.U64.pack(1 << 40)) != 0  # not offered
    assert fe.ack(R.SET_VRING_ADDR, vu.VRING_ADDR.pack(0, 0, 0x1000, 0x2000, 0x3000, 0)) != 0  # not guest memory
    assert fe.ack(R.SET_VRING_CALL, b"\x00") != 0  # short payload
    assert fe.ack(99) != 0  # unknown request
    region = struct.pack("<Q", 0) + vu.MEMORY_REGION.pack(GPA_BASE + 4096, 4096, UVA_BASE + 4096, 4096)
    assert fe.ack(R.ADD_MEM_REG, region, fds=[fe.mem_fd]) != 0  # overlaps guest RAM
    assert fe.ack(R.REM_MEM_REG, region) != 0  # no such region
    assert fe.ack(R.ADD_MEM_REG, region) != 0  # no descriptor
    # still serving
    assert resp_type(fe.command(hdr(T.CMD_GET_DISPLAY_INFO), 24 + 16 * 24)) == T.RESP_OK_DISPLAY_INFO


def test_add_and_remove_memory_regions(fe, server):
    R = vu.Request
    memory = server.session.memory
    region = struct.pack("<Q", 0) + vu.MEMORY_REGION.pack(GPA_BASE + MEM_SIZE, 8192, UVA_BASE + MEM_SIZE, 0)
    assert fe.ack(R.ADD_MEM_REG, region, fds=[fe.mem_fd]) == 0
    assert memory.region_count == 2
    assert memory.read(GPA_BASE + MEM_SIZE, 4) == fe.read(GPA_BASE, 4)  # same file, offset 0
    assert fe.ack(R.REM_MEM_REG, region) == 0
    assert memory.region_count == 1
    assert fe.request(R.GET_MAX_MEM_SLOTS).payload == vu.U64.pack(509)


def _raw(fe, data, fds=()):
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))] if fds else []
    fe.sock.sendmsg([data], anc)


@pytest.mark.parametrize(
    "name,data,nfds",
    [
        ("payload over the limit", vu.HEADER.pack(1, 1, vu.MAX_PAYLOAD + 1), 0),
        ("wrong version", vu.HEADER.pack(1, 2, 0), 0),
        ("too many descriptors", vu.HEADER.pack(vu.Request.SET_MEM_TABLE, 1, 0), vu.MAX_FDS + 2),
    ],
)
def test_broken_framing_ends_the_session_and_frees_it(server, name, data, nfds):
    fe = FakeFrontend.connect(server.path)
    try:
        assert resp_type(fe.command(ctx_create(1))) == T.RESP_OK_NODATA
        device = server.session.device
        fds = [os.dup(fe.mem_fd) for _ in range(nfds)]
        _raw(fe, data, fds)
        for fd in fds:
            os.close(fd)
        wait_for(lambda: server.sessions_served == 1, what="session end")
        assert device.counts().contexts == 0
    finally:
        fe.close()
    fe2 = FakeFrontend.connect(server.path)  # the next front-end is served
    fe2.close()
