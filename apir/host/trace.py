"""The call tracer: each command a host serves, as one JSON line, and the tools to read it back.

Theory of operation: `CommandTrace(path)` is the `HostContext.tracer` of every context a host
makes (`traced_context_factory` wraps the factory `apir host serve` gives its server). After
each command, `HostContext.submit` calls it with the command's bytes, its (return code, reply
payload bytes) and the host's time for it; the trace keeps the 12-byte header's meaning
(command type, backend function) and sizes, never the payload: no tensor data, names or
addresses reach the file. Writes are line-buffered and locked, so a trace read while the host
runs, or after it is killed, ends at the last whole command.

File format (JSON lines, TRACE_VERSION 1): a first line ``{"apir_trace": 1, "started": ISO
time, "pid": N}``, then one line per command:

  t         seconds since the trace started, when the command began
  ctx       the context id (one per guest context)
  type      "HandShake", "LoadLibrary", "Forward", or "invalid(N)"
  function  Forward's backend function (`ApirBackendCommandType.c_name`, e.g.
            "buffer_set_tensor"), or "unknown(N)"; absent for the other types
  cmd_bytes the command's length (header included)
  rc        the return code sent, as on the wire, or null when no reply could be sent
  status    "ok", or what went wrong: the return code's name (NO_DISPATCH_FCT, CANNOT_OPEN,
            ...), "function rc N" (a Forward whose backend function returned N != 0),
            "no reply"
  reply_bytes the reply payload written after the notification word
  host_us   the host's time for the command, microseconds

`read_trace(path)` gives the records back and `format_trace(records)` the `apir trace` text:
one line per command and a per-function summary (count, errors, host time, bytes).
"""

from __future__ import annotations

import datetime
import json
import os
import struct
import threading
import time
from collections import defaultdict
from typing import IO, Any, Callable, Dict, List, Optional, Tuple

from apir.codec.constants import (
    APIR_HANDSHAKE_MAGIC,
    VENUS_COMMAND_TYPE_LENGTH,
    ApirBackendCommandType,
    ApirCommandType,
    ApirForwardReturnCode,
    ApirLoadLibraryReturnCode,
)

__all__ = ["TRACE_VERSION", "CommandTrace", "traced_context_factory", "read_trace", "format_trace", "TraceError"]

TRACE_VERSION = 1
_HEADER = struct.Struct("<III")  # command type, flags, reply resource id (apir.host.component)
_FORWARD = int(ApirCommandType.FORWARD)


class TraceError(ValueError):
    """A file that is not an apir trace (the message names it and the line)."""


def _type_name(cmd_type: int) -> str:
    try:
        return ApirCommandType(cmd_type).c_name
    except ValueError:
        return f"invalid({cmd_type})"


def _function_name(function_id: int) -> str:
    try:
        return ApirBackendCommandType(function_id).c_name
    except ValueError:
        return f"unknown({function_id})"


def _status(type_name: str, rc: Optional[int]) -> str:
    """ "ok" or a name for what `rc` says went wrong (see the module docstring)."""
    if rc is None:
        return "no reply"
    if type_name == "HandShake":
        return "ok" if rc == APIR_HANDSHAKE_MAGIC else f"rc {rc}"
    if type_name == "LoadLibrary":
        if rc == ApirLoadLibraryReturnCode.SUCCESS:
            return "ok"
        try:
            return ApirLoadLibraryReturnCode(rc).name
        except ValueError:
            return f"rc {rc}"
    if type_name == "Forward":
        if rc >= ApirForwardReturnCode.BASE_INDEX:
            n = rc - ApirForwardReturnCode.BASE_INDEX
            return "ok" if n == 0 else f"function rc {n}"
        return ApirForwardReturnCode(rc).name
    return f"rc {rc}"


