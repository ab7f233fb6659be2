"""Differential run: the same APIR commands to the C dispatcher and to apir's Python dispatcher.

Theory of operation: two `HostContext`s live in one process whose only ggml is the C reference
build's (APIR_GGML_LIB_DIR / APIR_GGML_INCLUDE_DIR point at it, so the C backend library and
apir's ggml binding share one libggml-base). One loads libggml-virtgpu-backend.so through
`apir.host.backend.c_library`, the other apir's built-in dispatcher. Each gets its own reply blob, data
blob and buffer_from_ptr blob of the same sizes. A scripted session sends every one of the 23
backend functions (some several times) as identical command bytes, except for the handles each
host gave out earlier, which are substituted per side. Each reply is decoded with the layout the
C handler writes and compared field by field: return codes and every value must be equal;
handles and host addresses must be non-zero on both sides (their values are excepted);
device_get_props' reply bytes (each slot's first byte, slots after the reply included) must
be equal;
device_get_memory's free memory is read twice by the OS and only has to be within the total.
Data a command leaves in shared memory (buffer_get_tensor) is compared byte for byte.

Run it as ``python -m tests.interop.differential PATHS_ENV`` (the C build's paths.env); it prints
one JSON object: {"apir_version": [0, 2], "ggml": "0.20.2", "checks": [{"name", "function" (-1 for
HandShake / LoadLibrary), "ok", "detail", "shmem_hex" (the C side's shared-memory bytes)}...]}.
tests/interop/test_differential.py runs it in a subprocess with the right environment.
"""

from __future__ import annotations

import json
import mmap
import re
import struct
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from apir.codec.constants import ApirBackendCommandType as Fn
from apir.codec.constants import ApirCommandType, ApirForwardReturnCode
from apir.codec.records import ggml_tensor_dtype, rpc_tensor_dtype
from apir.codec.wire import Decoder, Encoder

REPLY_SIZE = 0x4000
DATA_SIZE = 1 << 20
FROM_PTR_SIZE = 1 << 16
RES_REPLY, RES_DATA, RES_FROM_PTR = 1, 2, 3
_HEADER = struct.Struct("<III")

# Reply layouts of the C handlers (backend-dispatched-*.cpp): field kinds in order.
#   u32 / i32 / u64 / bool: compared; "string": u64 size + bytes; "handle" / "address": non-zero
#   on both sides; "free_memory": checked against the next field (total).
REPLY_LAYOUT: Dict[int, Tuple[str, ...]] = {
    Fn.DEVICE_GET_DEVICE_COUNT: ("i32",),
    Fn.DEVICE_GET_COUNT: ("i32",),
    Fn.DEVICE_GET_NAME: ("string",),
    Fn.DEVICE_GET_DESCRIPTION: ("string",),
    Fn.DEVICE_GET_TYPE: ("u32",),
    Fn.DEVICE_GET_MEMORY: ("free_memory", "u64"),
    Fn.DEVICE_SUPPORTS_OP: ("bool",),
    Fn.DEVICE_GET_BUFFER_TYPE: ("handle",),
    Fn.DEVICE_GET_PROPS: ("bool",) * 5,  # 4 for an APIR 0.1 guest, see props_layout()
    Fn.DEVICE_BUFFER_FROM_PTR: ("handle", "handle"),
    Fn.BUFFER_TYPE_GET_NAME: ("string",),
    Fn.BUFFER_TYPE_GET_ALIGNMENT: ("u64",),
    Fn.BUFFER_TYPE_GET_MAX_SIZE: ("u64",),
    Fn.BUFFER_TYPE_IS_HOST: ("bool",),
    Fn.BUFFER_TYPE_ALLOC_BUFFER: ("handle",),
    Fn.BUFFER_TYPE_GET_ALLOC_SIZE: ("u64",),
    Fn.BUFFER_GET_BASE: ("address",),
    Fn.BUFFER_SET_TENSOR: (),
    Fn.BUFFER_GET_TENSOR: (),
    Fn.BUFFER_CPY_TENSOR: ("bool",),
    Fn.BUFFER_CLEAR: (),
    Fn.BUFFER_FREE_BUFFER: (),
    Fn.BACKEND_GRAPH_COMPUTE: ("u32",),  # enum ggml_status
}


