"""The vhost-user device's front-end messages and virtqueues, fuzzed.

The target is a `VhostUserServer` (apir.host.vhost_user) in the fuzzer's child, with real
HostContexts. An input is one hostile front-end (tests/vhost_user/frontend.py's
`FakeFrontend`, driven step by step): QEMU's set-up messages (features, memory table, the two
vrings, the back-end channel) with mutated fields, requests and flags, descriptors missing,
extra or of the wrong kind; then chains on the queues carrying virtio-gpu commands (contexts,
HOST3D and GUEST blobs, maps, submits of APIR commands) and chains that are not (loops,
addresses outside guest memory or across a region's end, huge or zero lengths, indirect
tables, readable after writable, heads past the ring, avail indices that jump), interleaved
with mid-session messages (ADD/REM_MEM_REG, SET_MEM_TABLE, GET_VRING_BASE, RESET_DEVICE).

Before it leaves, the front-end posts a GET_DISPLAY_INFO: while its rings are as set up and
the avail index never jumped, the device must answer it (every chain before it was used or
refused in order; else `no-reply`). The oracle after it leaves: a fresh front-end, an
`ApirClient` over it (tests/vhost_user/guest_driver.py), is served; no descriptor or thread is
left.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import List

from apir.codec.constants import ApirCommandType
from apir.codec.virtgpu import VirtioGpuCtrlType as T
from apir.host.vhost_user import protocol as vu
from tests.fuzz.protokit import FD_KINDS, INTERESTING_U64, Outcome, Target, close_all, make_fds, settle
from tests.vhost_user import gpu
from tests.vhost_user.frontend import (
    F_INDIRECT,
    F_NEXT,
    F_WRITE,
    FREE_BASE,
    GPA_BASE,
    MEM_SIZE,
    QUEUE_SIZE,
    REQ_AREA,
    RING_OFFSETS,
    SLOT_BASE,
    SLOT_SIZE,
    SLOTS,
    UVA_BASE,
    FakeFrontend,
    guest_ram,
    hdr,
)

R = vu.Request
_REPLYING = {
    R.GET_FEATURES,
    R.GET_PROTOCOL_FEATURES,
    R.GET_QUEUE_NUM,
    R.GET_MAX_MEM_SLOTS,
    R.GET_VRING_BASE,
    R.GET_CONFIG,
    R.GET_SHMEM_CONFIG,
}
SENTINEL_WAIT_S = 15.0  # a chain ahead of it may be a graph (the host bounds it to 5 s)
RESP = 4096
RES_IDS = [1, 2, 5, 0, 0xFFFFFFFF]


def _pick(rng, seq):
    return seq[int(rng.integers(len(seq)))]


def _u64(rng) -> int:
    return _pick(rng, INTERESTING_U64) if rng.random() < 0.7 else int(rng.integers(0, 1 << 63))


def _addr(rng) -> int:
    """A guest-physical address: inside guest memory mostly, else at and past its edges."""
    if rng.random() < 0.6:
        return GPA_BASE + FREE_BASE + int(rng.integers(0, 1 << 20))
    return _pick(rng, [0, GPA_BASE - 16, GPA_BASE + MEM_SIZE - 8, GPA_BASE + MEM_SIZE, 1 << 63, (1 << 64) - 8])


def _gpu_command(rng) -> bytes:
    """A virtio-gpu control request, well formed mostly, with its fields from the edges."""
    ctx = _pick(rng, [1, 1, 1, 2, 0, 0xFFFFFFFF])
    res = _pick(rng, RES_IDS)
    r = rng.random()
    if r < 0.12:
        cmd = gpu.ctx_create(
            ctx, capset=_pick(rng, [10, 10, 4, 0, 255]), nlen=_pick(rng, [None, None, 0, 64, 65, 1 << 31])
        )
    elif r < 0.17:
        cmd = gpu.ctx_destroy(ctx)
    elif r < 0.35:
        mem = _pick(rng, [gpu.HOST3D, gpu.HOST3D, gpu.GUEST, 3, 0])
        entries = [(_addr(rng), _pick(rng, [4096, 16384, 0, 1 << 31])) for _ in range(_pick(rng, [0, 1, 2, 4]))]
        size = _pick(rng, [16384, 4096, 65536]) if rng.random() < 0.6 else _u64(rng)
        nr = None if rng.random() < 0.8 else _pick(rng, [0, 5, 1 << 20, 0xFFFFFFFF])
        flags = _pick(rng, [gpu.MAPPABLE, gpu.MAPPABLE, 0, 2, 7])
        cmd = gpu.create_blob(res, size, ctx, mem=mem, flags=flags, entries=entries, nr=nr)
    elif r < 0.45:
        cmd = gpu.map_blob(res, _pick(rng, [0, 0, 16384, 1 << 20, (64 << 20) - 4096, 64 << 20, _u64(rng)]), ctx)
    elif r < 0.52:
        cmd = gpu.res_cmd(_pick(rng, [T.CMD_RESOURCE_UNMAP_BLOB, T.CMD_RESOURCE_UNREF]), res, ctx)
    elif r < 0.6:
        cmd = gpu.res_cmd(_pick(rng, [T.CMD_CTX_ATTACH_RESOURCE, T.CMD_CTX_DETACH_RESOURCE]), res, ctx)
    elif r < 0.8:
        kind = _pick(rng, [ApirCommandType.HANDSHAKE, ApirCommandType.LOADLIBRARY, ApirCommandType.FORWARD])
        body = struct.pack("<II", 0, 2) if kind == ApirCommandType.HANDSHAKE else rng.bytes(int(rng.integers(0, 24)))
        apir = struct.pack("<III", int(kind), int(rng.integers(0, 40)), res) + body
        size = None if rng.random() < 0.85 else _pick(rng, [0, len(apir) + 1, 1 << 20, 0xFFFFFFFF])
        cmd = gpu.submit(ctx, apir, size=size)
    elif r < 0.88:
        cmd = hdr(_pick(rng, [T.CMD_GET_DISPLAY_INFO, T.CMD_GET_CAPSET_INFO, T.CMD_GET_CAPSET, T.CMD_GET_EDID]), ctx)
        cmd += struct.pack("<II", int(rng.integers(0, 3)), 0)
    else:
        cmd = hdr(_pick(rng, [0, 0x0101, 0x0105, 0x0300, 0x1100, 0xFFFFFFFF]), ctx) + rng.bytes(
            int(rng.integers(0, 64))
        )
    if rng.random() < 0.1:
        cmd = cmd[: int(rng.integers(0, len(cmd)))]
    return cmd


def _chain(rng, slot: int) -> dict:
    """A chain on queue 0 in `slot`'s descriptors and buffers: request + response, or a
    mutated shape."""
    req_gpa = GPA_BASE + SLOT_BASE + slot * SLOT_SIZE
    resp_gpa = req_gpa + REQ_AREA
    request = _gpu_command(rng)
    head = 2 * slot
    descs = [[head, req_gpa, len(request), F_NEXT, head + 1], [head + 1, resp_gpa, RESP, F_WRITE, 0]]
    shape = "plain"
    if rng.random() < 0.3:
        shape = _pick(rng, ["loop", "addr", "len", "indirect", "order", "head", "split", "noresp", "straddle"])
        if shape == "loop":
            descs[1] = [head + 1, resp_gpa, RESP, F_WRITE | F_NEXT, _pick(rng, [head, head + 1])]
        elif shape == "addr":
            k = int(rng.integers(2))
            descs[k][1] = _addr(rng)
        elif shape == "len":
            k = int(rng.integers(2))
            descs[k][2] = _pick(rng, [0, 1, REQ_AREA + 1, 1 << 20, 0xFFFFFFFF])
        elif shape == "indirect":  # a table in guest memory, as a driver with INDIRECT_DESC would
            table = GPA_BASE + FREE_BASE + (2 << 20) + slot * 256
            descs[0] = [
                head,
                table,
                _pick(rng, [32, 16, 0, 17, 1 << 20]),
                F_INDIRECT | _pick(rng, [0, F_NEXT]),
                head + 1,
            ]
            entries = struct.pack("<QIHH", req_gpa, len(request), F_NEXT, 1) + struct.pack(
                "<QIHH", resp_gpa, RESP, F_WRITE, 0
            )
            return {
                "op": "chain",
                "slot": slot,
                "shape": shape,
                "request": request.hex(),
                "descs": descs,
                "head": head,
                "extra": [[table, entries.hex()]],
            }
        elif shape == "order":
            descs = [[head, resp_gpa, RESP, F_WRITE | F_NEXT, head + 1], [head + 1, req_gpa, len(request), 0, 0]]
        elif shape == "head":
            head = _pick(rng, [QUEUE_SIZE, QUEUE_SIZE + 1, 0xFFFF])
        elif shape == "split":  # the request one byte per descriptor (as far as the slot's two go)
            descs = [
                [head, req_gpa, 1, F_NEXT, head + 1],
                [head + 1, req_gpa + 1, max(0, len(request) - 1), F_NEXT, head],
            ]
        elif shape == "noresp":
            descs = [[head, req_gpa, len(request), 0, 0]]
        elif shape == "straddle":
            descs[0][1] = GPA_BASE + MEM_SIZE - 4
    return {"op": "chain", "slot": slot, "shape": shape, "request": request.hex(), "descs": descs, "head": head}


def _setup(rng) -> List[dict]:
    """QEMU's set-up, each message at times mutated."""
    steps = [
        {"op": "vu", "req": R.GET_FEATURES, "reply": True},
        {"op": "vu", "req": R.SET_FEATURES, "payload": "features"},
        {"op": "vu", "req": R.GET_PROTOCOL_FEATURES, "reply": True},
        {"op": "vu", "req": R.SET_PROTOCOL_FEATURES, "payload": "protocol"},
        {"op": "vu", "req": R.GET_QUEUE_NUM, "reply": True},
        {"op": "vu", "req": R.SET_BACKEND_REQ_FD, "fds": ["backend"], "ack": True},
        {"op": "vu", "req": R.GET_SHMEM_CONFIG, "reply": True},
        {
            "op": "vu",
            "req": R.SET_MEM_TABLE,
            "ack": True,
            "fds": ["ram"],
            "payload": (struct.pack("<II", 1, 0) + vu.MEMORY_REGION.pack(GPA_BASE, MEM_SIZE, UVA_BASE, 0)).hex(),
        },
    ]
    for q in (0, 1):
        desc, avail, used = RING_OFFSETS[q]
        steps += [
            {"op": "vu", "req": R.SET_VRING_NUM, "ack": True, "payload": vu.VRING_STATE.pack(q, QUEUE_SIZE).hex()},
            {"op": "vu", "req": R.SET_VRING_BASE, "ack": True, "payload": vu.VRING_STATE.pack(q, 0).hex()},
            {
                "op": "vu",
                "req": R.SET_VRING_ADDR,
                "ack": True,
                "payload": vu.VRING_ADDR.pack(q, 0, UVA_BASE + desc, UVA_BASE + used, UVA_BASE + avail, 0).hex(),
            },
            {"op": "vu", "req": R.SET_VRING_CALL, "ack": True, "payload": vu.U64.pack(q).hex(), "fds": [f"call{q}"]},
            {"op": "vu", "req": R.SET_VRING_KICK, "ack": True, "payload": vu.U64.pack(q).hex(), "fds": [f"kick{q}"]},
            {"op": "vu", "req": R.SET_VRING_ENABLE, "ack": True, "payload": vu.VRING_STATE.pack(q, 1).hex()},
        ]
    if rng.random() < 0.4:
        for _ in range(int(rng.integers(1, 4))):
            k = int(rng.integers(len(steps)))
            steps[k] = _mutate_message(rng, dict(steps[k]))
    return steps


