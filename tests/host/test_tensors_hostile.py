"""Hostile apir_rpc_tensor records for set / get / cpy_tensor (apir.host.tensors: `RpcTensor`
read in one struct.unpack_from, the host tensor `TensorChecker.loose_twin` writes for ggml),
through the real dispatch path, in a child process where an abort would fail the test.
- Every refusal (unknown / freed / foreign handles, bad types, ops, names and blocks, extents
  and offsets that wrap 2**64, sizes over the resource, truncated records, cpy_tensor sources
  larger than the room left) answers BACKEND_RC_ERROR and changes no byte of any buffer or
  resource; the host serves on.
- Accepted edges (a tensor ending exactly at its buffer's end, nb[0] below the element size,
  zero-size transfers at offset 2**64 - 1, cpy_tensor into a smaller tensor as the C does,
  src == dst, ggml's zero-size dummy buffer) touch only the tensor's bytes.
- RpcTensor against numpy on random bytes; ggml_nbytes of the loose twin never exceeds the
  checked extent, for every valid type and random ne / nb; the twin's fields.
- A guest thread flipping `data` and ne[0] inside the command while the host reads it: every
  accepted command wrote / read the one checked range (a record re-read per field fails this).
- graph_compute's per-tensor fallback refuses what the kernel leaves to it, naming the tensor.
- Handles: another context's handles reach only this context's buffers; a freed handle is
  never handed out again; a wrapped buffer's handle dies with its resource.
- Names, ops and op_params do not change what a transfer moves; deferred uploads get the
  checked twin, refusals queue nothing, an upload over the staging goes synchronous.
"""

from __future__ import annotations

import ctypes
import mmap
import struct

import numpy as np

from apir.codec.constants import ApirBackendCommandType as Cmd, ApirCommandType
from apir.codec.records import rpc_tensor_dtype
from tests.host.childkit import run_in_child
from tests.host.hostkit import DATA_RES, REPLY_RES, Guest

WRAP_RES = 3  # a resource a buffer_from_ptr buffer wraps: its bytes past the buffer are watched
PAGE = mmap.PAGESIZE
U32 = (1 << 32) - 1
U64 = (1 << 64) - 1


