"""Which bytes of a C-serialized graph or record are defined (see apir-host-side.md): the C
fills each apir_rpc_tensor on its stack without zeroing it, so its holes, `padding` and the
name bytes after the NUL are stack garbage and not compared."""

from __future__ import annotations

import numpy as np

from apir.codec.records import rpc_tensor_undefined_mask


def record_garbage(raw: bytes, dtype: np.dtype) -> np.ndarray:
    """Bool mask over one record's bytes `raw`: True where the C leaves garbage."""
    mask = rpc_tensor_undefined_mask(dtype).copy()
    off = dtype.fields["name"][1]
    name = raw[off : off + dtype.fields["name"][0].itemsize]
    mask[off + name.index(b"\0") + 1 : off + len(name)] = True
    return mask


def graph_garbage(raw: bytes, dtype: np.dtype) -> np.ndarray:
    """Bool mask over a serialized graph `raw` (the C's bytes): True where undefined."""
    mask = np.zeros(len(raw), dtype=bool)
    n_nodes = int.from_bytes(raw[:4], "little")
    start = 8 + 8 * n_nodes
    n_tensors = int.from_bytes(raw[start - 4 : start], "little")
    size = dtype.itemsize
    for i in range(n_tensors):
        o = start + size * i
        mask[o : o + size] = record_garbage(raw[o : o + size], dtype)
    return mask
