"""The call tracer: each command a host serves, as one JSON line, and the tools to read it back.

Theory of operation: `CommandTrace(path)` is the `HostContext.tracer` of every context a host
makes (`traced_context_factory` wraps the context factory of `apir host serve` or of an
embedded host). `HostContext.submit` calls `describe(ctx, command)` before each command, while
the guest waits, and `finish(record, (rc, reply_bytes) or None, host_seconds)` after it. A
record keeps the 12-byte header's meaning (command type, backend function), sizes, the return
code and its status, the host's time and, for a Forward, its arguments as the Forward table
names them: numbers, tensors' types and shapes, the graph's node count by op. Tensor contents,
names and addresses never reach the file. Describing never raises: a command too hostile to
describe gets the header fields only. Writes are line-buffered and locked, so a trace read
while the host runs, or after it is killed, ends at the last whole command. The file format,
field by field: docs/design.md, "The call trace".

`read_trace(path)` gives the records back and `format_trace(records)` the `apir trace` text:
one line per command (with its arguments, short), a per-function summary (calls, errors, host
time, bytes) and the graph nodes by op over all computes.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import struct
import threading
import time
from collections import Counter, defaultdict
from typing import IO, Any, Dict, List, Optional, Protocol, Tuple, Union, runtime_checkable

import numpy as np

from apir.codec.constants import (
    APIR_FORWARD_POSTED,
    APIR_HANDSHAKE_MAGIC,
    APIR_PROTOCOL_MAJOR,
    APIR_PROTOCOL_MINOR,
    VENUS_COMMAND_TYPE_LENGTH,
    ApirBackendCommandType,
    ApirExtensionCommandType,
    ApirCommandType,
    ApirForwardReturnCode,
    ApirLoadLibraryReturnCode,
    negotiated_version,
)
from apir.codec.forward import FORWARD, InlineTensor, Kind, TensorLayouts, decode_args
from apir.codec.graph import GraphError, parse_graph
from apir.codec.records import rpc_tensor_dtype
from apir.codec.wire import Decoder
from apir.errors import ApirError
from apir.ggml import load as load_ggml
from apir.host.library import LibraryHost
from apir.host.component.seams import ApirContext, ContextFactory

__all__ = ["TRACE_VERSION", "CommandTrace", "traced_context_factory", "read_trace", "format_trace", "TraceError"]

log = logging.getLogger(__name__)

TRACE_VERSION = 1
# What a record is made of: the context (a HostContext, whose shared memory holds the graphs),
# or its id alone (a replay, a test: graphs then read as "unreadable").
TracedContext = Union[LibraryHost, int]
_HEADER = struct.Struct("<III")  # command type, flags, reply resource id (apir.host.component.context)
_FORWARD = int(ApirCommandType.FORWARD)


class TraceError(ApirError, ValueError):
    """A file that is not an apir trace (the message names it and the line)."""


def _type_name(cmd_type: int) -> str:
    try:
        return ApirCommandType(cmd_type).c_name
    except ValueError:
        return f"invalid({cmd_type})"


def _function_name(function_id: int) -> str:
    entry = FORWARD.get(function_id)
    return entry.name if entry is not None else f"unknown({function_id})"


def _status(type_name: str, rc: Optional[int]) -> str:
    """ "ok" or a name for what `rc` says went wrong (docs/design.md, "The call trace")."""
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


class _GgmlFacts:
    """What describing arguments needs of the host's ggml build: the apir_rpc_tensor layout,
    type and op names, GGML_OP_COUNT and the valid types (read from the build, as the host)."""

    def __init__(self, g: Any):
        self.limits = g.limits
        self.layouts = TensorLayouts(rpc_tensor_dtype(g.limits), g.tensor_dtype)
        self.type_names = {v: k for k, v in g.types.items()}
        self.op_names = {v: k for k, v in g.ops.items()}
        self.op_count = g.op_count
        self.valid_types = g.valid_types

    @classmethod
    def of_loaded(cls) -> "_GgmlFacts":
        return cls(load_ggml())

    def tensor(self, value: Any) -> Dict[str, Any]:
        """An rpc tensor's bytes or an InlineTensor: its type, shape and op (no name, no address)."""
        if isinstance(value, InlineTensor):
            rec = np.frombuffer(value.tensor, dtype=self.layouts.ggml_tensor, count=1)[0]
        else:
            rec = np.frombuffer(bytes(value), dtype=self.layouts.rpc_tensor, count=1)[0]
        return self._describe(rec)

    def _describe(self, rec) -> Dict[str, Any]:
        type_, op = int(rec["type"]), int(rec["op"])
        out: Dict[str, Any] = {"type": self.type_names.get(type_, type_), "ne": [int(x) for x in rec["ne"]]}
        if op:
            out["op"] = self.op_names.get(op, op)
        return out

    def graph(self, ctx: TracedContext, res_id: int, size: int) -> Dict[str, Any]:
        """The graph `backend_graph_compute` names: its node and tensor counts and its nodes'
        ops, parsed as the host parses it (apir.codec.graph.parse_graph)."""
        out: Dict[str, Any] = {"graph_bytes": size}
        res = None if isinstance(ctx, int) else ctx.get_shmem(res_id)
        if res is None or size == 0 or size > res.size:
            out["graph"] = "unreadable"
            return out
        try:
            parsed = parse_graph(
                res.memory, 0, size, limits=self.limits, op_count=self.op_count, type_valid=self.valid_types
            )
        except GraphError:
            out["graph"] = "invalid"
            return out
        ops = Counter(self.op_names.get(int(op), int(op)) for op in parsed.tensors["op"][parsed.node_index])
        out.update(nodes=parsed.n_nodes, tensors=parsed.n_tensors, ops=dict(ops.most_common()))
        return out