class CommandTrace:
    """A trace file being written; call it as a `HostContext.tracer`. Thread-safe (each
    context serves on its own thread). `close()` ends it; so does the process's exit."""

    def __init__(self, path: str):
        self.path = path
        self._file: IO[str] = open(path, "w", encoding="utf-8", buffering=1)
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self._write({"apir_trace": TRACE_VERSION, "started": started, "pid": os.getpid()})

    def _write(self, record: Dict[str, Any]) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def __call__(self, ctx_id: int, command: memoryview, result: Optional[Tuple[int, int]], seconds: float) -> None:
        start = time.perf_counter() - seconds - self._t0
        record: Dict[str, Any] = {"t": round(start, 6), "ctx": ctx_id}
        if len(command) >= _HEADER.size:
            cmd_type, flags, _ = _HEADER.unpack_from(command, 0)
            if cmd_type >= VENUS_COMMAND_TYPE_LENGTH:  # sent over the Venus capset
                cmd_type -= VENUS_COMMAND_TYPE_LENGTH
            record["type"] = _type_name(cmd_type)
            if cmd_type == _FORWARD:
                record["function"] = _function_name(flags)
        else:
            record["type"] = "truncated"
        record["cmd_bytes"] = len(command)
        rc, reply_bytes = result if result is not None else (None, 0)
        record["rc"] = rc
        record["status"] = _status(record["type"], rc)
        record["reply_bytes"] = reply_bytes
        record["host_us"] = round(seconds * 1e6, 1)
        self._write(record)

    def close(self) -> None:
        with self._lock:
            self._file.close()


def traced_context_factory(factory: Callable[..., Any], trace: CommandTrace) -> Callable[..., Any]:
    """`factory` (ctx_id, capset_id, config) -> context, with `trace` set as each context's
    tracer (the contexts must be `HostContext`s, or have a `tracer` attribute)."""

    def make(ctx_id: int, capset_id: int, config: Optional[dict]):
        ctx = factory(ctx_id, capset_id, config)
        ctx.tracer = trace
        return ctx

    return make


def read_trace(path: str) -> List[Dict[str, Any]]:
    """The command records of the trace at `path`, in order. A last line cut short (a host
    killed mid-write) is left out. Raises OSError, TraceError (not a trace, a bad line)."""
    with open(path, encoding="utf-8") as fh:
        lines = fh.read().split("\n")
    try:
        head = json.loads(lines[0]) if lines[0] else None
    except json.JSONDecodeError:
        head = None
    if not isinstance(head, dict) or head.get("apir_trace") != TRACE_VERSION:
        raise TraceError(
            f"{path}: not an apir trace (version {TRACE_VERSION}): its first line is "
            f'not {{"apir_trace": {TRACE_VERSION}, ...}}'
        )
    records = []
    complete = lines[1:-1]  # the text after the last newline is an unfinished record, or ""
    for n, line in enumerate(complete, start=2):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise TraceError(f"{path}: line {n}: {exc.msg}") from None
    return records


def _name(record: Dict[str, Any]) -> str:
    return record.get("function") or record.get("type", "?")


def format_trace(records: List[Dict[str, Any]], commands: bool = True) -> str:
    """The `apir trace` text: each command (with `commands`) then the per-function summary."""
    out: List[str] = []
    if commands:
        out.append(f"{'time s':>10} {'ctx':>3}  {'command':<28} {'cmd B':>9} {'reply B':>8} {'host us':>10}  status")
        for r in records:
            out.append(
                f"{r.get('t', 0):>10.6f} {r.get('ctx', '?'):>3}  {_name(r):<28} {r.get('cmd_bytes', 0):>9} "
                f"{r.get('reply_bytes', 0):>8} {r.get('host_us', 0):>10.1f}  {r.get('status', '?')}"
            )
        out.append("")
    stats: Dict[str, List[float]] = defaultdict(lambda: [0, 0, 0.0, 0.0, 0, 0])
    for r in records:
        s = stats[_name(r)]
        s[0] += 1
        s[1] += r.get("status") != "ok"
        s[2] += r.get("host_us", 0.0)
        s[3] = max(s[3], r.get("host_us", 0.0))
        s[4] += r.get("cmd_bytes", 0)
        s[5] += r.get("reply_bytes", 0)
    total_us = sum(s[2] for s in stats.values()) or 1.0
    out.append(f"summary: {len(records)} commands, {total_us / 1e6:.3f} s of host time")
    out.append(
        f"  {'function':<28} {'calls':>7} {'errors':>6} {'host ms':>10} {'share':>6} {'mean us':>9} "
        f"{'max us':>9} {'cmd B':>11} {'reply B':>10}"
    )
    for name, (n, errors, us, mx, cmd_b, reply_b) in sorted(stats.items(), key=lambda kv: -kv[1][2]):
        out.append(
            f"  {name:<28} {n:>7} {errors:>6} {us / 1e3:>10.3f} {100 * us / total_us:>5.1f}% "
            f"{us / n:>9.1f} {mx:>9.1f} {cmd_b:>11} {reply_b:>10}"
        )
    return "\n".join(out)
