"""A fake vhost-user front-end: plays QEMU (and the guest kernel's virtqueue side) over the
device's Unix socket, with no VM.

`FakeFrontend.connect(path)` negotiates features as QEMU 11.1 does, shares a memfd as guest
RAM (SET_MEM_TABLE), puts both vrings in it with kick/call eventfds, and serves the back-end
channel: a SHMEM_MAP's memfd is mapped into `bar` (the host-visible region, offset -> mmap),
acked with 0 (or with `shmem_status`). `command(request, resp_size)` sends one control command
as a two-descriptor chain and returns the response bytes; `post` / `wait` do the same without
waiting, and the raw methods (`write_desc`, `publish`, `kick`) craft any chain.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import select
import socket
import struct
import threading
import time
from typing import Dict, List, Optional, Tuple

from apir.host.vhost_user import protocol as vu
from apir.host.vhost_user.gpu_wire import CTRL_HDR

GPA_BASE = 0x4000_0000
UVA_BASE = 0x7F00_0000_0000  # QEMU's address of guest RAM (any number: only translated)
MEM_SIZE = 32 << 20
QUEUE_SIZE = 64
RING_OFFSETS = [(0x0000, 0x1000, 0x2000), (0x3000, 0x4000, 0x5000)]  # desc, avail, used
SLOT_BASE = 0x10000
REQ_AREA = 0x20000  # 128 KiB request area per slot
RESP_AREA = 0x1000
SLOT_SIZE = REQ_AREA + RESP_AREA
SLOTS = QUEUE_SIZE // 2
FREE_BASE = SLOT_BASE + SLOTS * SLOT_SIZE  # guest pages for GUEST blobs and crafted buffers

F_NEXT, F_WRITE, F_INDIRECT = 1, 2, 4


# QEMU's memory-backend-memfd seals guest RAM so (seal=on, its default): the device maps it
QEMU_SEALS = fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL


def guest_ram(size: int, sealed: bool = True) -> int:
    """A memfd of `size` bytes as guest RAM: sealed as QEMU's memory-backend-memfd seals it, or
    (`sealed=False`) a file the front-end can still truncate, as memory-backend-file's (the
    device then reads and writes it with pread / pwrite)."""
    fd = os.memfd_create("fake-guest-ram", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if sealed:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, QEMU_SEALS)
    return fd


class FakeFrontend:
    def __init__(self, sock: socket.socket, sealed: bool = True):
        """`sealed`: guest RAM as `guest_ram` makes it."""
        self.sock = sock
        self.mem_fd = guest_ram(MEM_SIZE, sealed)
        self.mem = mmap.mmap(self.mem_fd, MEM_SIZE)
        self.kick = [os.eventfd(0), os.eventfd(0)]
        self.call = [os.eventfd(0, os.EFD_NONBLOCK), os.eventfd(0, os.EFD_NONBLOCK)]
        self.avail_idx = [0, 0]
        self.used_seen = [0, 0]
        self.done: List[Dict[int, int]] = [{}, {}]  # head -> bytes written
        self.free_slots = list(range(SLOTS))
        self.bar: Dict[int, mmap.mmap] = {}  # host-visible region offset -> mapping
        self.backend_requests: List[Tuple[int, tuple]] = []
        self.shmem_status = 0
        self.shmem_config: Optional[bytes] = None
        self.features = 0
        self.protocol_features = 0
        self._backend_sock, self._peer_backend = socket.socketpair()
        self._stop = False
        self._backend_thread = threading.Thread(target=self._serve_backend, daemon=True)
        self._backend_thread.start()

    # --- vhost-user messages ----------------------------------------------------------------
    def request(self, req: int, payload: bytes = b"", fds=(), need_reply: bool = False) -> Optional[vu.Message]:
        """Sends one message; returns the reply when the request has one (or need_reply)."""
        flags = vu.FLAG_NEED_REPLY if need_reply else 0
        vu.send_message(self.sock, req, flags, payload, fds)
        replying = {
            vu.Request.GET_FEATURES,
            vu.Request.GET_PROTOCOL_FEATURES,
            vu.Request.GET_QUEUE_NUM,
            vu.Request.GET_MAX_MEM_SLOTS,
            vu.Request.GET_VRING_BASE,
            vu.Request.GET_CONFIG,
            vu.Request.GET_SHMEM_CONFIG,
        }
        if req in replying or need_reply:
            self.sock.settimeout(10)
            msg = vu.recv_message(self.sock)
            self.sock.settimeout(None)
            assert msg.request == req and msg.flags & vu.FLAG_REPLY, (req, msg)
            return msg
        return None

    def ack(self, req: int, payload: bytes = b"", fds=()) -> int:
        """Sends with NEED_REPLY; the REPLY_ACK status (0: done)."""
        msg = self.request(req, payload, fds, need_reply=True)
        assert msg is not None
        return vu.U64.unpack(msg.payload)[0]

    @classmethod
    def connect(cls, path: str, queue_size: int = QUEUE_SIZE, sealed: bool = True) -> "FakeFrontend":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        fe = cls(sock, sealed)
        fe.negotiate()
        fe.setup_memory()
        for q in (0, 1):
            fe.setup_queue(q, queue_size)
        return fe

    def negotiate(self) -> None:
        R = vu.Request
        features = vu.U64.unpack(self.request(R.GET_FEATURES).payload)[0]  # type: ignore[union-attr]
        self.features = features
        self.request(R.SET_FEATURES, vu.U64.pack(features))
        proto = vu.U64.unpack(self.request(R.GET_PROTOCOL_FEATURES).payload)[0]  # type: ignore[union-attr]
        self.protocol_features = proto
        self.request(R.SET_PROTOCOL_FEATURES, vu.U64.pack(proto))
        assert vu.U64.unpack(self.request(R.GET_QUEUE_NUM).payload)[0] == 2  # type: ignore[union-attr]
        assert self.ack(R.SET_BACKEND_REQ_FD, fds=[self._peer_backend.fileno()]) == 0
        self._peer_backend.close()
        self.shmem_config = self.request(R.GET_SHMEM_CONFIG).payload  # type: ignore[union-attr]

    def setup_memory(self) -> None:
        region = struct.pack("<II", 1, 0) + vu.MEMORY_REGION.pack(GPA_BASE, MEM_SIZE, UVA_BASE, 0)
        assert self.ack(vu.Request.SET_MEM_TABLE, region, fds=[self.mem_fd]) == 0

    def setup_queue(self, q: int, num: int) -> None:
        R = vu.Request
        desc, avail, used = RING_OFFSETS[q]
        assert self.ack(R.SET_VRING_NUM, vu.VRING_STATE.pack(q, num)) == 0
        assert self.ack(R.SET_VRING_BASE, vu.VRING_STATE.pack(q, 0)) == 0
        addr = vu.VRING_ADDR.pack(q, 0, UVA_BASE + desc, UVA_BASE + used, UVA_BASE + avail, 0)
        assert self.ack(R.SET_VRING_ADDR, addr) == 0
        assert self.ack(R.SET_VRING_CALL, vu.U64.pack(q), fds=[self.call[q]]) == 0
        assert self.ack(R.SET_VRING_KICK, vu.U64.pack(q), fds=[self.kick[q]]) == 0
        assert self.ack(R.SET_VRING_ENABLE, vu.VRING_STATE.pack(q, 1)) == 0

    def stop_queue(self, q: int) -> int:
        """GET_VRING_BASE: QEMU stops the ring (VM paused or device reset); the base."""
        reply = self.request(vu.Request.GET_VRING_BASE, vu.VRING_STATE.pack(q, 0))
        assert reply is not None
        return vu.VRING_STATE.unpack(reply.payload)[1]

    def restart_queue(self, q: int, base: int) -> None:
        """SET_VRING_BASE + SET_VRING_KICK: QEMU starts the ring again at `base`."""
        assert self.ack(vu.Request.SET_VRING_BASE, vu.VRING_STATE.pack(q, base)) == 0
        assert self.ack(vu.Request.SET_VRING_KICK, vu.U64.pack(q), fds=[self.kick[q]]) == 0

    def reset_driver(self) -> None:
        """What a rebooted guest's driver does: both rings stopped, zeroed and started at 0."""
        for q in (0, 1):
            self.stop_queue(q)
            desc, avail, used = RING_OFFSETS[q]
            self.write(GPA_BASE + desc, bytes(0x3000))
            self.avail_idx[q] = self.used_seen[q] = 0
            self.done[q] = {}
            self.restart_queue(q, 0)
        self.free_slots = list(range(SLOTS))

    # --- the back-end channel (QEMU's side) ---------------------------------------------------
    def _serve_backend(self) -> None:
        sock = self._backend_sock
        while not self._stop:
            try:
                r, _, _ = select.select([sock], [], [], 0.2)
                if not r:
                    continue
                msg = vu.recv_message(sock)
            except (OSError, vu.ProtocolError, ValueError):
                return
            fields = vu.SHMEM_MAP.unpack_from(msg.payload) if len(msg.payload) >= vu.SHMEM_MAP.size else ()
            self.backend_requests.append((msg.request, fields))
            status = self.shmem_status
            if msg.request == vu.BackendRequest.SHMEM_MAP and status == 0:
                shmid, fd_offset, shm_offset, length, _flags = fields
                fd = msg.take_fd()
                assert fd is not None
                self.bar[shm_offset] = mmap.mmap(fd, length, offset=fd_offset)
                os.close(fd)
            elif msg.request == vu.BackendRequest.SHMEM_UNMAP and status == 0:
                mm = self.bar.pop(fields[2], None)
                if mm is not None:
                    try:
                        mm.close()
                    except BufferError:
                        pass
            msg.close_fds()
            if msg.need_reply and status >= 0:  # status < 0: never answer (a hung QEMU)
                try:
                    vu.send_message(sock, msg.request, vu.FLAG_REPLY, vu.U64.pack(status))
                except OSError:
                    return

    # --- guest memory -------------------------------------------------------------------------
    def write(self, gpa: int, data: bytes) -> None:
        off = gpa - GPA_BASE
        self.mem[off : off + len(data)] = data

    def read(self, gpa: int, n: int) -> bytes:
        off = gpa - GPA_BASE
        return bytes(self.mem[off : off + n])

    # --- raw ring access ----------------------------------------------------------------------
    def write_desc(self, q: int, index: int, addr: int, length: int, flags: int = 0, nxt: int = 0) -> None:
        desc = RING_OFFSETS[q][0]
        self.write(GPA_BASE + desc + 16 * index, struct.pack("<QIHH", addr, length, flags, nxt))

    def publish(self, q: int, head: int) -> None:
        """Puts `head` in the avail ring and bumps avail.idx (no kick)."""
        avail = GPA_BASE + RING_OFFSETS[q][1]
        self.write(avail + 4 + 2 * (self.avail_idx[q] % QUEUE_SIZE), struct.pack("<H", head))
        self.avail_idx[q] = (self.avail_idx[q] + 1) & 0xFFFF
        self.write(avail + 2, struct.pack("<H", self.avail_idx[q]))

    def set_avail_idx(self, q: int, value: int) -> None:
        self.write(GPA_BASE + RING_OFFSETS[q][1] + 2, struct.pack("<H", value & 0xFFFF))

    def kick_queue(self, q: int) -> None:
        os.eventfd_write(self.kick[q], 1)

    def reap(self, q: int) -> None:
        used = GPA_BASE + RING_OFFSETS[q][2]
        used_idx = struct.unpack("<H", self.read(used + 2, 2))[0]
        while self.used_seen[q] != used_idx:
            slot = self.used_seen[q] % QUEUE_SIZE
            head, written = struct.unpack("<II", self.read(used + 4 + 8 * slot, 8))
            self.done[q][head] = written
            self.used_seen[q] = (self.used_seen[q] + 1) & 0xFFFF

    def wait_used(self, q: int, head: int, timeout: float = 30.0) -> int:
        """Bytes the device wrote for chain `head` (waits on the call eventfd)."""
        deadline = time.monotonic() + timeout
        while True:
            self.reap(q)
            if head in self.done[q]:
                return self.done[q].pop(head)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"queue {q}: chain {head} not used within {timeout} s")
            select.select([self.call[q]], [], [], min(left, 0.5))
            try:
                os.eventfd_read(self.call[q])
            except BlockingIOError:
                pass

    def used_idx(self, q: int) -> int:
        return struct.unpack("<H", self.read(GPA_BASE + RING_OFFSETS[q][2] + 2, 2))[0]

    # --- commands -----------------------------------------------------------------------------
    def post(self, request: bytes, resp_size: int = 4096, q: int = 0) -> int:
        """Sends `request` as chain (readable request, writable response); returns its slot."""
        assert len(request) <= REQ_AREA and resp_size <= RESP_AREA
        slot = self.free_slots.pop(0)
        req_gpa = GPA_BASE + SLOT_BASE + slot * SLOT_SIZE
        resp_gpa = req_gpa + REQ_AREA
        self.write(req_gpa, request)
        self.write(resp_gpa, bytes(resp_size))
        head = 2 * slot
        self.write_desc(q, head, req_gpa, len(request), F_NEXT, head + 1)
        self.write_desc(q, head + 1, resp_gpa, resp_size, F_WRITE)
        self.publish(q, head)
        self.kick_queue(q)
        return slot

    def wait(self, slot: int, timeout: float = 30.0, q: int = 0) -> bytes:
        written = self.wait_used(q, 2 * slot, timeout)
        resp_gpa = GPA_BASE + SLOT_BASE + slot * SLOT_SIZE + REQ_AREA
        data = self.read(resp_gpa, written)
        self.free_slots.append(slot)
        return data

    def command(self, request: bytes, resp_size: int = 4096, timeout: float = 30.0) -> bytes:
        return self.wait(self.post(request, resp_size), timeout)

    def close(self) -> None:
        if self._stop:
            return
        self._stop = True
        try:
            self.sock.close()
        except OSError:
            pass
        self._backend_thread.join(2)
        self._backend_sock.close()
        for fd in self.kick + self.call:
            os.close(fd)
        for mm in self.bar.values():
            try:
                mm.close()
            except BufferError:
                pass
        self.bar.clear()
        try:
            self.mem.close()
        except BufferError:
            pass
        os.close(self.mem_fd)


def hdr(ctrl_type: int, ctx_id: int = 0, flags: int = 0, fence_id: int = 0, ring_idx: int = 0) -> bytes:
    return CTRL_HDR.pack(ctrl_type, flags, fence_id, ctx_id, ring_idx)


def resp_type(data: bytes) -> int:
    assert len(data) >= CTRL_HDR.size, data
    return CTRL_HDR.unpack_from(data)[0]