_NOT_TRACED = (Kind.HANDLE, Kind.RES_ID)  # ids of this run: they describe nothing
_TENSORS = (Kind.RPC_TENSOR, Kind.INLINE_TENSOR)
_NEWEST = (APIR_PROTOCOL_MAJOR, APIR_PROTOCOL_MINOR)


def _forward_arguments(facts: _GgmlFacts, ctx: TracedContext, function: int, dec: Decoder) -> Dict[str, Any]:
    """The arguments of Forward `function`, named as the Forward table names them (raises
    what decoding raises: the caller keeps the header fields only)."""
    version = _NEWEST if isinstance(ctx, int) else negotiated_version(ctx.guest_version, ctx.host_version)
    entry = FORWARD[function]
    values = decode_args(dec, entry, version, facts.layouts)
    if entry.id is ApirBackendCommandType.BACKEND_GRAPH_COMPUTE:
        res_id, size = values
        return facts.graph(ctx, res_id, size)  # the graph itself, in shared memory
    if entry.id is ApirExtensionCommandType.GRAPH_COMPUTE_KEEP:
        graph_id, res_id, size = values
        return dict(facts.graph(ctx, res_id, size), graph_id=graph_id)
    out: Dict[str, Any] = {}
    for field, value in zip(entry.args_in(version), values):
        if field.kind in _TENSORS:
            out[field.name] = facts.tensor(value)
        elif field.kind not in _NOT_TRACED:
            out[field.name] = value
    return out


class CommandTrace:
    """A trace file being written; call it as a `HostContext.tracer`. Thread-safe (each
    context serves on its own thread). `close()` ends it; so does the process's exit."""

    def __init__(self, path: str):
        self.path = path
        self._file: IO[str] = open(path, "w", encoding="utf-8", buffering=1)
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._facts: Optional[_GgmlFacts] = None
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self._write({"apir_trace": TRACE_VERSION, "started": started, "pid": os.getpid()})

    def _write(self, record: Dict[str, Any]) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def describe(self, ctx: TracedContext, command: memoryview) -> Dict[str, Any]:
        """The record of `command` before it runs (HostContext.submit calls this first, while
        the guest waits, so a graph in shared memory is read as the host will read it):
        start time, context, type, function and a Forward's arguments (their shapes and
        sizes). Never raises: a command too hostile to
        describe gets the header fields only."""
        record: Dict[str, Any] = {"t": round(time.perf_counter() - self._t0, 6), "ctx": _ctx_id(ctx)}
        if len(command) < _HEADER.size:
            record["type"] = "truncated"
            record["cmd_bytes"] = len(command)
            return record
        cmd_type, flags, length = _HEADER.unpack_from(command, 0)
        if cmd_type >= VENUS_COMMAND_TYPE_LENGTH:  # sent over the Venus capset
            cmd_type -= VENUS_COMMAND_TYPE_LENGTH
        posted, pos = 0, 0
        while cmd_type == _FORWARD and flags & APIR_FORWARD_POSTED and _HEADER.size <= length <= len(command) - pos:
            # posted commands (ASYNC) first: counted; the command after them is described
            posted, pos = posted + 1, pos + length
            if len(command) - pos < _HEADER.size:
                break
            cmd_type, flags, length = _HEADER.unpack_from(command, pos)
            if cmd_type >= VENUS_COMMAND_TYPE_LENGTH:
                cmd_type -= VENUS_COMMAND_TYPE_LENGTH
        if posted:
            record["posted"] = posted
            command = command[pos:]
            if len(command) < _HEADER.size:
                record["type"] = "posted"
                record["cmd_bytes"] = pos
                return record
        record["type"] = _type_name(cmd_type)
        if cmd_type == _FORWARD:
            record["function"] = _function_name(flags)
        record["cmd_bytes"] = len(command)
        if cmd_type == _FORWARD and flags in FORWARD:
            try:
                record.update(_forward_arguments(self._ggml_facts(), ctx, flags, Decoder(command, _HEADER.size)))
            except Exception:  # noqa: BLE001 - a trace never stops the host; the header is enough
                pass
        return record

    def finish(self, record: Dict[str, Any], result: Optional[Tuple[int, int]], seconds: float) -> None:
        """Completes `describe`'s record with the command's (return code, reply bytes) or None
        (no reply sent) and the host's time for it, and writes it."""
        rc, reply_bytes = result if result is not None else (None, 0)
        record["rc"] = rc
        record["status"] = _status(record["type"], rc)
        record["reply_bytes"] = reply_bytes
        record["host_us"] = round(seconds * 1e6, 1)
        self._write(record)

    def __call__(
        self, ctx: TracedContext, command: memoryview, result: Optional[Tuple[int, int]], seconds: float
    ) -> None:
        """`describe` and `finish` at once (for a caller that did not describe beforehand)."""
        record = self.describe(ctx, command)
        record["t"] = round(max(record["t"] - seconds, 0.0), 6)
        self.finish(record, result, seconds)

    def _ggml_facts(self) -> "_GgmlFacts":
        if self._facts is None:
            self._facts = _GgmlFacts.of_loaded()
        return self._facts

    def close(self) -> None:
        with self._lock:
            self._file.close()


