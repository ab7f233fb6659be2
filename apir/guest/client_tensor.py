"""How the client puts tensors on the wire: rpc records and inline ggml_tensor structs.

Theory of operation: two forms exist (apir_cs_ggml.h).

- `apir_rpc_tensor` (set/get/cpy tensor): a 304-byte record the caller builds (with
  `apir.codec.graph.rpc_tensor_from_ggml`, or by hand as a numpy record of
  `apir.codec.records.rpc_tensor_dtype`); it is sent as its raw bytes.
- the inline `ggml_tensor` (device_supports_op, buffer_type_get_alloc_size): the guest's
  own 336-byte struct read from memory, then the buffer's host handle when `buffer` is
  set, then the `view_src` struct when set, then one struct per non-null `src[i]` until the
  first null (`apir_encode_ggml_tensor_inline`). The C sender has no bound on `src[]`; here
  it stops at GGML_MAX_SRC. A tensor with `extra` set cannot be sent (the C aborts).
  Where the C writes the address of its local handle variable, this sends the handle.

Reading raw memory at an address is only done for addresses the caller owns (its own
ggml context); a wrong address crashes the process, as in C.
"""

from __future__ import annotations

import ctypes

import numpy as np

from apir.codec.forward import InlineTensor

__all__ = ["rpc_tensor_bytes", "inline_tensor_at"]


def rpc_tensor_bytes(rpc, dtype: np.dtype) -> bytes:
    """The raw bytes of one rpc tensor record: a numpy record/0-d or 1-element array of
    `dtype`, or bytes-like of exactly `dtype.itemsize`. Raises ValueError otherwise."""
    if isinstance(rpc, (np.void, np.ndarray)):
        if rpc.dtype.itemsize != dtype.itemsize or (isinstance(rpc, np.ndarray) and rpc.size != 1):
            raise ValueError(f"an rpc tensor is one {dtype.itemsize}-byte record, got {rpc.dtype} x {np.size(rpc)}")
        return rpc.tobytes()
    raw = bytes(memoryview(rpc).cast("B"))
    if len(raw) != dtype.itemsize:
        raise ValueError(f"an rpc tensor is {dtype.itemsize} bytes, got {len(raw)}")
    return raw


def inline_tensor_at(tensor_addr: int, buffer_handle: int, dtype: np.dtype) -> InlineTensor:
    """The tensor at `tensor_addr` (a `struct ggml_tensor *` laid out as `dtype`) in the
    inline form; `buffer_handle` is the host handle of its buffer (sent only when the tensor
    has one). Raises ValueError for a null address or a tensor with `extra`."""
    if not tensor_addr:
        raise ValueError("null ggml_tensor address")
    size = dtype.itemsize
    raw = ctypes.string_at(tensor_addr, size)
    fields = np.frombuffer(raw, dtype=dtype)[0]
    if fields["extra"]:
        raise ValueError("cannot send a tensor with `extra` set")
    view_src = ctypes.string_at(int(fields["view_src"]), size) if fields["view_src"] else None
    srcs = []
    for src in fields["src"]:
        if not src:
            break
        srcs.append(ctypes.string_at(int(src), size))
    return InlineTensor(raw, buffer_handle if fields["buffer"] else None, view_src, tuple(srcs))