def _hostile_message(rng) -> dict:
    """A mid-session message: memory regions, ring state, resets, anything."""
    r = rng.random()
    if r < 0.3:
        gpa = _pick(rng, [GPA_BASE + MEM_SIZE, GPA_BASE, 0, 1 << 40, GPA_BASE - 4096])
        size = _pick(rng, [1 << 20, 4096, MEM_SIZE, 0, 1 << 40])
        payload = struct.pack("<Q", 0) + vu.MEMORY_REGION.pack(
            gpa, size, _pick(rng, [UVA_BASE + MEM_SIZE, UVA_BASE, 0]), _pick(rng, [0, 4096, 1 << 20])
        )
        step = {
            "op": "vu",
            "req": _pick(rng, [R.ADD_MEM_REG, R.ADD_MEM_REG, R.REM_MEM_REG]),
            "ack": True,
            "payload": payload.hex(),
            "fds": [_pick(rng, ["ram2", "ram2", "ram", "memfd0"])],
        }
    elif r < 0.4:
        n = _pick(rng, [1, 2, 0, 9])
        regions = [
            vu.MEMORY_REGION.pack(GPA_BASE + k * MEM_SIZE, MEM_SIZE, UVA_BASE + k * MEM_SIZE, 0) for k in range(n)
        ]
        step = {
            "op": "vu",
            "req": R.SET_MEM_TABLE,
            "ack": True,
            "fds": ["ram"] * min(n, 8),
            "payload": (struct.pack("<II", n, 0) + b"".join(regions)).hex(),
        }
    elif r < 0.55:
        q = _pick(rng, [0, 1, 2, 255])
        req = _pick(rng, [R.SET_VRING_NUM, R.SET_VRING_BASE, R.GET_VRING_BASE, R.SET_VRING_ENABLE])
        step = {
            "op": "vu",
            "req": req,
            "ack": req != R.GET_VRING_BASE,
            "reply": req == R.GET_VRING_BASE,
            "payload": vu.VRING_STATE.pack(q, _pick(rng, [0, 1, 3, QUEUE_SIZE, 32768, 65535, 1 << 31])).hex(),
        }
    elif r < 0.65:
        q = _pick(rng, [0, 1, 3])
        a = [_pick(rng, [UVA_BASE, UVA_BASE + MEM_SIZE - 8, 0, 1 << 63, UVA_BASE + 1]) for _ in range(3)]
        step = {"op": "vu", "req": R.SET_VRING_ADDR, "ack": True, "payload": vu.VRING_ADDR.pack(q, 0, *a, 0).hex()}
    elif r < 0.75:
        q = _pick(rng, [0, 1, 5])
        nofd = rng.random() < 0.3
        step = {
            "op": "vu",
            "req": _pick(rng, [R.SET_VRING_KICK, R.SET_VRING_CALL, R.SET_VRING_ERR]),
            "ack": True,
            "payload": vu.U64.pack(q | (vu.VRING_NOFD if nofd else 0)).hex(),
            "fds": [] if nofd else [_pick(rng, FD_KINDS + [f"kick{q % 2}", f"call{q % 2}"])],
        }
    elif r < 0.85:
        step = {
            "op": "vu",
            "req": _pick(
                rng,
                [
                    R.RESET_DEVICE,
                    R.RESET_OWNER,
                    R.SET_OWNER,
                    R.SET_STATUS,
                    R.GET_STATUS,
                    R.GET_CONFIG,
                    R.SET_CONFIG,
                    R.SET_LOG_BASE,
                    R.GET_MAX_MEM_SLOTS,
                ],
            ),
            "ack": True,
            "payload": rng.bytes(_pick(rng, [0, 8, 12, 40])).hex(),
        }
    else:
        step = {
            "op": "vu",
            "req": _pick(rng, [0, 99, 0xFFFFFFFF] + [int(x) for x in R]),
            "ack": rng.random() < 0.5,
            "payload": rng.bytes(int(rng.integers(0, 64))).hex(),
        }
    step["hostile"] = True
    return _mutate_message(rng, step) if rng.random() < 0.3 else step


