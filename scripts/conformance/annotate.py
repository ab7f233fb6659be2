"""Field-by-field annotation of captured APIR commands and replies (for make-conformance-vectors.py).

The bytes are the C's (captured); this module only names them. Each field becomes
``[offset, size, name, helper, value]`` plus a sixth element, the comparison rule, where plain
byte equality is not the rule (conformance/README.md lists the rules). The argument lists per
function mirror the C guest encoders (virtgpu-forward-*.cpp) and the C host handlers
(backend-dispatched-*.cpp); the record layouts come from the C compiler (the driver prints
offsetof/sizeof as LAYOUT lines). A capture whose bytes do not add up to its annotation is an
error, so a wrong table cannot go unnoticed.
"""

from __future__ import annotations

import json
import struct

CMD_NAMES = {0: "HandShake", 1: "LoadLibrary", 2: "Forward"}
VENUS_OFFSET = 331
FUNCTIONS = [
    "device_get_device_count", "device_get_count", "device_get_name", "device_get_description",
    "device_get_type", "device_get_memory", "device_supports_op", "device_get_buffer_type",
    "device_get_props", "device_buffer_from_ptr", "buffer_type_get_name", "buffer_type_get_alignment",
    "buffer_type_get_max_size", "buffer_type_is_host", "buffer_type_alloc_buffer",
    "buffer_type_get_alloc_size", "buffer_get_base", "buffer_set_tensor", "buffer_get_tensor",
    "buffer_cpy_tensor", "buffer_clear", "buffer_free_buffer", "backend_graph_compute",
]
# the extensions beyond APIR 0.2 (docs/protocol.md 12.1), by function id
EXT_FUNCTIONS = {
    0x100: "ext_query", 0x101: "device_select", 0x102: "graph_compute_keep", 0x103: "graph_recompute",
    0x104: "synchronize", 0x105: "event_new", 0x106: "event_record", 0x107: "event_wait",
    0x108: "event_synchronize", 0x109: "event_free", 0x10A: "buffer_set_tensor_at",
}
POSTED = 1 << 31  # APIR_FORWARD_POSTED: the header's third word is the command's length

U32 = ("apir_encode_uint32_t", "u32")
BUFT = ("apir_encode_apir_buffer_type_host_handle", "handle")
BUFFER = ("apir_encode_apir_buffer_host_handle_t", "handle")
SIZE = ("apir_encode_size_t", "u64")
RES = ("apir_encode_virtgpu_shmem_res_id", "res_id")
RPC = ("apir_encode_ggml_tensor", "rpc_tensor")
INLINE = ("apir_encode_ggml_tensor_inline", "inline_tensor")
GRAPH_ID = ("apir_encode_uint64_t", "guest_id")
EVENT = ("apir_encode_uint64_t", "handle")

