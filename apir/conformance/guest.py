"""Checks apir's guest encoder (apir.guest.ApirClient over a Remote) against the vectors.

Theory of operation: `ReplayDevice` is a VirtgpuDevice that plays the host from the vectors:
its blobs get the vector's res_ids (in the order the vector's guest created them), and each
EXECBUFFER is recorded and answered with the vector's reply (payload, return code, and the
shared-memory output). The client is driven with the arguments the C guest used, read from the
vector's command fields (sizes, handles, the raw tensor records); the bytes apir sends and puts
in shared memory are then compared with the C's by the vector's rules. The handles in the
vector's replies are the ones the client receives, so "ref:" fields compare with the vector's
own values.

Inline tensors are rebuilt in this process's memory from the vector's raw ggml_tensor structs
(pointers patched to the copies); graphs are rebuilt as ggml_tensor structs from the vector's
records and serialized with apir.codec.graph.serialize_graph, so its walk order, ids and
records are checked against apir_serialize_graph's. Steps that are not guest commands (the
error, component and forget steps, encoded by hand with the C helpers) are skipped.

Extension vectors: ext_query is driven with the C guest's bits; a graph_recompute step
computes again the graph kept under its id (the same rebuilt bytes, so apir's guest finds
its id too); a graph_recompute answered GRAPH_UNKNOWN and the graph_compute_keep after it
are one guest call; device_select steps select the device. With ASYNC agreed the client
decides itself what it posts, as the C guest does: a posted step (`sent_with`) is driven and
must send nothing, then the EXECBUFFER of the step it was sent with must hold its command
first, byte for byte, and its bytes where the vector's are in the post window.
"""

from __future__ import annotations

import ctypes
import mmap
import struct
from typing import Any, Dict, List, Optional

import numpy as np

from apir.codec.constants import (
    APIR_BACKEND_GRAPH_UNKNOWN,
    APIR_FORWARD_POSTED,
    ApirCommandType,
    ApirForwardReturnCode,
)
from apir.codec.forward import FORWARD, Kind
from apir.conformance.host import StepResult
from apir.conformance.vectors import Context, Session, Step, VectorFile, compare

__all__ = ["ReplayDevice", "check_guest", "serialize_vector_graph", "split_commands"]

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_PARAM_SUPPORTED_CAPSET_IDS = 7

_BY_NAME = {function.name: function for function in FORWARD.values()}
_GRAPH_UNKNOWN_RC = int(ApirForwardReturnCode.BASE_INDEX) + APIR_BACKEND_GRAPH_UNKNOWN


class ReplayDevice:
    """A VirtgpuDevice answering from one vector session (see the module docstring)."""

    name = "conformance-replay"

    def __init__(self, session: Session, apir_minor: int):
        self.session = session
        self.minor = apir_minor
        self.roles = list(session.resources.items())
        self.blobs: Dict[str, Any] = {}
        self.sent: List[bytes] = []
        self.steps: List[Step] = []  # the steps that answer the next commands, in order

    def get_param(self, param: int) -> int:
        return 1 << self.session.capset if param == _PARAM_SUPPORTED_CAPSET_IDS else 0

    def get_caps(self, capset_id: int, size: int) -> bytes:
        from apir.codec.constants import CapsetApir

        return CapsetApir(self.minor, True).pack()[:size]

    def context_init(self, capset_id: int, num_rings: int = 1) -> None:
        if capset_id != self.session.capset:
            raise RuntimeError(f"guest chose capset {capset_id}, the vector's guest {self.session.capset}")

    def create_blob(self, size: int):
        from apir.guest.device import Blob

        n = len(self.blobs)
        if n >= len(self.roles):
            raise RuntimeError("the guest created more blobs than the vector's guest")
        role, info = self.roles[n]
        blob = Blob(info["res_id"], n + 1, size, mmap.mmap(-1, max(size, info["size"])))
        self.blobs[role] = blob
        return blob

    def destroy_blob(self, blob) -> None:
        pass

    def execbuffer(self, payload, ring_idx: int = 0) -> None:
        commands = split_commands(bytes(memoryview(payload).cast("B")))
        self.sent += commands
        if not self.steps or _posted(commands[-1]):
            return  # not answered: the client times out, or posted (no reply)
        step = self.steps.pop(0)
        reply = step.raw["reply"]
        mem = self.blobs["reply"].memory
        data = bytes.fromhex(reply["hex"])
        mem[4 : 4 + len(data)] = data
        out = step.raw.get("shmem_out")
        if out:
            raw = bytes.fromhex(out["hex"])
            self.blobs[out["res"]].memory[0 : len(raw)] = raw
        _U32.pack_into(mem, 0, (reply["return_code"] + 1) & 0xFFFFFFFF)

    def close(self) -> None:
        pass


