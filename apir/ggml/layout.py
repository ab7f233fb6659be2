"""Start-up check that `struct ggml_tensor` is where apir's records say it is.

Theory of operation: the codec reads and writes ggml tensors as raw bytes through
`apir.codec.records.ggml_tensor_dtype(limits)`. Before anything relies on that, build real tensors with the
loaded libggml and check every field apir uses at its offset: type, buffer, ne, nb, op,
op_params, flags, src, view_src, view_offs, data, name; and the struct's size through
`ggml_tensor_overhead()` (= sizeof(struct ggml_object) + sizeof(struct ggml_tensor)).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import NoReturn

import numpy as np

from apir.ggml.errors import GgmlLoadError
from apir.ggml.functions import GgmlFunctions, InitParams
from apir.ggml.header import HeaderFacts

__all__ = ["check_layout", "tensor_record", "GGML_OBJECT_SIZE"]

# struct ggml_object (ggml-impl.h): size_t offs, size; ggml_object *next; enum type; char pad[4].
GGML_OBJECT_SIZE = 32


def tensor_record(address: int, dtype: np.dtype) -> np.ndarray:
    """A writable numpy record viewing the ggml_tensor at `address` (no copy). The address
    must be a live tensor of this process: a bad one crashes it."""
    buf = (ctypes.c_char * dtype.itemsize).from_address(address)
    return np.frombuffer(memoryview(buf), dtype=dtype, count=1)[0]


def check_layout(g: GgmlFunctions, h: HeaderFacts, dtype: np.dtype, lib_dir: Path) -> None:
    """Raises GgmlLoadError when the tensor layout of the ggml build at `lib_dir` (functions
    `g`, header facts `h`) differs from `dtype` (apir.codec.records.ggml_tensor_dtype)."""

    def fail(what: str) -> NoReturn:
        raise GgmlLoadError(f"ggml_tensor layout of {lib_dir} differs from apir's records: {what}")

    overhead = g.ggml_tensor_overhead()
    if overhead != GGML_OBJECT_SIZE + dtype.itemsize:
        fail(f"ggml_tensor_overhead() = {overhead}, expected {GGML_OBJECT_SIZE} + {dtype.itemsize}")

    ctx = g.ggml_init(InitParams(16 * overhead + 4096, None, False))
    if not ctx:
        fail("ggml_init failed")
    try:
        f32, f16 = h.types["F32"], h.types["F16"]
        a = g.ggml_new_tensor_4d(ctx, f16, 3, 5, 7, 2)
        b = g.ggml_new_tensor_4d(ctx, f16, 3, 5, 7, 2)
        g.ggml_set_name(a, b"apir-layout-probe")
        rec = tensor_record(a, dtype)
        if rec["type"] != f16:
            offset = dtype.fields["type"][1] if dtype.fields else "?"
            fail(f"type at {offset} reads {rec['type']}")
        if list(rec["ne"]) != [3, 5, 7, 2]:
            fail(f"ne reads {list(rec['ne'])}")
        if list(rec["nb"]) != [2, 6, 30, 210]:
            fail(f"nb reads {list(rec['nb'])}")
        if bytes(rec["name"]).split(b"\0")[0] != b"apir-layout-probe":
            fail("name")
        if rec["data"] == 0 or rec["buffer"] != 0 or rec["op"] != h.ops["NONE"]:
            fail("data/buffer/op of a fresh tensor")
        s = g.ggml_add(ctx, a, b)
        rs = tensor_record(s, dtype)
        if rs["op"] != h.ops["ADD"] or rs["src"][0] != a or rs["src"][1] != b or rs["src"][2] != 0:
            fail("op/src of ggml_add")
        v = g.ggml_view_1d(ctx, a, 4, 8)
        rv = tensor_record(v, dtype)
        if rv["view_src"] != a or rv["view_offs"] != 8 or rv["data"] != rec["data"] + 8:
            fail("view_src/view_offs/data of ggml_view_1d")
        sc = g.ggml_scale(ctx, g.ggml_new_tensor_1d(ctx, f32, 4), 2.5)
        rsc = tensor_record(sc, dtype)
        if rsc["op_params"][0] != np.float32(2.5).view(np.int32):
            fail("op_params of ggml_scale")
        g.ggml_set_output(sc)
        if rsc["flags"] == 0:
            fail("flags after ggml_set_output")
    finally:
        g.ggml_free(ctx)
