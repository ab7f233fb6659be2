"""The buffer type group of backend functions (virtgpu-forward-buffer-type.cpp).

Every call starts with the buffer type's host handle (u64), as learned from
`device_get_buffer_type` or `device_buffer_from_ptr`.
"""

from __future__ import annotations

from apir.codec.constants import ApirBackendCommandType as F
from apir.guest.client_forward import ForwardCaller
from apir.guest.client_tensor import inline_tensor_at

__all__ = ["BufferTypeCalls"]


class BufferTypeCalls(ForwardCaller):
    """Mixed into ApirClient."""

    def buffer_type_get_name(self, buft: int) -> str:
        """`apir_buffer_type_get_name`."""
        return self._call(F.BUFFER_TYPE_GET_NAME, buft)[0]

    def buffer_type_get_alignment(self, buft: int) -> int:
        """`apir_buffer_type_get_alignment`: bytes."""
        return self._call(F.BUFFER_TYPE_GET_ALIGNMENT, buft)[0]

    def buffer_type_get_max_size(self, buft: int) -> int:
        """`apir_buffer_type_get_max_size`: bytes."""
        return self._call(F.BUFFER_TYPE_GET_MAX_SIZE, buft)[0]

    def buffer_type_is_host(self, buft: int) -> bool:
        """buffer_type_is_host (deprecated in the C guest, still served; the C host answers
        false). The handle is sent although the C host does not read it."""
        return self._call(F.BUFFER_TYPE_IS_HOST, buft)[0]

    def buffer_type_alloc_buffer(self, buft: int, size: int) -> int:
        """`apir_buffer_type_alloc_buffer`: the new buffer's host handle (0 when the host
        could not allocate `size` bytes)."""
        return self._call(F.BUFFER_TYPE_ALLOC_BUFFER, buft, size)[0]

    def buffer_type_get_alloc_size(self, buft: int, tensor_addr: int, buffer_handle: int = 0) -> int:
        """`apir_buffer_type_get_alloc_size`: bytes the ggml_tensor at `tensor_addr` takes
        in a buffer of this type (the tensor travels inline, see client_tensor)."""
        op = inline_tensor_at(tensor_addr, buffer_handle, self.tensor_dtype)
        return self._call(F.BUFFER_TYPE_GET_ALLOC_SIZE, buft, op)[0]