def _posted(cmd: bytes) -> bool:
    return (
        len(cmd) >= 12
        and _U32.unpack_from(cmd, 0)[0] == ApirCommandType.FORWARD
        and bool(_U32.unpack_from(cmd, 4)[0] & APIR_FORWARD_POSTED)
    )


def split_commands(payload: bytes) -> List[bytes]:
    """The commands of one EXECBUFFER payload: the posted ones at its head (their length in
    the third header word, docs/protocol.md 12.7), then the rest as one."""
    out, pos = [], 0
    while _posted(payload[pos:]) and 12 <= _U32.unpack_from(payload, pos + 8)[0] <= len(payload) - pos:
        length = _U32.unpack_from(payload, pos + 8)[0]
        out.append(payload[pos : pos + length])
        pos += length
    if pos < len(payload) or not out:
        out.append(payload[pos:])
    return out


def _field_offset(fields: list, name: str) -> int:
    for item in fields:
        if item[2] == name:
            return item[0]
    raise KeyError(name)


def _rpc_bytes(vf: VectorFile, step: Step, prefix: str) -> bytes:
    off = _field_offset(step.raw["command"]["fields"], prefix + ".id")
    return step.command[off : off + vf.layouts["apir_rpc_tensor"]["size"]]


def _inline_tensor(vf: VectorFile, step: Step, prefix: str):
    """The vector's inline tensor rebuilt in memory: (address of the main struct, keep-alive)."""
    layout = vf.layouts["ggml_tensor"]
    size, f = layout["size"], layout["fields"]
    raw = step.command
    pos = _field_offset(step.raw["command"]["fields"], prefix + ".type") - f["type"][0]
    main = ctypes.create_string_buffer(raw[pos : pos + size], size)
    keep = [main]
    pos += size
    if _U64.unpack_from(raw, pos - size + f["buffer"][0])[0]:
        pos += 8  # the handle the C wrote (any)
    if _U64.unpack_from(main, f["view_src"][0])[0]:
        view = ctypes.create_string_buffer(raw[pos : pos + size], size)
        keep.append(view)
        _U64.pack_into(main, f["view_src"][0], ctypes.addressof(view))
        pos += size
    for i in range(f["src"][1] // 8):
        off = f["src"][0] + 8 * i
        if not _U64.unpack_from(main, off)[0]:
            break
        src = ctypes.create_string_buffer(raw[pos : pos + size], size)
        keep.append(src)
        _U64.pack_into(main, off, ctypes.addressof(src))
        pos += size
    return ctypes.addressof(main), keep


class _GraphView:
    """The part of `apir.ggml.Ggml` that serialize_graph uses, over rebuilt tensors."""

    def __init__(self, nodes: np.ndarray, tensor_dtype, limits):
        self.nodes = nodes
        self.tensor_dtype = tensor_dtype
        self.limits = limits

    def ggml_graph_n_nodes(self, _cgraph) -> int:
        return len(self.nodes)

    def ggml_graph_nodes(self, _cgraph) -> int:
        return self.nodes.ctypes.data

    def ggml_get_name(self, _addr):
        return b"?"


def serialize_vector_graph(vf: VectorFile, graph: bytes) -> np.ndarray:
    """apir's serialize_graph run on ggml_tensor structs rebuilt from a vector graph's records
    (buffers: one fake buffer per handle, registered with that handle)."""
    from apir.codec.graph import BufferTable, serialize_graph
    from apir.codec.records import GGML_0_20_LIMITS, ggml_tensor_dtype

    rl = vf.layouts["apir_rpc_tensor"]
    rf, rsize = rl["fields"], rl["size"]
    dtype = ggml_tensor_dtype(GGML_0_20_LIMITS)
    if dtype.itemsize != vf.layouts["ggml_tensor"]["size"]:
        raise ValueError("the vector's ggml_tensor layout is not apir's")
    n_nodes = _U32.unpack_from(graph, 0)[0]
    node_ids = [_U64.unpack_from(graph, 4 + 8 * i)[0] for i in range(n_nodes)]
    pos = 4 + 8 * n_nodes
    n_tensors = _U32.unpack_from(graph, pos)[0]
    pos += 4
    recs = [graph[pos + i * rsize : pos + (i + 1) * rsize] for i in range(n_tensors)]

    def u(rec, name, i=0, width=8):
        return int.from_bytes(rec[rf[name][0] + i * width : rf[name][0] + (i + 1) * width], "little")

    arr = np.zeros(n_tensors, dtype=dtype)
    addr0 = arr.ctypes.data
    index = {u(rec, "id"): i for i, rec in enumerate(recs)}
    table = BufferTable()
    fake: Dict[int, tuple] = {}

    def addr(tid):
        return addr0 + index[tid] * dtype.itemsize if tid else 0

    for i, rec in enumerate(recs):
        t = arr[i]
        t["type"] = u(rec, "type", width=4)
        handle = u(rec, "buffer")
        if handle:
            if handle not in fake:
                k = len(fake) + 1
                fake[handle] = (0x1000 * k, 0x7F0000000000 + (k << 32))
                table.register(fake[handle][0], handle, fake[handle][1])
            t["buffer"] = fake[handle][0]
            t["data"] = fake[handle][1] + u(rec, "data")
        t["ne"] = [u(rec, "ne", j, 4) for j in range(4)]
        t["nb"] = [u(rec, "nb", j, 4) for j in range(4)]
        t["op"] = u(rec, "op", width=4)
        t["op_params"] = np.frombuffer(rec[rf["op_params"][0] : rf["op_params"][0] + rf["op_params"][1]], "<i4")
        t["flags"] = int.from_bytes(rec[rf["flags"][0] : rf["flags"][0] + 4], "little", signed=True)
        t["src"] = [addr(u(rec, "src", j)) for j in range(rf["src"][1] // 8)]
        t["view_src"] = addr(u(rec, "view_src"))
        t["view_offs"] = u(rec, "view_offs")
        name = rec[rf["name"][0] : rf["name"][0] + rf["name"][1]].split(b"\0")[0]
        arr["name"][i] = np.frombuffer(name.ljust(rf["name"][1], b"\0"), "S1")
    nodes = np.array([addr(i) for i in node_ids], dtype=np.uint64)
    out = serialize_graph(_GraphView(nodes, dtype, GGML_0_20_LIMITS), 0, table)
    del arr  # the serializer copied everything out
    return out


_NOT_GUEST_COMMANDS = ("error.", "component.", "forget.")


def _graph(vf: VectorFile, step: Step, graphs: Dict[int, np.ndarray]) -> np.ndarray:
    """The graph a graph step computes: rebuilt from its records, or for a graph_recompute the
    graph kept under its id, the same bytes again (so apir's guest finds its own id for it)."""
    if step.function == "graph_recompute":
        graph_id = step.arg("graph_id")
        if graph_id not in graphs:
            raise ValueError(f"graph_recompute of graph id {graph_id:#x}, which no earlier step kept")
        return graphs[graph_id]
    graph = serialize_vector_graph(vf, bytes.fromhex(step.raw["shmem_in"]["hex"]))
    if step.function == "graph_compute_keep":
        graphs[step.arg("graph_id")] = graph
    return graph


def _call(client, vf: VectorFile, step: Step, graphs: Dict[int, np.ndarray]) -> Optional[str]:
    """Drives the client for one step; returns a note for a step it cannot drive."""
    f, a = step.function, step.arg
    if step.raw["command_type"] == "HandShake":
        client.handshake()
    elif step.raw["command_type"] == "LoadLibrary":
        client.load_library()
    elif f == "device_buffer_from_ptr":
        client.device_buffer_from_ptr(a("size"), a("max_tensor_size"))
    elif f in ("buffer_set_tensor", "buffer_set_tensor_at"):  # posted or not: the client's choice
        data = np.frombuffer(bytes.fromhex(step.raw["shmem_in"]["hex"]), dtype=np.uint8)
        client.buffer_set_tensor(a("buffer"), _rpc_bytes(vf, step, "tensor"), a("offset"), data)
    elif f == "buffer_get_tensor":
        out = np.zeros(a("size"), dtype=np.uint8)
        client.buffer_get_tensor(a("buffer"), _rpc_bytes(vf, step, "tensor"), a("offset"), out)
        if out.tobytes() != bytes.fromhex(step.raw["shmem_out"]["hex"]):
            return "the bytes the client returned are not the shared memory's"
    elif f in ("backend_graph_compute", "graph_compute_keep", "graph_recompute"):
        client.backend_graph_compute(_graph(vf, step, graphs))
    elif f == "ext_query":
        client.negotiate_extensions(a("guest_extensions"))
    elif f == "device_select":
        client.select_device(a("device"))
    elif f == "synchronize":
        client.synchronize()
    elif f in _BY_NAME:
        # the client method takes the table's arguments in order; an inline tensor as its
        # address and its buffer's handle
        args: List[Any] = []
        keep = []
        for field in _BY_NAME[f].args:
            if field.kind is Kind.RPC_TENSOR:
                args.append(_rpc_bytes(vf, step, field.name))
            elif field.kind is Kind.INLINE_TENSOR:
                address, structs = _inline_tensor(vf, step, field.name)
                args += [address, 1]
                keep.append(structs)
            else:
                args.append(a(field.name))
        getattr(client, f)(*args)
        del keep
    else:
        return f"no driver for {f}"
    return None


def check_session(vf: VectorFile, session: Session) -> List[StepResult]:
    from apir.guest.client import ApirClient
    from apir.guest.remote import Remote

    dev = ReplayDevice(session, vf.minor)
    remote = Remote(dev, use_apir_capset=session.capset == 10)
    client = ApirClient(remote, protocol=(0, vf.minor))
    ctx = Context(res={role: info["res_id"] for role, info in session.resources.items()})
    for step in session.steps:  # the handles the vector's host gave: what the client gets
        for item in step.raw.get("reply", {}).get("fields") or []:
            if len(item) > 5 and item[5] == "handle":
                ctx.handles[f"{step.name}.{item[2]}"] = item[4]
    results = []
    graphs: Dict[int, np.ndarray] = {}
    steps = list(session.steps)
    posted: List[Step] = []  # posted steps driven, their EXECBUFFER not sent yet
    n_sent = 0
    try:
        while steps:
            step = steps.pop(0)
            if step.name.startswith(_NOT_GUEST_COMMANDS):
                results.append(
                    StepResult(str(vf), session.name, step.name, True, "not a command apir's guest sends", True)
                )
                continue
            if not posted:
                n_sent = len(dev.sent)
            call = [step]
            if step.function == "graph_recompute" and step.raw["reply"]["return_code"] == _GRAPH_UNKNOWN_RC and steps:
                call.append(steps.pop(0))  # the graph sent again, by the same call
            dev.steps = [st for st in call if "reply" in st.raw]
            try:
                note = _call(client, vf, step, graphs)
            except Exception as exc:  # noqa: BLE001 - reported per step
                note = f"{type(exc).__name__}: {exc}"
            if note is None and "sent_with" in step.raw:
                posted.append(step)  # compared with the EXECBUFFER of the step it was sent with
                continue
            call = posted + call
            posted = []
            if note is None and len(dev.sent) != n_sent + len(call):
                note = f"the client sent {len(dev.sent) - n_sent} commands, expected {len(call)}"
            for i, st in enumerate(call):
                if note is None:
                    note = _compare_sent(st, dev.sent[n_sent + i], dev, ctx)
                results.append(StepResult(str(vf), session.name, st.name, note is None, note or ""))
    finally:
        dev.steps = []
        remote.close()
    return results


def _compare_sent(step: Step, sent: bytes, dev: ReplayDevice, ctx: Context) -> Optional[str]:
    """The command the client sent for `step` and what it put in shared memory, against the
    vector's (the blob holds the last command's bytes: a step's own when it is a call's last
    or the only one with shared memory)."""
    note = compare(step.raw["command"]["fields"], sent, ctx, step.name)
    if note:
        return f"command {note}"
    shmem_in = step.raw.get("shmem_in")
    if shmem_in:
        want = bytes.fromhex(shmem_in["hex"])
        at = shmem_in.get("offset", 0)
        got = bytes(dev.blobs[shmem_in["res"]].memory[at : at + len(want)])
        if "fields" in shmem_in:
            note = compare(shmem_in["fields"], got, ctx, step.name)
        elif got != want:
            note = "shared memory in differs"
        if note:
            return f"shared memory in: {note}"
    return None


def check_guest(files: List[VectorFile]) -> List[StepResult]:
    """apir's guest encoder against every session of every file."""
    results = []
    for vf in files:
        for session in vf.sessions:
            results += check_session(vf, session)
    return results