def apir_version_of(paths: Dict[str, str]) -> Tuple[int, int]:
    """APIR_PROTOCOL_MAJOR / MINOR of a C reference build (its api_remoting.h)."""
    text = open(f"{paths['GGML_VIRTGPU_SHARED_INCLUDE']}/api_remoting.h").read()
    major = int(re.search(r"#define APIR_PROTOCOL_MAJOR (\d+)", text).group(1))
    minor = int(re.search(r"#define APIR_PROTOCOL_MINOR (\d+)", text).group(1))
    return major, minor


@dataclass
class Side:
    """One host (C or Python) with its blobs and the handles it gave out."""

    name: str
    ctx: object
    reply: mmap.mmap
    data: mmap.mmap
    from_ptr: mmap.mmap
    handles: Dict[str, int] = field(default_factory=dict)

    def submit(self, cmd_type: int, flags: int, payload: bytes) -> Tuple[int, Decoder]:
        struct.pack_into("<I", self.reply, 0, 0)
        self.ctx.submit(_HEADER.pack(cmd_type, flags, RES_REPLY) + payload)
        word = struct.unpack_from("<I", self.reply, 0)[0]
        return word - 1, Decoder(self.reply, 4)


def _config(paths: Dict[str, str], c_library: bool) -> Dict[str, str]:
    cfg = {"ggml.library.path": paths["LIBGGML_CPU"], "ggml.library.reg": "ggml_backend_cpu_reg"}
    if c_library:
        cfg["apir.load_library.path"] = paths["LIBGGML_VIRTGPU_BACKEND"]
    return cfg


def make_sides(paths: Dict[str, str]) -> List[Side]:
    from apir.host.backend.c_library import c_library_factory
    from apir.host.component.context import HostContext

    sides = []
    for ctx_id, (name, is_c) in enumerate((("C", True), ("apir", False)), start=101):
        kwargs = {"library_factory": c_library_factory} if is_c else {}
        ctx = HostContext(ctx_id, _config(paths, is_c), **kwargs)
        side = Side(name, ctx, mmap.mmap(-1, REPLY_SIZE), mmap.mmap(-1, DATA_SIZE), mmap.mmap(-1, FROM_PTR_SIZE))
        ctx.add_resource(RES_REPLY, side.reply)
        ctx.add_resource(RES_DATA, side.data)
        ctx.add_resource(RES_FROM_PTR, side.from_ptr)
        sides.append(side)
    return sides


# --- command builders: fn(side) -> payload bytes ------------------------------------------------

