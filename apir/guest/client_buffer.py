"""The buffer group of backend functions (virtgpu-forward-buffer.cpp).

Tensor bytes travel through the data window: `buffer_set_tensor` copies a chunk in, then
sends (buffer, rpc tensor, window res_id, offset, size); `buffer_get_tensor` sends the same
and copies the chunk out once the host replied. A transfer of one chunk
(`Remote.transfer_chunk`, 8 MiB) or less is one such call. A larger one is cut into chunks at
increasing offsets (the C makes a temporary blob instead) that alternate between two windows
(`Remote.transfer_windows`), so that the guest's copy of one chunk overlaps the host's copy of
the previous one (two copies per byte, one after the other, would cap the transfer at half a
memcpy's speed): an upload copies chunk k+1 into the other window while the host takes chunk
k, a download copies chunk k-1 out while the host fills chunk k (Remote.call's `meanwhile`).
Each chunk is still one call whose reply is checked before the next is sent: a refused chunk
raises, and no later chunk reaches the host (upload) or the caller's buffer (download). The
remote's lock is held for the whole transfer: other callers wait, never share a window.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from apir.codec.constants import ApirBackendCommandType as F
from apir.codec.copy import copy_bytes
from apir.guest.client_forward import ForwardCaller
from apir.guest.client_tensor import rpc_tensor_bytes

__all__ = ["BufferCalls"]


def _bytes_view(buf, writable: bool) -> np.ndarray:
    arr = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf.reshape(-1).view(np.uint8)
    if writable and not arr.flags.writeable:
        raise ValueError("buffer_get_tensor needs a writable destination")
    return arr


def _chunks(remote, size: int):
    """(windows, chunk size, number of chunks) of a transfer of `size` bytes: chunk k goes
    through window k % len(windows) (`Remote.transfer_windows`)."""
    windows = remote.transfer_windows(size)
    step = windows[0][1].size
    return windows, step, -(-size // step)


class BufferCalls(ForwardCaller):
    """Mixed into ApirClient."""

    def buffer_get_base(self, buffer: int) -> int:
        """`apir_buffer_get_base`: the buffer's base address on the host (only ever used
        to turn tensor addresses into offsets)."""
        return self._call(F.BUFFER_GET_BASE, buffer)[0]

    def _chunk(self, function, buffer: int, rpc: bytes, offset: int, res_id: int, size: int, meanwhile=None) -> None:
        """One set/get_tensor call for `size` bytes at tensor byte `offset`, through window
        `res_id`; `meanwhile` runs while the host serves it."""
        self._call(function, buffer, rpc, res_id, offset, size, meanwhile=meanwhile)

    def buffer_set_tensor(self, buffer: int, rpc_tensor, offset: int, data) -> None:
        """`apir_buffer_set_tensor`: writes the bytes of `data` (any bytes-like or numpy
        array, C order) at byte `offset` of the tensor `rpc_tensor` (see client_tensor).
        Raises the first refused chunk's ForwardError (later chunks are not sent)."""
        rpc = rpc_tensor_bytes(rpc_tensor, self.rpc_dtype)
        src = _bytes_view(np.ascontiguousarray(data) if isinstance(data, np.ndarray) else data, False)
        remote = self.remote
        with remote.lock:
            windows, step, n = _chunks(remote, src.size)
            overlap = len(windows) > 1

            def fill(k: int) -> None:  # chunk k into its window
                size = min(step, src.size - k * step)
                copy_bytes(windows[k % len(windows)][1], src, size, src_offset=k * step)

            for k in range(n):
                if k == 0 or not overlap:
                    fill(k)
                then = partial(fill, k + 1) if overlap and k + 1 < n else None
                size = min(step, src.size - k * step)
                res_id = windows[k % len(windows)][0]
                self._chunk(F.BUFFER_SET_TENSOR, buffer, rpc, offset + k * step, res_id, size, then)

    def buffer_get_tensor(self, buffer: int, rpc_tensor, offset: int, out) -> None:
        """`apir_buffer_get_tensor`: fills the writable buffer `out` (bytearray, contiguous
        numpy array, ...) with len(out) bytes from byte `offset` of the tensor. Raises the
        first refused chunk's ForwardError (`out` then holds the chunks before it, no more)."""
        rpc = rpc_tensor_bytes(rpc_tensor, self.rpc_dtype)
        if isinstance(out, np.ndarray) and not out.flags.c_contiguous:
            raise ValueError("buffer_get_tensor needs a contiguous destination")
        dst = _bytes_view(out, True)
        remote = self.remote
        with remote.lock:
            windows, step, n = _chunks(remote, dst.size)
            overlap = len(windows) > 1

            def drain(k: int) -> None:  # chunk k out of its window, once its reply was checked
                size = min(step, dst.size - k * step)
                copy_bytes(dst, windows[k % len(windows)][1], size, dst_offset=k * step)

            for k in range(n):
                then = partial(drain, k - 1) if overlap and k > 0 else None
                size = min(step, dst.size - k * step)
                res_id = windows[k % len(windows)][0]
                self._chunk(F.BUFFER_GET_TENSOR, buffer, rpc, offset + k * step, res_id, size, then)
                if not overlap:
                    drain(k)
            if overlap and n:
                drain(n - 1)

    def buffer_cpy_tensor(self, buffer: int, src_rpc, dst_rpc) -> bool:
        """`apir_buffer_cpy_tensor`: copies tensor `src_rpc` into `dst_rpc` on the host;
        False when the host cannot (e.g. different buffer types)."""
        src = rpc_tensor_bytes(src_rpc, self.rpc_dtype)
        dst = rpc_tensor_bytes(dst_rpc, self.rpc_dtype)
        return self._call(F.BUFFER_CPY_TENSOR, buffer, src, dst)[0]

    def buffer_clear(self, buffer: int, value: int) -> None:
        """`apir_buffer_clear`: sets every byte of the buffer to `value` (0..255)."""
        self._call(F.BUFFER_CLEAR, buffer, value)

    def buffer_free_buffer(self, buffer: int) -> None:
        """`apir_buffer_free_buffer`."""
        self._call(F.BUFFER_FREE_BUFFER, buffer)
