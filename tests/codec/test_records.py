"""apir.codec.records against the C: sizeof/offsetof of ggml_tensor and apir_rpc_tensor as
compiled from the reference headers, and ggml_tensor against the loaded libggml."""

import ctypes

import numpy as np

from apir.codec.records import (GGML_TENSOR_DTYPE, RPC_TENSOR_DTYPE, RecordStruct, ggml_tensor_dtype,
                                rpc_tensor_dtype, rpc_tensor_undefined_mask)
from apir.ggml import InitParams
from apir.ggml.layout import GGML_OBJECT_SIZE, tensor_record

TENSOR_FIELDS = ["type", "buffer", "ne", "nb", "op", "op_params", "flags", "src", "view_src", "view_offs",
                 "data", "name", "extra"]
RPC_FIELDS = ["id", "type", "buffer", "ne", "nb", "op", "op_params", "flags", "src", "view_src", "view_offs",
              "data", "name", "padding"]


def c_layout(ref):
    out = (ctypes.c_int64 * 64)()
    n = ref.ref_layout(out)
    vals = list(out[:n])
    k = 1 + len(TENSOR_FIELDS)
    return vals[0], dict(zip(TENSOR_FIELDS, vals[1:k])), vals[k], dict(zip(RPC_FIELDS, vals[k + 1:]))


def test_offsets_match_c(codec_ref, ggml):
    t_size, t_off, r_size, r_off = c_layout(codec_ref)
    assert (t_size, r_size) == (336, 304)
    for dtype, size, offs in [(GGML_TENSOR_DTYPE, t_size, t_off), (ggml_tensor_dtype(ggml.limits), t_size, t_off),
                              (RPC_TENSOR_DTYPE, r_size, r_off), (rpc_tensor_dtype(ggml.limits), r_size, r_off)]:
        assert dtype.itemsize == size
        assert {f: dtype.fields[f][1] for f in offs} == offs


def test_tensor_size_matches_libggml(ggml):
    assert ggml.ggml_tensor_overhead() == GGML_OBJECT_SIZE + GGML_TENSOR_DTYPE.itemsize


def test_real_tensor_fields(ggml):
    ctx = ggml.ggml_init(InitParams(8 * ggml.ggml_tensor_overhead() + 1024, None, False))
    try:
        a = ggml.ggml_new_tensor_3d(ctx, ggml.types["F32"], 5, 6, 7)
        b = ggml.ggml_view_1d(ctx, a, 3, 8)
        ggml.ggml_set_name(b, b"probe")
        rec = tensor_record(b, GGML_TENSOR_DTYPE)
        assert list(rec["ne"]) == [3, 1, 1, 1]
        assert rec["view_src"] == a and rec["view_offs"] == 8 and rec["src"][0] == a
        assert rec["data"] == tensor_record(a, GGML_TENSOR_DTYPE)["data"] + 8
        assert bytes(rec["name"]).split(b"\0")[0] == b"probe"
        assert rec["op"] == ggml.ops["VIEW"]
    finally:
        ggml.ggml_free(ctx)


def test_undefined_mask_covers_holes_only():
    mask = rpc_tensor_undefined_mask()
    assert list(np.nonzero(mask)[0]) == [12, 13, 14, 15, 296, 297, 298, 299, 300, 301, 302, 303]


def _field_at(raw: bytes, offset: int, size: int, count: int, signed: bool):
    vals = [int.from_bytes(raw[offset + k * size: offset + (k + 1) * size], "little", signed=signed)
            for k in range(count)]
    return vals[0] if count == 1 else vals


def test_record_struct_reads_fields_at_the_c_offsets(codec_ref):
    """Each slot of RecordStruct's tuple holds the bytes at the field's offset as compiled
    from the C headers (not as our dtype says), for random bytes."""
    _, t_off, _, r_off = c_layout(codec_ref)
    raw = np.random.default_rng(7).integers(0, 256, 512, dtype=np.uint8).tobytes()
    # (field, element size, count, signed) per struct, from ggml.h / apir_cs_rpc.h
    rpc = [("id", 8, 1, False), ("type", 4, 1, False), ("buffer", 8, 1, False), ("ne", 4, 4, False),
           ("nb", 4, 4, False), ("op", 4, 1, False), ("op_params", 4, 16, True), ("flags", 4, 1, True),
           ("src", 8, 10, False), ("view_src", 8, 1, False), ("view_offs", 8, 1, False), ("data", 8, 1, False)]
    tensor = [("type", 4, 1, False), ("buffer", 8, 1, False), ("ne", 8, 4, True), ("nb", 8, 4, False),
              ("op", 4, 1, False), ("op_params", 4, 16, True), ("flags", 4, 1, True), ("src", 8, 10, False),
              ("view_src", 8, 1, False), ("view_offs", 8, 1, False), ("data", 8, 1, False),
              ("extra", 8, 1, False)]
    for dtype, offs, fields in ((RPC_TENSOR_DTYPE, r_off, rpc), (GGML_TENSOR_DTYPE, t_off, tensor)):
        rs = RecordStruct(dtype)
        v = rs.struct.unpack_from(raw)
        for name, size, count, signed in fields:
            got = v[rs.slots[name]]
            want = _field_at(raw, offs[name], size, count, signed)
            assert (list(got) if count > 1 else got) == want, name
        assert v[rs.slots["name"]] == raw[offs["name"]: offs["name"] + 64]


def test_record_struct_packs_what_it_reads_holes_zeroed():
    raw = np.random.default_rng(8).integers(0, 256, RPC_TENSOR_DTYPE.itemsize, dtype=np.uint8).tobytes()
    rs = RecordStruct(RPC_TENSOR_DTYPE)
    out = bytearray(rs.size)
    rs.struct.pack_into(out, 0, *rs.struct.unpack(raw))
    holes = np.flatnonzero(rpc_tensor_undefined_mask() & ~_padding_mask())
    want = bytearray(raw)
    for i in holes:
        want[i] = 0
    assert out == want and rs.items == len(rs.struct.unpack(raw))


def _padding_mask():
    m = np.zeros(RPC_TENSOR_DTYPE.itemsize, dtype=bool)
    off = RPC_TENSOR_DTYPE.fields["padding"][1]
    m[off: off + 4] = True
    return m


def test_record_struct_reads_a_tensor_libggml_built(ggml):
    ctx = ggml.ggml_init(InitParams(8 * ggml.ggml_tensor_overhead() + 1024, None, False))
    try:
        a = ggml.ggml_new_tensor_3d(ctx, ggml.types["F16"], 6, 5, 7)
        b = ggml.ggml_view_2d(ctx, a, 3, 2, 12, 4)
        ggml.ggml_set_name(b, b"probe-view")
        rs = RecordStruct(ggml_tensor_dtype(ggml.limits))
        v = rs.struct.unpack((ctypes.c_char * rs.size).from_address(b).raw)
        assert v[rs.slots["ne"]] == (3, 2, 1, 1) and v[rs.slots["nb"]] == (2, 12, 24, 24)
        assert v[rs.slots["view_src"]] == a and v[rs.slots["view_offs"]] == 4 and v[rs.slots["src"]][0] == a
        assert v[rs.slots["op"]] == ggml.ops["VIEW"] and v[rs.slots["type"]] == ggml.types["F16"]
        assert v[rs.slots["name"]].split(b"\0")[0] == b"probe-view"
    finally:
        ggml.ggml_free(ctx)