class Tensors:
    """Raw records the commands carry, for the ggml build in this process."""

    def __init__(self, g):
        self.g = g
        # GGML_TENSOR_FLAG_COMPUTE: ggml CPU skips graph nodes without it (ggml >= 0.10)
        header = (g.include_dir / "ggml.h").read_text()
        self.flag_compute = int(re.search(r"GGML_TENSOR_FLAG_COMPUTE\s*=\s*(\d+)", header).group(1))
        self.rpc = rpc_tensor_dtype(g.limits)
        self.inline = ggml_tensor_dtype(g.limits)

    def rpc_tensor(self, tid: int, type_name: str, ne, buffer: int, data: int, op: str = "NONE",
                   src=(), name: str = "") -> bytes:
        g = self.g
        rec = np.zeros((), self.rpc)
        rec["id"] = tid
        rec["type"] = g.types[type_name]
        rec["buffer"] = buffer
        ne = list(ne) + [1] * (g.limits.max_dims - len(ne))
        rec["ne"] = ne
        size = g.ggml_type_size(g.types[type_name])
        nb = [size]
        for i in range(1, len(ne)):
            nb.append(nb[-1] * ne[i - 1])
        rec["nb"] = nb
        rec["op"] = g.ops[op]
        if op != "NONE":
            rec["flags"] = self.flag_compute  # what ggml_build_forward_expand sets on nodes
        for i, s in enumerate(src):
            rec["src"][i] = s
        rec["data"] = data
        rec["name"][: len(name)] = list(name.encode())
        return rec.tobytes()

    def inline_tensor(self, op: str, type_name: str, ne, srcs=()) -> bytes:
        """The raw ggml_tensor of a bufferless node followed by its bufferless sources, as
        apir_encode_ggml_tensor_inline sends it (src pointers are the guest's: any non-zero)."""
        g = self.g

        def one(op_name, ne_, src_count):
            rec = np.zeros((), self.inline)
            rec["type"] = g.types[type_name]
            full = list(ne_) + [1] * (g.limits.max_dims - len(ne_))
            rec["ne"] = full
            size = g.ggml_type_size(g.types[type_name])
            nb = [size]
            for i in range(1, len(full)):
                nb.append(nb[-1] * full[i - 1])
            rec["nb"] = nb
            rec["op"] = g.ops[op_name]
            for i in range(src_count):
                rec["src"][i] = 0x1000 * (i + 1)  # guest pointers: only their presence matters
            return rec.tobytes()

        return one(op, ne, len(srcs)) + b"".join(one("NONE", s, 0) for s in srcs)


def _enc(build: Callable[[Encoder], None], size: int = 8192) -> bytes:
    buf = bytearray(size)
    enc = Encoder(buf)
    build(enc)
    enc.check()
    return bytes(buf[: enc.pos])


@dataclass
class Step:
    """One command; `payload(side)` builds its bytes; `after(side, values)` keeps handles;
    `shmem(side)` returns the bytes to compare from the data blob after the command."""

    name: str
    function: int
    payload: Callable[[Side], bytes] = lambda side: b""
    after: Optional[Callable[[Side, list], None]] = None
    shmem: Optional[Callable[[Side], bytes]] = None
    prepare: Optional[Callable[[Side], None]] = None


def _keep(*names):
    def after(side: Side, values: list) -> None:
        for n, v in zip(names, values):
            side.handles[n] = v
    return after


