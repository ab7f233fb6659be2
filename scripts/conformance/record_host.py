"""A recording APIR host for scripts/make-conformance-vectors.py.

    python scripts/conformance/record_host.py --socket PATH --out CAPTURE.json \
        [--c-library LIB --ggml-library LIB --ggml-reg SYM] [--config KEY=VALUE ...]

Serves the local transport (apir.host.local.server) with one HostContext per guest, whose
backend library is the C host library (libggml-virtgpu-backend.so through
apir.host.backend.c_library) or, without --c-library, apir's own (its extensions included;
--config sets host configuration such as apir.host.extensions=off), and records, per context
and in order: every blob the guest creates (res_id, size) and every EXECBUFFER payload, split
into its commands (posted ones first, docs/protocol.md 12.7), with the bytes each left in
shared memory (for the commands that carry data there), and the return code and the reply
payload the host wrote for its waited-for command. Run on the C build's ggml
(APIR_GGML_LIB_DIR), as every host process that loads the C library.

Writes CAPTURE.json when it receives SIGTERM; prints "ready" once the socket listens.
"""

from __future__ import annotations

import argparse
import json
import signal
import struct
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from apir.codec.constants import VENUS_COMMAND_TYPE_LENGTH, VIRTGPU_DRM_CAPSET_VENUS  # noqa: E402
from apir.conformance.guest import split_commands  # noqa: E402
from apir.host.backend.c_library import c_library_factory  # noqa: E402
from apir.host.component.context import HostContext  # noqa: E402
from apir.host.local.server import LocalServer  # noqa: E402

_HDR = struct.Struct("<III")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# Forward function ids whose data travels in a blob: where the res_id and size sit in the
# command (byte offsets from the command start), whether the host reads or writes it, and where
# the offset of the bytes in the blob sits (None: they start at the blob's start).
# From the C guest encoders (virtgpu-forward-buffer.cpp, -backend.cpp): set/get_tensor send
# handle (8) + apir_rpc_tensor (304) + res_id + offset + size; graph_compute res_id + size;
# graph_compute_keep (docs/protocol.md 12.4) the graph id (8) first; buffer_set_tensor_at
# (12.7) handle + apir_rpc_tensor + res_id + res_offset + offset + size.
_RPC = 304
_BLOB_ARGS = {17: (12 + 8 + _RPC, 12 + 8 + _RPC + 12, "in", None),
              18: (12 + 8 + _RPC, 12 + 8 + _RPC + 12, "out", None),
              22: (12, 16, "in", None),
              0x102: (20, 24, "in", None),
              0x10A: (12 + 8 + _RPC, 12 + 8 + _RPC + 20, "in", 12 + 8 + _RPC + 4)}
_POSTED = 1 << 31  # APIR_FORWARD_POSTED: the third header word is the command's length


def _posted(cmd: bytes) -> bool:
    cmd_type, flags, _length = _HDR.unpack_from(cmd, 0)
    return cmd_type == 2 and bool(flags & _POSTED)


class RecordingContext(HostContext):
    """A HostContext that notes what crosses it (see the module docstring)."""

    def __init__(self, *args, events, **kwargs):
        super().__init__(*args, **kwargs)
        self.events = events
        self.reply_len = 0

    def add_resource(self, res_id, memory):
        super().add_resource(res_id, memory)
        self.events.append({"kind": "resource", "res_id": res_id, "size": len(memoryview(memory))})

    def _forward(self, function_id, dec, enc):
        start = enc.pos
        rc = super()._forward(function_id, dec, enc)
        self.reply_len = enc.pos - start
        return rc

    def _handshake(self, dec, enc):
        start = enc.pos
        rc = super()._handshake(dec, enc)
        self.reply_len = enc.pos - start
        return rc

    def _blob(self, cmd: bytes, function_id: int):
        spec = _BLOB_ARGS.get(function_id & ~_POSTED)
        if spec is None or len(cmd) < spec[1] + 8:
            return None
        res_id = _U32.unpack_from(cmd, spec[0])[0]
        size = _U64.unpack_from(cmd, spec[1])[0]
        start = _U64.unpack_from(cmd, spec[3])[0] if spec[3] is not None else 0
        res = self.get_shmem(res_id)
        if res is None or start > res.size or size > res.size - start:
            return None
        return res_id, start, size, spec[2]

    def submit(self, command):
        payload = bytes(memoryview(command).cast("B"))
        commands, blobs = [], []
        for cmd in split_commands(payload):
            entry = {"command": cmd.hex()}
            blob = None
            cmd_type, flags, _reply_res = _HDR.unpack_from(cmd, 0) if len(cmd) >= _HDR.size else (-1, 0, 0)
            if self.capset_id == VIRTGPU_DRM_CAPSET_VENUS and cmd_type >= VENUS_COMMAND_TYPE_LENGTH:
                cmd_type -= VENUS_COMMAND_TYPE_LENGTH
            if cmd_type == 2:
                blob = self._blob(cmd, flags)
            if blob and blob[3] == "in":
                mem = self.get_shmem(blob[0]).memory
                entry["shmem_in"] = {"res_id": blob[0], "hex": bytes(mem[blob[1]: blob[1] + blob[2]]).hex()}
                if blob[1]:
                    entry["shmem_in"]["offset"] = blob[1]
            commands.append(entry)
            blobs.append(blob)
        event = {"kind": "submit", "commands": commands}
        self.reply_len = 0
        super().submit(command)
        last = bytes.fromhex(commands[-1]["command"]) if commands else b""
        blob = blobs[-1] if blobs else None
        if len(last) >= _HDR.size and not _posted(last):  # a posted command has no reply
            reply = self.get_shmem(_HDR.unpack_from(last, 0)[2])
            if reply is not None:
                mem = reply.memory
                word = _U32.unpack_from(mem, 0)[0]
                event["return_code"] = (word - 1) & 0xFFFFFFFF
                event["reply"] = bytes(mem[4: 4 + self.reply_len]).hex()
            if blob and blob[3] == "out":
                mem = self.get_shmem(blob[0]).memory
                event["shmem_out"] = {"res_id": blob[0], "hex": bytes(mem[blob[1]: blob[1] + blob[2]]).hex()}
        self.events.append(event)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--c-library")
    ap.add_argument("--ggml-library")
    ap.add_argument("--ggml-reg")
    ap.add_argument("--config", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)

    config = dict(item.split("=", 1) for item in args.config)
    if args.c_library:
        config.update({"apir.load_library.path": args.c_library, "ggml.library.path": args.ggml_library,
                       "ggml.library.reg": args.ggml_reg})
    contexts = []

    def factory(ctx_id, capset_id, cfg):
        events: list = []
        contexts.append({"ctx_id": ctx_id, "capset": capset_id, "events": events})
        return RecordingContext(ctx_id, cfg, capset_id=capset_id, library_factory=c_library_factory,
                                events=events)

    server = LocalServer(args.socket, config, context_factory=factory)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    server.start()
    print("ready", flush=True)
    stop.wait()
    server.close()
    Path(args.out).write_text(json.dumps(contexts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
