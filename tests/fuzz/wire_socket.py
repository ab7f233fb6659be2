"""The socket host's framing, fuzzed: valid HELLO, then mutated message sequences.

The target is a `LocalServer` (what `apir host serve` runs) in the fuzzer's child, with real
HostContexts. An input is one hostile connection: mostly a valid opening (HELLO,
CONTEXT_INIT, a blob or two, HandShake and LoadLibrary in EXECBUFFERs), then messages of
every op (apir.local.wire) with mutated sizes, ops, header fields and payload bytes,
descriptors passed where none is expected (SCM_RIGHTS, more than the host's room for them),
payloads sent in pieces or cut short, pipelined requests (blobs by the hundred), other
connections of the same peer held idle or mid-HELLO, the exec ring's words and command
(apir.local.exec_ring) written behind the host's back, and an ending (close, half-close,
reset, leaving with a command in flight).

The peer models the host's rules: while the stream is whole, every request gets exactly one
reply, in order, with its op and seq (else `no-reply` / `reply-order`); after a HELLO the
host refuses or a message it cannot frame, it only reads until the peer leaves. The oracle
after the peer leaves: a fresh `ApirClient` over `LocalDevice` is served, the host holds no
context, blob or buffer (`LocalServer.stats`), and no descriptor or thread is left.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
from typing import List, Optional, Tuple

from apir.codec.constants import ApirBackendCommandType as Cmd, ApirCommandType
from apir.codec.virtgpu import (
    VIRTGPU_BLOB_FLAG_USE_MAPPABLE,
    VIRTGPU_BLOB_MEM_HOST3D,
    VIRTGPU_DRM_CAPSET_APIR,
    VIRTGPU_EXECBUF_RING_IDX,
)
from apir.local.socket_io import recv_message
from apir.local.wire import (
    HEADER,
    HELLO_MAGIC,
    MAX_PAYLOAD,
    MAX_RING_COMMAND,
    REQUEST,
    RING_COMMAND,
    RING_DONE,
    RING_ERR,
    RING_HEADER,
    RING_POLLING,
    RING_POSTED,
    RING_SIZE,
    WIRE_VERSION,
    Op,
)
from tests.fuzz.protokit import FD_KINDS, INTERESTING_U64, Outcome, Target, close_all, make_fds, settle

REPLY_WAIT_S = 20.0  # a reply may wait for a graph (bounded by the host's 5 s limit)
_FORWARD = int(ApirCommandType.FORWARD)
_CMDS = [int(c) for c in Cmd]


def _pick(rng, seq):
    return seq[int(rng.integers(len(seq)))]


def _u64(rng) -> int:
    return _pick(rng, INTERESTING_U64) if rng.random() < 0.7 else int(rng.integers(0, 1 << 63))


def _apir_command(rng) -> Tuple[bytes, bool]:
    """An APIR command for EXECBUFFER or the ring; whether its reply_res (offset 8) is to be
    patched with a blob of this connection."""
    r = rng.random()
    if r < 0.15:
        body, kind, flags = struct.pack("<II", 0, int(rng.integers(0, 4))), int(ApirCommandType.HANDSHAKE), 0
    elif r < 0.25:
        body, kind, flags = b"", int(ApirCommandType.LOADLIBRARY), 0
    elif r < 0.9:
        body = rng.bytes(int(rng.integers(0, 64)))
        kind, flags = _FORWARD, _pick(rng, _CMDS)
    else:
        body, kind, flags = (
            rng.bytes(int(rng.integers(0, 32))),
            int(rng.integers(0, 1 << 32)),
            int(rng.integers(0, 1 << 32)),
        )
    patch = rng.random() < 0.85
    return struct.pack("<III", kind, flags, 0 if patch else int(rng.integers(0, 8))) + body, patch


def _payload(rng, op: int) -> Tuple[bytes, Optional[int]]:
    """A well-formed payload of `op` (field values from the edges) and where, if anywhere,
    a res id is to be patched in."""
    if op == Op.HELLO:
        return REQUEST[Op.HELLO].pack(HELLO_MAGIC, WIRE_VERSION), None
    if op == Op.GETPARAM:
        return struct.pack("<Q", int(rng.integers(0, 12)) if rng.random() < 0.8 else _u64(rng)), None
    if op == Op.GET_CAPS:
        cap = _pick(rng, [VIRTGPU_DRM_CAPSET_APIR, 4, 0, 255, 1 << 31])
        return struct.pack("<IIII", cap, int(rng.random() < 0.2), _u64(rng) & 0xFFFFFFFF, 0), None
    if op == Op.CONTEXT_INIT:
        cap = VIRTGPU_DRM_CAPSET_APIR if rng.random() < 0.8 else _pick(rng, [4, 0, 11, 0xFFFFFFFF])
        rings = _pick(rng, [1, 1, 2, 0, 64, 65, 0xFFFFFFFF])
        return struct.pack("<IIQ", cap, rings, _u64(rng)), None
    if op == Op.CREATE_BLOB:
        mem = VIRTGPU_BLOB_MEM_HOST3D if rng.random() < 0.85 else int(rng.integers(0, 5))
        flags = VIRTGPU_BLOB_FLAG_USE_MAPPABLE if rng.random() < 0.85 else int(rng.integers(0, 8))
        size = _pick(rng, [16384, 65536, 4096, 1]) if rng.random() < 0.6 else _u64(rng)
        return struct.pack("<IIQQ", mem, flags, size, 0 if rng.random() < 0.9 else _u64(rng)), None
    if op in (Op.MAP, Op.GEM_CLOSE):
        bo = int(rng.integers(0, 6)) if rng.random() < 0.85 else int(rng.integers(0, 1 << 32))
        return struct.pack("<II", bo, 0), None
    if op == Op.EXECBUFFER:
        cmd, patch = _apir_command(rng)
        flags = 0 if rng.random() < 0.7 else _pick(rng, [VIRTGPU_EXECBUF_RING_IDX, 1, 0xFFFFFFFF])
        ring_idx = 0 if rng.random() < 0.8 else _pick(rng, [1, 63, 64, 0xFFFFFFFF])
        head = REQUEST[Op.EXECBUFFER].pack(flags, len(cmd), ring_idx, 0)
        return head + cmd, (len(head) + 8 if patch else None)
    return b"", None  # STAT, RING, KICK, unknown ops


def _message(rng, op: int, seq: int, mutate: bool) -> Tuple[dict, bool]:
    """One `send` step and whether the stream stays framed after it."""
    payload, patch = _payload(rng, op)
    length, err, framed, muts = len(payload), 0, True, []
    step: dict = {"op": "send", "wire_op": op, "seq": seq}
    if mutate:
        for _ in range(int(rng.integers(1, 3))):
            m = _pick(rng, ["cut", "grow", "flip", "op", "err", "len", "huge", "fds", "split", "seq"])
            muts.append(m)
            if m == "cut" and payload:
                payload = payload[: int(rng.integers(0, len(payload)))]
                patch = patch if patch is not None and patch + 4 <= len(payload) else None
            elif m == "grow":
                payload += rng.bytes(_pick(rng, [1, 4, 8, 100, 4096]))
            elif m == "flip" and payload:
                b = bytearray(payload)
                for _ in range(int(rng.integers(1, 4))):
                    b[int(rng.integers(len(b)))] ^= 1 << int(rng.integers(8))
                payload, patch = bytes(b), None
            elif m == "op":
                op = _pick(rng, [0, 12, 13, 255, 0xFFFFFFFF] + [int(o) for o in Op])
            elif m == "err":
                err = _pick(rng, [1, 22, 0xFFFFFFFF])
            elif m == "len":  # the header's length lies: the stream is out of step from here
                delta = _pick(rng, [-8, -1, 1, 8, 4096])
                if delta < 0 and len(payload) < -delta:
                    delta = 1
                length, framed = len(payload) + delta, False
            elif m == "huge":
                length, framed = _pick(rng, [MAX_PAYLOAD + 1, 1 << 24, 0xFFFFFFFF]), False
            elif m == "fds":
                step["fds"] = [_pick(rng, FD_KINDS) for _ in range(_pick(rng, [1, 1, 2, 4, 5, 8]))]
            elif m == "split":
                step["split"] = [int(x) for x in rng.integers(1, 24, size=int(rng.integers(1, 5)))]
            elif m == "seq":
                seq = int(rng.integers(0, 1 << 32))
    length = length if not framed else len(payload)
    step.update(
        wire_op=op,
        seq=seq,
        data=(HEADER.pack(op & 0xFFFFFFFF, err, length & 0xFFFFFFFF, seq & 0xFFFFFFFF) + payload).hex(),
        framed=framed,
        mutations=muts,
    )
    if patch is not None:
        step["patch_res"] = HEADER.size + patch
    return step, framed


def _ring_step(rng) -> dict:
    """Writes to the exec ring page: the guest's words and command, at times the host's too."""
    cmd, patch = _apir_command(rng)
    size = len(cmd) if rng.random() < 0.8 else _pick(rng, [0, MAX_RING_COMMAND, MAX_RING_COMMAND + 1, 0xFFFFFFFF])
    flags = 0 if rng.random() < 0.8 else _pick(rng, [VIRTGPU_EXECBUF_RING_IDX, 0xFFFFFFFF])
    words = [[RING_HEADER, flags], [RING_HEADER + 4, size & 0xFFFFFFFF], [RING_HEADER + 8, 0]]
    for _ in range(int(rng.integers(0, 3))):
        words.append([_pick(rng, [RING_DONE, RING_ERR, RING_POLLING, RING_HEADER + 12]), int(rng.integers(0, 1 << 32))])
    posted = _pick(rng, ["next", "next", "same", "zero", "random"])
    return {
        "op": "ring",
        "cmd": cmd.hex(),
        "patch_res": RING_COMMAND + 8 if patch else None,
        "words": words,
        "posted": posted,
    }


class _Peer:
    """The hostile connection, as the steps drive it."""

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(REPLY_WAIT_S)
        self.sock.connect(path)
        self.memfd: Optional[int] = None
        self.ring: Optional[mmap.mmap] = None
        self.ring_seq = 0
        self.res_ids: List[int] = []
        self.pending: List[Tuple[int, int]] = []  # (op, seq) of requests the host must answer
        self.state = "hello"  # hello -> open -> dropped (the host reads no more requests)
        self.outcome = Outcome()

    def send(self, step: dict) -> None:
        data = bytearray(bytes.fromhex(step["data"]))
        at = step.get("patch_res")
        if at is not None and self.res_ids and at + 4 <= len(data):
            struct.pack_into("<I", data, at, self.res_ids[0])
        fds = make_fds(step.get("fds", []))
        try:
            self._send_bytes(bytes(data), fds, step.get("split"))
        finally:
            close_all(fds)
        self._model(step, bytes(data))

    def _send_bytes(self, data: bytes, fds: List[int], split) -> None:
        try:
            if fds:
                anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"<{len(fds)}i", *fds))]
                sent = self.sock.sendmsg([data[:1]], anc)
                data = data[sent:]
            for n in split or ():
                if not data:
                    break
                self.sock.sendall(data[:n])
                data = data[n:]
            if data:
                self.sock.sendall(data)
        except OSError:  # the host dropped us (as it may): later steps see it too
            self.state = "dropped"

    def _model(self, step: dict, data: bytes) -> None:
        """Which replies the host owes for this message (see the module docstring)."""
        if self.state == "dropped":
            return
        if not step["framed"] or len(data) < HEADER.size:
            self.state = "dropped"
            return
        op, _, length, seq = HEADER.unpack_from(data)
        if length > MAX_PAYLOAD:
            self.state = "dropped"
            return
        if self.state == "hello":
            body = data[HEADER.size :]
            if op == Op.HELLO and len(body) == 8:
                self.pending.append((op, seq))
                ok = REQUEST[Op.HELLO].unpack(body) == (HELLO_MAGIC, WIRE_VERSION)
                self.state = "open" if ok else "hello-refused"
            else:
                self.state = "dropped"
            self.drain()
            return
        if self.state == "open":
            self.pending.append((op, seq))

    def drain(self) -> None:
        """Reads every reply owed, checking op and seq, keeping what later steps use."""
        while self.pending and self.state != "dropped":
            op, seq = self.pending[0]
            try:
                header, body, fds = recv_message(self.sock)
            except (OSError, ValueError) as exc:
                self.outcome.no_reply += len(self.pending)
                self.outcome.broken.append(f"no-reply to op {op} seq {seq}: {type(exc).__name__}: {exc}")
                self.pending, self.state = [], "dropped"
                return
            self.pending.pop(0)
            if (header.op, header.seq) != (op & 0xFFFFFFFF, seq & 0xFFFFFFFF):
                close_all(fds)
                self.outcome.broken.append(f"reply-order got op {header.op} seq {header.seq}, owed op {op} seq {seq}")
                self.state = "dropped"
                return
            if op == Op.HELLO and header.err == 0 and fds and self.memfd is None:
                self.memfd, fds = fds[0], fds[1:]
            close_all(fds)
            if op == Op.HELLO and self.state == "hello-refused":
                self.state = "dropped"  # the host answered the bad HELLO and hung up
            if header.err == 0 and op in (Op.EXECBUFFER, Op.KICK):
                self.outcome.computed += 1  # commands the host ran (refused ones in their reply blob)
            if header.err == 0 and op == Op.CREATE_BLOB and len(body) >= 4:
                self.res_ids.append(struct.unpack_from("<I", body)[0])
            if header.err == 0 and op == Op.RING and len(body) >= 12 and self.memfd is not None and self.ring is None:
                offset, size, _ = struct.unpack_from("<QII", body)
                if size >= RING_SIZE:
                    try:
                        self.ring = mmap.mmap(self.memfd, RING_SIZE, offset=offset)
                    except (OSError, ValueError) as exc:
                        self.outcome.broken.append(f"ring-map offset {offset}: {exc}")

    def burst(self, step: dict) -> None:
        """`n` CREATE_BLOBs sent at once, then their replies read."""
        if self.state != "open":
            return
        body = struct.pack("<IIQQ", VIRTGPU_BLOB_MEM_HOST3D, VIRTGPU_BLOB_FLAG_USE_MAPPABLE, step["size"], 0)
        msg = HEADER.pack(Op.CREATE_BLOB, 0, len(body), step["seq"]) + body
        try:
            self.sock.sendall(msg * step["n"])
        except OSError:
            self.state = "dropped"
            return
        self.pending += [(int(Op.CREATE_BLOB), step["seq"])] * step["n"]
        self.drain()

    def write_ring(self, step: dict) -> None:
        if self.ring is None:
            return
        self.outcome.computed += 0  # (ring commands are counted by the KICK that follows)
        cmd = bytearray(bytes.fromhex(step["cmd"]))
        if step.get("patch_res") is not None and self.res_ids and len(cmd) >= 12:
            struct.pack_into("<I", cmd, 8, self.res_ids[0])
        self.ring[RING_COMMAND : RING_COMMAND + len(cmd)] = bytes(cmd)
        for off, value in step["words"]:
            struct.pack_into("<I", self.ring, off, value)
        posted = step["posted"]
        if posted == "next":
            self.ring_seq = (self.ring_seq + 1) & 0xFFFFFFFF or 1
        elif posted == "zero":
            self.ring_seq = 0
        elif posted == "random":
            self.ring_seq = (self.ring_seq * 2654435761 + 12345) & 0xFFFFFFFF
        struct.pack_into("<I", self.ring, RING_POSTED, self.ring_seq)

    def end(self, how: str) -> None:
        if how == "drain":
            self.drain()
        if how == "half-close":
            try:
                self.sock.shutdown(socket.SHUT_WR)
                self.drain()
                self.sock.settimeout(REPLY_WAIT_S)
                while self.sock.recv(4096):
                    pass
            except OSError:
                pass
        if how == "reset":
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close()

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        if self.memfd is not None:
            os.close(self.memfd)
            self.memfd = None
        self.sock.close()


class SocketTarget(Target):
    name = "socket"

    def __init__(self, config: dict, workdir: str):
        from apir.host.local.server import LocalServer

        self.path = os.path.join(workdir, "host.sock")
        self.server = LocalServer(self.path, config=config).start()

    def generate(self, rng):
        steps: List[dict] = []
        seq = 1
        opening = rng.random() < 0.85
        if opening:
            case = "opened"
            script = [Op.HELLO, Op.CONTEXT_INIT, Op.CREATE_BLOB, Op.EXECBUFFER, Op.EXECBUFFER]
            for k, op in enumerate(script):
                step, _ = _message(rng, op, seq, mutate=k > 0 and rng.random() < 0.05)
                if k == 1:  # CONTEXT_INIT of the APIR capset, one ring
                    step["data"] = (
                        HEADER.pack(op, 0, 16, seq) + struct.pack("<IIQ", VIRTGPU_DRM_CAPSET_APIR, 1, 0)
                    ).hex()
                    step["framed"], step["mutations"] = True, []
                if k == 2:
                    step["data"] = (
                        HEADER.pack(op, 0, 24, seq)
                        + struct.pack("<IIQQ", VIRTGPU_BLOB_MEM_HOST3D, VIRTGPU_BLOB_FLAG_USE_MAPPABLE, 16384, 0)
                    ).hex()
                    step["framed"], step["mutations"] = True, []
                steps.append(step)
                seq += 1
        else:
            case = "hello"
            step, _ = _message(rng, Op.HELLO, seq, mutate=rng.random() < 0.7)
            steps.append(step)
            seq += 1
        if rng.random() < 0.1:  # other connections of the same peer, idle or mid-HELLO, held to the end
            steps.insert(0, {"op": "lurk", "n": _pick(rng, [1, 2, 8]), "bytes": int(rng.integers(0, 24))})
        framed = True
        ops = [int(o) for o in Op if o != Op.HELLO] + [Op.EXECBUFFER] * 4 + [Op.RING, Op.KICK, 0, 99]
        for _ in range(int(rng.integers(1, 16))):
            r = rng.random()
            if r < 0.12:
                steps.append(_ring_step(rng))
                if rng.random() < 0.6:
                    step, _ = _message(rng, Op.KICK, seq, mutate=False)
                    steps.append(step)
                    seq += 1
                continue
            if r < 0.2:
                steps.append({"op": "drain"})
                continue
            if r < 0.23:  # blobs by the hundred, pipelined: past the context's count bound at times
                size = _pick(rng, [4096, 16384, 1 << 20])
                steps.append({"op": "burst", "n": _pick(rng, [16, 64, 256, 1100]), "size": size, "seq": seq})
                seq += 1
                continue
            step, ok = _message(rng, _pick(rng, ops), seq, mutate=rng.random() < 0.35)
            framed = framed and ok
            if rng.random() < 0.7:
                step["wait"] = True
            steps.append(step)
            seq += 1
        if rng.random() < 0.1:  # the last message cut off: the host waits for the rest until we go
            step, _ = _message(rng, _pick(rng, ops), seq, mutate=False)
            data = bytes.fromhex(step["data"])
            step["data"] = data[: int(rng.integers(1, len(data)))].hex()
            step["framed"] = False
            steps.append(step)
        steps.append({"op": "end", "how": _pick(rng, ["close", "drain", "half-close", "reset", "close"])})
        return f"{case}{'' if framed else '-unframed'}", steps

    def run(self, steps):
        peer = _Peer(self.path)
        lurkers: List[socket.socket] = []
        try:
            for step in steps:
                kind = step["op"]
                if kind == "lurk":
                    lurkers += self._lurk(step)
                elif kind == "burst":
                    peer.burst(step)
                elif kind == "send":
                    peer.send(step)
                    if step.get("wait"):
                        peer.drain()
                elif kind == "ring":
                    peer.write_ring(step)
                elif kind == "drain":
                    peer.drain()
                elif kind == "end":
                    peer.end(step["how"])
        finally:
            peer.close()
            for s in lurkers:
                s.close()
        return peer.outcome

    def _lurk(self, step: dict) -> List[socket.socket]:
        hello = HEADER.pack(Op.HELLO, 0, 8, 1) + REQUEST[Op.HELLO].pack(HELLO_MAGIC, WIRE_VERSION)
        out = []
        for _ in range(step["n"]):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            out.append(s)
            try:
                s.connect(self.path)
                s.sendall(hello[: step["bytes"]])
            except OSError:
                pass
        return out

    def check(self):
        """A fresh client is served; then nothing is held."""
        from apir.guest.client import ApirClient
        from apir.guest.local import LocalDevice

        failures: List[str] = []
        alive = False
        try:
            client = ApirClient.connect(LocalDevice(self.path, connect_timeout_s=30), data_size=65536)
            try:
                alive = client.device_get_count() >= 1
            finally:
                client.close()
        except Exception as exc:  # noqa: BLE001 - any failure of a well-behaved guest is the finding
            failures.append(f"not-serving {type(exc).__name__}: {exc}")
        if not settle(lambda: self.server.stats().as_tuple() == (0, 0, 0, 0, 0) and not self.server._conns, 10):
            failures.append(f"held-after-leaving {self.server.stats()} with {len(self.server._conns)} connections")
        return alive, failures

    def close(self):
        self.server.close()