def _mutate_message(rng, step: dict) -> dict:
    m = _pick(rng, ["fds", "nofds", "payload", "flags", "size", "req"])
    step["mutation"] = m
    if m == "fds":
        step["fds"] = list(step.get("fds", [])) + [_pick(rng, FD_KINDS) for _ in range(_pick(rng, [1, 2, 8, 9]))]
    elif m == "nofds":
        step["fds"] = []
    elif m == "payload":
        p = step.get("payload")
        data = bytearray(bytes.fromhex(p) if isinstance(p, str) and p not in ("features", "protocol") else rng.bytes(8))
        if data and rng.random() < 0.5:
            data = data[: int(rng.integers(0, len(data)))]
        else:
            for _ in range(int(rng.integers(1, 4))):
                if data:
                    data[int(rng.integers(len(data)))] = int(rng.integers(256))
        step["payload"] = bytes(data).hex()
    elif m == "flags":
        step["flags"] = _pick(rng, [0, 2, 3, vu.FLAG_REPLY | 1, 0xFFFFFFFF])
    elif m == "size":  # the header's size lies (the session may end: framing)
        step["size"] = _pick(rng, [vu.MAX_PAYLOAD + 1, 0, 1, 0xFFFFFFFF])
    elif m == "req":
        step["req"] = _pick(rng, [0, 45, 99] + [int(x) for x in R])
    return step


