"""A ggml backend in Python over APIR: the guest's twin of ggml-virtgpu's
ggml-backend-{reg,device,buffer-type,buffer}.cpp and ggml-backend.cpp.

`ApirBackend(client)` builds ggml's registry, device, buffer type and backend structs
(ggml-backend-impl.h, declared per ggml version in `abi`) with ctypes callbacks into an
ApirClient, so ggml's own code — `ggml_gallocr`, `ggml_backend_alloc_ctx_tensors_from_buft`,
`ggml_backend_tensor_set/get`, `ggml_backend_graph_compute` — runs on the host's buffers.
`tensor_set` / `tensor_get` move tensor data from and to numpy arrays.

Modules: abi (struct layouts), callbacks (lifetime and errors of C-called functions), reg,
device, buffer_type, buffer, stream (the ggml_backend), tensors (numpy helpers),
apir_backend (the object tying them together).
"""

from apir.guest.backend.abi import SUPPORTED_VERSIONS, UnsupportedGgmlVersion
from apir.guest.backend.apir_backend import ApirBackend, BackendInitError, GraphComputeError
from apir.guest.backend.callbacks import BackendCallbackError
from apir.guest.backend.tensors import numpy_dtype, tensor_get, tensor_set, tensor_shape

__all__ = [
    "ApirBackend",
    "BackendInitError",
    "GraphComputeError",
    "BackendCallbackError",
    "UnsupportedGgmlVersion",
    "SUPPORTED_VERSIONS",
    "tensor_set",
    "tensor_get",
    "tensor_shape",
    "numpy_dtype",
]
