"""The buffer type (`ggml_backend_buffer_type`), twin of the C guest's
ggml-backend-buffer-type.cpp.

Theory of operation: one buffer type per device, its `context` the host's buffer type handle
(as in the C). Name, alignment and max size come from the registry's cache. `alloc_buffer`
makes a remote buffer (buffer.py). `get_alloc_size` asks the host only for a tensor already
in a buffer this device supports; otherwise, like the C, it answers `ggml_nbytes` locally,
which is what ggml's allocators see for tensors they are placing. `is_host` stays NULL
(false): the data is not directly usable by the CPU backend.
"""

from __future__ import annotations

from apir.guest.backend.buffer import alloc_buffer, tensor_field
from apir.guest.backend.callbacks import record_error

__all__ = ["build_buffer_type_iface", "build_buffer_type"]


def build_buffer_type_iface(owner):
    """The `ggml_backend_buffer_type_i` of `owner`'s buffer types."""
    g, abi, cb, info = owner.g, owner.abi, owner.callbacks, owner.info
    name = cb.cstring(info.buft_name)

    def get_alloc_size(buft, tensor):
        nbytes = int(g.ggml_nbytes(tensor))
        buf = tensor_field(g, tensor, "buffer")
        # The C's test: a real (not zero-size, context-less) buffer of a buffer type this
        # device supports. Only this backend's own buffers pass it.
        if not (buf and owner.has_buffer(buf)):
            return nbytes
        device = abi.BufferType.from_address(buft).device
        if abi.BufferType.from_address(abi.Buffer.from_address(buf).buft).device != device:
            return nbytes
        try:
            size = owner.client.buffer_type_get_alloc_size(
                info.buft_handle, tensor, buffer_handle=owner.buffer(buf).host_handle
            )
            return max(nbytes, int(size))
        except Exception as exc:  # ggml has no error path here: fall back to ggml's default
            record_error("buffer_type.get_alloc_size", exc)
            return nbytes

    return cb.iface(
        abi.BufferTypeI,
        abi.protos["ggml_backend_buffer_type_i"],
        {
            "get_name": (lambda buft: name, None),
            "alloc_buffer": (lambda buft, size: alloc_buffer(owner, buft, size), None),
            "get_alignment": (lambda buft: info.alignment, 0),
            "get_max_size": (lambda buft: info.max_size, 0),
            "get_alloc_size": (get_alloc_size, 0),
        },
        "buffer_type",
    )


def build_buffer_type(owner, iface, device_ptr: int):
    """A `ggml_backend_buffer_type` struct (Python-owned, never freed by ggml)."""
    return owner.callbacks.keep(owner.abi.BufferType(iface=iface, device=device_ptr, context=owner.info.buft_handle))