# command arguments after the 12-byte header: (name, C encode helper, kind)
ARGS = {
    "HandShake": [("guest_major",) + U32, ("guest_minor",) + U32],
    "LoadLibrary": [],
    "device_supports_op": [("op",) + INLINE],
    "device_buffer_from_ptr": [("shmem_res_id",) + RES, ("size",) + SIZE, ("max_tensor_size",) + SIZE],
    "buffer_type_get_name": [("buft",) + BUFT],
    "buffer_type_get_alignment": [("buft",) + BUFT],
    "buffer_type_get_max_size": [("buft",) + BUFT],
    "buffer_type_is_host": [("buft",) + BUFT],
    "buffer_type_alloc_buffer": [("buft",) + BUFT, ("size",) + SIZE],
    "buffer_type_get_alloc_size": [("buft",) + BUFT, ("op",) + INLINE],
    "buffer_get_base": [("buffer",) + BUFFER],
    "buffer_set_tensor": [("buffer",) + BUFFER, ("tensor",) + RPC, ("shmem_res_id",) + RES,
                          ("offset",) + SIZE, ("size",) + SIZE],
    "buffer_get_tensor": [("buffer",) + BUFFER, ("tensor",) + RPC, ("shmem_res_id",) + RES,
                          ("offset",) + SIZE, ("size",) + SIZE],
    "buffer_cpy_tensor": [("buffer",) + BUFFER, ("src",) + RPC, ("dst",) + RPC],
    "buffer_clear": [("buffer",) + BUFFER, ("value", "apir_encode_uint8_t", "u8")],
    "buffer_free_buffer": [("buffer",) + BUFFER],
    "backend_graph_compute": [("shmem_res_id",) + RES, ("size",) + SIZE],
    "ext_query": [("guest_extensions",) + U32],
    "device_select": [("device",) + U32],
    "graph_compute_keep": [("graph_id",) + GRAPH_ID, ("shmem_res_id",) + RES, ("size",) + SIZE],
    "graph_recompute": [("graph_id",) + GRAPH_ID],
    "event_record": [("event",) + EVENT],
    "event_wait": [("event",) + EVENT],
    "event_synchronize": [("event",) + EVENT],
    "event_free": [("event",) + EVENT],
    "buffer_set_tensor_at": [("buffer",) + BUFFER, ("tensor",) + RPC, ("shmem_res_id",) + RES,
                             ("shmem_offset",) + SIZE, ("offset",) + SIZE, ("size",) + SIZE],
}

STRING = ("apir_encode_array_size + apir_encode_char_array", "string")
# reply payloads (from byte 4 of the reply blob): (name, C encode helper, kind, rule)
REPLIES = {
    "HandShake": [("host_major", "apir_encode_uint32_t", "u32", None),
                  ("host_minor", "apir_encode_uint32_t", "u32", "any")],
    "device_get_device_count": [("count", "apir_encode_int32_t", "i32", None)],
    "device_get_count": [("count", "apir_encode_int32_t", "i32", None)],
    "device_get_name": [("name",) + STRING + (None,)],
    "device_get_description": [("description",) + STRING + ("any",)],
    "device_get_type": [("type", "apir_encode_uint32_t", "u32", None)],
    "device_get_memory": [("free", "apir_encode_size_t", "u64", "any"),
                          ("total", "apir_encode_size_t", "u64", "nonzero")],
    "device_supports_op": [("supported", "apir_encode_bool_t", "bool", None)],
    "device_get_buffer_type": [("buft", "apir_encode_ggml_buffer_type", "u64", "handle")],
    "device_get_props": [(n, "apir_encode_bool_t", "bool", None)
                         for n in ("async", "host_buffer", "buffer_from_host_ptr", "events", "mmap_support")],
    "device_buffer_from_ptr": [("buffer", "apir_encode_ggml_buffer", "u64", "handle"),
                               ("buft", "apir_encode_ggml_buffer_type", "u64", "handle")],
    "buffer_type_get_name": [("name",) + STRING + (None,)],
    "buffer_type_get_alignment": [("alignment", "apir_encode_size_t", "u64", None)],
    "buffer_type_get_max_size": [("max_size", "apir_encode_size_t", "u64", None)],
    "buffer_type_is_host": [("is_host", "apir_encode_bool_t", "bool", None)],
    "buffer_type_alloc_buffer": [("buffer", "apir_encode_ggml_buffer", "u64", "handle")],
    "buffer_type_get_alloc_size": [("alloc_size", "apir_encode_size_t", "u64", None)],
    "buffer_get_base": [("base", "apir_encode_uintptr_t", "u64", "nonzero")],
    "buffer_cpy_tensor": [("copied", "apir_encode_bool_t", "bool", None)],
    "backend_graph_compute": [("status", "apir_encode_ggml_status", "i32", None)],
    "ext_query": [("extensions", "apir_encode_uint32_t", "u32", None),
                  ("device_count", "apir_encode_uint32_t", "u32", None)],
    "graph_compute_keep": [("status", "apir_encode_ggml_status", "i32", None)],
    "graph_recompute": [("status", "apir_encode_ggml_status", "i32", None)],
    "synchronize": [(n, "apir_encode_uint32_t", "u32", None) for n in ("posted", "failed_index", "function", "code")],
    "event_new": [("event", "apir_encode_uint64_t", "u64", "handle")],
}