def _ctx_id(ctx: TracedContext) -> int:
    return ctx if isinstance(ctx, int) else ctx.ctx_id


@runtime_checkable
class Traceable(Protocol):
    """A context that reports its commands to a tracer (`HostContext.tracer`)."""

    tracer: Optional[CommandTrace]


def traced_context_factory(factory: ContextFactory, trace: CommandTrace) -> ContextFactory:
    """`factory` (ctx_id, capset_id, config) -> context, with `trace` set as each context's
    tracer (the contexts must be `HostContext`s, or have a `tracer` attribute; another one
    is left untraced, with a warning)."""

    def make(ctx_id: int, capset_id: int, config: Optional[dict]) -> ApirContext:
        ctx = factory(ctx_id, capset_id, config)
        if isinstance(ctx, Traceable):
            ctx.tracer = trace
        else:
            log.warning("ctx %d: %s has no tracer: its commands are not traced", ctx_id, type(ctx).__name__)
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


def _tensor_text(t: Dict[str, Any]) -> str:
    ne = t.get("ne", [])
    while len(ne) > 1 and ne[-1] == 1:  # ggml pads shapes with 1s: show the meaningful dims
        ne = ne[:-1]
    return f"{t.get('type', '?')}[{','.join(map(str, ne))}]" + (f" {t['op']}" if t.get("op") else "")


# A record's own keys; the others are the command's arguments.
_RECORD_KEYS = {"t", "ctx", "type", "function", "cmd_bytes", "rc", "status", "reply_bytes", "host_us"}


def _arguments(r: Dict[str, Any]) -> str:
    """A record's described arguments, short: tensor shapes and types, sizes, graph op counts."""
    if "tensor" in r:
        return f"{_tensor_text(r['tensor'])} offset {r.get('offset', 0)} size {r.get('size', 0)}"
    if "src" in r:
        return f"{_tensor_text(r['src'])} -> {_tensor_text(r['dst'])}"
    if "ops" in r:
        top = ", ".join(f"{op} {n}" for op, n in list(r["ops"].items())[:4])
        more = ", ..." if len(r["ops"]) > 4 else ""
        return f"graph of {r.get('nodes', '?')} nodes ({top}{more})"
    if "graph" in r:
        return f"graph {r['graph']} ({r.get('graph_bytes', 0)} bytes)"
    args = [(k, v) for k, v in r.items() if k not in _RECORD_KEYS]
    return " ".join(f"{k} {_tensor_text(v) if isinstance(v, dict) else v}" for k, v in args)


def format_trace(records: List[Dict[str, Any]], commands: bool = True) -> str:
    """The `apir trace` text: each command (with `commands`) then the per-function summary."""
    out: List[str] = []
    if commands:
        out.append(f"{'time s':>10} {'ctx':>3}  {'command':<28} {'cmd B':>9} {'reply B':>8} {'host us':>10}  status")
        for r in records:
            args = _arguments(r)
            out.append(
                f"{r.get('t', 0):>10.6f} {r.get('ctx', '?'):>3}  {_name(r):<28} {r.get('cmd_bytes', 0):>9} "
                f"{r.get('reply_bytes', 0):>8} {r.get('host_us', 0):>10.1f}  {r.get('status', '?')}"
                + (f"  {args}" if args else "")
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
    graph_ops: Counter = Counter()
    for r in records:
        graph_ops.update(r.get("ops") or {})
    if graph_ops:
        n = sum(1 for r in records if r.get("ops"))
        ops = ", ".join(f"{op} {count}" for op, count in graph_ops.most_common())
        out.append(f"graph nodes by op ({n} graph computes): {ops}")
    return "\n".join(out)
