"""An apir host (the local transport, apir's dispatcher) that records every command's bytes, for
the tests of the extended C guest (tests/llama/test_c_guest_extensions.py).

    python -m tests.llama.record_host --socket PATH --out RECORD.json [--config KEY=VALUE ...]

Each context's tracer (HostContext.tracer, the hook of `apir host serve --trace`) notes, in
order, each command of an EXECBUFFER payload as the guest wrote it, the return code, the reply
payload, and for a kept graph (graph_compute_keep, graph_recompute) the host device that
computed it.
Run on the guest build's ggml (APIR_GGML_LIB_DIR). Prints "ready" once the socket listens and
writes RECORD.json (a list of {"command", "rc", "reply"} hex records, with "posted",
"execbuffer" and, for kept graphs, "device", and for graph_compute_keep "graph", its bytes) on
SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import signal
import struct
import sys
import threading
from pathlib import Path

from apir.codec.constants import APIR_FORWARD_POSTED, ApirExtensionCommandType as X

_HEADER = struct.Struct("<III")
_KEPT_GRAPH_FUNCTIONS = (X.GRAPH_COMPUTE_KEEP, X.GRAPH_RECOMPUTE)  # a u64 graph_id first
_REPLY_KEEP = 64  # reply bytes kept per command: enough for every reply the tests read


class ByteRecorder:
    """A HostContext tracer that keeps the raw command and reply bytes: a record per command,
    the posted commands at the head of an EXECBUFFER payload (ASYNC) each on their own, with
    the index of the payload (`execbuffer`) they came in."""

    def __init__(self) -> None:
        self.records: list = []
        self._lock = threading.Lock()
        self._execbuffers = 0

    def describe(self, ctx, cmd) -> dict:
        return {"ctx": ctx, "command": bytes(cmd)}

    def finish(self, record: dict, result, seconds: float) -> None:
        ctx, payload = record.pop("ctx"), record.pop("command")
        with self._lock:
            execbuffer = self._execbuffers
            self._execbuffers += 1
        records, at = [], 0
        while at + _HEADER.size <= len(payload):  # posted commands (ASYNC): their length in the third word
            _, flags, length = _HEADER.unpack_from(payload, at)
            if not flags & APIR_FORWARD_POSTED or length < _HEADER.size or at + length > len(payload):
                break
            records.append({"command": payload[at: at + length].hex(), "rc": None, "reply": "", "posted": True,
                            "execbuffer": execbuffer})
            at += length
        cmd = payload[at:]
        if cmd:
            records.append(self._waited(ctx, cmd, result, execbuffer))
        with self._lock:
            self.records.extend(records)

    def _waited(self, ctx, cmd: bytes, result, execbuffer: int) -> dict:
        rc, reply_len = result if result is not None else (None, 0)
        reply = b""
        if len(cmd) >= _HEADER.size:
            res = ctx.get_shmem(_HEADER.unpack_from(cmd, 0)[2])
            if res is not None:
                reply = bytes(res.memory[4: 4 + min(reply_len, _REPLY_KEEP)])
        record = {"command": cmd.hex(), "rc": rc, "reply": reply.hex(), "posted": False, "execbuffer": execbuffer}
        if len(cmd) >= _HEADER.size + 8 and _HEADER.unpack_from(cmd, 0)[1] in _KEPT_GRAPH_FUNCTIONS:
            # the extended library's kept graphs: graph id -> (device index, graph bytes)
            kept = getattr(ctx._library, "_kept", {}).get(struct.unpack_from("<Q", cmd, _HEADER.size)[0])
            record["device"] = None if kept is None else kept[0]
            if kept is not None and _HEADER.unpack_from(cmd, 0)[1] == X.GRAPH_COMPUTE_KEEP:
                record["graph"] = kept[1].tobytes().hex()  # the graph's bytes, as the host computed them
        return record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", action="append", default=[], help="KEY=VALUE, a host configuration key")
    args = ap.parse_args(argv)

    from apir.host.component.context import HostContext
    from apir.host.local.server import LocalServer

    config = dict(item.split("=", 1) for item in args.config)
    recorder = ByteRecorder()

    def context_factory(ctx_id, capset_id, cfg):
        ctx = HostContext(ctx_id, cfg, capset_id=capset_id)
        ctx.tracer = recorder
        return ctx

    server = LocalServer(args.socket, config, context_factory=context_factory)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    server.start()
    print("ready", flush=True)
    stop.wait()
    server.close()
    Path(args.out).write_text(json.dumps(recorder.records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