RC_MEANING = {
    "HandShake": {0xAB1E: "APIR_HANDSHAKE_MAGIC (accepted)", 1: "malformed (apir component: no guest version)"},
    "LoadLibrary": {0: "APIR_LOAD_LIBRARY_SUCCESS", 2: "APIR_LOAD_LIBRARY_ALREADY_LOADED"},
    "Forward": {4: "APIR_FORWARD_BASE_INDEX + 0 (success)", 5: "APIR_FORWARD_BASE_INDEX + 1 (the function failed)",
                10: "APIR_FORWARD_BASE_INDEX + APIR_BACKEND_FORWARD_INDEX_INVALID (6)",
                1: "APIR_FORWARD_NO_DISPATCH_FCT",
                11: "APIR_FORWARD_BASE_INDEX + APIR_BACKEND_GRAPH_UNKNOWN (7): the host holds no graph of that id",
                12: "APIR_FORWARD_BASE_INDEX + APIR_BACKEND_POSTED_FAILED (8)",
                13: "APIR_FORWARD_BASE_INDEX + APIR_BACKEND_QUEUE_FULL (9)"},
}

KIND_SIZE = {"u32": 4, "i32": 4, "u8": 4, "bool": 4, "u64": 8, "handle": 8, "res_id": 4, "guest_id": 8}


class Layout:
    """Offsets and sizes of apir_rpc_tensor and ggml_tensor as the C compiler laid them out."""

    def __init__(self, stdout: str):
        self.fields: dict = {"apir_rpc_tensor": {}, "ggml_tensor": {}}
        self.sizes: dict = {}
        self.consts: dict = {}
        for line in stdout.splitlines():
            parts = line.split()
            if parts[:1] == ["LAYOUT"]:
                self.fields[parts[1]][parts[2]] = (int(parts[3]), int(parts[4]))
            elif parts[:1] == ["SIZEOF"]:
                self.sizes[parts[1]] = int(parts[2])
            elif parts[:1] == ["CONST"]:
                self.consts[parts[1]] = int(parts[2])

    def as_json(self) -> dict:
        return {name: {"size": self.sizes[name], "fields": {f: list(v) for f, v in fields.items()}}
                for name, fields in self.fields.items()}


def _u(raw: bytes, off: int, size: int, signed: bool = False) -> int:
    return int.from_bytes(raw[off: off + size], "little", signed=signed)


def _name_field(raw: bytes, off: int, size: int, prefix: str) -> list:
    """A NUL-terminated char[size]: exact up to and with the NUL, the tail any (the C's
    snprintf / strncpy leaves it as the stack held it)."""
    text = raw[off: off + size]
    end = text.find(b"\0")
    value = text[:end].decode("latin-1")
    if end + 1 < size:
        return [[off, end + 1, prefix + "name", "char[]", value],
                [off + end + 1, size - end - 1, prefix + "name (after the NUL)", "-", None, "any"]]
    return [[off, size, prefix + "name", "char[]", value]]


