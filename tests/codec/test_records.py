"""apir.codec.records against the C: sizeof/offsetof of ggml_tensor and apir_rpc_tensor as
compiled from the reference headers, and ggml_tensor against the loaded libggml."""

import ctypes

import numpy as np

from apir.codec.records import (GGML_TENSOR_DTYPE, RPC_TENSOR_DTYPE, ggml_tensor_dtype, rpc_tensor_dtype,
                                rpc_tensor_undefined_mask)
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
