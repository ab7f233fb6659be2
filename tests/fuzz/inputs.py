"""One fuzz input, run on a fresh host context in fenced memory; reproducer files.

Theory of operation: every input starts from the same state, so that it can be replayed
alone: a fresh `HostContext` (HandShake 0.2, LoadLibrary), its three blobs in fenced memory
(reply, data, and a graph blob sized to the input's graph, ending at its guard), the host
buffers the input asks for allocated through `buffer_type_alloc_buffer` (fenced by
`FencedBuffers` when installed) with their images written, then the input's steps: blob
writes and raw EXECBUFFER payloads (an EXT_QUERY among them where the input agrees an
extension), each payload itself placed against a guard. Handles are therefore the same on
every run. After the steps the host must still answer a command.

What `Env` checks on every command, besides the process surviving: a command whose header
names the reply blob gets a reply; the host raised no internal exception (it logs one and
answers nothing when a bug escapes a handler; `HostErrors` counts them).

A reproducer is a JSON file (`Recording`): the configuration, the buffer images, the steps
as base64, and where the input came from (ggml version, seed, index, case, mutations).
`replay(recording, fences)` runs one without the generator.
"""

from __future__ import annotations

import base64
import ctypes
import json
import logging
import struct
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from apir.codec.constants import ApirBackendCommandType as Cmd, ApirCommandType, ApirExtensionCommandType
from apir.host import HostContext
from tests.fuzz.fence import Fenced

__all__ = [
    "Env",
    "Fences",
    "Recording",
    "HostErrors",
    "replay",
    "REPLY_RES",
    "DATA_RES",
    "GRAPH_RES",
    "FORMAT_VERSION",
    "payload",
]

REPLY_RES, DATA_RES, GRAPH_RES = 1, 2, 3
REPLY_SIZE, DATA_SIZE, GRAPH_MAX, CMD_MAX = 16 << 10, 256 << 10, 1 << 20, 64 << 10
FORMAT_VERSION = 1
_FORWARD = int(ApirCommandType.FORWARD)
_COMPUTE_HEADER = struct.pack("<II", _FORWARD, int(Cmd.BACKEND_GRAPH_COMPUTE))


def payload(cmd_type: int, flags: int, body: bytes = b"", reply_res: int = REPLY_RES) -> bytes:
    return struct.pack("<III", cmd_type, flags, reply_res) + body


def forward(cmd: Cmd, body: bytes = b"") -> bytes:
    return payload(_FORWARD, int(cmd), body)