class _Hostile(FakeFrontend):
    """A FakeFrontend that sends what the steps say and owns every descriptor it makes."""

    def __init__(self, path: str):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(path)
        super().__init__(sock, sealed=True)
        self.ram2 = guest_ram(1 << 20)
        self.dropped = False
        self.sane = True  # rings as set up, avail index in step: the device must answer
        self.acks = False  # REPLY_ACK negotiated: NEED_REPLY messages are answered
        self.chains = 0  # chains posted
        self.outcome = Outcome()

    def fd(self, name: str, made: List[int]) -> int:
        fixed = {
            "ram": self.mem_fd,
            "ram2": self.ram2,
            "kick0": self.kick[0],
            "kick1": self.kick[1],
            "call0": self.call[0],
            "call1": self.call[1],
            "backend": self._peer_backend.fileno(),
        }
        if name in fixed:
            return fixed[name]
        made += make_fds([name])
        return made[-1]

    def message(self, step: dict) -> None:
        if self.dropped:
            return
        payload = step.get("payload", "")
        if payload == "features":
            payload = vu.U64.pack(self.features).hex()
        elif payload == "protocol":
            payload = vu.U64.pack(self.protocol_features).hex()
        data = bytes.fromhex(payload)
        made: List[int] = []
        fds: List[int] = []
        flags = step.get("flags", vu.FLAG_VERSION | (vu.FLAG_NEED_REPLY if step.get("ack") else 0))
        try:
            fds = [self.fd(n, made) for n in step.get("fds", [])]
            size = step.get("size", len(data))
            msg = vu.HEADER.pack(step["req"] & 0xFFFFFFFF, flags & 0xFFFFFFFF, size & 0xFFFFFFFF) + data
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))] if fds else []
            sent = self.sock.sendmsg([msg], anc)
            if sent < len(msg):
                self.sock.sendall(msg[sent:])
        except OSError:
            self.dropped = True
            return
        finally:
            close_all(made)
        if step.get("hostile") or "mutation" in step:
            self.sane = False
        if "size" in step or (flags & 3) != vu.FLAG_VERSION or len(fds) > vu.MAX_FDS:
            self.dropped = True  # framing broken: the device ends the session
            return
        if step["req"] == R.SET_PROTOCOL_FEATURES:
            self.acks = "mutation" not in step and bool(self.protocol_features & (1 << vu.ProtocolFeature.REPLY_ACK))
        replying = step["req"] in _REPLYING
        if replying or (flags & vu.FLAG_NEED_REPLY and self.acks):
            self._read_reply(10.0 if self.sane else 2.0)

    def _read_reply(self, timeout_s: float) -> None:
        self.sock.settimeout(timeout_s)
        try:
            msg = vu.recv_message(self.sock)
        except (OSError, vu.ProtocolError):
            # the session ended, or this message is not one the device answers as we
            # thought: the stream is out of step, and this front-end stops here
            self.dropped = True
            return
        msg.close_fds()
        if msg.request == R.GET_FEATURES and len(msg.payload) >= 8:
            self.features = vu.U64.unpack_from(msg.payload)[0]
        if msg.request == R.GET_PROTOCOL_FEATURES and len(msg.payload) >= 8:
            self.protocol_features = vu.U64.unpack_from(msg.payload)[0]

    def chain(self, step: dict) -> None:
        if self.dropped:
            return
        slot = step["slot"]
        req_gpa = GPA_BASE + SLOT_BASE + slot * SLOT_SIZE
        self.write(req_gpa, bytes.fromhex(step["request"]))
        self.write(req_gpa + REQ_AREA, bytes(RESP))
        for gpa, data in step.get("extra", []):
            self.write(gpa, bytes.fromhex(data))
        for index, addr, length, flags, nxt in step["descs"]:
            if index < QUEUE_SIZE:
                self.write_desc(0, index, addr & (2**64 - 1), length & 0xFFFFFFFF, flags, nxt & 0xFFFF)
        self.publish(0, step["head"] & 0xFFFF)
        self.kick_queue(0)
        self.chains += 1

    def avail(self, step: dict) -> None:
        self.sane = False
        self.set_avail_idx(0, step["value"])
        self.kick_queue(0)

    def sentinel(self) -> None:
        """GET_DISPLAY_INFO in a slot of its own: answered once every chain before it was."""
        if self.dropped:
            return
        slot = SLOTS - 1
        head = 2 * slot
        req_gpa = GPA_BASE + SLOT_BASE + slot * SLOT_SIZE
        self.write(req_gpa, hdr(T.CMD_GET_DISPLAY_INFO))
        self.write_desc(0, head, req_gpa, 24, F_NEXT, head + 1)
        self.write_desc(0, head + 1, req_gpa + REQ_AREA, RESP, F_WRITE)
        self.publish(0, head)
        self.kick_queue(0)
        try:
            self.wait_used(0, head, SENTINEL_WAIT_S if self.sane else 0.3)
            self.outcome.computed = self.chains + 1  # every chain before it was got through
        except TimeoutError:
            if self.sane:
                self.outcome.no_reply += 1

    def close(self) -> None:
        super().close()
        close_all([self.ram2])
        try:
            self._peer_backend.close()
        except OSError:
            pass