def script(t: Tensors, n_props: int) -> List[Step]:
    """The session: every backend function at least once, in an order a guest would use."""
    g = t.g
    K, M, N = 16, 4, 3  # a: K x M, b: K x N, c: M x N (ggml ne order)
    f32 = g.ggml_type_size(g.types["F32"])
    a_vals = (np.arange(K * M, dtype=np.float32) % 7 - 3) / 4
    b_vals = (np.arange(K * N, dtype=np.float32) % 5 - 2) / 2
    c_vals = np.arange(M * N, dtype=np.float32) / 8
    # tensor placement in the allocated buffer (offsets from its base, 64-byte aligned)
    off_a, off_b, off_c, off_mm, off_out, off_cpy = 0, 4096, 8192, 12288, 16384, 20480
    size_a, size_c = K * M * f32, M * N * f32

    def buf(side):
        return side.handles["buffer"]

    def rpc_a(side):
        return t.rpc_tensor(1, "F32", (K, M), buf(side), off_a, name="a")

    def rpc_c(side):
        return t.rpc_tensor(3, "F32", (M, N), buf(side), off_c, name="c")

    def rpc_cpy(side):
        return t.rpc_tensor(9, "F32", (M, N), buf(side), off_cpy, name="c_copy")

    def _set_get(e, handle, rpc, data_off, size):
        e.u64(handle)
        e.blob(rpc)
        e.u32(RES_DATA)
        e.u64(0)  # offset in the tensor
        e.u64(size)

    def set_step(name, rpc, values):
        # the values go to the start of the data blob, then set_tensor reads them from there
        return Step(name, Fn.BUFFER_SET_TENSOR,
                    lambda side: _enc(lambda e: _set_get(e, buf(side), rpc(side), 0, values.nbytes)),
                    prepare=lambda side: side.data.__setitem__(slice(0, values.nbytes), values.tobytes()))

    def get_step(name, rpc, size):
        return Step(name, Fn.BUFFER_GET_TENSOR,
                    lambda side: _enc(lambda e: _set_get(e, buf(side), rpc(side), 0, size)),
                    prepare=lambda side: side.data.__setitem__(slice(0, size), b"\xee" * size),
                    shmem=lambda side: bytes(side.data[:size]))

    def graph(side):
        """mul_mat(a, b) + c, serialized as the C guest does: u32 n_nodes, u64 node ids,
        u32 n_tensors, apir_rpc_tensor records."""
        h = buf(side)
        recs = [
            t.rpc_tensor(1, "F32", (K, M), h, off_a, name="a"),
            t.rpc_tensor(2, "F32", (K, N), h, off_b, name="b"),
            t.rpc_tensor(3, "F32", (M, N), h, off_c, name="c"),
            t.rpc_tensor(4, "F32", (M, N), h, off_mm, op="MUL_MAT", src=(1, 2), name="mm"),
            t.rpc_tensor(5, "F32", (M, N), h, off_out, op="ADD", src=(4, 3), name="out"),
        ]
        nodes = [4, 5]
        return (struct.pack("<I", len(nodes)) + struct.pack(f"<{len(nodes)}Q", *nodes)
                + struct.pack("<I", len(recs)) + b"".join(recs))

    def graph_prepare(side):
        blob = graph(side)
        side.data[: len(blob)] = blob

    steps = [
        Step("device_get_device_count", Fn.DEVICE_GET_DEVICE_COUNT),
        Step("device_get_count", Fn.DEVICE_GET_COUNT),
        Step("device_get_name", Fn.DEVICE_GET_NAME),
        Step("device_get_description", Fn.DEVICE_GET_DESCRIPTION),
        Step("device_get_type", Fn.DEVICE_GET_TYPE),
        Step("device_get_memory", Fn.DEVICE_GET_MEMORY),
        Step("device_get_props", Fn.DEVICE_GET_PROPS),
        Step("device_supports_op(ADD f32)", Fn.DEVICE_SUPPORTS_OP,
             lambda side: t.inline_tensor("ADD", "F32", (8, 4), [(8, 4), (8, 4)])),
        Step("device_supports_op(MUL_MAT f32)", Fn.DEVICE_SUPPORTS_OP,
             lambda side: t.inline_tensor("MUL_MAT", "F32", (4, 3), [(16, 4), (16, 3)])),
        Step("device_get_buffer_type", Fn.DEVICE_GET_BUFFER_TYPE, after=_keep("buft")),
        Step("buffer_type_get_name", Fn.BUFFER_TYPE_GET_NAME, lambda side: struct.pack("<Q", side.handles["buft"])),
        Step("buffer_type_get_alignment", Fn.BUFFER_TYPE_GET_ALIGNMENT,
             lambda side: struct.pack("<Q", side.handles["buft"])),
        Step("buffer_type_get_max_size", Fn.BUFFER_TYPE_GET_MAX_SIZE,
             lambda side: struct.pack("<Q", side.handles["buft"])),
        Step("buffer_type_is_host", Fn.BUFFER_TYPE_IS_HOST, lambda side: struct.pack("<Q", side.handles["buft"])),
        Step("buffer_type_get_alloc_size", Fn.BUFFER_TYPE_GET_ALLOC_SIZE,
             lambda side: struct.pack("<Q", side.handles["buft"]) + t.inline_tensor("NONE", "F32", (33, 5))),
        Step("buffer_type_alloc_buffer", Fn.BUFFER_TYPE_ALLOC_BUFFER,
             lambda side: struct.pack("<QQ", side.handles["buft"], 32768), after=_keep("buffer")),
        Step("buffer_get_base", Fn.BUFFER_GET_BASE, lambda side: struct.pack("<Q", buf(side))),
        Step("buffer_clear(0)", Fn.BUFFER_CLEAR, lambda side: struct.pack("<QI", buf(side), 0)),
        set_step("buffer_set_tensor(a)", rpc_a, a_vals),
        get_step("buffer_get_tensor(a)", rpc_a, size_a),
        set_step("buffer_set_tensor(b)",
                 lambda side: t.rpc_tensor(2, "F32", (K, N), buf(side), off_b, name="b"), b_vals),
        set_step("buffer_set_tensor(c)", rpc_c, c_vals),
        Step("backend_graph_compute(mul_mat + add)", Fn.BACKEND_GRAPH_COMPUTE,
             lambda side: struct.pack("<IQ", RES_DATA, len(graph(side))), prepare=graph_prepare),
        get_step("buffer_get_tensor(out)",
                 lambda side: t.rpc_tensor(5, "F32", (M, N), buf(side), off_out, name="out"), size_c),
        Step("buffer_cpy_tensor(c -> c_copy)", Fn.BUFFER_CPY_TENSOR,
             lambda side: struct.pack("<Q", buf(side)) + rpc_c(side) + rpc_cpy(side)),
        get_step("buffer_get_tensor(c_copy)", rpc_cpy, size_c),
        Step("buffer_clear(0x5a)", Fn.BUFFER_CLEAR, lambda side: struct.pack("<QI", buf(side), 0x5A)),
        get_step("buffer_get_tensor(a) after clear", rpc_a, size_a),
        Step("device_buffer_from_ptr", Fn.DEVICE_BUFFER_FROM_PTR,
             lambda side: struct.pack("<IQQ", RES_FROM_PTR, FROM_PTR_SIZE, FROM_PTR_SIZE),
             after=_keep("from_ptr_buffer", "from_ptr_buft")),
        Step("buffer_free_buffer(from_ptr)", Fn.BUFFER_FREE_BUFFER,
             lambda side: struct.pack("<Q", side.handles["from_ptr_buffer"])),
        Step("buffer_free_buffer(alloc)", Fn.BUFFER_FREE_BUFFER, lambda side: struct.pack("<Q", buf(side))),
    ]
    return steps


