"""The buffer group of backend functions (virtgpu-forward-buffer.cpp).

Tensor bytes travel through the data window: `buffer_set_tensor` copies a chunk in, then
sends (buffer, rpc tensor, window res_id, offset, size); `buffer_get_tensor` sends the same
and copies the chunk out once the host replied. Transfers larger than the window are cut
into window-sized chunks at increasing offsets (the C makes a temporary blob instead); each
chunk is one call under the remote's lock, so chunks of different callers may interleave
but never share the window.
"""

from __future__ import annotations

import numpy as np

from apir.codec.constants import ApirBackendCommandType as F
from apir.guest.client_state import ClientState
from apir.guest.client_tensor import rpc_tensor_bytes

__all__ = ["BufferCalls"]


def _bytes_view(buf, writable: bool) -> np.ndarray:
    arr = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf.reshape(-1).view(np.uint8)
    if writable and not arr.flags.writeable:
        raise ValueError("buffer_get_tensor needs a writable destination")
    return arr


class BufferCalls(ClientState):
    """Mixed into ApirClient."""

    def buffer_get_base(self, buffer: int) -> int:
        """`apir_buffer_get_base`: the buffer's base address on the host (only ever used
        to turn tensor addresses into offsets)."""
        return self._forward(F.BUFFER_GET_BASE, lambda enc: enc.handle(buffer), lambda dec: dec.uintptr())

    def _transfer(self, function, buffer: int, rpc: bytes, offset: int, chunk: np.ndarray, copy_in: bool):
        remote = self.remote
        n = chunk.size

        def encode(enc):
            if copy_in:
                remote.data_view[:n] = chunk
            enc.handle(buffer)
            enc.blob(rpc)
            enc.u32(remote.data.res_id)
            enc.size_t(offset)
            enc.size_t(n)

        def decode(dec):
            if not copy_in:
                chunk[:] = remote.data_view[:n]

        self._forward(function, encode, decode)

    def buffer_set_tensor(self, buffer: int, rpc_tensor, offset: int, data) -> None:
        """`apir_buffer_set_tensor`: writes the bytes of `data` (any bytes-like or numpy
        array, C order) at byte `offset` of the tensor `rpc_tensor` (see client_tensor)."""
        rpc = rpc_tensor_bytes(rpc_tensor, self.rpc_dtype)
        src = _bytes_view(np.ascontiguousarray(data) if isinstance(data, np.ndarray) else data, False)
        step = self.remote.data_size
        for start in range(0, src.size, step):
            self._transfer(F.BUFFER_SET_TENSOR, buffer, rpc, offset + start, src[start : start + step], True)

    def buffer_get_tensor(self, buffer: int, rpc_tensor, offset: int, out) -> None:
        """`apir_buffer_get_tensor`: fills the writable buffer `out` (bytearray, contiguous
        numpy array, ...) with len(out) bytes from byte `offset` of the tensor."""
        rpc = rpc_tensor_bytes(rpc_tensor, self.rpc_dtype)
        if isinstance(out, np.ndarray) and not out.flags.c_contiguous:
            raise ValueError("buffer_get_tensor needs a contiguous destination")
        dst = _bytes_view(out, True)
        step = self.remote.data_size
        for start in range(0, dst.size, step):
            self._transfer(F.BUFFER_GET_TENSOR, buffer, rpc, offset + start, dst[start : start + step], False)

    def buffer_cpy_tensor(self, buffer: int, src_rpc, dst_rpc) -> bool:
        """`apir_buffer_cpy_tensor`: copies tensor `src_rpc` into `dst_rpc` on the host;
        False when the host cannot (e.g. different buffer types)."""
        src = rpc_tensor_bytes(src_rpc, self.rpc_dtype)
        dst = rpc_tensor_bytes(dst_rpc, self.rpc_dtype)

        def encode(enc):
            enc.handle(buffer)
            enc.blob(src)
            enc.blob(dst)

        return self._forward(F.BUFFER_CPY_TENSOR, encode, lambda dec: dec.bool())

    def buffer_clear(self, buffer: int, value: int) -> None:
        """`apir_buffer_clear`: sets every byte of the buffer to `value` (0..255)."""

        def encode(enc):
            enc.handle(buffer)
            enc.u8(value)

        self._forward(F.BUFFER_CLEAR, encode, None)

    def buffer_free_buffer(self, buffer: int) -> None:
        """`apir_buffer_free_buffer`."""
        self._forward(F.BUFFER_FREE_BUFFER, lambda enc: enc.handle(buffer), None)