class VhostTarget(Target):
    name = "vhost"

    def __init__(self, config: dict, workdir: str):
        from apir.host.vhost_user import VhostUserServer

        self.path = os.path.join(workdir, "vgpu.sock")
        self.server = VhostUserServer(self.path, config=config, shm_size=64 << 20).start()

    def generate(self, rng):
        steps = _setup(rng)
        case = "mutated-setup" if any("mutation" in s for s in steps) else "setup"
        slot = 0
        for _ in range(int(rng.integers(1, 20))):
            r = rng.random()
            if r < 0.7:
                steps.append(_chain(rng, slot))
                slot = (slot + 1) % (SLOTS - 1)
            elif r < 0.9:
                steps.append(_hostile_message(rng))
            elif r < 0.95:
                steps.append({"op": "avail", "value": int(rng.integers(0, 1 << 16))})
            else:
                steps.append(
                    {
                        "op": "write",
                        "gpa": GPA_BASE + _pick(rng, [0, 0x1000, 0x2000, 0x1002]),
                        "data": rng.bytes(_pick(rng, [2, 8, 64])).hex(),
                    }
                )
        steps.append({"op": "end", "sentinel": rng.random() < 0.9})
        return case, steps

    def run(self, steps):
        fe = _Hostile(self.path)
        try:
            for step in steps:
                kind = step["op"]
                if kind == "vu":
                    fe.message(step)
                elif kind == "chain":
                    fe.chain(step)
                elif kind == "avail":
                    fe.avail(step)
                elif kind == "write":
                    fe.sane = False
                    fe.write(step["gpa"], bytes.fromhex(step["data"]))
                elif kind == "end" and step["sentinel"]:
                    fe.sentinel()
        finally:
            fe.close()
        return fe.outcome

    def check(self):
        """A fresh front-end and an APIR client over it are served; the VM's state goes with it."""
        from apir.guest.client import ApirClient
        from tests.vhost_user.guest_driver import FrontendDriver

        failures: List[str] = []
        alive = False
        if not settle(lambda: self.server.session is None, 15):
            failures.append("session-stays the hostile front-end's session did not end")
            return False, failures
        fe = None
        try:
            fe = FakeFrontend.connect(self.path)
            client = ApirClient.connect(FrontendDriver(fe), data_size=65536, handshake_timeout_s=30)
            try:
                alive = client.device_get_count() >= 1
            finally:
                client.close()
            counts = self.server.counts()
            if (counts.contexts, counts.blobs, counts.blob_bytes) != (0, 0, 0):
                failures.append(f"held-after-close {counts}")
        except Exception as exc:  # noqa: BLE001 - any failure of a well-behaved front-end is the finding
            failures.append(f"not-serving {type(exc).__name__}: {exc}")
        finally:
            if fe is not None:
                fe.close()
        if not settle(lambda: self.server.session is None, 15):
            failures.append("session-stays a well-behaved front-end's session did not end")
        return alive, failures

    def close(self):
        self.server.close()