# Replies compared byte for byte, with what the reply resource held before: the byte each
# 4-byte slot's decoder reads (the C writes a bool's one byte and leaves the slot's padding),
# in every slot, so a slot written on one side only shows (device_get_props: 4 slots in APIR
# 0.1, 5 in 0.2).
_RAW_EQUAL = (Fn.DEVICE_GET_PROPS,)
_RAW_REPLY = 64


def props_layout(version: Tuple[int, int]) -> Tuple[str, ...]:
    return ("bool",) * (4 if version < (0, 2) else 5)


def decode_reply(dec: Decoder, layout: Tuple[str, ...]) -> list:
    values = []
    for kind in layout:
        if kind == "string":
            size = dec.u64()
            values.append(bytes(dec.blob(size)) if 0 < size <= dec.remaining else None)
        elif kind in ("u64", "handle", "address", "free_memory"):
            values.append(dec.u64())
        elif kind == "i32":
            values.append(dec.i32())
        elif kind == "bool":
            values.append(dec.bool())
        else:
            values.append(dec.u32())
    return values


def compare(layout: Tuple[str, ...], c_vals: list, py_vals: list) -> List[str]:
    """Differences between two decoded replies ([] when they agree)."""
    diffs = []
    for i, kind in enumerate(layout):
        cv, pv = c_vals[i], py_vals[i]
        if kind in ("handle", "address"):
            if not cv or not pv:
                diffs.append(f"field {i} ({kind}): C {cv:#x}, apir {pv:#x} (both must be non-zero)")
        elif kind == "free_memory":
            total_c, total_p = c_vals[i + 1], py_vals[i + 1]
            if not (0 < cv <= total_c and 0 < pv <= total_p):
                diffs.append(f"field {i} (free memory): C {cv}/{total_c}, apir {pv}/{total_p}")
        elif cv != pv:
            diffs.append(f"field {i} ({kind}): C {cv!r}, apir {pv!r}")
    return diffs


