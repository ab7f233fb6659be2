"""apir.host.vhost_user.process_limits at its bounds, by a front-end that plays by the rules:
SET_MEM_TABLE replaces the table, so what the old table held is not counted twice."""

import struct

from apir.host.vhost_user import protocol as vu
from apir.host.vhost_user.process_limits import MEM_BYTES, MEM_REGIONS

from .frontend import GPA_BASE, MEM_SIZE, UVA_BASE, FakeFrontend


def test_a_table_sent_again_at_the_front_ends_bounds_is_taken(make_server):
    """QEMU sends SET_MEM_TABLE again whenever its memory map changes: the new table replaces
    the old one, so a front-end whose table takes more than half of its bound must still be
    able to send it again."""
    config = {"apir.vhost.max_mem_regions": "1", "apir.vhost.max_mem_bytes": str(MEM_SIZE + MEM_SIZE // 2)}
    server = make_server(config=config)
    fe = FakeFrontend.connect(server.path)
    try:
        share = server.session.memory.share
        assert (share.held[MEM_REGIONS], share.held[MEM_BYTES]) == (1, MEM_SIZE)
        fe.setup_memory()  # (asserts the REPLY_ACK is 0)
        assert (share.held[MEM_REGIONS], share.held[MEM_BYTES]) == (1, MEM_SIZE)
        assert server.session.memory.region_count == 1
    finally:
        fe.close()


def test_a_replacing_table_past_the_bounds_is_refused_and_the_old_one_kept(make_server):
    config = {"apir.vhost.max_mem_regions": "1"}
    server = make_server(config=config)
    fe = FakeFrontend.connect(server.path)
    try:
        half = MEM_SIZE // 2
        table = struct.pack("<II", 2, 0) + b"".join(
            vu.MEMORY_REGION.pack(GPA_BASE + i * half, half, UVA_BASE + i * half, i * half) for i in (0, 1)
        )
        assert fe.ack(vu.Request.SET_MEM_TABLE, table, fds=[fe.mem_fd, fe.mem_fd]) != 0
        share = server.session.memory.share
        assert (share.held[MEM_REGIONS], share.held[MEM_BYTES]) == (1, MEM_SIZE)
        assert server.session.memory.region_count == 1
    finally:
        fe.close()