def rec(g, type_="F32", ne=(16, 1, 1, 1), nb=None, buffer=0, data=0, name=b"t", op=0, op_params=(), flags=0):
    """One apir_rpc_tensor's bytes, every field given (nb: contiguous when None)."""
    r = np.zeros(1, rpc_tensor_dtype(g.limits))[0]
    t = g.types[type_] if isinstance(type_, str) else type_
    r["type"] = t
    ne = list(ne)
    if nb is None:
        ts, bs = g.ggml_type_size(t), g.ggml_blck_size(t)
        nb = [ts, ts * (ne[0] // bs)]
        nb += [nb[1] * ne[1], nb[1] * ne[1] * ne[2]]
    r["ne"], r["nb"] = ne, list(nb)
    r["buffer"], r["data"], r["op"], r["flags"] = buffer, data, op, flags
    params = np.zeros(g.limits.max_op_params // 4, np.int32)
    params[: len(op_params)] = op_params
    r["op_params"] = params
    raw = bytearray(r.tobytes())
    at = rpc_tensor_dtype(g.limits).fields["name"][1]
    raw[at : at + g.limits.max_name] = name.ljust(g.limits.max_name, b"\0")[: g.limits.max_name]
    return bytes(raw)


class Host:
    """A Guest with one allocated buffer pair and a buffer_from_ptr buffer whose resource is
    larger than the buffer (its bytes past the buffer show any write beyond it)."""

    def __init__(self, g, wrap_pages: int = 1, res_pages: int = 3):
        self.g = g
        self.guest = Guest()
        self.lib = self.guest.ctx._library
        self.wrap_mem = mmap.mmap(-1, res_pages * PAGE)
        self.guest.ctx.add_resource(WRAP_RES, self.wrap_mem)
        rc, d = self.guest.forward(
            Cmd.DEVICE_BUFFER_FROM_PTR, lambda e: (e.u32(WRAP_RES), e.size_t(wrap_pages * PAGE), e.size_t(PAGE))
        )
        assert rc == 0
        self.wrap = d.handle()
        assert self.wrap and self.lib.buffers.get(self.wrap).size == wrap_pages * PAGE

    def alloc(self, size: int, fill: int = 0) -> int:
        h = self.guest.alloc(size)
        if fill:
            b = self.lib.buffers.get(h)
            ctypes.memset(b.base, fill, b.size)
        return h

    def bytes_of(self, h: int) -> bytes:
        b = self.lib.buffers.get(h)
        return ctypes.string_at(b.base, b.size) if b.size else b""

    def transfer(self, cmd, handle: int, rpc: bytes, offset: int, size: int, res: int = DATA_RES) -> int:
        rc, _ = self.guest.forward(
            cmd, lambda e: (e.handle(handle), e.blob(rpc), e.u32(res), e.size_t(offset), e.size_t(size))
        )
        return rc

    def set(self, handle, rpc, data: bytes, offset: int = 0, size=None) -> int:
        self.guest.data[: len(data)] = data
        return self.transfer(Cmd.BUFFER_SET_TENSOR, handle, rpc, offset, len(data) if size is None else size)

    def get(self, handle, rpc, size: int, offset: int = 0):
        self.guest.data[:size] = b"\xee" * size if size <= len(self.guest.data) else b""
        rc = self.transfer(Cmd.BUFFER_GET_TENSOR, handle, rpc, offset, size)
        return rc, bytes(self.guest.data[: min(size, len(self.guest.data))])

    def cpy(self, handle, src: bytes, dst: bytes):
        rc, d = self.guest.forward(Cmd.BUFFER_CPY_TENSOR, lambda e: (e.handle(handle), e.blob(src), e.blob(dst)))
        return rc, (d.bool() if rc == 0 else None)

    def close(self):
        self.guest.close()


# --- every refusal: an error code, no byte of any buffer or resource changed (child) --------------


def _transfer_cases(g, A, B, W, buft, data_size):
    """(label, command handle, rpc bytes, offset, size, res_id) of set/get commands the host
    must refuse; A, B: allocated 4096-byte buffers, W: the 4096-byte buffer_from_ptr one."""
    out = []
    for tgt in (A, W):

        def add(label, rpc, offset=0, size=64, handle=tgt, res=DATA_RES, tgt=tgt):
            out.append((f"{label} [{'A' if tgt == A else 'W'}]", handle, rpc, offset, size, res))

        add("unknown command handle", rec(g, buffer=999), handle=999)
        add("command handle 0, record without buffer", rec(g), handle=0)
        add("record without buffer", rec(g))
        add("record without buffer, data 16", rec(g, data=16))
        add("record in another buffer", rec(g, buffer=B if tgt == A else A))
        add("record's buffer is a buffer-type handle", rec(g, buffer=buft))
        for t in [int(t) for t in np.flatnonzero(~g.valid_types)] + [len(g.valid_types), 255, U32]:
            add(f"type {t}", rec(g, type_=t, nb=(4, 64, 64, 64), buffer=tgt))
        for op in [g.op_count, g.op_count + 1, U32] + sorted(
            int(g.ops[n]) for n in ("CUSTOM", "MAP_CUSTOM1", "MAP_CUSTOM2", "MAP_CUSTOM3")
        ):
            add(f"op {op}", rec(g, buffer=tgt, op=op, op_params=(-1, (1 << 31) - 1, -(1 << 31))))
        add("Q4_0 ne[0] 31", rec(g, "Q4_0", ne=(31, 1, 1, 1), nb=(18, 18, 18, 18), buffer=tgt), size=18)
        add("Q4_K ne[0] 255", rec(g, "Q4_K", ne=(255, 1, 1, 1), nb=(144, 144, 144, 144), buffer=tgt), size=16)
        add("name of 64 bytes, no NUL", rec(g, buffer=tgt, name=b"N" * 64))
        for data in (4096 - 63, 4096, 4097, 1 << 32, 1 << 63, U64 - 63, U64):
            add(f"data {data}", rec(g, buffer=tgt, data=data), size=1)
        add(
            "ggml_nbytes wraps to 6 (extent 2**64 + 6)",
            rec(g, ne=(1, U32, 7, 1), nb=(4, U32, 1 << 31, 4), buffer=tgt),
            size=4,
        )
        add("ne, nb all 2**32 - 1", rec(g, ne=(U32,) * 4, nb=(U32,) * 4, buffer=tgt), size=4)
        add("ne[0] 2**32 - 1 (extent 16 GiB)", rec(g, ne=(U32, 1, 1, 1), nb=(4, 4, 4, 4), buffer=tgt), size=4)
        add("nb[3] 2**32 - 1 with ne[3] 2", rec(g, ne=(16, 1, 1, 2), nb=(4, 64, 64, U32), buffer=tgt), size=4)
        add("offset + size wraps 2**64", rec(g, buffer=tgt), offset=U64 - 7, size=16)
        add("offset 2**64 - 1", rec(g, buffer=tgt), offset=U64, size=1)
        add("offset 61, size 4 of 64", rec(g, buffer=tgt), offset=61, size=4)
        add("offset 64, size 1 of 64", rec(g, buffer=tgt), offset=64, size=1)
        add("size 65 of 64", rec(g, buffer=tgt), size=65)
        add("size over the resource", rec(g, ne=(1024, 1, 1, 1), buffer=tgt), size=data_size + 1)
        add("size 2**64 - 1", rec(g, ne=(1024, 1, 1, 1), buffer=tgt), size=U64)
        add("unknown resource", rec(g, buffer=tgt), res=99)
        add("resource 0", rec(g, buffer=tgt), res=0)
        add("nb[0] 1 < 4: ggml_nbytes 19, size 20", rec(g, nb=(1, 64, 64, 64), buffer=tgt), size=20)
        add(
            "Q4_0 nb[0] 1: ggml_nbytes 1, size 2",
            rec(g, "Q4_0", ne=(32, 1, 1, 1), nb=(1, 18, 18, 18), buffer=tgt),
            size=2,
        )
        add("ne[1] 0: ggml_nbytes 0, size 1", rec(g, ne=(16, 0, 1, 1), buffer=tgt), size=1)
        add("ne[1] 0, data at the buffer's end", rec(g, ne=(16, 0, 1, 1), buffer=tgt, data=4096), size=1)
    return out


def _snapshot(h, handles):
    return [h.bytes_of(x) for x in handles] + [bytes(h.wrap_mem), bytes(h.guest.data[:8192])]


def refusal_matrix():
    """In the child: each refused set / get / cpy command's (label, rc, whether every buffer's
    and resource's bytes are as before)."""
    import apir.ggml

    g = apir.ggml.load()
    h = Host(g)
    A, B = h.alloc(4096, 0x11), h.alloc(4096, 0x22)
    W = h.wrap
    h.wrap_mem[:] = bytes(range(256)) * (len(h.wrap_mem) // 256)
    buft = h.guest.buffer_type()
    freed = h.alloc(4096, 0x33)
    assert h.guest.forward(Cmd.BUFFER_FREE_BUFFER, lambda e: e.handle(freed))[0] == 0
    h.guest.data[:8192] = b"\x77" * 8192
    results = []
    handles = (A, B, W)

    def run(label, fn, *args):
        before = _snapshot(h, handles)
        rc = fn(*args)
        results.append((label, rc, _snapshot(h, handles) == before))

    for label, handle, rpc, offset, size, res in _transfer_cases(g, A, B, W, buft, len(h.guest.data)):
        for cmd in (Cmd.BUFFER_SET_TENSOR, Cmd.BUFFER_GET_TENSOR):
            run(f"{cmd.name} {label}", h.transfer, cmd, handle, rpc, offset, size, res)
    truncated = rec(g, buffer=A)[:100]
    for cmd in (Cmd.BUFFER_SET_TENSOR, Cmd.BUFFER_GET_TENSOR):
        run(
            f"{cmd.name} truncated record",
            lambda c: h.guest.forward(c, lambda e: (e.handle(A), e.blob(truncated), e.u32(DATA_RES), e.size_t(0)))[0],
            cmd,
        )
        run(f"{cmd.name} freed buffer", h.transfer, cmd, freed, rec(g, buffer=freed), 0, 64)
        run(f"{cmd.name} freed buffer in the record", h.transfer, cmd, A, rec(g, buffer=freed), 0, 64)

    whole = rec(g, ne=(1024, 1, 1, 1), buffer=A)  # all of A: 4096 bytes
    cpys = [
        ("source larger than the room left", A, whole, rec(g, buffer=A, data=1)),
        ("source 4096 bytes, destination at 1 of B", B, whole, rec(g, buffer=B, data=1)),
        ("source 4096 bytes, destination at 1 of W", W, whole, rec(g, buffer=W, data=1)),
        ("destination not in the command's buffer", B, rec(g, buffer=A), rec(g, buffer=A, data=64)),
        ("destination in W, command names B", B, rec(g, buffer=A), rec(g, buffer=W)),
        ("source without buffer", A, rec(g), rec(g, buffer=A)),
        ("destination without buffer", A, rec(g, buffer=A), rec(g)),
        ("both without buffer, command handle 0", 0, rec(g), rec(g)),
        ("unknown command handle", 999, rec(g, buffer=A), rec(g, buffer=999)),
        ("source in a freed buffer", A, rec(g, buffer=freed), rec(g, buffer=A)),
        ("destination in a freed buffer", freed, rec(g, buffer=A), rec(g, buffer=freed)),
        ("source extent past its buffer", B, rec(g, buffer=A, data=4095), rec(g, buffer=B)),
        ("destination extent past its buffer", B, rec(g, buffer=A), rec(g, buffer=B, data=4033)),
        (
            "source ggml_nbytes wraps to 6",
            B,
            rec(g, ne=(1, U32, 7, 1), nb=(4, U32, 1 << 31, 4), buffer=A),
            rec(g, buffer=B),
        ),
        (
            "destination ggml_nbytes wraps to 6",
            B,
            rec(g, buffer=A, ne=(1, 1, 1, 1)),
            rec(g, ne=(1, U32, 7, 1), nb=(4, U32, 1 << 31, 4), buffer=B),
        ),
        ("source data 2**64 - 1", B, rec(g, buffer=A, data=U64), rec(g, buffer=B)),
        ("destination data 2**64 - 1, ne 0", B, rec(g, buffer=A), rec(g, ne=(0, 1, 1, 1), buffer=B, data=U64)),
        ("destination ne 0 at the buffer's end", B, rec(g, buffer=A), rec(g, ne=(0, 1, 1, 1), buffer=B, data=4096)),
        ("source type 4", B, rec(g, type_=4, nb=(4, 64, 64, 64), buffer=A), rec(g, buffer=B)),
        ("destination op CUSTOM", B, rec(g, buffer=A), rec(g, buffer=B, op=int(g.ops["CUSTOM"]))),
        ("source name without NUL", B, rec(g, buffer=A, name=b"s" * 64), rec(g, buffer=B)),
        ("source Q4_0 ne[0] 33", B, rec(g, "Q4_0", ne=(33, 1, 1, 1), nb=(18,) * 4, buffer=A), rec(g, buffer=B)),
    ]
    for label, handle, src, dst in cpys:
        run(f"cpy {label}", lambda *a: h.cpy(*a)[0], handle, src, dst)
    run(
        "cpy truncated destination",
        lambda: h.guest.forward(
            Cmd.BUFFER_CPY_TENSOR, lambda e: (e.handle(B), e.blob(rec(g, buffer=A)), e.blob(rec(g, buffer=B)[:200]))
        )[0],
    )
    # the host serves on: a good set and get afterwards
    ok = h.set(A, rec(g, buffer=A, data=64), b"\x42" * 64) == 0 and h.get(A, rec(g, buffer=A, data=64), 64) == (
        0,
        b"\x42" * 64,
    )
    h.close()
    return results, ok


def test_every_refusal_changes_no_byte():
    results, ok = run_in_child(refusal_matrix)
    assert len(results) == 233
    wrong = [(label, rc, same) for label, rc, same in results if rc != 1 or not same]
    assert wrong == []
    assert ok


# --- what is accepted writes and reads exactly the tensor's bytes (child) -------------------------


def accepted_edges():
    """In the child: accepted commands at the edges, each (label, rc, A, W's resource, data res
    bytes after it) for the parent to compare with what they must be."""
    import apir.ggml

    g = apir.ggml.load()
    h = Host(g)
    A = h.alloc(4096, 0x11)
    B = h.alloc(4096, 0x22)
    W = h.wrap
    out = {}

    def state():
        return h.bytes_of(A), h.bytes_of(B), bytes(h.wrap_mem)

    pat = bytes(range(1, 65))
    out["set A end"] = (h.set(A, rec(g, buffer=A, data=4032), pat), state())
    out["set W end"] = (h.set(W, rec(g, buffer=W, data=4032), pat), state())
    out["get A end"] = h.get(A, rec(g, buffer=A, data=4032), 64)
    out["get W end"] = h.get(W, rec(g, buffer=W, data=4032), 64)
    out["set W last byte"] = (h.set(W, rec(g, "I8", ne=(1, 1, 1, 1), buffer=W, data=4095), b"\x99"), state())
    # nb[0] below the element size: ggml_nbytes 4 + 15 = 19 bytes, all 19 writable, no more
    out["set nb0 1"] = (h.set(W, rec(g, nb=(1, 64, 64, 64), buffer=W, data=1000), b"\x55" * 19), state())
    # Q4_0 with nb[0] 1: ggml_nbytes 32 * 1 / 32 = 1
    out["set q4_0 nb0 1"] = (
        h.set(W, rec(g, "Q4_0", ne=(32, 1, 1, 1), nb=(1, 18, 18, 18), buffer=W, data=2000), b"\x66"),
        state(),
    )
    # zero-size transfers with any offset: nothing moves
    out["set size 0"] = (h.set(W, rec(g, buffer=W, data=0), b"", offset=U64, size=0), state())
    out["get size 0"] = (h.transfer(Cmd.BUFFER_GET_TENSOR, W, rec(g, buffer=W), U64, 0), state())
    out["set size 0 ne 0 at end"] = (h.set(W, rec(g, ne=(0, 1, 1, 1), buffer=W, data=4096), b"", size=0), state())
    # but a bad record with size 0 is still refused
    out["set size 0 bad record"] = (h.set(W, rec(g, buffer=W, data=4033), b"", size=0), state())
    # cpy: the whole of A into B at 0 (ggml copies ggml_nbytes(src), past the destination tensor's
    # 64 bytes but within B); src == dst; overlapping; into W to its last byte
    ctypes.memmove(h.lib.buffers.get(A).base, bytes(range(256)) * 16, 4096)
    whole = rec(g, ne=(1024, 1, 1, 1), buffer=A)
    out["cpy A into B"] = (h.cpy(B, whole, rec(g, buffer=B)), state())
    out["cpy src == dst"] = (h.cpy(A, whole, whole), state())
    out["cpy overlapping"] = (h.cpy(A, rec(g, buffer=A, data=0), rec(g, buffer=A, data=32)), state())
    out["cpy A into W end"] = (
        h.cpy(W, rec(g, buffer=A, data=64), rec(g, "I8", ne=(1, 1, 1, 1), buffer=W, data=4032)),
        state(),
    )
    out["cpy empty source"] = (
        h.cpy(W, rec(g, ne=(16, 0, 1, 1), buffer=A, data=4096), rec(g, ne=(0, 1, 1, 1), buffer=W, data=4096)),
        state(),
    )
    # a zero-size buffer (ggml's dummy, base NULL, no iface): nothing to copy into or out of
    rc, d = h.guest.forward(Cmd.BUFFER_TYPE_ALLOC_BUFFER, lambda e: (e.handle(h.guest.buffer_type()), e.size_t(0)))
    Z = d.handle()
    out["zero buffer"] = (rc, Z != 0, h.lib.buffers.get(Z).base if Z else None)
    empty = rec(g, ne=(0, 1, 1, 1), buffer=Z)
    out["cpy into zero buffer"] = (h.cpy(Z, rec(g, ne=(0, 1, 1, 1), buffer=A), empty), state())
    out["cpy from zero buffer"] = (h.cpy(W, empty, rec(g, buffer=W, data=64)), state())
    out["set zero buffer"] = (h.set(Z, empty, b"\x01"), state())
    out["get zero buffer"] = h.get(Z, empty, 1)
    out["set zero buffer data 1"] = (h.set(Z, rec(g, ne=(0, 1, 1, 1), buffer=Z, data=1), b"", size=0), state())
    h.close()
    return out


def test_accepted_edges_touch_only_the_tensor():
    got = run_in_child(accepted_edges)
    A0, W0 = b"\x11" * 4096, bytes(3 * PAGE)
    pat = bytes(range(1, 65))
    rc, (a, b, w) = got["set A end"]
    assert rc == 0 and a == A0[:4032] + pat and w == W0
    rc, (a, b, w) = got["set W end"]
    assert rc == 0 and w == bytes(4032) + pat + bytes(2 * PAGE)
    assert got["get A end"] == (0, pat) and got["get W end"] == (0, pat)
    rc, (a, b, w) = got["set W last byte"]
    assert rc == 0 and w[4095] == 0x99 and w[4096:] == bytes(2 * PAGE)
    W1 = w
    rc, (a, b, w) = got["set nb0 1"]
    assert rc == 0 and w == W1[:1000] + b"\x55" * 19 + W1[1019:]
    W2 = w
    rc, (a, b, w) = got["set q4_0 nb0 1"]
    assert rc == 0 and w == W2[:2000] + b"\x66" + W2[2001:]
    W3 = w
    for k in ("set size 0", "get size 0", "set size 0 ne 0 at end"):
        assert got[k] == (0, (a, b, W3)), k
    assert got["set size 0 bad record"] == (1, (a, b, W3))
    A1 = bytes(range(256)) * 16
    rc, (a, b, w) = got["cpy A into B"]
    assert rc == (0, True) and a == A1 and b == A1 and w == W3
    assert got["cpy src == dst"] == ((0, True), (A1, A1, W3))
    rc, (a, b, w) = got["cpy overlapping"]
    assert rc == (0, True) and a[:32] == A1[:32] and a[96:] == A1[96:] and b == A1 and w == W3
    rc, (a2, b, w) = got["cpy A into W end"]
    # the source is 64 bytes of A from 64: exactly W's last 64 bytes are written
    assert rc == (0, True) and w == W3[:4032] + a[64:128] + bytes(2 * PAGE)
    assert got["cpy empty source"] == ((0, True), (a2, b, w))
    assert got["zero buffer"] == (0, True, 0)
    assert got["cpy into zero buffer"] == ((0, False), (a2, b, w))  # ggml's dummy buffer has no cpy_tensor
    assert got["cpy from zero buffer"] == ((0, True), (a2, b, w))
    assert got["set zero buffer"] == (1, (a2, b, w))
    assert got["get zero buffer"][0] == 1
    assert got["set zero buffer data 1"] == (1, (a2, b, w))


# --- the record as read is the record as checked and as written (in-process) ----------------------


def test_rpc_tensor_reads_the_fields_numpy_reads(ggml):
    """RpcTensor (one struct.unpack_from) against numpy's view of the same random bytes: every
    field the host uses, name bytes included, equal."""
    from apir.host.tensors import TensorChecker

    chk = TensorChecker(ggml)
    dt = rpc_tensor_dtype(ggml.limits)
    rng = np.random.default_rng(15)
    for _ in range(300):
        raw = rng.integers(0, 256, dt.itemsize, dtype=np.uint8).tobytes()
        r = np.frombuffer(raw, dt)[0]
        got = chk.rpc_tensor(memoryview(bytearray(raw)))
        assert got.type == int(r["type"]) and got.buffer == int(r["buffer"]) and got.op == int(r["op"])
        assert got.ne == tuple(int(x) for x in r["ne"]) and got.nb == tuple(int(x) for x in r["nb"])
        assert got.op_params == tuple(int(x) for x in r["op_params"]) and got.flags == int(r["flags"])
        assert got.data == int(r["data"])
        at = dt.fields["name"][1]
        assert got.name == raw[at : at + ggml.limits.max_name]


def test_ggml_nbytes_of_the_twin_never_exceeds_the_checked_extent(ggml):
    """The transfer's bound (offset + size <= ggml_nbytes of the twin) is inside the checked
    extent for every valid type and random ne/nb (u32 on the wire, small and huge mixed),
    wherever the extent fits a buffer (< 2**62); where ggml_nbytes wraps modulo 2**64 the
    extent is exact and the record is refused. The twin holds exactly the record's fields."""
    from apir.ggml.layout import tensor_record
    from apir.host.handles import HostBuffer
    from apir.host.tensors import TensorChecker

    chk = TensorChecker(ggml)
    buf = HostBuffer(ptr=0x1000, base=0x10000, size=1 << 62, virtual_base=1 << 40, buft_handle=1)
    rng = np.random.default_rng(1515)
    valid = [int(t) for t in np.flatnonzero(ggml.valid_types)]
    wraps = 0
    ops = [o for o in range(ggml.op_count) if o not in chk.custom_ops]
    # names: empty, 63 bytes and a NUL (the longest), junk after the NUL, a NUL inside
    names = [b"", b"n" * 63, b"ab\0" + b"\xff" * 61, b"\0" + b"j" * 63, bytes(range(1, 64))]
    for k in range(4000):
        t = valid[k % len(valid)]
        bs = chk.blck_size[t]
        pick = lambda: int(rng.choice([0, 1, 2, 3, 7, 64, 1 << 16, (1 << 31) + 5, U32]))  # noqa: E731
        ne = [pick() for _ in range(4)]
        ne[0] = ne[0] // bs * bs
        nb = [pick() for _ in range(4)]
        op = int(rng.choice(ops))
        params = [int(x) for x in rng.integers(-(1 << 31), 1 << 31, int(rng.choice([0, 1, 16])))]
        flags = int(rng.integers(-(1 << 31), 1 << 31))
        name = names[k % len(names)]
        raw = rec(ggml, t, ne=ne, nb=nb, buffer=1, data=0, op=op, op_params=params, flags=flags, name=name)
        r = chk.rpc_tensor(raw)
        extent = chk.extent(r.type, r.ne, r.nb)
        twin = chk.loose_twin(r, buf)
        nbytes = ggml.ggml_nbytes(ctypes.addressof(twin))
        exact = (
            0
            if min(ne) == 0
            else (
                ne[0] * nb[0] // bs + sum((ne[i] - 1) * nb[i] for i in range(1, 4))
                if bs > 1
                else chk.type_size[t] + sum((ne[i] - 1) * nb[i] for i in range(4))
            )
        )
        assert nbytes == exact % (1 << 64)
        assert exact <= extent
        if exact >= 1 << 64:
            wraps += 1
            assert extent >= 1 << 64
        tr = tensor_record(ctypes.addressof(twin), ggml.tensor_dtype)
        assert [int(x) for x in tr["ne"]] == ne and [int(x) for x in tr["nb"]] == nb
        assert int(tr["type"]) == t and int(tr["data"]) == buf.base and int(tr["buffer"]) == buf.ptr
        assert int(tr["view_src"]) == 0 and not any(int(x) for x in tr["src"]) and int(tr["extra"]) == 0
        assert int(tr["op"]) == op and int(tr["flags"]) == flags
        assert [int(x) for x in tr["op_params"]] == (params + [0] * 16)[:16]
        assert tr["name"].tobytes() == name.split(b"\0")[0][:63].ljust(64, b"\0")
    assert wraps > 0


def _forward_payload(cmd: Cmd, args: bytes) -> bytes:
    return struct.pack("<III", int(ApirCommandType.FORWARD), int(cmd), REPLY_RES) + args


def _submit(guest: Guest, mem) -> int:
    guest.reply[0:4] = b"\0\0\0\0"
    guest.ctx.submit(mem)
    word = struct.unpack_from("<I", guest.reply, 0)[0]
    assert word >= 5, word
    return word - 5  # the backend rc


def test_racing_record_is_checked_and_used_as_one_read(ggml):
    """TOCTOU: the guest rewrites the record in the command's own memory while the host reads
    it: `data` between 0 and 3072, ne[0] between 512 and 16, of an F32 row set / got at offset
    1984, 64 bytes, in a 4096-byte buffer_from_ptr buffer. Every mix of the two reads either
    refused or [1984, 2048); had the check and the twin read `data` apart, a write or read at
    3072 + 1984 would land in the watched resource bytes past the buffer."""
    from tests.host.hostilekit import racing_guest

    h = Host(ggml, wrap_pages=1, res_pages=2)
    try:
        W = h.wrap
        secret = b"S3CRET!!" * (PAGE // 8)
        h.wrap_mem[PAGE:] = secret
        r = rec(ggml, ne=(512, 1, 1, 1), nb=(4, 2048, 2048, 2048), buffer=W, data=0)
        args = struct.pack("<Q", W) + r + struct.pack("<IQQ", DATA_RES, 1984, 64)
        head = 12 + 8
        data_at = head + rpc_tensor_dtype(ggml.limits).fields["data"][1]
        ne_at = head + rpc_tensor_dtype(ggml.limits).fields["ne"][1]
        spec = [(data_at + 1, 0x00, 0x0C), (ne_at, 0x00, 0x10), (ne_at + 1, 0x02, 0x00)]
        for cmd in (Cmd.BUFFER_SET_TENSOR, Cmd.BUFFER_GET_TENSOR):
            seen = {0: 0, 1: 0}
            with racing_guest(_forward_payload(cmd, args), spec) as mem:
                for _ in range(20000):
                    if cmd == Cmd.BUFFER_SET_TENSOR:
                        h.guest.data[:64] = b"\xab" * 64
                    else:
                        h.wrap_mem[1984:2048] = b"\xcd" * 64
                        h.guest.data[:64] = bytes(64)
                    rc = _submit(h.guest, mem)
                    seen[rc] += 1
                    if rc == 0 and cmd == Cmd.BUFFER_GET_TENSOR:
                        assert bytes(h.guest.data[:64]) == b"\xcd" * 64
                    if min(seen.values()) >= 200:
                        break
            assert set(seen) == {0, 1} and min(seen.values()) >= 200, seen  # both outcomes happened
            assert bytes(h.wrap_mem[PAGE:]) == secret
            if cmd == Cmd.BUFFER_SET_TENSOR:
                assert bytes(h.wrap_mem[:PAGE]) == bytes(1984) + b"\xab" * 64 + bytes(PAGE - 2048)
    finally:
        h.close()


# --- graph_compute's per-tensor fallback reads its records the same way (child) -----------------


def graph_fallback(edits):
    """In the child: an ADD chain's graph with its input x's record edited by each of `edits`
    (field -> value), computed; per edit (rc, fallback calls, refusal messages), then the
    unedited graph's (rc, status)."""
    import logging

    import apir.ggml
    from apir.host.graph import build as host_graph
    from tests.host.hostkit import GgmlScratch, RemoteGraph, add_chain

    g = apir.ggml.load()
    guest = Guest()
    s = GgmlScratch(g)
    graph = add_chain(g, s.ctx, 2)
    remote = RemoteGraph(guest, g, s.ctx, graph)
    wire = bytearray(remote.wire)
    dt = rpc_tensor_dtype(g.limits)
    n_nodes = struct.unpack_from("<I", wire, 0)[0]
    head = 4 + 8 * n_nodes + 4
    n = struct.unpack_from("<I", wire, head - 4)[0]
    recs = np.frombuffer(bytes(wire[head:]), dt, n)
    x = [i for i in range(n) if int(recs["op"][i]) == 0][0]
    calls = [0]
    one_by_one = host_graph._check_records_one_by_one

    def spy(lib, parsed):
        calls[0] += 1
        return one_by_one(lib, parsed)

    host_graph._check_records_one_by_one = spy
    messages = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda r: messages.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("apir.host").addHandler(handler)

    def compute(raw):
        guest.data[: len(raw)] = raw
        rc, dec = guest.forward(Cmd.BACKEND_GRAPH_COMPUTE, lambda e: (e.u32(DATA_RES), e.size_t(len(raw))))
        return rc, (dec.i32() if rc == 0 else None)

    out = []
    for edit in edits:
        r = recs.copy()
        for field, value in edit.items():
            if field == "name":
                b = bytearray(r[x : x + 1].tobytes())
                at = dt.fields["name"][1]
                b[at : at + g.limits.max_name] = value
                r[x] = np.frombuffer(bytes(b), dt)[0]
            else:
                r[field][x] = value
        calls[0], messages[:] = 0, []
        rc, _ = compute(bytes(wire[:head]) + r.tobytes())
        out.append((rc, calls[0], list(messages)))
    after = compute(bytes(wire))
    remote.close()
    s.close()
    guest.close()
    return x, out, after


def test_graph_fallback_refuses_what_the_kernel_leaves_to_it():
    """Records the whole-graph kernel gives up on (extents past int64, ggml_nbytes wrapping,
    data near 2**64, an invalid type...) go to `_check_records_one_by_one`, now reading each
    record through `rpc_tensor`: each refused naming tensor x, and the graph sent unedited
    next still computes."""
    # (edit of x's record, text its refusal holds, whether the per-tensor checks ran)
    cases = [
        ({"ne": (1, U32, 7, 1), "nb": (4, U32, 1 << 31, 4)}, "data [0, 18446744073709551622) outside", 1),
        ({"ne": (U32,) * 4, "nb": (U32,) * 4}, "data [0, 73786976243298598924) outside", 1),
        ({"data": U64}, "data [18446744073709551615, 18446744073709551743) outside", 1),
        ({"data": U64 - 127}, "data [18446744073709551488, 18446744073709551616) outside", 1),
        ({"buffer": 0, "data": 0}, "no buffer with data", 1),
        # extent 0 (an ne is 0): the per-tensor check passes it, the span check refuses
        ({"ne": (U32, 0, U32, U32), "nb": (U32,) * 4}, "more than the 1073741824 bytes its buffer allows", 1),
        # refused when parsed, before either record check
        ({"type": 4}, "type 4 is not a ggml type", 0),
        ({"type": U32}, "type 4294967295 is not a ggml type", 0),
        ({"op": U32}, "op 4294967295 is out of range", 0),
        ({"name": b"x" * 64}, "name is not NUL-terminated", 0),
    ]
    x, out, after = run_in_child(graph_fallback, [e for e, _, _ in cases])
    for (edit, text, fallback), (rc, calls, messages) in zip(cases, out):
        assert rc == 1, (edit, messages)
        assert len(messages) == 1 and text in messages[0] and f"tensor {x}" in messages[0], (edit, messages)
        assert calls == fallback, (edit, calls)
    assert after == (0, 0)


# --- handles: another context's, freed, reused, of a removed resource ------------------------------


def test_no_other_context_buffer_and_no_reused_handle(ggml):
    """Guest A names every handle guest B's context holds (and around them) in get, set and cpy:
    only A's own buffers answer, never with B's bytes, and B's buffers stay as they were. A
    freed buffer's handle is refused and never handed out again; a buffer_from_ptr buffer is
    gone with its resource."""
    from apir.host import HostContext

    a = Host(ggml)
    b = Guest(HostContext(8))
    try:
        lib_b = b.ctx._library
        secret = b"\x5b" * 4096
        b_handles = [b.alloc(4096) for _ in range(4)]
        for hb in b_handles:
            ctypes.memmove(lib_b.buffers.get(hb).base, secret, 4096)
        own = a.alloc(4096, 0x11)
        lib_a = a.lib
        for h in range(0, max(b_handles) + 8):
            r = rec(ggml, buffer=h, data=0)
            rc, got = a.get(h, r, 64)
            if h in (own, a.wrap):
                assert rc == 0 and got == a.bytes_of(h)[:64]
            else:
                assert rc == 1 and lib_a.buffers.get(h) is None
            assert b"\x5b" not in got
            assert a.set(h, r, b"\xa5" * 64) == (0 if h in (own, a.wrap) else 1)
            assert a.cpy(own, r, rec(ggml, buffer=own, data=1024))[0] == (0 if h in (own, a.wrap) else 1)
        for hb in b_handles:
            assert ctypes.string_at(lib_b.buffers.get(hb).base, 4096) == secret
        # freed: refused, and its id is never given again
        freed = a.alloc(4096, 0x33)
        assert a.guest.forward(Cmd.BUFFER_FREE_BUFFER, lambda e: e.handle(freed))[0] == 0
        again = [a.alloc(4096) for _ in range(3)]
        assert freed not in again and all(x > freed for x in again)
        r = rec(ggml, buffer=freed)
        assert a.set(freed, r, b"\x01" * 64) == 1 and a.get(freed, r, 64)[0] == 1
        assert a.cpy(again[0], r, rec(ggml, buffer=again[0]))[0] == 1
        assert a.cpy(freed, rec(ggml, buffer=own), r)[0] == 1
        # a buffer_from_ptr buffer after its resource was removed: its handle is refused
        wrap = a.wrap
        a.guest.ctx.remove_resource(WRAP_RES)
        r = rec(ggml, buffer=wrap)
        assert a.set(wrap, r, b"\x01" * 64) == 1 and a.get(wrap, r, 64)[0] == 1
        assert a.cpy(own, r, rec(ggml, buffer=own))[0] == 1
        assert a.cpy(wrap, rec(ggml, buffer=own), r)[0] == 1
    finally:
        b.close()
        a.close()


def test_transfer_between_a_wrapped_resource_and_itself(ggml):
    """set / get of a buffer_from_ptr buffer whose bytes come from (go to) the very resource it
    wraps: the copy stays inside that resource, the resource's bytes past the buffer are
    untouched."""
    h = Host(ggml)
    try:
        W = h.wrap
        h.wrap_mem[:] = bytes(range(256)) * (len(h.wrap_mem) // 256)
        tail = bytes(h.wrap_mem[PAGE:])
        r = rec(ggml, ne=(256, 1, 1, 1), buffer=W, data=2048)  # 1024 bytes at 2048
        for cmd in (Cmd.BUFFER_SET_TENSOR, Cmd.BUFFER_GET_TENSOR):
            assert h.transfer(cmd, W, r, 0, 1024, res=WRAP_RES) == 0
        assert bytes(h.wrap_mem[PAGE:]) == tail
        assert bytes(h.wrap_mem[:1024]) == bytes(h.wrap_mem[2048:3072]) == bytes(range(256)) * 4
        # past the tensor or the wrapped resource's size: refused
        assert h.transfer(Cmd.BUFFER_SET_TENSOR, W, r, 1, 1024, res=WRAP_RES) == 1
        assert (
            h.transfer(Cmd.BUFFER_GET_TENSOR, W, rec(ggml, ne=(1024, 1, 1, 1), buffer=W), 0, 3 * PAGE + 1, res=WRAP_RES)
            == 1
        )
        assert bytes(h.wrap_mem[PAGE:]) == tail
    finally:
        h.close()


def test_names_ops_and_op_params_do_not_matter_to_a_transfer(ggml):
    """Accepted records with the longest name (63 bytes and its NUL), junk after a NUL, an
    empty name, any non-custom op with extreme op_params and flags: set and get move exactly the
    tensor's bytes; the custom ops and GGML_OP_COUNT are refused."""
    h = Host(ggml)
    try:
        A = h.alloc(4096, 0x11)
        extremes = (-(1 << 31), (1 << 31) - 1, -1, 0) * 4
        for k, (name, op) in enumerate(
            [
                (b"n" * 63, 0),
                (b"ab\0" + b"\xff" * 61, ggml.ops["ADD"]),
                (b"", ggml.op_count - 1),
                (b"\0" + b"j" * 63, ggml.ops["MUL_MAT"]),
            ]
        ):
            if op in h.lib.checker.custom_ops:
                continue
            r = rec(ggml, buffer=A, data=64 * k, op=op, op_params=extremes, flags=-1, name=name)
            pat = bytes([k + 1]) * 64
            assert h.set(A, r, pat) == 0
            assert h.get(A, r, 64) == (0, pat)
        assert h.bytes_of(A) == b"".join(bytes([k + 1]) * 64 for k in range(4)) + b"\x11" * (4096 - 256)
        for op in sorted(h.lib.checker.custom_ops) + [ggml.op_count]:
            r = rec(ggml, buffer=A, data=1024, op=op)
            assert h.set(A, r, b"\x77" * 64) == 1 and h.get(A, r, 64)[0] == 1
        assert h.bytes_of(A)[1024:] == b"\x11" * (4096 - 1024)
    finally:
        h.close()


def test_deferred_uploads_get_the_checked_twin(monkeypatch, ggml):
    """With a context's DeviceTransfers (staging of 256 bytes: uploads queued, one larger than
    the staging synchronous), every ggml_backend_tensor_set_async / _set the host makes gets a
    twin whose [data + offset, + size) lies in the named buffer; refusals queue nothing; the
    bytes land where the records say once flushed."""
    from apir.ggml.layout import tensor_record
    from apir.host.backend.transfers import DeviceTransfers

    h = Host(ggml)
    try:
        lib = h.lib
        lib.transfers = DeviceTransfers(lib.g, lib.backend, lib.dev, 256)
        A = h.alloc(4096, 0x11)
        base = lib.buffers.get(A).base
        calls = []
        for name in ("ggml_backend_tensor_set_async", "ggml_backend_tensor_set"):
            real = getattr(lib.g, name)

            def spy(*args, _real=real, _name=name):
                t, offset, n = args[-4], args[-2], args[-1]
                r = tensor_record(t, lib.g.tensor_dtype)
                calls.append((_name, int(r["data"]) - base + offset, n, int(r["buffer"]) == lib.buffers.get(A).ptr))
                return _real(*args)

            monkeypatch.setattr(lib.g, name, spy)
        big = rec(ggml, ne=(1024, 1, 1, 1), buffer=A)
        assert h.set(A, rec(ggml, buffer=A, data=4032), b"\x01" * 64) == 0
        assert h.set(A, rec(ggml, buffer=A, data=0), b"\x02" * 60, offset=4) == 0
        assert h.set(A, rec(ggml, buffer=A, data=4033), b"\x03" * 64) == 1
        assert h.set(A, big, b"\x04" * 1000, offset=3096) == 0  # over the staging: synchronous
        assert h.set(A, big, b"\x05" * 2, offset=4095) == 1
        assert h.set(A, rec(ggml, ne=(1, U32, 7, 1), nb=(4, U32, 1 << 31, 4), buffer=A), b"\x06" * 4) == 1
        assert lib.transfers.pending == 0  # (the synchronous set flushed the two queued)
        assert h.get(A, big, 4096)[0] == 0  # flushes first
        assert calls == [
            ("ggml_backend_tensor_set_async", 4032, 64, True),
            ("ggml_backend_tensor_set_async", 4, 60, True),
            ("ggml_backend_tensor_set", 3096, 1000, True),
        ]
        want = b"\x11" * 4 + b"\x02" * 60 + b"\x11" * (3096 - 64) + b"\x04" * 1000  # (over the first)
        assert h.get(A, big, 4096) == (0, want)
    finally:
        h.close()
