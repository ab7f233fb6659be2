"""Replays the vectors' commands to a host and checks its replies.

Theory of operation: for each session of a vector file, a target host gets a fresh context
on the session's capset and one blob per resource role the session used (reply, data,
buffer_from_ptr blobs). Each step's command is the C guest's bytes with the run-dependent
values put back: the blob res_ids of this run ("res:" fields) and the handles this host gave in
earlier replies ("ref:" fields, in the command and in graph records). The step's shared-memory
input is copied to its blob (at its start, or at the vector's `offset`), the notification word
zeroed, the command submitted; then the return code, the reply payload (by fields) and any
shared-memory output are compared.
Posted commands (ASYNC, docs/protocol.md 12.7: steps with `sent_with`) have no reply: they go
at the head of the EXECBUFFER of the step they were sent with, as the C guest sent them, and
share its outcome (their effects show in later replies: synchronize, buffer_get_tensor).

Targets: `EmbeddedTarget` (a HostContext in this process: apir's Python dispatcher, or with
config the C host library through apir.host.backend.c_library) and `SocketTarget` (any host serving
apir's local transport, `apir host serve --socket PATH`). A session that needs host
configuration (`host_config`: the extension vectors' APIR 0.2 fallback, two devices) gets it from the
embedded target and is skipped by the socket target, which cannot set it; the extension
sessions are skipped with the C host library, which has no extensions.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from apir.conformance.vectors import Context, Session, Step, VectorFile, compare
from apir.host.config import CONFIG_KEY_EXTENSIONS, CONFIG_KEY_LOAD_LIBRARY_PATH

__all__ = ["EmbeddedTarget", "SocketTarget", "StepResult", "check_host"]

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@dataclass
class StepResult:
    file: str
    session: str
    step: str
    ok: bool
    detail: str = ""
    skipped: bool = False


class EmbeddedTarget:
    """A `HostContext` per session, in this process. `config`: its configuration (empty:
    apir's built-in dispatcher; apir.load_library.path etc.: that backend library)."""

    name = "embedded"

    def __init__(self, config: Optional[dict] = None, library_factory=None):
        self.config = dict(config or {})
        self.library_factory = library_factory
        self.ctx: Any = None
        self.blobs: Dict[int, mmap.mmap] = {}
        self._next_ctx = 1

    def skip_reason(self, vf: VectorFile, session: Session) -> Optional[str]:
        extensions_off = (session.host_config or {}).get(CONFIG_KEY_EXTENSIONS) == "off"
        if vf.extensions and not extensions_off and CONFIG_KEY_LOAD_LIBRARY_PATH in self.config:
            return "the extensions' replies are apir's host's (a backend library has no extensions)"
        return None

    def open(self, capset: int, host_config: Optional[dict] = None) -> None:
        from apir.host.component.context import HostContext

        config = {**self.config, **(host_config or {})}
        if self.library_factory is None:
            self.ctx = HostContext(self._next_ctx, config, capset_id=capset)
        else:
            self.ctx = HostContext(self._next_ctx, config, capset_id=capset, library_factory=self.library_factory)
        self._next_ctx += 1
        self._res = 0

    def create_blob(self, size: int):
        self._res += 1
        mem = mmap.mmap(-1, size)
        self.ctx.add_resource(self._res, mem)
        self.blobs[self._res] = mem
        return self._res, mem

    def submit(self, payload: bytes) -> None:
        self.ctx.submit(payload)

    def close(self) -> None:
        if self.ctx is not None:
            self.ctx.close()
            self.ctx = None
        for mem in self.blobs.values():
            try:
                mem.close()
            except BufferError:
                pass
        self.blobs.clear()


class SocketTarget:
    """A host over apir's local transport (docs/local-transport.md) at `path`."""

    name = "socket"

    def __init__(self, path: str):
        self.path = path
        self.dev: Any = None

    def skip_reason(self, vf: VectorFile, session: Session) -> Optional[str]:
        if session.host_config:
            return f"needs a host configured with {session.host_config}; a socket host's is its own"
        return None

    def open(self, capset: int, host_config: Optional[dict] = None) -> None:
        from apir.guest.local import LocalDevice

        self.dev = LocalDevice(self.path)
        self.dev.context_init(capset, 1)

    def create_blob(self, size: int):
        blob = self.dev.create_blob(size)
        return blob.res_id, blob.memory

    def submit(self, payload: bytes) -> None:
        self.dev.execbuffer(payload)

    def close(self) -> None:
        if self.dev is not None:
            self.dev.close()
            self.dev = None


def _patch(raw: bytearray, fields: list, ctx: Context) -> Optional[str]:
    """Writes this run's res_ids and handles into `raw` where the fields' rules say."""
    for off, _size, name, _helper, _value, *rule in fields:
        if not rule:
            continue
        rule = rule[0]
        if rule.startswith("res:"):
            res = ctx.res.get(rule[4:])
            if res is None:
                return f"{name}: no blob for {rule}"
            _U32.pack_into(raw, off, res)
        elif rule.startswith("ref:"):
            handle = ctx.handles.get(rule[4:])
            if handle is None:
                return f"{name}: {rule} unknown (an earlier step failed)"
            _U64.pack_into(raw, off, handle)
    return None


def _wait_word(mem, timeout_s: float = 60.0) -> int:
    import time

    end = time.monotonic() + timeout_s
    word = _U32.unpack_from(mem, 0)[0]
    while not word and time.monotonic() < end:
        time.sleep(0.0005)
        word = _U32.unpack_from(mem, 0)[0]
    return word


def _prepare(step: Step, ctx: Context, blobs: dict) -> Tuple[Optional[bytes], Optional[str]]:
    """The step's command with this run's values, its shared-memory input written to its blob
    (at the vector's offset): (command, None), or (None, why not)."""
    cmd = bytearray(step.command)
    why = _patch(cmd, step.raw["command"]["fields"], ctx)
    if why:
        return None, why
    shmem_in = step.raw.get("shmem_in")
    if shmem_in:
        data = bytearray.fromhex(shmem_in["hex"])
        if "fields" in shmem_in:
            why = _patch(data, shmem_in["fields"], ctx)
            if why:
                return None, why
        at = shmem_in.get("offset", 0)
        blobs[shmem_in["res"]][at : at + len(data)] = bytes(data)
    return bytes(cmd), None


def run_step(target, step: Step, ctx: Context, blobs: dict, posted: Sequence[bytes] = ()) -> Optional[str]:
    """One step against `target`, after the posted commands `posted` in its EXECBUFFER; None
    when the host's answer conforms, else the first difference. A posted step (no reply) is
    only submitted."""
    cmd, why = _prepare(step, ctx, blobs)
    if cmd is None:
        return why
    reply_mem = blobs["reply"]
    _U32.pack_into(reply_mem, 0, 0)
    target.submit(b"".join(posted) + cmd)
    if "reply" not in step.raw:
        return None
    word = _wait_word(reply_mem)
    if not word:
        return "no reply (the notification word stayed 0)"
    rc = word - 1
    reply = step.raw["reply"]
    if rc != reply["return_code"]:
        return f"return code {rc}, expected {reply['return_code']} ({reply.get('return_code_meaning', '')})"
    fields = reply.get("fields") or []
    if fields and not (len(fields) == 1 and fields[0][5:] == ["any"]):
        size = max(f[0] + f[1] for f in fields)
        if any(len(f) > 5 and f[5] == "any-string" for f in fields):
            size = len(reply_mem) - 4
        why = compare(fields, bytes(reply_mem[4 : 4 + size]), ctx, step.name, strict_length=False)
        if why:
            return f"reply {why}"
    shmem_out = step.raw.get("shmem_out")
    if shmem_out:
        want = bytes.fromhex(shmem_out["hex"])
        got = bytes(blobs[shmem_out["res"]][0 : len(want)])
        if got != want:
            first = next(i for i in range(len(want)) if got[i] != want[i])
            return f"shared memory out: byte {first} is {got[first]:#04x}, expected {want[first]:#04x}"
    return None


def check_session(
    target, vf: VectorFile, session: Session, select: Optional[Callable[[Step], bool]] = None
) -> List[StepResult]:
    ctx = Context()
    results = []
    why_not = target.skip_reason(vf, session)
    if why_not:
        return [StepResult(str(vf), session.name, step.name, True, why_not, True) for step in session.steps]
    target.open(session.capset, session.host_config)
    try:
        blobs = {}
        for role, info in session.resources.items():
            res_id, mem = target.create_blob(info["size"])
            ctx.res[role] = res_id
            blobs[role] = mem
        # posted steps wait for the step they were sent with: one EXECBUFFER, its outcome theirs
        posted: List[Tuple[Step, bytes]] = []
        for step in session.steps:
            if select is not None and not select(step):
                results.append(StepResult(str(vf), session.name, step.name, True, "not selected", True))
                continue
            if "sent_with" in step.raw:
                cmd, why = _prepare(step, ctx, blobs)
                if cmd is None:
                    results.append(StepResult(str(vf), session.name, step.name, False, why or ""))
                else:
                    posted.append((step, cmd))
                continue
            why = run_step(target, step, ctx, blobs, [cmd for _, cmd in posted])
            for before, _ in posted:
                detail = f"sent with {step.name}: {why}" if why else ""
                results.append(StepResult(str(vf), session.name, before.name, why is None, detail))
            posted = []
            results.append(StepResult(str(vf), session.name, step.name, why is None, why or ""))
        del blobs
    finally:
        target.close()
    return results


def check_host(target, files: List[VectorFile], select=None) -> List[StepResult]:
    """Every session of every file against `target`."""
    results = []
    for vf in files:
        for session in vf.sessions:
            results += check_session(target, vf, session, select)
    return results