class HostErrors(logging.Handler):
    """Counts the host's internal exceptions (`submit`'s "internal error" log with a
    traceback): a bug even when the process survives. Installed once per process."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.count = 0
        self.last = ""

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.count += 1
            exc = record.exc_info[1]
            self.last = f"{type(exc).__name__}: {exc}"[:300]

    @classmethod
    def install(cls) -> "HostErrors":
        log = logging.getLogger("apir.host")
        for h in log.handlers:
            if isinstance(h, cls):
                return h
        h = cls()
        log.addHandler(h)
        log.setLevel(logging.ERROR)  # refusals are expected by the thousand: not printed
        log.propagate = False
        return h


class Fences:
    """The fenced regions of one process, reused by every input."""

    def __init__(self):
        self.reply = Fenced(REPLY_SIZE)
        self.data = Fenced(DATA_SIZE)
        self.graph = Fenced(GRAPH_MAX)
        self.cmd = Fenced(CMD_MAX)


@dataclass
class Recording:
    """A reproducer (see the module docstring)."""

    config: Dict[str, str]
    graph_size: int
    images: List[bytes] = field(default_factory=list)
    handles: List[int] = field(default_factory=list)
    steps: List[Tuple[str, int, bytes]] = field(default_factory=list)  # ("blob", res, bytes) / ("cmd", 0, bytes)
    meta: Dict[str, object] = field(default_factory=dict)

    def to_json(self) -> str:
        b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
        return json.dumps(
            {
                "format": FORMAT_VERSION,
                "config": self.config,
                "graph_size": self.graph_size,
                "images": [b64(i) for i in self.images],
                "handles": self.handles,
                "steps": [[kind, res, b64(data)] for kind, res, data in self.steps],
                "meta": self.meta,
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> "Recording":
        d = json.loads(text)
        if d.get("format") != FORMAT_VERSION:
            raise ValueError(f"reproducer format {d.get('format')}, expected {FORMAT_VERSION}")
        unb = base64.b64decode
        return cls(
            d["config"],
            d["graph_size"],
            [unb(i) for i in d["images"]],
            d["handles"],
            [(k, r, unb(b)) for k, r, b in d["steps"]],
            d.get("meta", {}),
        )


class Env:
    """A fresh host context for one input (see the module docstring). `record_to`: a path
    the recording is rewritten to before every step (so it survives a crash of the step)."""

    def __init__(
        self,
        fences: Fences,
        config: Dict[str, str],
        graph_size: int,
        ctx_id: int = 1,
        record_to: Optional[str] = None,
        meta: Optional[dict] = None,
    ):
        self.f = fences
        self.rec = Recording(dict(config), graph_size, meta=dict(meta or {}))
        self.record_to = record_to
        self.ctx = HostContext(ctx_id, config)
        self.reply = fences.reply.tail(REPLY_SIZE)
        fences.data.zero()
        self.data = fences.data.tail(DATA_SIZE)
        self.graph = fences.graph.tail(graph_size, align=8)
        ctypes.memset(fences.graph.end - len(self.graph), 0, len(self.graph))
        self.ctx.add_resource(REPLY_RES, self.reply)
        self.ctx.add_resource(DATA_RES, self.data)
        self.ctx.add_resource(GRAPH_RES, self.graph)
        self.no_reply = 0
        self.on_command = None  # called with the input's meta before each command (the child reports it)
        self.computed = 0  # graph computes the host accepted (ran ggml)
        self._views = {DATA_RES: self.data, GRAPH_RES: self.graph, REPLY_RES: self.reply}
        rc, _ = self._submit(payload(int(ApirCommandType.HANDSHAKE), 0, struct.pack("<II", 0, 2)))
        assert rc == 0xAB1E, rc
        rc, _ = self._submit(payload(int(ApirCommandType.LOADLIBRARY), 0))
        assert rc == 0, rc
        rc, reply = self._submit(forward(Cmd.DEVICE_GET_BUFFER_TYPE))
        assert rc == 4, rc
        self.buft = struct.unpack_from("<Q", reply, 0)[0]
        self._save()

    # --- setup ---------------------------------------------------------------------------
    def alloc(self, images: List[bytes]) -> List[int]:
        """Host buffers of these images' sizes, images written; their handles."""
        handles = []
        lib = self.ctx._library
        for image in images:
            rc, reply = self._submit(forward(Cmd.BUFFER_TYPE_ALLOC_BUFFER, struct.pack("<QQ", self.buft, len(image))))
            handle = struct.unpack_from("<Q", reply, 0)[0]
            if rc != 4 or not handle:
                raise RuntimeError(f"setup: no host buffer of {len(image)} bytes (rc {rc})")
            ctypes.memmove(lib.buffers.get(handle).base, image, len(image))
            handles.append(handle)
        self.rec.images += list(images)
        self.rec.handles += handles
        self._save()
        return handles

    # --- steps ---------------------------------------------------------------------------
    def write(self, res_id: int, data: bytes) -> None:
        """Guest bytes into the start of a blob (cut at its end)."""
        if res_id == GRAPH_RES:  # the graph blob is re-made to end where its bytes end
            self.ctx.remove_resource(GRAPH_RES)
            self.graph = self._views[GRAPH_RES] = self.f.graph.tail(min(len(data), GRAPH_MAX), align=8)
            self.graph[:] = b"\0" * len(self.graph)
            self.ctx.add_resource(GRAPH_RES, self.graph)
        view = self._views[res_id]
        data = bytes(data[: len(view)])
        self._step("blob", res_id, data)
        view[: len(data)] = data

    def agree(self, extensions: int) -> int:
        """EXT_QUERY asking for these ApirExtension bits (a recorded step, so a replay agrees
        them too); the bits the host agreed, 0 when it did not answer."""
        ext_query = payload(_FORWARD, int(ApirExtensionCommandType.EXT_QUERY), struct.pack("<I", extensions))
        rc, reply = self.submit(ext_query)
        return struct.unpack_from("<I", reply, 0)[0] if rc == 4 else 0

    def submit(self, cmd: bytes) -> Tuple[Optional[int], memoryview]:
        """Submits a raw payload; (return code or None when no reply came, reply payload)."""
        self._step("cmd", 0, cmd)
        if self.on_command is not None:
            self.on_command(self.rec.meta)
        rc, reply = self._submit(cmd)
        names_reply = len(cmd) >= 12 and struct.unpack_from("<I", cmd, 8)[0] == REPLY_RES
        if rc is None and names_reply:
            self.no_reply += 1
        elif rc == 4 and len(cmd) >= 12 and cmd[:8] == _COMPUTE_HEADER:
            self.computed += 1
        return rc, reply

    def _submit(self, cmd: bytes) -> Tuple[Optional[int], memoryview]:
        view = self.f.cmd.tail(max(len(cmd), 1), align=1)[: len(cmd)]
        view[:] = cmd
        self.reply[0:4] = b"\0\0\0\0"
        self.ctx.submit(view)
        word = struct.unpack_from("<I", self.reply, 0)[0]
        return (None if word == 0 else word - 1), self.reply[4:]

    def _step(self, kind: str, res: int, data: bytes) -> None:
        self.rec.steps.append((kind, res, data))
        self._save()

    def _save(self) -> None:
        if self.record_to:
            with open(self.record_to, "w") as fh:
                fh.write(self.rec.to_json())

    # --- after ---------------------------------------------------------------------------
    def alive(self) -> bool:
        """The host answers DEVICE_GET_COUNT (and LoadLibrary survived the input)."""
        rc, reply = self._submit(forward(Cmd.DEVICE_GET_COUNT))
        if rc == 1:  # a mutated command may not unload, but check it answers anyway
            return False
        return rc == 4 and struct.unpack_from("<i", reply, 0)[0] >= 1

    def use_counts(self) -> bool:
        """Whether the host builds this context's graphs with the guest's use counts (the
        records' padding: USE_COUNTS agreed)."""
        return bool(self.ctx._library.wire_use_counts)

    def close(self) -> None:
        self.ctx.close()


def replay(rec: Recording, fences: Fences) -> Tuple[int, bool, int, bool]:
    """Runs a recording on a fresh context: (commands without a reply, host alive after,
    internal exceptions, USE_COUNTS agreed at the end). Raises AssertionError when setup
    gives other handles than recorded (a reproducer from another host version or fence mode)."""
    errors = HostErrors.install()
    before = errors.count
    env = Env(fences, rec.config, rec.graph_size, meta=rec.meta)
    try:
        handles = env.alloc(rec.images)
        if handles != rec.handles:
            raise AssertionError(f"setup handles {handles}, recorded {rec.handles}")
        for kind, res, data in rec.steps:
            if kind == "blob":
                env.write(res, data)
            else:
                env.submit(data)
        return env.no_reply, env.alive(), errors.count - before, env.use_counts()
    finally:
        env.close()