def rpc_tensor_fields(raw: bytes, base: int, layout: Layout, prefix: str, in_graph: bool, refs) -> list:
    """Fields of one apir_rpc_tensor at raw[base:]. In a graph, src/view_src name other
    records by id ("id-ref"); alone (set/get/cpy_tensor) they are guest pointers ("nonzero")."""
    L = layout.fields["apir_rpc_tensor"]
    size = layout.sizes["apir_rpc_tensor"]
    out = []
    ref_rule = "id-ref" if in_graph else "nonzero"

    def add(field, helper, value, rule=None, name=None):
        off, sz = L[field]
        item = [base + off, sz, prefix + (name or field), helper, value]
        if rule:
            item.append(rule)
        out.append(item)

    add("id", "u64", _u(raw, base + L["id"][0], 8), "id")
    add("type", "u32 (enum ggml_type)", _u(raw, base + L["type"][0], 4))
    end_type = L["type"][0] + 4
    if L["buffer"][0] > end_type:
        out.append([base + end_type, L["buffer"][0] - end_type, prefix + "(hole)", "-", None, "any"])
    buf = _u(raw, base + L["buffer"][0], 8)
    add("buffer", "u64 buffer handle", buf, refs(buf) if buf else None)
    add("ne", "u32[4]", [_u(raw, base + L["ne"][0] + 4 * i, 4) for i in range(L["ne"][1] // 4)])
    add("nb", "u32[4]", [_u(raw, base + L["nb"][0] + 4 * i, 4) for i in range(L["nb"][1] // 4)])
    add("op", "u32 (enum ggml_op)", _u(raw, base + L["op"][0], 4))
    add("op_params", "i32[16]", [_u(raw, base + L["op_params"][0] + 4 * i, 4, True)
                                 for i in range(L["op_params"][1] // 4)])
    add("flags", "i32 (GGML_TENSOR_FLAG_*)", _u(raw, base + L["flags"][0], 4, True))
    add("src", "u64[10] ids", [_u(raw, base + L["src"][0] + 8 * i, 8) for i in range(L["src"][1] // 8)], ref_rule)
    add("view_src", "u64 id", _u(raw, base + L["view_src"][0], 8), ref_rule)
    add("view_offs", "u64", _u(raw, base + L["view_offs"][0], 8))
    add("data", "u64 offset from the buffer's base", _u(raw, base + L["data"][0], 8))
    out += _name_field(raw, base + L["name"][0], L["name"][1], prefix)
    pad_off = L["padding"][0]
    out.append([base + pad_off, size - pad_off, prefix + "padding + tail hole", "-", None, "any"])
    return out


def ggml_tensor_fields(raw: bytes, base: int, layout: Layout, prefix: str) -> list:
    """Fields of one raw ggml_tensor (inline tensors): guest pointers only count as null or
    not; holes, padding and the name's tail are any."""
    L = layout.fields["ggml_tensor"]
    size = layout.sizes["ggml_tensor"]
    out = []
    pos = 0
    order = sorted(L.items(), key=lambda kv: kv[1][0])
    for field, (off, sz) in order:
        if off > pos:
            out.append([base + pos, off - pos, prefix + "(hole)", "-", None, "any"])
        if field == "name":
            out += _name_field(raw, base + off, sz, prefix)
        elif field == "padding":
            out.append([base + off, sz, prefix + "padding", "-", None, "any"])
        elif field in ("buffer", "view_src", "data", "extra"):
            out.append([base + off, sz, prefix + field, "guest pointer", _u(raw, base + off, 8), "nonzero"])
        elif field == "src":
            out.append([base + off, sz, prefix + field, "guest pointer[10]",
                        [_u(raw, base + off + 8 * i, 8) for i in range(sz // 8)], "nonzero"])
        elif field in ("ne", "nb"):
            signed = field == "ne"
            out.append([base + off, sz, prefix + field, "i64[4]" if signed else "u64[4]",
                        [_u(raw, base + off + 8 * i, 8, signed) for i in range(sz // 8)]])
        elif field == "op_params":
            out.append([base + off, sz, prefix + field, "i32[16]", [_u(raw, base + off + 4 * i, 4, True)
                                                                   for i in range(sz // 4)]])
        elif field == "type":
            out.append([base + off, sz, prefix + field, "u32 (enum ggml_type)", _u(raw, base + off, sz)])
        elif field == "op":
            out.append([base + off, sz, prefix + field, "u32 (enum ggml_op)", _u(raw, base + off, sz)])
        elif field == "flags":
            out.append([base + off, sz, prefix + field, "i32", _u(raw, base + off, sz, True)])
        else:
            out.append([base + off, sz, prefix + field, f"u{8 * sz}", _u(raw, base + off, sz)])
        pos = off + sz
    if pos < size:
        out.append([base + pos, size - pos, prefix + "(tail)", "-", None, "any"])
    return out


def inline_tensor_fields(raw: bytes, pos: int, layout: Layout, prefix: str):
    """apir_encode_ggml_tensor_inline: the struct, the 'handle' when buffer is set (the C
    writes its local variable's address: any), the view_src struct, src[i] structs until null."""
    L = layout.fields["ggml_tensor"]
    size = layout.sizes["ggml_tensor"]
    out = ggml_tensor_fields(raw, pos, layout, prefix)
    head = pos
    pos += size
    if _u(raw, head + L["buffer"][0], 8):
        out.append([pos, 8, prefix + "buffer handle (address of the C helper's local variable)",
                    "apir_encode_ggml_buffer_handle", _u(raw, pos, 8), "any"])
        pos += 8
    if _u(raw, head + L["view_src"][0], 8):
        out += ggml_tensor_fields(raw, pos, layout, prefix + "view_src.")
        pos += size
    for i in range(L["src"][1] // 8):
        if not _u(raw, head + L["src"][0] + 8 * i, 8):
            break
        out += ggml_tensor_fields(raw, pos, layout, f"{prefix}src[{i}].")
        pos += size
    return out, pos


def annotate_args(raw: bytes, pos: int, args, layout: Layout, refs, res_role) -> list:
    """Fields of the arguments from `pos`; stops where the bytes end (truncated commands)."""
    out = []
    for name, helper, kind in args:
        if pos >= len(raw):
            break
        if kind == "rpc_tensor":
            out += rpc_tensor_fields(raw, pos, layout, name + ".", False, refs)
            pos += layout.sizes["apir_rpc_tensor"]
        elif kind == "inline_tensor":
            fields, pos = inline_tensor_fields(raw, pos, layout, name + ".")
            out += fields
        else:
            size = KIND_SIZE[kind]
            value = _u(raw, pos, 1 if kind in ("u8", "bool") else size)
            item = [pos, 1 if kind in ("u8", "bool") else size, name, helper, value]
            if kind == "handle":
                rule = refs(value)
                if rule:
                    item.append(rule)
            elif kind == "guest_id":
                item.append("guest-id")
            elif kind == "res_id" and res_role(value):
                item.append(f"res:{res_role(value)}")  # else a deliberately unknown res_id: exact
            out.append(item)
            if kind in ("u8", "bool"):
                out.append([pos + 1, 3, name + " (padding)", "-", None, "any"])
            pos += size
    if pos != len(raw):
        raise ValueError(f"annotation covers {pos} of {len(raw)} bytes")
    return out


def graph_fields(raw: bytes, layout: Layout, refs) -> list:
    """The serialized cgraph (apir_serialize_graph): n_nodes, node ids, n_tensors, records."""
    n_nodes = _u(raw, 0, 4)
    out = [[0, 4, "n_nodes", "u32", n_nodes]]
    for i in range(n_nodes):
        out.append([4 + 8 * i, 8, f"nodes[{i}]", "u64 id", _u(raw, 4 + 8 * i, 8), "id-ref"])
    pos = 4 + 8 * n_nodes
    n_tensors = _u(raw, pos, 4)
    out.append([pos, 4, "n_tensors", "u32", n_tensors])
    pos += 4
    for i in range(n_tensors):
        out += rpc_tensor_fields(raw, pos, layout, f"tensors[{i}].", True, refs)
        pos += layout.sizes["apir_rpc_tensor"]
    if pos != len(raw):
        raise ValueError(f"graph annotation covers {pos} of {len(raw)} bytes")
    return out


def reply_fields(raw: bytes, function: str, minor: int) -> list:
    fields = REPLIES.get(function, [])
    if function == "device_get_props" and minor < 2:
        fields = fields[:4]
    out, pos = [], 0
    for name, helper, kind, rule in fields:
        if kind == "string":
            n = _u(raw, pos, 8)
            text = raw[pos + 8: pos + 8 + n]
            padded = (n + 3) & ~3
            if rule == "any":
                out.append([pos, len(raw) - pos, name, helper, text.rstrip(b"\0").decode("latin-1"), "any-string"])
                pos = len(raw)
                continue
            out.append([pos, 8, name + " (array size: length + 1)", "apir_encode_array_size", n])
            out.append([pos + 8, n, name, "apir_encode_char_array", text.rstrip(b"\0").decode("latin-1")])
            if padded > n:
                out.append([pos + 8 + n, padded - n, name + " (padding)", "-", None, "any"])
            pos += 8 + padded
            continue
        size = KIND_SIZE[kind]
        signed = kind == "i32"
        vsize = 1 if kind == "bool" else size
        item = [pos, vsize, name, helper, _u(raw, pos, vsize, signed)]
        if rule:
            item.append(rule)
        out.append(item)
        if kind == "bool":
            out.append([pos + 1, 3, name + " (padding)", "-", None, "any"])
        pos += size
    if pos != len(raw):
        raise ValueError(f"{function}: reply annotation covers {pos} of {len(raw)} bytes")
    return out


def _steps(stdout: str) -> list:
    return [line.split(None, 1)[1] for line in stdout.splitlines() if line.startswith("STEP ")]


def session(name: str, stdout: str, context: dict, host_config=None, ext: bool = False) -> dict:
    """One capture (the driver's stdout, the recorder's events of its one context) as vectors.
    `ext`: the extended C guest against apir's host, configured with `host_config`."""
    layout = Layout(stdout)
    minor = layout.consts["APIR_PROTOCOL_MINOR"]
    names = _steps(stdout)
    roles: dict = {}
    resources: dict = {}
    handles: dict = {}  # reply handle value -> "step.field"
    steps = []
    submits = 0
    for event in context["events"]:
        if event["kind"] == "resource":
            role = ("reply", "data")[len(roles)] if len(roles) < 2 else f"blob.{names[submits]}"
            roles[event["res_id"]] = role
            resources[role] = {"res_id": event["res_id"], "size": event["size"]}
            continue
        # posted commands first, each its own step, sent with the last (docs/protocol.md 12.7)
        commands = event["commands"]
        batch = names[submits: submits + len(commands)]
        for i, command in enumerate(commands):
            step_name = names[submits]
            submits += 1
            last = i == len(commands) - 1
            step = _step(step_name, command, event if last else None, layout, minor, roles, handles,
                         host_config if ext else None)
            if not last:
                step["sent_with"] = batch[-1]
            steps.append(step)
    if submits != len(names):
        raise ValueError(f"{name}: the driver announced {len(names)} commands, the host saw {submits}")
    out = {"name": name, "capset": context["capset"]}
    if ext:
        out["host_config"] = dict(host_config or {})
    return {**out, "resources": resources, "steps": steps}


def _function(command: str, flags: int):
    if command != "Forward":
        return None
    fid = flags & ~POSTED
    return FUNCTIONS[fid] if fid < len(FUNCTIONS) else EXT_FUNCTIONS.get(fid)


def _step(step_name, command_event, event, layout, minor, roles, handles, apir_host_config=None) -> dict:
    """One step: one command of an EXECBUFFER (`command_event`), with the reply and shared
    memory out of `event` (None for a posted command before the waited one: no reply);
    `apir_host_config` (not None) when apir's host, so configured, answered."""
    raw = bytes.fromhex(command_event["command"])
    cmd_type, flags, reply_res = struct.unpack_from("<III", raw, 0)
    base_type = cmd_type - VENUS_OFFSET if cmd_type >= VENUS_OFFSET else cmd_type
    command = CMD_NAMES[base_type]
    function = _function(command, flags)
    key = function or command

    def refs(value):
        return f"ref:{handles[value]}" if value in handles else None

    def res_role(value):
        return roles.get(value)

    fields = [[0, 4, "command type" + (" (+331: Venus capset)" if cmd_type >= VENUS_OFFSET else ""),
               "apir_encode_int32_t", cmd_type],
              [4, 4, "flags" + (" (backend function id)" if command == "Forward" else ""),
               "apir_encode_int32_t", flags]]
    if command == "Forward" and flags & POSTED:
        fields.append([8, 4, "length (posted: header included, no reply)", "u32", reply_res])
    else:
        fields.append([8, 4, "reply resource id", "u32", reply_res, f"res:{res_role(reply_res)}"])
    fields += annotate_args(raw, 12, ARGS.get(key, []), layout, refs, res_role)
    if step_name.startswith("error.") and command == "Forward" and flags & POSTED:
        encoder = ("apir_buffer_post_clear + remote_call_post (patches/ggml-virtgpu-extensions.patch), "
                   "of a buffer the host never gave: posted, a deliberately wrong command")
    elif step_name.startswith(("error.", "component.")):
        encoder = "remote_call_prepare + apir_cs.h helpers (a deliberately wrong or repeated command)"
    elif step_name.startswith("forget."):
        encoder = "remote_call_prepare + apir_cs.h helpers (ext_query sent again, to make the host forget its graphs)"
    elif function in ("device_get_device_count", "buffer_type_is_host"):
        encoder = "remote_call_prepare + apir_cs.h helpers (the C guest has no function for it)"
    elif function == "ext_query":
        encoder = "virtgpu_ext_query (ggml-virtgpu/virtgpu.cpp, patches/ggml-virtgpu-extensions.patch)"
    elif function in ("graph_compute_keep", "graph_recompute"):
        encoder = ("apir_backend_graph_compute (ggml-virtgpu/virtgpu-forward-backend.cpp, "
                   "patches/ggml-virtgpu-extensions.patch)")
    elif function == "device_select":
        encoder = "apir_device_lock (ggml-virtgpu/virtgpu-forward-device.cpp, patches/ggml-virtgpu-extensions.patch)"
    elif function == "synchronize":
        encoder = ("apir_backend_synchronize (ggml-virtgpu/virtgpu-forward-backend.cpp, "
                   "patches/ggml-virtgpu-extensions.patch)")
    elif function and function.startswith("event_"):
        encoder = f"apir_{function} (ggml-virtgpu/virtgpu-forward-backend.cpp, patches/ggml-virtgpu-extensions.patch)"
    elif command == "Forward" and flags & POSTED:
        post = "set_tensor" if function == "buffer_set_tensor_at" else function.removeprefix("buffer_")
        encoder = (f"apir_buffer_post_{post} + remote_call_post (ggml-virtgpu/virtgpu-forward-buffer.cpp, "
                   "virtgpu.cpp, patches/ggml-virtgpu-extensions.patch): posted")
    elif command == "Forward":
        encoder = f"apir_{function} (ggml-virtgpu/virtgpu-forward-*.cpp)"
    else:
        encoder = "virtgpu_handshake / virtgpu_load_library (ggml-virtgpu/virtgpu.cpp)"
    step = {"name": step_name, "command_type": command, "encoder": encoder}
    if function or command == "Forward":
        step["function"] = function or f"(id {flags}: out of range)"
        step["function_id"] = flags
    step["command"] = {"hex": raw.hex(), "fields": fields}
    if "shmem_in" in command_event:
        blob = bytes.fromhex(command_event["shmem_in"]["hex"])
        shmem = {"res": roles.get(command_event["shmem_in"]["res_id"], "unknown")}
        if command_event["shmem_in"].get("offset"):
            shmem["offset"] = command_event["shmem_in"]["offset"]
        shmem["hex"] = blob.hex()
        if function in ("backend_graph_compute", "graph_compute_keep") and blob:
            shmem["fields"] = graph_fields(blob, layout, refs)
        step["shmem_in"] = shmem
    if event is None:
        return step
    rc = event["return_code"]
    reply_raw = bytes.fromhex(event["reply"])
    if apir_host_config is not None and command == "Forward":
        settings = ", ".join(f"{k}={v}" for k, v in apir_host_config.items())
        source = ("apir's host (apir.host.backend.extensions, ggml's CPU backend" +
                  (f"; {settings})" if settings else "; extensions on)") +
                  ": the C host library has no extensions")
    elif command != "Forward":
        source = "apir component (virglrenderer's role: no C build of the component exists)"
    elif function == "buffer_free_buffer":
        source = "apir.host.backend.c_library adapter, with the C handler's checks and return codes (docs/interop.md)"
    else:
        source = "C host library libggml-virtgpu-backend.so (apir_backend_dispatcher)"
    ok = (command == "Forward" and rc == 4) or (command == "HandShake" and rc == 0xAB1E)
    reply = {"source": source, "return_code": rc,
             "return_code_meaning": RC_MEANING.get(command, {}).get(rc, ""), "hex": reply_raw.hex()}
    if ok:
        reply["fields"] = reply_fields(reply_raw, key, minor)
        for item in reply["fields"]:
            if len(item) > 5 and item[5] == "handle" and item[4]:
                handles.setdefault(item[4], f"{step_name}.{item[2]}")
    elif reply_raw:
        reply["fields"] = [[0, len(reply_raw), "(payload of a failed command: meaningless)", "-", None, "any"]]
    else:
        reply["fields"] = []
    step["reply"] = reply
    if "shmem_out" in event:
        step["shmem_out"] = {"res": roles.get(event["shmem_out"]["res_id"], "unknown"),
                             "hex": event["shmem_out"]["hex"]}
    return step


def document(version: str, ggml_version: str, stdout: str, sessions: list, ext: bool = False) -> dict:
    layout = Layout(stdout)
    if ext:
        by = ("scripts/make-conformance-vectors.py --version ext (the C guest libggml-virtgpu.so of this ggml "
              "with patches/ggml-virtgpu-extensions.patch, apir's host with and without extensions, on ggml's "
              "CPU backend)")
    else:
        by = ("scripts/make-conformance-vectors.py (C guest libggml-virtgpu.so and C host library "
              "libggml-virtgpu-backend.so of this ggml, on ggml's CPU backend)")
    return {
        "format": "apir-conformance/1",
        "apir": f"{layout.consts['APIR_PROTOCOL_MAJOR']}.{layout.consts['APIR_PROTOCOL_MINOR']}",
        **({"extensions": True} if ext else {}),
        "ggml": ggml_version,
        "generated_by": by,
        "readme": "conformance/README.md (fields, rules, how to replay)",
        "constants": layout.consts,
        "layouts": layout.as_json(),
        "sessions": sessions,
    }


def dumps(doc: dict) -> str:
    """JSON with one field per line: diffable, still compact."""

    def flat(value) -> bool:
        return isinstance(value, list) and all(not isinstance(v, (dict, list)) or
                                               (isinstance(v, list) and all(not isinstance(w, (dict, list)) for w in v))
                                               for v in value)

    def enc(value, indent: int) -> str:
        pad = " " * indent
        if isinstance(value, dict):
            items = [f"{pad} {json.dumps(k)}: {enc(v, indent + 1)}" for k, v in value.items()]
            return "{\n" + ",\n".join(items) + "\n" + pad + "}" if items else "{}"
        if isinstance(value, list) and not flat(value):
            items = [f"{pad} {enc(v, indent + 1)}" for v in value]
            return "[\n" + ",\n".join(items) + "\n" + pad + "]" if items else "[]"
        if isinstance(value, list) and value and isinstance(value[0], list):
            items = [f"{pad} {json.dumps(v)}" for v in value]
            return "[\n" + ",\n".join(items) + "\n" + pad + "]"
        return json.dumps(value)

    return enc(doc, 0) + "\n"
