"""Setting and reading tensor data from numpy arrays, on any ggml backend's buffer.

Theory of operation: thin wrappers over `ggml_backend_tensor_set` / `ggml_backend_tensor_get`
(ggml-backend.h) that shape numpy arrays. Plain types map to numpy dtypes (F32 float32,
F16 float16, F64, I8..I64; BF16 as its raw uint16 bits); quantized and other types travel as
raw bytes (uint8, length `ggml_nbytes`). Arrays keep ggml's order reversed, numpy style: a
tensor with ne = (4, 3) reads as shape (3, 4). Only contiguous tensors are accepted.

Failures inside apir's backend callbacks are recorded per thread and raised here as
`BackendCallbackError` (callbacks.py), so a remote error is not silently lost.
"""

from __future__ import annotations

import numpy as np

from apir.ggml.layout import tensor_record
from apir.guest.backend.callbacks import clear_errors, raise_errors

__all__ = ["numpy_dtype", "tensor_shape", "tensor_set", "tensor_get"]

_PLAIN = {
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "BF16": np.uint16,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}


def numpy_dtype(g, type_: int) -> np.dtype:
    """numpy dtype of ggml type `type_`'s elements; uint8 (raw bytes) for block types."""
    name = g.type_names.get(type_)
    if name is None:
        raise ValueError(f"ggml type {type_} does not exist in ggml {g.version}")
    return np.dtype(_PLAIN.get(name, np.uint8))


def _record(g, tensor: int):
    return tensor_record(tensor, g.tensor_dtype)


def tensor_shape(g, tensor: int) -> tuple:
    """numpy shape of the tensor's data: reversed ne over its dimensions, or (nbytes,) for
    block types."""
    rec = _record(g, tensor)
    if g.type_names[int(rec["type"])] not in _PLAIN:
        return (int(g.ggml_nbytes(tensor)),)
    n = max(1, int(g.ggml_n_dims(tensor)))
    return tuple(int(x) for x in rec["ne"][:n][::-1])


def _check(g, tensor: int) -> int:
    if not tensor:
        raise ValueError("NULL tensor")
    if not g.ggml_is_contiguous(tensor):
        raise ValueError("tensor_set/tensor_get: the tensor is not contiguous")
    if not _record(g, tensor)["data"]:
        raise ValueError("the tensor has no data (not allocated in a buffer)")
    return int(g.ggml_nbytes(tensor))


def tensor_set(g, tensor: int, array) -> None:
    """Write `array` into `tensor` (any backend's buffer) with ggml_backend_tensor_set.
    `array` must have the tensor's numpy dtype and as many elements (any shape).
    Raises ValueError, BackendCallbackError."""
    nbytes = _check(g, tensor)
    dtype = numpy_dtype(g, int(_record(g, tensor)["type"]))
    arr = np.ascontiguousarray(array)
    if arr.dtype != dtype:
        raise ValueError(f"array dtype {arr.dtype} != tensor dtype {dtype}")
    if arr.nbytes != nbytes:
        raise ValueError(f"array has {arr.nbytes} bytes, the tensor {nbytes}")
    clear_errors()
    g.ggml_backend_tensor_set(tensor, arr.ctypes.data, 0, nbytes)
    raise_errors("ggml_backend_tensor_set")


def tensor_get(g, tensor: int) -> np.ndarray:
    """A new array with the data of `tensor`, read with ggml_backend_tensor_get.
    Raises ValueError, BackendCallbackError."""
    nbytes = _check(g, tensor)
    out = np.empty(tensor_shape(g, tensor), dtype=numpy_dtype(g, int(_record(g, tensor)["type"])))
    assert out.nbytes == nbytes
    clear_errors()
    g.ggml_backend_tensor_get(tensor, out.ctypes.data, 0, nbytes)
    raise_errors("ggml_backend_tensor_get")
    return out