def run(paths: Dict[str, str]) -> dict:
    import apir.ggml

    g = apir.ggml.load()
    version = apir_version_of(paths)
    sides = make_sides(paths)
    checks = []

    def check(name, function, ok, detail="", shmem=None):
        checks.append({"name": name, "function": function, "ok": bool(ok), "detail": detail,
                       "shmem_hex": shmem.hex() if shmem is not None else None})

    # HandShake and LoadLibrary, as the C guest of this build sends them
    results = []
    for side in sides:
        rc, dec = side.submit(ApirCommandType.HANDSHAKE, 0, struct.pack("<II", *version))
        results.append((rc, dec.u32(), dec.u32()))
    check("HandShake", -1, results[0][0] == results[1][0] == 0xAB1E, f"C {results[0]}, apir {results[1]}")
    rcs = [side.submit(ApirCommandType.LOADLIBRARY, 0, b"")[0] for side in sides]
    check("LoadLibrary", -1, rcs == [0, 0], f"C {rcs[0]}, apir {rcs[1]}")
    if rcs != [0, 0]:
        return {"apir_version": list(version), "ggml": g.version, "checks": checks}

    t = Tensors(g)
    for step in script(t, len(props_layout(version))):
        layout = props_layout(version) if step.function == Fn.DEVICE_GET_PROPS else REPLY_LAYOUT[step.function]
        out = []
        for side in sides:
            if step.prepare:
                step.prepare(side)
            side.reply[4:4 + _RAW_REPLY] = b"\xee" * _RAW_REPLY  # what a longer earlier reply left
            rc, dec = side.submit(ApirCommandType.FORWARD, step.function, step.payload(side))
            values = decode_reply(dec, layout)
            if step.after and rc == ApirForwardReturnCode.BASE_INDEX:
                step.after(side, values)
            out.append((rc, values, step.shmem(side) if step.shmem else None, bytes(side.reply[4:4 + _RAW_REPLY])))
        (rc_c, v_c, m_c, raw_c), (rc_p, v_p, m_p, raw_p) = out
        diffs = [] if rc_c == rc_p else [f"return code: C {rc_c}, apir {rc_p}"]
        diffs += compare(layout, v_c, v_p)
        if step.function in _RAW_EQUAL and raw_c[::4] != raw_p[::4]:
            diffs.append(f"reply bytes differ: C {raw_c.hex()}, apir {raw_p.hex()}")
        if m_c != m_p:
            diffs.append("shared memory differs after the command")
        if rc_c != ApirForwardReturnCode.BASE_INDEX:
            diffs.append(f"C returned {rc_c}, not success")
        detail = "; ".join(diffs) if diffs else f"rc {rc_c}, values {[_show(v) for v in v_c]}"
        if m_c is not None and not diffs:
            detail += f", {len(m_c)} shared-memory bytes equal"
        check(step.name, int(step.function), not diffs, detail, m_c)

    for side in sides:
        side.ctx.close()
    return {"apir_version": list(version), "ggml": g.version, "checks": checks}


def _show(v):
    return v.decode(errors="replace") if isinstance(v, bytes) else v


def main(argv: List[str]) -> int:
    paths = {}
    for line in open(argv[1]).read().splitlines():
        key, _, value = line.partition("=")
        paths[key] = value
    print(json.dumps(run(paths)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
